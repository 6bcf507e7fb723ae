"""Benchmark: the whole clean_slate playbook, on one simulated node and on the 5-host lab.

Run with `make bench` (or `tests/tools/pidns-run .venv/bin/python tests/bench/role.py`; it
re-executes itself there). In one run:

* single node: playbooks/clean_slate.yml (ansible-playbook, start-up and inventory included)
  against the simulated 8 x H200 node, connection local inside the node's sandbox, vs the
  hand-run pipeline of the developers' guide (tests/bench/kill_verify.py's PIPELINE: the two
  commands, the operator's 3 s pause, then re-checks until every GPU line says 0 MiB) on the
  same workload (kill_verify's build(): an SGLang launcher, eight renamed scheduler workers,
  and for "messy" a forked child that kept GPU 6 and a vLLM worker on GPU 7 that ignores
  SIGTERM; nvidia-persistenced, nv-hostengine and dcgm-exporter beside them);
* the lab (tests/lab, docs/lab.md): the same playbook over SSH against the Proxmox inventory
  (5 GPU hosts: 2 hypervisors, a container with sshd, 2 containers cleaned from their node
  through pct), with --forks 5 and --forks 1, and limited to one host (pve1) for the
  single-host reference. Every run starts cold: new ansible-playbook, inventory read from the
  API simulator, no SSH connection kept from an earlier run. Each host carries an SGLang-like
  workload with a SIGTERM-ignoring vLLM worker, so each host waits its grace period once.

Both use ``clean_slate_grace_period`` = GRACE. Every cell is the median of --repeat runs, each
on a freshly built workload. The module executions per host are the gpuops modules the role
ran for that host (on the host itself, or on its hypervisor for a container without network).
``--write-docs`` replaces the section "Role: the clean_slate playbook, local and on the 5-host
lab" of docs/benchmarks.md and leaves the rest alone.
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path[:0] = [str(HERE), str(HERE.parent), str(HERE.parent / "sim")]

from gpusim import Node  # noqa: E402
from kill_verify import build, run_pipeline, survivors  # noqa: E402
from support.ansible import VENV_PYTHON, AnsibleRun, local_inventory, run_playbook, write_docs_section  # noqa: E402

DOCS = ROOT / "docs" / "benchmarks.md"
SECTION = "## Role: the clean_slate playbook, local and on the 5-host lab"
PLAYBOOK = ROOT / "playbooks" / "clean_slate.yml"
GRACE = 1.0
GOAL_LOCAL_S = 3.0
GOAL_LAB_RATIO = 1.5


def children_cpu(pid: int) -> float:
    """CPU seconds of the reaped descendants of ``pid`` (cutime + cstime)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()
    except OSError:
        return 0.0
    return (int(fields[13]) + int(fields[14])) / os.sysconf("SC_CLK_TCK")


def own_children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def module_runs(run: AnsibleRun) -> dict[str, int]:
    """gpuops module executions per inventory host (a delegated one counts for its host)."""
    counts: Counter[str] = Counter()
    for r in run.results:
        if r["action"].startswith("gpuops.clean_slate.") and r["status"] in ("ok", "failed"):
            counts[r["host"]] += 1
    return dict(counts)


# ---------------------------------------------------------------------- single node
def local_playbook(scenario: str) -> dict[str, Any]:
    with Node(gpus=8) as node, tempfile.TemporaryDirectory(prefix="gpuops-bench-role-") as tmp:
        sb = node.sandbox()
        work = build(node, sb, scenario)
        inventory = local_inventory(
            Path(tmp) / "inventory.yml",
            {"gpu-node-1": {"clean_slate_device_dir": str(node.dev_dir), "clean_slate_expected_gpus": 8, "clean_slate_grace_period": GRACE}},
        )
        env = node.env()
        env["PATH"] = f"{node.bin_dir}:{os.environ.get('PATH', '')}"
        cpu = own_children_cpu()
        run = run_playbook(PLAYBOOK, inventory=inventory, env=env, wrapper=sb.nsenter_prefix())
        cpu = own_children_cpu() - cpu
        if run.rc != 0:
            raise RuntimeError(run.output)
        verify = run.phase("verify", host="gpu-node-1")
        out = {
            "wall": run.elapsed,
            "cpu_controller": cpu,
            "clean": verify["clean"] and all(node.memory(i)["used_mib"] == 0 for i in range(8)),
            "daemons": len(survivors(work)),
            "modules": module_runs(run).get("gpu-node-1", 0),
            "tasks": sum(1 for r in run.results if r["host"] == "gpu-node-1" and r["status"] != "skipped"),
        }
        sb.stop()
        return out


