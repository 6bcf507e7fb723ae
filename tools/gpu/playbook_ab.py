"""The clean_slate playbook before and after a change, side by side on one GPU node (issue 13's before/after).

Runs, alternating so that a machine that warms up or slows down meets every contender alike: the empty one-task
playbook (Ansible's start-up and inventory), the same with one ``ansible.builtin.ping`` task (Ansible's floor for a
module task: no play of modules can cost less over the empty playbook), ``playbooks/clean_slate.yml`` of the
checkout given with --baseline (when given), and this checkout's. Nothing is killed (the node is idle), so what is left is what Ansible and the role cost.
Every run is a fresh ``ansible-playbook`` with the local connection and the running Python as the modules'
interpreter (it has nvidia-ml-py and psutil). Prints each run's wall time and the medians.

    python3 tools/gpu/playbook_ab.py --baseline ../before --repeat 5 [--profile]

With --profile (issue 43), every run also goes through the benchmark callback (tools/bench/callback/tasktime.py): each
task's wall time and this checkout's ``clean_slate_node`` ``timings``, printed after the walls as one table of medians,
the ping play's parts beside the role's, as tools/bench/cost.py prints on the simulated node.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import typing as t
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

EMPTY = """- name: Yardstick
  hosts: gpu_nodes
  gather_facts: false
  tasks:
    - name: Nothing
      ansible.builtin.debug:
        msg: nothing
"""

PING = """- name: Floor
  hosts: gpu_nodes
  gather_facts: false
  tasks:
    - name: One module
      ansible.builtin.ping:
