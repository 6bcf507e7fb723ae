"""Which processes can this (root) process not inspect the way gpu_job_residue must?

    python3 tools/gpu/proc_access.py        JSON on stdout

The residue module proves a file orphaned only when it has read every process's open files
(/proc/PID/fd) and maps; a process it cannot read makes it refuse (scan_incomplete). On the
H200 device machine one process could not be read by root: this names it (status fields,
namespaces compared with ours, cmdline), so that the refusal can be judged.
"""

from __future__ import annotations

import json
import os
import sys


def _read(path: str) -> str:
    try:
        with open(path, "rb") as fh:
            return fh.read().decode(errors="replace")
    except OSError as exc:
        return f"<{type(exc).__name__}: {exc.strerror}>"


def main() -> int:
    me = {ns: os.readlink(f"/proc/self/ns/{ns}") for ns in ("pid", "user", "mnt") if os.path.exists(f"/proc/self/ns/{ns}")}
    out = []
    for name in sorted(os.listdir("/proc"), key=lambda x: int(x) if x.isdigit() else -1):
        if not name.isdigit():
            continue
        problems = {}
        for what in ("fd", "maps", "environ"):
            path = f"/proc/{name}/{what}"
            try:
                if what == "fd":
                    os.listdir(path)
                else:
                    with open(path, "rb") as fh:
                        fh.read(1)
            except OSError as exc:
                problems[what] = f"{type(exc).__name__}: {exc.strerror}"
        if not problems:
            continue
        status = {
            k: v.strip()
            for k, _s, v in (line.partition(":") for line in _read(f"/proc/{name}/status").splitlines())
            if k in ("Name", "State", "PPid", "Uid", "Gid", "NSpid", "Kthread", "CapEff")
        }
        ns = {}
        for kind in me:
            try:
                ns[kind] = "same" if os.readlink(f"/proc/{name}/ns/{kind}") == me[kind] else os.readlink(f"/proc/{name}/ns/{kind}")
            except OSError as exc:
                ns[kind] = f"<{exc.strerror}>"
        out.append({"pid": int(name), "problems": problems, "status": status, "ns": ns, "cmdline": _read(f"/proc/{name}/cmdline").replace("\0", " ")[:200]})
    json.dump({"self": os.getpid(), "uid": os.getuid(), "uninspectable": out}, sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