def local_pipeline(scenario: str, tmp: Path) -> dict[str, Any]:
    """The hand-run pipeline on the same workload: kill_verify's run, in its terms here."""
    result = run_pipeline(scenario, tmp)
    return {"wall": result["wall"], "clean": result["clean"], "daemons": len(result["daemons_left"])}


# ---------------------------------------------------------------------- lab
def lab_runs(repeat: int) -> dict[str, list[dict[str, Any]]]:
    from lab.builder import Lab

    configs = {"lab, 1 host (pve1)": {"limit": "pve1", "forks": 5}, "lab, 5 hosts, forks 5": {"forks": 5}, "lab, 5 hosts, forks 1": {"forks": 1}}
    results: dict[str, list[dict[str, Any]]] = {name: [] for name in configs}
    lab = Lab()
    try:
        lab.build()
        # The hypervisors start without the modules' dependencies (docs/lab.md): one run makes their virtual
        # environments, so that the measured runs are the steady state of a node after its first run.
        warm = lab.playbook(extra_vars={"clean_slate_grace_period": GRACE})
        if warm.rc != 0:
            raise RuntimeError(warm.output)
        for _unused in range(repeat):
            for name, kw in configs.items():
                lab.reset()
                lab.close_connections()
                daemons = {h.name: set(h.daemons) for h in lab.hosts.values()}
                sshds = [h.sshd.pid for h in lab.hosts.values() if h.sshd is not None]
                hosts_cpu = sum(children_cpu(pid) for pid in sshds)
                controller_cpu = own_children_cpu()
                run = lab.playbook(extra_vars={"clean_slate_grace_period": GRACE}, **kw)
                controller_cpu = own_children_cpu() - controller_cpu
                if run.rc != 0:
                    raise RuntimeError(run.output)
                # Closing the connections ends the SSH sessions; each sshd then reaps its session,
                # which has reaped everything that ran on that host (modules, pct, shells).
                lab.close_connections()
                time.sleep(0.3)
                hosts_cpu = sum(children_cpu(pid) for pid in sshds) - hosts_cpu
                hosts = sorted(run.stats["stats"])
                clean = all(not any(lab.used_mib(lab[h]).values()) for h in hosts)
                alive = {h.name: {n for n, p in h.daemons.items() if p.alive()} for h in lab.hosts.values()}
                results[name].append(
                    {
                        "wall": run.elapsed,
                        "cpu_controller": controller_cpu,
                        "cpu_hosts": hosts_cpu,
                        "hosts": len(hosts),
                        "clean": clean,
                        "daemons": sum(len(v) for v in alive.values()),
                        "daemons_all": sum(len(v) for v in daemons.values()),
                        "modules": module_runs(run),
                        "tasks": Counter(r["host"] for r in run.results if r["status"] != "skipped"),
                    }
                )
    finally:
        lab.teardown()
    return results


