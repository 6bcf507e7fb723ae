"""Configuration faults on the real driver (issue 41, run 2; issue 40): what the module says when a device file the next
start needs is absent, another device's or a regular file, each made in a private mount namespace of the module's run
only (``unshare --mount``; the machine's own /dev is never changed).

    python3 tools/gpu/config_faults.py --out DIR     (as root, with ansible-core importable: tools/gpu/run.sh says how)

For each scenario it runs ``gpuops.clean_slate.gpu_mem_verify`` once through ``ansible localhost -m`` (the local
connection, this Python as the modules' interpreter) and keeps the module's result: its reason, the GPUs' diagnoses and
CUDA codes, the health verdict and findings, the message's lines, the reset plan, and whether any word of it advises a
reset or a reboot. Writes DIR/config-faults.json and prints a table. Nothing resets a GPU or changes its modes, clocks
or power.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# Each scenario: binds made before the module runs (source "REGULAR" is an empty regular file, "NODE:M:m" a character
# node of those numbers), or nodes left out of a copy of /dev (omit).
SCENARIOS = [
    {"name": "baseline"},
    {"name": "uvm_is_dev_null", "bind": [["/dev/null", "/dev/nvidia-uvm"]]},
    {"name": "uvm_has_gpu0_numbers", "bind": [["NODE:195:0", "/dev/nvidia-uvm"]]},
    {"name": "uvm_is_regular_file", "bind": [["REGULAR", "/dev/nvidia-uvm"]]},
    {"name": "uvm_absent", "omit": ["nvidia-uvm"]},
    {"name": "gpu0_is_dev_null", "bind": [["/dev/null", "/dev/nvidia0"]]},
    {"name": "gpu0_has_minor_1", "bind": [["NODE:195:1", "/dev/nvidia0"]]},
    {"name": "ctl_is_dev_null", "bind": [["/dev/null", "/dev/nvidiactl"]]},
]

# Runs inside the scenario's mount namespace: set it up, then exec the module through Ansible.
SETUP = textwrap.dedent(
    r"""
    import json, os, stat, subprocess, sys
    spec = json.loads(sys.argv[1])
    def run(*cmd):
        subprocess.run(list(cmd), check=True)
    if spec.get("omit"):
        os.makedirs("/tmp/cf-olddev", exist_ok=True)
        run("mount", "--bind", "/dev", "/tmp/cf-olddev")
        run("mount", "-t", "tmpfs", "-o", "mode=0755", "cfdev", "/dev")
        for name in os.listdir("/tmp/cf-olddev"):
            src = "/tmp/cf-olddev/" + name
            st = os.lstat(src)
            if name in spec["omit"]:
                continue
            if stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode):
                os.mknod("/dev/" + name, st.st_mode, st.st_rdev)
            elif stat.S_ISLNK(st.st_mode):
                os.symlink(os.readlink(src), "/dev/" + name)
            elif stat.S_ISDIR(st.st_mode):
                os.mkdir("/dev/" + name)
                run("mount", "--rbind", src, "/dev/" + name)
    for src, dst in spec.get("bind", []):
        if src == "REGULAR":
            src = "/tmp/cf-regular"
            open(src, "w").close()
        elif src.startswith("NODE:"):
            major, minor = map(int, src[5:].split(":"))
            src = "/tmp/cf-node-%d-%d" % (major, minor)
            if os.path.exists(src):
                os.unlink(src)
            os.mknod(src, stat.S_IFCHR | 0o666, os.makedev(major, minor))
        run("mount", "--bind", src, dst)
    os.execvp(sys.argv[2], sys.argv[2:])
    """
)


def module_run(spec: dict, tmp: Path) -> dict:
    args = {"timeout": 0, "cuda_probe_timeout": 20}
    env = {
        **os.environ,
        "ANSIBLE_COLLECTIONS_PATH": str(tmp),
        "ANSIBLE_PYTHON_INTERPRETER": sys.executable,
        "ANSIBLE_LOCALHOST_WARNING": "0",
        "ANSIBLE_INVENTORY_UNPARSED_WARNING": "0",
    }
    cmd = ["ansible", "localhost", "-o", "-c", "local", "-m", "gpuops.clean_slate.gpu_mem_verify", "-a", json.dumps(args)]
    done = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", sys.executable, "-I", "-c", SETUP, json.dumps(spec), *cmd],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )
    # -o: one line per host, "localhost | FAILED! => {result}".
    line = next((x for x in done.stdout.splitlines() if x.startswith("localhost | ")), "")
    try:
        return dict(json.loads(line.split(" => ", 1)[1]))
    except (ValueError, IndexError):
        return {"rc": done.returncode, "stdout": done.stdout[-3000:], "stderr": done.stderr[-3000:]}


def advises_reset(r: dict) -> bool:
    text = " ".join(str(x) for x in [r.get("msg", ""), *(g.get("detail", "") for g in r.get("gpus") or [])]).lower()
    return "nvidia-smi -r" in text or "reset the" in text or "reboot" in text or r.get("reset_plan") is not None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    tmp = a.out / "collections"
    (tmp / "ansible_collections" / "gpuops").mkdir(parents=True, exist_ok=True)
    link = tmp / "ansible_collections" / "gpuops" / "clean_slate"
    if not link.exists():
        link.symlink_to(ROOT)
    rows = []
    for spec in SCENARIOS:
        r = module_run(spec, tmp)
        health = r.get("health") or {}
        row = {
            "scenario": spec["name"],
            "reason": r.get("reason", ""),
            "nvml_reason": r.get("nvml_reason"),
            "gpu_count": r.get("gpu_count"),
            "diagnoses": sorted({g.get("diagnosis") for g in r.get("gpus") or []}),
            "cuda": sorted({(g.get("startable") or {}).get("code") for g in r.get("gpus") or []} - {None}),
            "health": health.get("verdict"),
            "findings": [(f.get("name"), f.get("verdict"), f.get("gpus")) for f in health.get("findings") or []],
            "devices": {k: (v or {}).get("fault") for k, v in ((r.get("software") or {}).get("devices") or {}).items() if isinstance(v, dict)},
            "lines": r.get("lines"),
            "advises_reset": advises_reset(r),
            "elapsed_s": r.get("elapsed_s"),
            "cuda_s": r.get("cuda_s"),
            "result": r,
        }
        rows.append(row)
        print(
            f"{row['scenario']:22} reason={row['reason'] or 'ok':16} nvml={row['nvml_reason']} gpus={row['gpu_count']} diag={row['diagnoses']}"
            f" cuda={row['cuda']} health={row['health']} reset-advice={row['advises_reset']}"
        )
        for line in row["lines"] or [r.get("msg", "")][:1]:
            print(f"    {line}")
    (a.out / "config-faults.json").write_text(json.dumps(rows, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
