"""Benchmark: what the role's single failure path costs (issue 10), against an earlier revision of it.

Run with `tools/pidns-run .venv/bin/python tools/bench/failure_path.py [--against REV] [--repeat N]`.
In one run, interleaved so that the machine's load falls on both alike:

* "plain": playbooks/clean_slate.yml on the simulated 8 x H200 node with kill_verify's plain workload
  (eight renamed SGLang workers), connection local, for this checkout and for ``--against`` (a git
  revision of the collection, extracted with `git archive`; default: the parent of the first commit
  that touched the failure path, b98e9bd);
* "+ unreachable host": the same, with a second inventory host that refuses SSH (a closed loopback
  port), which this checkout reports (summary, set_stats entry, JSON report) and the old role dropped.

Every cell is the median of --repeat runs on a fresh workload. CPU is the CPU time of ansible-playbook
and everything it started (modules included), which a loaded machine disturbs less than the wall time;
the tasks column counts the tasks that ran (not skipped) for the GPU node, and those skipped for it.
"""

from __future__ import annotations

import argparse
import os
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.kill_verify import build
from gpusim import Node
from support.ansible import local_inventory, run_playbook

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


BASELINE = "b98e9bd"
GRACE = 1.0


def extract(rev: str, dest: Path) -> Path:
    """The collection at ``rev`` as a collections path (ansible_collections/gpuops/clean_slate)."""
    target = dest / "ansible_collections" / "gpuops" / "clean_slate"
    target.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "roles", "playbooks", "plugins", "meta", "galaxy.yml"], check=True, capture_output=True)
    subprocess.run(["tar", "-x", "-C", str(target)], input=archive.stdout, check=True)
    return dest


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def children_cpu() -> float:
    """CPU seconds of this process's reaped children: ansible-playbook and everything it ran."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def one_run(collections: Path, unreachable: bool) -> dict[str, Any]:
    with Node(gpus=8) as node, tempfile.TemporaryDirectory(prefix="gpuops-bench-fp-") as tmp:
        sb = node.sandbox()
        try:
            build(node, sb, "plain")
            hosts: dict[str, dict[str, Any]] = {
                "gpu-node-1": {"clean_slate_device_dir": str(node.dev_dir), "clean_slate_expected_gpus": 8, "clean_slate_grace_period": GRACE}
            }
            if unreachable:
                hosts["gone"] = {"ansible_connection": "ssh", "ansible_host": "127.0.0.1", "ansible_port": closed_port(), "ansible_user": "root"}
            inventory = local_inventory(Path(tmp) / "inventory.yml", hosts)
            env = {**node.env(), "ANSIBLE_COLLECTIONS_PATH": str(collections)}
            playbook = collections / "ansible_collections" / "gpuops" / "clean_slate" / "playbooks" / "clean_slate.yml"
            cpu = children_cpu()
            run = run_playbook(playbook, inventory=inventory, env=env, wrapper=sb.nsenter_prefix())
            cpu = children_cpu() - cpu
            entries = run.stats.get("custom", {}).get("_run", {}).get("clean_slate", {})
            return {
                "wall": run.elapsed,
                "cpu": cpu,
                "rc": run.rc,
                "clean": all(node.memory(i)["used_mib"] == 0 for i in range(8)),
                "tasks": sum(1 for r in run.results if r["host"] == "gpu-node-1" and r["status"] != "skipped"),
                "skipped": sum(1 for r in run.results if r["host"] == "gpu-node-1" and r["status"] == "skipped"),
                "reported": sorted(entries),
            }
        finally:
            sb.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--against", default=BASELINE, help="git revision of the collection to compare with")
    parser.add_argument("--repeat", type=int, default=5, help="runs per cell (median reported)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="gpuops-bench-rev-") as tmp:
        old = extract(args.against, Path(tmp))
        contenders = {f"{args.against}": old, "this checkout": ROOT}
        cells: dict[tuple[str, str], list[dict[str, Any]]] = {}
        for _unused in range(args.repeat):
            for scenario, unreachable in (("plain", False), ("plain + unreachable host", True)):
                for name, path in contenders.items():
                    cells.setdefault((name, scenario), []).append(one_run(path, unreachable))
    print(f"clean_slate playbook, failure path: {args.repeat} runs per cell (medians), grace period {GRACE:g} s, {os.cpu_count()} CPUs")
    print("| Role | Scenario | Wall (s) | CPU (s), Ansible and modules | rc | GPUs clean | Tasks run / skipped (GPU node) | Hosts in set_stats |")
    print("|---|---|---:|---:|---:|---|---|---|")
    for (name, scenario), runs in cells.items():
        first = runs[0]
        wall, cpu = statistics.median(r["wall"] for r in runs), statistics.median(r["cpu"] for r in runs)
        clean = "yes" if all(r["clean"] for r in runs) else "NO"
        reported = ", ".join(first["reported"]) or "-"
        print(f"| {name} | {scenario} | {wall:.2f} | {cpu:.2f} | {first['rc']} | {clean} | {first['tasks']} / {first['skipped']} | {reported} |")
    return 0


if __name__ == "__main__":
    if os.environ.get("GPUOPS_PIDNS") != "1":
        os.execvp(str(ROOT / "tests" / "tools" / "pidns-run"), [str(ROOT / "tests" / "tools" / "pidns-run"), sys.executable, *sys.argv])
    sys.exit(main())