"""


def collections_dir(checkout: Path, tmp: Path, name: str) -> Path:
    """A collections path holding ``checkout`` as gpuops.clean_slate."""
    d = tmp / name / "ansible_collections" / "gpuops"
    d.mkdir(parents=True)
    (d / "clean_slate").symlink_to(checkout.resolve())
    return tmp / name


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--baseline", type=Path, action="append", default=[], help="a checkout of the collection to compare with (repeatable)")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--gpus", type=int, default=0, help="clean_slate_expected_gpus (0: not checked)")
    p.add_argument("--host-var", action="append", default=[], metavar="NAME=VALUE", help="another host variable (a simulated node's device dir)")
    p.add_argument("--profile", action="store_true", help="also account for each part of a run (tasks, the node's timings)")
    a = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="gpuops-ab-") as tmpdir:
        tmp = Path(tmpdir)
        inventory = tmp / "inventory.json"
        host = {"ansible_connection": "local", "ansible_python_interpreter": sys.executable, "clean_slate_expected_gpus": a.gpus}
        host.update(v.split("=", 1) for v in a.host_var)
        inventory.write_text(json.dumps({"all": {"children": {"gpu_nodes": {"hosts": {"gpu-node": host}}}}}))
        (tmp / "empty.yml").write_text(EMPTY)
        (tmp / "ping.yml").write_text(PING)
        contenders: dict[str, tuple[t.Any, ...]] = {
            "empty one-task playbook": (collections_dir(ROOT, tmp, "after"), tmp / "empty.yml"),
            "one ping task (Ansible's floor for a module task)": (tmp / "after", tmp / "ping.yml"),
        }
        for n, baseline in enumerate(a.baseline):
            contenders[f"playbook before ({baseline})"] = (collections_dir(baseline, tmp, f"before{n}"), baseline.resolve() / "playbooks" / "clean_slate.yml")
        contenders["playbook after (this checkout)"] = (tmp / "after", ROOT / "playbooks" / "clean_slate.yml")
        # The same without the CUDA start on each GPU: the role's shape alone, against a baseline that had no probe.
        contenders["playbook after, clean_slate_cuda_probe=false"] = (tmp / "after", ROOT / "playbooks" / "clean_slate.yml", "clean_slate_cuda_probe=false")
        # Round 4's readiness checks off (the peer check, the link readings): what they cost on top (issue 39).
        contenders["playbook after, clean_slate_peers=false clean_slate_links=false"] = (
            tmp / "after",
            ROOT / "playbooks" / "clean_slate.yml",
            "clean_slate_peers=false",
            "clean_slate_links=false",
        )
        walls: dict[str, list[float]] = {name: [] for name in contenders}
        profiles: dict[str, list[dict[str, t.Any]]] = {name: [] for name in contenders}
        for n in range(a.repeat):
            for i, (name, (collections, playbook, *extra)) in enumerate(contenders.items()):
                env = dict(os.environ, ANSIBLE_COLLECTIONS_PATH=str(collections), ANSIBLE_NOCOLOR="1", ANSIBLE_PIPELINING="True")
                if a.profile:
                    tasks, results = tmp / f"tasks-{i}-{n}.txt", tmp / f"results-{i}-{n}.jsonl"
                    env.update(
                        ANSIBLE_CALLBACK_PLUGINS=str(ROOT / "tools" / "bench" / "callback"), GPUOPS_TASKTIME=str(tasks), GPUOPS_TASKTIME_RESULTS=str(results)
                    )
                start = time.perf_counter()
                argv = ["ansible-playbook", "-i", str(inventory), str(playbook)] + [x for e in extra for x in ("-e", e)]
                run = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, check=False)
                walls[name].append(round(time.perf_counter() - start, 3))
                if a.profile:
                    profiles[name].append(profile_of(tasks, results, walls[name][-1]))
                if run.returncode != 0:
                    print(f"{name}: rc {run.returncode}\n{run.stdout[-2000:]}{run.stderr[-2000:]}", file=sys.stderr)
                    return 1
        print("| run | wall s, each run | median s |\n|---|---|---:|")
        for name, values in walls.items():
            print(f"| {name} | {', '.join(f'{v:.2f}' for v in values)} | {statistics.median(values):.2f} |")
        if a.profile:
            print_profile(profiles)
    return 0


NODE = ("before_run", "preflight", "plan", "kill", "residue", "verify", "metrics")
VERIFY = ("nvml_start", "poll", "cuda", "software", "health")


def profile_of(tasks: Path, results: Path, wall: float) -> dict[str, float]:
    """One run's parts: outside the play, start-up, each task, and the node's own timings."""
    row: dict[str, float] = {"wall": wall}
    lines = [line.strip().partition(" ") for line in tasks.read_text().splitlines()] if tasks.exists() else []
    for seconds, _sep, name in lines:
        if name.startswith("total"):
            row["outside the play (interpreter, inventory, exit)"] = wall - float(seconds)
        elif name == "start":
            row["start-up to the first task"] = float(seconds)
        elif name != "end":
            key = "task: " + name.split(" : ")[-1]
            row[key] = row.get(key, 0.0) + float(seconds)
    if results.exists():
        for line in results.read_text().splitlines():
            res = json.loads(line)
            if res.get("elapsed_s") is not None:
                row["node: the module's own run"] = float(res["elapsed_s"])
            for key in NODE:
                if key in res["timings"]:
                    row[f"node: {key}"] = float(res["timings"][key])
            for key in VERIFY:
                if key in res["verify"]:
                    row[f"node: verify: {key}"] = float(res["verify"][key])
    return row


def print_profile(profiles: dict[str, list[dict[str, float]]]) -> None:
    """Medians of each part, one column per contender that has parts."""
    names = [n for n, rows in profiles.items() if rows]
    keys: list[str] = []
    for n in names:
        for r in profiles[n]:
            keys += [k for k in r if k not in keys]
    print("\n| part (median s) | " + " | ".join(names) + " |\n|---|" + "---:|" * len(names))
    for k in keys:
        cells = []
        for n in names:
            values = [r[k] for r in profiles[n] if k in r]
            cells.append(f"{statistics.median(values):.3f}" if values else "-")
        print(f"| {k} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    sys.exit(main())
