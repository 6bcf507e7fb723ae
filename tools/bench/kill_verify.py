"""Benchmark: gpu_procs_kill + gpu_mem_verify vs the hand-run pipeline vs the floor.

Run with `make bench` (or `tools/pidns-run .venv/bin/python tools/bench/kill_verify.py`).
On the simulated 8 x H200 node, each scenario is built three times from scratch:

* floor: every holder is SIGKILLed at once by the harness and the clock stops when
  the simulated driver has released all memory (node state, polled every 2 ms);
* ours: a two-task playbook (gpu_procs_kill, then gpu_mem_verify) run through
  ansible-playbook in the node's sandbox; "modules" is the time from the start of
  gpu_procs_kill to the moment gpu_mem_verify saw every GPU clean (Ansible's
  hand-over between the two tasks included), "playbook" the whole ansible-playbook
  wall time, start-up included;
* pipeline: the commands from the developers' guide, sleeps included, run in the
  same kind of sandbox (so fuser -k cannot reach the harness), then the operator's
  re-check (sleep 2; nvidia-smi) until eight lines say "0 MiB".

Scenarios: "plain" (an SGLang launcher and eight renamed scheduler workers, one per
GPU), and "messy" (plain + a forked child that kept GPU 6 after its parent died +
a worker on GPU 7 that ignores SIGTERM). nvidia-persistenced, nv-hostengine and
dcgm-exporter run beside them in every scenario; the table says what each
approach left of them.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from gpusim import Node
from support.ansible import VENV_PYTHON, local_play, run_playbook

HERE = Path(__file__).resolve().parent


DAEMONS = ("nvidia-persistenced", "nv-hostengine", "dcgm-exporter")
GRACE = 2.0
# The developers' guide's two commands; the guide puts its fixed sleeps at 3-5 s in all,
# so the operator's pause between the two commands is 3 s here (plus the guide's sleep 2).
PIPELINE = r"""
ps aux | grep python3 | grep -v grep | awk '{print $2}' | xargs -r kill -9
sleep 3
fuser -k "$DEV"/nvidia* >/dev/null 2>&1; sleep 2; nvidia-smi --query-gpu=index,memory.used --format=csv,noheader > "$OUT"
tries=1
while [ "$(grep -c ', 0 MiB' "$OUT")" -ne 8 ] && [ $tries -lt 10 ]; do
    sleep 2; nvidia-smi --query-gpu=index,memory.used --format=csv,noheader > "$OUT"; tries=$((tries + 1))
done
"""


def stamp(text: str) -> float:
    """Epoch seconds of a module's start field (local time, as ansible.builtin.command reports it)."""
    return datetime.datetime.strptime(text, "%Y-%m-%d %H:%M:%S.%f").timestamp()


def build(node: Node, sandbox, scenario: str) -> dict:
    """Start the workload; returns what was started."""
    # The API server: a python3 process that holds no GPU (what `grep python3` finds).
    launcher = sandbox.popen(["bash", "-c", "exec -a 'python3 -m sglang.launch_server --tp 8' sleep 600"])
    workers = [sandbox.spawn_worker(gpus=[i], mib=60000, title=f"sglang::scheduler_TP{i}") for i in range(8)]
    extra = []
    if scenario == "messy":
        extra.append(sandbox.spawn_worker(gpus=[6], mib=8000, fork_child=True, title="sglang::data_worker"))
        extra.append(sandbox.spawn_worker(gpus=[7], mib=8000, ignore_term=True, title="VLLM::Worker_TP7"))
    daemons = {name: node.spawn_daemon(name, sandbox=sandbox) for name in DAEMONS}
    time.sleep(0.05)
    return {"launcher": launcher, "workers": workers, "extra": extra, "daemons": daemons}


def survivors(work: dict) -> list[str]:
    return [name for name, d in work["daemons"].items() if d.alive()]


def run_floor(scenario: str) -> float:
    with Node(gpus=8) as node:
        sb = node.sandbox()
        work = build(node, sb, scenario)
        procs = [*work["workers"], *work["extra"]]
        start = time.monotonic()
        for w in procs:
            w.kill()
            w.kill_child()
        node.wait_clean(timeout=30, poll=0.002)
        took = time.monotonic() - start
        sb.stop()
        return took