# ---------------------------------------------------------------------- report
def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=3, help="runs per cell (median reported)")
    parser.add_argument("--write-docs", action="store_true", help=f"write the figures into {DOCS.relative_to(ROOT)}")
    args = parser.parse_args()

    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="gpuops-bench-") as tmpdir:
        for scenario in ("plain", "messy"):
            ours = [local_playbook(scenario) for _unused in range(args.repeat)]
            pipe = [local_pipeline(scenario, Path(tmpdir)) for _unused in range(args.repeat)]
            rows.append(
                {
                    "what": f"1 node, {scenario}: playbook (local)",
                    "wall": statistics.median(o["wall"] for o in ours),
                    "cpu": f"{statistics.median(o['cpu_controller'] for o in ours):.1f}",
                    "hosts": 1,
                    "clean": all(o["clean"] for o in ours),
                    "daemons": f"{min(o['daemons'] for o in ours)}/3",
                    "modules": str(ours[0]["modules"]),
                    "tasks": str(ours[0]["tasks"]),
                }
            )
            rows.append(
                {
                    "what": f"1 node, {scenario}: hand-run pipeline",
                    "wall": statistics.median(p["wall"] for p in pipe),
                    "cpu": "-",
                    "hosts": 1,
                    "clean": all(p["clean"] for p in pipe),
                    "daemons": f"{max(p['daemons'] for p in pipe)}/3",
                    "modules": "-",
                    "tasks": "-",
                }
            )
    lab = lab_runs(args.repeat)
    for name, runs in lab.items():
        first = runs[0]
        rows.append(
            {
                "what": name,
                "wall": statistics.median(r["wall"] for r in runs),
                "cpu": f"{statistics.median(r['cpu_controller'] for r in runs):.1f} + {statistics.median(r['cpu_hosts'] for r in runs):.1f}",
                "cpu_ctl": statistics.median(r["cpu_controller"] for r in runs),
                "cpu_hosts": statistics.median(r["cpu_hosts"] for r in runs),
                "hosts": first["hosts"],
                "clean": all(r["clean"] for r in runs),
                "daemons": f"{min(r['daemons'] for r in runs)}/{first['daemons_all']}",
                "modules": ", ".join(f"{h} {n}" for h, n in sorted(first["modules"].items())),
                "tasks": ", ".join(f"{h} {n}" for h, n in sorted(first["tasks"].items())),
            }
        )

    by = {r["what"]: r for r in rows}
    local = by["1 node, plain: playbook (local)"]["wall"]
    messy = by["1 node, messy: playbook (local)"]["wall"]
    one = by["lab, 1 host (pve1)"]["wall"]
    five = by["lab, 5 hosts, forks 5"]["wall"]
    serial = by["lab, 5 hosts, forks 1"]["wall"]
    header = ["Run", "Hosts", "Wall (s)", "CPU (s): controller + hosts", "Clean", "Daemons kept"]
    header += ["gpuops module runs per host", "Tasks run per host (not skipped)"]
    lines = ["| " + " | ".join(header) + " |", "|---|---:|---:|---:|---|---:|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['what']} | {r['hosts']} | {r['wall']:.2f} | {r['cpu']} | {'yes' if r['clean'] else 'NO'} | {r['daemons']} | {r['modules']} | {r['tasks']} |"
        )
    table = "\n".join(lines)
    summary = [
        f"playbook vs pipeline, 1 node: plain {local:.2f} s vs {by['1 node, plain: hand-run pipeline']['wall']:.2f} s,"
        f" messy {messy:.2f} s vs {by['1 node, messy: hand-run pipeline']['wall']:.2f} s"
        f" (goal: under {GOAL_LOCAL_S:g} s: {'met' if max(local, messy) < GOAL_LOCAL_S else 'plain ' + ('met' if local < GOAL_LOCAL_S else 'missed')})",
        f"lab, forks 5 vs 1 host: {five:.2f} s / {one:.2f} s = {five / one:.2f}x over SSH; vs the local single node {five / local:.2f}x"
        f" (goal <= {GOAL_LAB_RATIO}x); forks 1: {serial:.2f} s ({serial / five:.1f}x the forks-5 time)",
    ]
    print(f"clean_slate playbook, {args.repeat} runs per cell (medians), grace period {GRACE:g} s")
    print(table)
    print("\n".join(summary))
    if args.write_docs:
        write_docs(table, by, args.repeat)
    return 0


