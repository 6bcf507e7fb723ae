"""The cost of trust (issue 43): one run of the clean_slate playbook on an idle simulated node, accounted for beside a
one-task ``ansible.builtin.ping`` play, every 0.1 s of the difference named.

    tools/pidns-run .venv/bin/python tools/bench/cost.py [--repeat 5] [--baseline CHECKOUT ...] [--write-docs]

On the simulated 8 x H200 node (connection local, nothing to kill: the node is idle, as issue 43's goal states), it
runs, alternating so that a machine that warms up or slows down meets every contender alike: the empty one-task play,
the one-task ping play, and ``playbooks/clean_slate.yml`` of this checkout (and of each ``--baseline`` checkout, named by
its commit), each a fresh ``ansible-playbook`` started through tools/bench/controller.py's launcher, which times every
worker Ansible forks (its CPU, the templates it compiles, the AnsiballZ payload it builds). For each run it reads:

* the controller: start-up to the first task (parsing the play and the role, loading plugins), each task's wall time
  (tools/bench/callback/tasktime.py), the clean task's worker CPU split into templating its arguments, building the
  payload and the rest (the action plugin's own work: the phases from the tags, the host's record);
* the node, from ``clean_slate_node``'s own ``timings``: from the module process's start to its code (the interpreter's
  start and the payload's import), each phase, and the verification's steps (the NVML helper's start, the polling,
  the CUDA start, the software checks, the health verdict).

It prints one table: each part's median for the ping play and for the role, and the difference, from the whole wall
time down to the parts; ``--write-docs`` replaces the section "Cost of trust: the role beside a ping play, part by
part" of docs/benchmarks.md. Nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
DOCS = ROOT / "docs" / "benchmarks.md"
SECTION = "## Cost of trust: the role beside a ping play, part by part (issue 43)"

EMPTY = [{"name": "Yardstick", "hosts": "gpu_nodes", "gather_facts": False, "tasks": [{"name": "Nothing", "ansible.builtin.debug": {"msg": "nothing"}}]}]
PING = [{"name": "Floor", "hosts": "gpu_nodes", "gather_facts": False, "tasks": [{"name": "One module", "ansible.builtin.ping": None}]}]


def commit_of(checkout: Path) -> str:
    done = subprocess.run(["git", "-C", str(checkout), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False)
    return done.stdout.strip() or checkout.name


def collections_path(checkout: Path, tmp: Path) -> Path:
    """A collections path holding ``checkout`` as gpuops.clean_slate."""
    base = tmp / f"ac-{commit_of(checkout)}"
    link = base / "ansible_collections" / "gpuops" / "clean_slate"
    if not link.exists():
        link.parent.mkdir(parents=True)
        link.symlink_to(checkout.resolve())
    return base


def one_run(kind: str, checkout: Path, node: Any, sb: Any, inventory: Path, tmp: Path, n: int) -> dict[str, Any]:
    """One ansible-playbook run through the launcher: its wall, and what the launcher and the callback recorded."""
    from bench import controller
    from support.ansible import run_playbook

    out = tmp / f"{kind}-{n}"
    out.mkdir()
    env = node.env()
    env.update(ANSIBLE_CONFIG=str(checkout / "ansible.cfg"), ANSIBLE_COLLECTIONS_PATH=str(collections_path(checkout, tmp)), **controller.env_for(out, False))
    playbook: Any = {"empty": EMPTY, "ping": PING}.get(kind, checkout / "playbooks" / "clean_slate.yml")
    started = time.perf_counter()
    run = run_playbook(playbook, inventory=inventory, env=env, wrapper=[*sb.nsenter_prefix(), *controller.wrapper()])
    wall = time.perf_counter() - started
    if run.rc != 0:
        raise RuntimeError(f"{kind} failed:\n{run.output[-4000:]}")
    tasks = []
    for line in (out / "tasktime.txt").read_text().splitlines():
        seconds, _sep, name = line.strip().partition(" ")
        tasks.append((name.split(" : ")[-1], float(seconds)))
    workers = [json.loads(line) for line in (out / "workers.jsonl").read_text().splitlines()] if (out / "workers.jsonl").exists() else []
    row: dict[str, Any] = {"wall": wall, "tasks": tasks, "workers": workers, "main_cpu": json.loads((out / "main.json").read_text())["cpu"]}
    if kind.startswith("role"):
        clean = run.role_clean("n1")["result"]
        row["node"] = {"elapsed": clean.get("elapsed_s"), **(clean.get("timings") or {})}
        row["verify"] = (clean.get("verify") or {}).get("timings") or {}
    return row


def median(values: list[float]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def parts(row: dict[str, Any]) -> dict[str, float | None]:
    """The parts of one run, in seconds."""
    tasks = row["tasks"]
    start = tasks[0][1] if tasks and tasks[0][0] == "start" else 0.0
    total = tasks[-1][1] if tasks and tasks[-1][0].startswith("total") else None
    body = [(name, s) for name, s in tasks[1:] if not name.startswith("total")]
    module_task = next(((name, s) for name, s in body if name.startswith("Clean the GPUs") or name == "One module"), (None, 0.0))
    others = sum(s for name, s in body if name != module_task[0])
    worker = next((w for w in row["workers"] if w["task"].split(" : ")[-1].startswith("Clean the GPUs") or w["task"] == "One module"), {})
    out: dict[str, float | None] = {
        "wall": row["wall"],
        "outside the play (interpreter, inventory, exit)": row["wall"] - total if total is not None else None,
        "start-up to the first task (play and role parsed, plugins loaded)": start,
        "the module task": module_task[1],
        "  controller worker CPU": worker.get("cpu"),
        "    templating the task's arguments": worker.get("template_cpu"),
        "    building the payload (AnsiballZ)": worker.get("payload_cpu"),
        "    the rest (the action plugin: phases from the tags, the record)": (
            (worker["cpu"] - worker.get("template_cpu", 0.0) - worker.get("payload_cpu", 0.0)) if worker else None
        ),
        "the play's other tasks": others,
        "controller main process CPU": row["main_cpu"],
    }
    node = row.get("node") or {}
    verify = row.get("verify") or {}
    out.update(
        {
            "  node: the module process's start to its code (interpreter, payload import)": node.get("before_run"),
            "  node: the module's own run": node.get("elapsed"),
            "    preflight": node.get("preflight"),
            "    kill": node.get("kill"),
            "    residue": node.get("residue"),
            "    verify": node.get("verify"),
            "      NVML helper start": verify.get("nvml_start"),
            "      polling": verify.get("poll"),
            "      device files and CUDA start": verify.get("cuda"),
            "      software checks": verify.get("software"),
            "      health verdict (kernel log)": verify.get("health"),
        }
    )
    return out


def table(columns: dict[str, list[dict[str, Any]]]) -> tuple[str, dict[str, dict[str, float | None]]]:
    med: dict[str, dict[str, float | None]] = {}
    for name, rows in columns.items():
        each = [parts(r) for r in rows]
        med[name] = {k: median([e[k] for e in each if e[k] is not None]) for k in each[0]}
    names = list(columns)
    ping = med.get("ping", {})
    head = "| Part (median s) | " + " | ".join(names) + " | " + " | ".join(f"{n} - ping" for n in names if n.startswith("role")) + " |"
    lines = [head, "|---|" + "---:|" * (len(names) + sum(1 for n in names if n.startswith("role")))]
    for key in med[names[0]]:
        cells = [fmt(med[n].get(key)) for n in names]
        diffs = [fmt(delta(med[n].get(key), ping.get(key))) for n in names if n.startswith("role")]
        lines.append(f"| {key.replace('  ', '&nbsp;&nbsp;')} | " + " | ".join(cells) + " | " + " | ".join(diffs) + " |")
    return "\n".join(lines), med


def delta(a: float | None, b: float | None) -> float | None:
    if a is None:
        return None
    return a - (b or 0.0)


def fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--baseline", type=Path, action="append", default=[], help="another checkout of the collection, run beside this one")
    ap.add_argument("--write-docs", action="store_true")
    a = ap.parse_args()
    from gpusim import Node
    from support.ansible import local_inventory

    contenders = [("empty", ROOT), ("ping", ROOT), ("role", ROOT)] + [(f"role {commit_of(b)}", b.resolve()) for b in a.baseline]
    columns: dict[str, list[dict[str, Any]]] = {name: [] for name, _c in contenders}
    with Node(gpus=8) as node, tempfile.TemporaryDirectory(prefix="gpuops-cost-") as tmpdir:
        tmp = Path(tmpdir)
        sb = node.sandbox()
        host = {"clean_slate_device_dir": str(node.dev_dir), "clean_slate_health_kernel_log": str(node.kernel_log)}
        inventory = local_inventory(tmp / "inventory.yml", {"n1": host})
        for n in range(a.repeat):
            for name, checkout in contenders:
                columns[name].append(one_run(name, checkout, node, sb, inventory, tmp, n))
        sb.stop()
    text, med = table(columns)
    when = time.strftime("%Y-%m-%d")
    load = os.getloadavg()[0]
    print(text)
    role, ping = med["role"], med["ping"]
    summary = [
        f"- role - ping play: {role['wall'] - ping['wall']:.2f} s (issue 43's goal: at most 0.9 s on the idle simulated node)",
    ]
    for name in columns:
        if name.startswith("role ") and med[name]["wall"] is not None:
            summary.append(f"- {name} - ping play: {med[name]['wall'] - ping['wall']:.2f} s (the same run)")
    print("\n".join(summary))
    if a.write_docs:
        from support.ansible import write_docs_section

        baselines = "".join(f" --baseline {b}" for b in a.baseline)
        section = (
            f"{SECTION}\n\nMeasured {when} on {platform.node()} ({os.cpu_count()} cores, Python {platform.python_version()}; load average"
            f" {load:.1f} at the end), with\n\n    tools/pidns-run .venv/bin/python tools/bench/cost.py --repeat {a.repeat}{baselines} --write-docs\n\n"
            "The simulated 8 x H200 node, idle (nothing to kill), connection local; every run a fresh `ansible-playbook`, the empty"
            " play, the ping play and the role's playbook alternating, medians of the runs. The controller's parts come from the"
            " launcher of tools/bench/controller.py (each worker's own CPU, the templates it compiles and the payload it builds);"
            " the node's from `clean_slate_node`'s `timings` (a baseline before them shows `-`). Rows indented under another are"
            " its parts.\n\n" + text + "\n\n" + "\n".join(summary) + "\n"
        )
        write_docs_section(DOCS, SECTION, section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