def run_ours(scenario: str) -> dict:
    with Node(gpus=8) as node:
        sb = node.sandbox()
        work = build(node, sb, scenario)
        tasks = [
            {
                "name": "End GPU processes",
                "gpuops.clean_slate.gpu_procs_kill": {"patterns": ["sglang", "VLLM"], "grace_period": GRACE, "device_dir": str(node.dev_dir)},
                "register": "kill",
            },
            {"name": "Verify", "gpuops.clean_slate.gpu_mem_verify": {"expected_count": 8, "device_dir": str(node.dev_dir)}},
        ]
        env = node.env()
        run = run_playbook(local_play(tasks), inventory="localhost,", env=env, wrapper=sb.nsenter_prefix())
        if run.rc != 0:
            raise RuntimeError(run.output)
        kill_rec, verify_rec = run.task("End GPU processes"), run.task("Verify")
        kill, verify = kill_rec["result"], verify_rec["result"]
        # From the start of gpu_procs_kill to the moment gpu_mem_verify saw every GPU clean
        # (the modules report their start time, as ansible.builtin.command does).
        kill_start = stamp(kill["start"])
        clean_at = stamp(verify["start"]) + verify["time_to_clean_s"]
        result = {
            "modules": clean_at - kill_start,
            "playbook": run.elapsed,
            "ended": len(kill["targets"]),
            "clean": verify["clean"],
            "daemons_left": survivors(work),
        }
        sb.stop()
        return result


def run_pipeline(scenario: str, tmp: Path) -> dict:
    with Node(gpus=8) as node:
        sb = node.sandbox()
        work = build(node, sb, scenario)
        out = tmp / f"smi-{scenario}.txt"
        env = node.env()
        env.update(DEV=str(node.dev_dir), OUT=str(out), PATH=f"{node.bin_dir}:/usr/bin:/bin:/usr/sbin:/sbin")
        start = time.monotonic()
        sb.run(["bash", "-c", PIPELINE], env=env, check=False, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        took = time.monotonic() - start
        lines = out.read_text().splitlines() if out.exists() else []
        result = {"wall": took, "clean": sum(1 for line in lines if line.endswith(", 0 MiB")) == 8, "daemons_left": survivors(work)}
        sb.stop()
        return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=3, help="runs per cell (median reported)")
    args = parser.parse_args()
    import tempfile

    rows = []
    with tempfile.TemporaryDirectory(prefix="gpuops-bench-") as tmpdir:
        tmp = Path(tmpdir)
        for scenario in ("plain", "messy"):
            floor = statistics.median(run_floor(scenario) for _unused in range(args.repeat))
            ours = [run_ours(scenario) for _unused in range(args.repeat)]
            pipe = [run_pipeline(scenario, tmp) for _unused in range(args.repeat)]
            rows.append(
                {
                    "scenario": scenario,
                    "floor": floor,
                    "modules": statistics.median(o["modules"] for o in ours),
                    "playbook": statistics.median(o["playbook"] for o in ours),
                    "pipeline": statistics.median(p["wall"] for p in pipe),
                    "ours_clean": all(o["clean"] for o in ours),
                    "pipe_clean": all(p["clean"] for p in pipe),
                    "ours_daemons": min(len(o["daemons_left"]) for o in ours),
                    "pipe_daemons": max(len(p["daemons_left"]) for p in pipe),
                }
            )
    print(f"gpu_procs_kill + gpu_mem_verify vs the hand-run pipeline, simulated 8 x H200 ({args.repeat} runs each, medians; grace_period {GRACE} s)")
    columns = [
        ("scenario", 8),
        ("floor s", 7),
        ("ours: kill to verified clean s", 29),
        ("ours (playbook) s", 17),
        ("pipeline s", 10),
        ("ours/pipeline", 13),
        ("ours - floor s", 14),
        ("clean ours/pipe", 15),
        ("daemons kept ours/pipe", 22),
    ]
    print("| " + " | ".join(f"{name:>{width}}" for name, width in columns) + " |")
    print("|" + "|".join("-" * (width + 2) for _name, width in columns) + "|")
    for r in rows:
        print(
            f"| {r['scenario']:<8} | {r['floor']:>7.3f} | {r['modules']:>29.3f} | {r['playbook']:>17.2f} | {r['pipeline']:>10.2f} |"
            f" {r['modules'] / r['pipeline']:>13.1%} | {r['modules'] - r['floor']:>14.3f} |"
            f" {('yes' if r['ours_clean'] else 'NO') + '/' + ('yes' if r['pipe_clean'] else 'NO'):>15} |"
            f" {str(r['ours_daemons']) + '/3 vs ' + str(r['pipe_daemons']) + '/3':>22} |"
        )
    return 0


if __name__ == "__main__":
    if not os.environ.get("GPUOPS_PIDNS"):
        # Signals fly: run in a private PID namespace.
        os.execvp(str(HERE.parent / "pidns-run"), [str(HERE.parent / "pidns-run"), VENV_PYTHON, __file__, *sys.argv[1:]])
    sys.exit(main())