def write_docs(table: str, by: dict[str, dict[str, Any]], repeat: int) -> None:
    local = by["1 node, plain: playbook (local)"]["wall"]
    messy = by["1 node, messy: playbook (local)"]["wall"]
    pipe = by["1 node, plain: hand-run pipeline"]["wall"]
    pipe_messy = by["1 node, messy: hand-run pipeline"]["wall"]
    one = by["lab, 1 host (pve1)"]["wall"]
    five = by["lab, 5 hosts, forks 5"]["wall"]
    serial = by["lab, 5 hosts, forks 1"]["wall"]
    b1, b5 = by["lab, 1 host (pve1)"], by["lab, 5 hosts, forks 5"]
    section = f"""{SECTION}

Measured {time.strftime("%Y-%m-%d")} on {platform.node() or "the build machine"} ({os.cpu_count()} cores, Python {platform.python_version()}), with

    tests/tools/pidns-run .venv/bin/python tests/bench/role.py --repeat {repeat} --write-docs

Each row is the whole `playbooks/clean_slate.yml` run by `ansible-playbook` (interpreter start-up,
inventory and every role task included), median of {repeat} runs, each on a freshly built workload,
`clean_slate_grace_period: {GRACE:g}`.

- **1 node**: the simulated 8 x H200 node, `ansible_connection: local` inside the node's sandbox,
  against the developers' guide's hand-run pipeline (`tests/bench/kill_verify.py`: `ps | grep python3 |
  kill -9`, the operator's 3 s pause, `fuser -k /dev/nvidia*; sleep 2; nvidia-smi`, re-checked every 2 s
  until eight lines say `0 MiB`) on the same workload: an SGLang launcher and eight renamed scheduler
  workers ("plain"), plus a forked child that kept GPU 6 and a vLLM worker on GPU 7 that ignores
  SIGTERM ("messy"), with nvidia-persistenced, nv-hostengine and dcgm-exporter beside them.
- **lab**: the 5-host lab of `tests/lab` ([lab.md](lab.md)): the same playbook over SSH, the
  inventory from the `gpuops.clean_slate.proxmox` plugin reading the API simulator, Python 3.9 on the
  hypervisors. Each host has an SGLang-like job with one SIGTERM-ignoring vLLM worker, so each waits
  its grace period once. Runs are cold: no SSH connection survives from an earlier run. "1 host" is
  the same playbook limited to pve1, the single-host reference for the forks comparison.

{table}

- Single node: the playbook takes {local:.2f} s ("plain") and {messy:.2f} s ("messy", of which
  {GRACE:g} s is the grace period the SIGTERM-ignoring worker is given before SIGKILL) against
  {pipe:.2f} s and {pipe_messy:.2f} s for the pipeline, which sleeps 5 s whatever happens and ends the
  management daemons with everything else. Goal (under {GOAL_LOCAL_S:g} s, start-up included):
  {"met for both" if max(local, messy) < GOAL_LOCAL_S else ("met for plain; messy adds the grace period" if local < GOAL_LOCAL_S else "missed")}.
- Lab: five hosts with `--forks 5` take {five:.2f} s, {five / one:.2f}x the {one:.2f} s of one lab host
  (goal: at most {GOAL_LAB_RATIO}x; {"met" if five / one <= GOAL_LAB_RATIO else "missed"}), and {five / local:.2f}x the local
  single node, which has no SSH. With `--forks 1` the hosts go one after another: {serial:.2f} s.
- Why the five hosts do not run in the time of one here: the controller and the five "machines" of
  the lab share {os.cpu_count()} cores. One lab host costs {b1["cpu_ctl"] + b1["cpu_hosts"]:.1f} s of CPU
  ({b1["cpu_ctl"]:.1f} on the controller, {b1["cpu_hosts"]:.1f} on the host), five cost {b5["cpu_ctl"] + b5["cpu_hosts"]:.1f} s
  ({b5["cpu_ctl"]:.1f} + {b5["cpu_hosts"]:.1f}), so the CPU alone needs {(b5["cpu_ctl"] + b5["cpu_hosts"]) / (os.cpu_count() or 1):.1f} s of the
  {five:.2f}, on top of what no parallelism hides (Ansible's start-up, about 0.5 s, and the {GRACE:g} s grace
  period). Host CPU is measured as what each host's sshd reaped from its sessions (modules, pct,
  shells), controller CPU as what ansible-playbook and its children used. On real machines each
  host's share runs on its own CPUs; the controller's share (Ansible forks a worker for every task
  and host, skipped ones included) is what grows with the number of hosts, about
  {(b5["cpu_ctl"] - b1["cpu_ctl"]) / 4:.2f} s of CPU per extra host here.
- Module runs per host: three gpuops modules (the before picture, the kill, the verification); the
  containers without network run theirs on their hypervisor. Everything else the role does
  (argument validation, mode, summary, set_stats) runs on the controller.
"""
    write_docs_section(DOCS, SECTION, section)


if __name__ == "__main__":
    if not os.environ.get("GPUOPS_PIDNS"):
        # Signals fly and the lab needs its own namespaces: run in a private PID namespace.
        tool = str(HERE.parent / "tools" / "pidns-run")
        os.execvp(tool, [tool, VENV_PYTHON, __file__, *sys.argv[1:]])
    sys.exit(main())
