"""Shared helpers for the Proxmox functional tests (imported by tests/functional: test_pct_exec.py, test_inventory*.py, test_role_failures.py).

* :func:`ansible_inventory` runs the real ``ansible-inventory`` from the venv;
* :func:`plain` strips the ``{"__ansible_unsafe": ...}`` wrappers ansible-inventory puts on untrusted strings;
* :class:`PctRegistry` writes the fake pct's registry (``$PCTSIM_DIR``);
* :func:`start_container` makes a "container": a process that is PID 1 of its own PID + mount namespace.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import typing as t
from pathlib import Path

from support.ansible import ROOT, VENV, ansible_env, plain

FAKE_PCT = str(ROOT / "tests" / "sim" / "bin" / "pct")
INVENTORY_DIR = ROOT / "tests" / "functional" / "inventory"
CLUSTER_SOURCE = INVENTORY_DIR / "cluster.proxmox.yml"


def ansible_inventory(source: str | Path, env: dict[str, str], *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run ``ansible-inventory -i source args...`` from the checkout."""
    cmd = [str(VENV / "bin" / "ansible-inventory"), "-i", str(source), *args]
    return subprocess.run(cmd, env=ansible_env(env), capture_output=True, text=True, timeout=timeout, cwd=str(ROOT), check=False)


def inventory_list(source: str | Path, env: dict[str, str], *args: str) -> dict[str, t.Any]:
    proc = ansible_inventory(source, env, "--list", *args)
    assert proc.returncode == 0, proc.stderr
    return plain(json.loads(proc.stdout))


def group_hosts(inv: dict[str, t.Any], group: str) -> set[str]:
    return set(inv.get(group, {}).get("hosts", []))


class PctRegistry:
    """The fake pct's registry in a directory (``$PCTSIM_DIR``)."""

    def __init__(self, path: Path, node: str = "pve1") -> None:
        self.path = path
        path.mkdir(parents=True, exist_ok=True)
        (path / "node").write_text(node + "\n")

    def add(self, vmid: int, status: str = "running", pid: int | None = None, node: str | None = None, **extra: t.Any) -> None:
        node = node or (self.path / "node").read_text().strip()
        doc = {"vmid": vmid, "status": status, "pid": pid, "node": node, "hostname": f"ct{vmid}", **extra}
        (self.path / f"{vmid}.json").write_text(json.dumps(doc))

    def calls(self) -> list[list[str]]:
        log = self.path / "calls.jsonl"
        return [json.loads(line)["argv"] for line in log.read_text().splitlines()] if log.exists() else []

    def env(self) -> dict[str, str]:
        return {"PCTSIM_DIR": str(self.path)}


class Container:
    """sleep as PID 1 of a new PID + mount namespace (with its own /proc), like an LXC container's init."""

    def __init__(self) -> None:
        if not shutil.which("unshare") or not shutil.which("nsenter"):
            raise RuntimeError("unshare and nsenter (util-linux) are needed")
        self.outer = subprocess.Popen(["unshare", "--pid", "--fork", "--mount-proc", "--kill-child", "sleep", "600"])
        deadline = time.monotonic() + 10
        self.init = 0
        while time.monotonic() < deadline and not self.init:
            children = Path(f"/proc/{self.outer.pid}/task/{self.outer.pid}/children")
            pids = children.read_text().split() if children.exists() else []
            self.init = int(pids[0]) if pids else 0
            time.sleep(0.02)
        if not self.init:
            self.stop()
            raise RuntimeError("the container's init did not start")

    def processes(self) -> list[str]:
        """Command lines of the processes inside, seen from inside."""
        out = subprocess.run(
            ["nsenter", "-t", str(self.init), "-p", "-m", "--", "sh", "-c", "for d in /proc/[0-9]*; do tr '\\0' ' ' < $d/cmdline; echo; done"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        return [line.strip() for line in out.splitlines() if line.strip()]

    def stop(self) -> None:
        # unshare ignores SIGTERM while it waits; ending the namespace's init ends everything inside.
        if self.init:
            try:
                os.kill(self.init, 9)
            except ProcessLookupError:
                pass
        try:
            self.outer.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.outer.kill()
            self.outer.wait(timeout=10)
