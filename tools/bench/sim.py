"""Benchmark: what the simulated node costs and how its timing compares with the H200's.

Run with `make bench` (or `tools/pidns-run .venv/bin/python tools/bench/sim.py`). Prints
one table: the simulator's own costs (these used to be asserted in tests/sim/tests, which a
loaded machine could fail; they are measurements, so they live here) and its release and
teardown timing, with the real figures from docs/validation.md beside them.

Each row is the median of --repeat runs.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from gpusim import Node, paths

HERE = Path(__file__).resolve().parent


PROBE = r"""
import sys, time, pynvml
pynvml.nvmlInit()
hs = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
def query():
    for h in hs:
        pynvml.nvmlDeviceGetMemoryInfo(h, version=pynvml.nvmlMemory_v2)
        pynvml.nvmlDeviceGetComputeRunningProcesses(h)
query()
samples = []
for _ in range(200):
    t0 = time.perf_counter(); query(); samples.append(time.perf_counter() - t0)
samples.sort()
print(samples[len(samples) // 2])
"""


def start_eight(node: Node) -> float:
    t0 = time.monotonic()
    ws = [node.spawn_worker(gpus=[i], mib=20000, title=f"sglang::scheduler_TP{i}") for i in range(8)]
    took = time.monotonic() - t0
    for w in ws:
        w.kill()
    node.wait_clean(timeout=30)
    return took


def full_query(node: Node) -> float:
    ws = [node.spawn_worker(gpus=[i], mib=1000) for i in range(8)]
    out = subprocess.run([sys.executable, "-c", PROBE], env={**os.environ, **node.env()}, capture_output=True, text=True, check=True)
    for w in ws:
        w.kill()
    node.wait_clean(timeout=30)
    return float(out.stdout.strip())


def smi_call(node: Node) -> float:
    t0 = time.perf_counter()
    subprocess.run(
        [str(paths.NVIDIA_SMI), "--query-gpu=index,memory.used", "--format=csv,noheader"], env={**os.environ, **node.env()}, capture_output=True, check=True
    )
    return time.perf_counter() - t0


def kill_to(node: Node, sig: int, count: int = 1) -> tuple[float, float]:
    """(seconds until every worker was gone, seconds until the GPU was clean) after `sig`."""
    ws = [node.spawn_worker(gpus=[0], mib=20000) for _unused in range(count)]
    fds = [os.pidfd_open(w.pid) for w in ws]
    t0 = time.monotonic()
    for w in ws:
        w.kill(sig)
    gone = clean = None
    while gone is None or clean is None:
        now = time.monotonic() - t0
        if gone is None and all(_readable(fd) for fd in fds):
            gone = now
        if clean is None and node.memory(0)["used_mib"] == 0:
            clean = now
        time.sleep(0.001)
    for fd in fds:
        os.close(fd)
    for w in ws:
        w.wait()
    return gone, clean


def _readable(fd: int) -> bool:
    import select

    return bool(select.select([fd], [], [], 0)[0])


def pct_call() -> float:
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "node").write_text("pve1\n")
        t0 = time.monotonic()
        subprocess.run([str(HERE.parents[1] / "tests" / "sim" / "bin" / "pct"), "list"], env={**os.environ, "PCTSIM_DIR": d}, capture_output=True, check=True)
        return time.monotonic() - t0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    rows: list[tuple[str, str, str]] = []

    def median(fn, *a):
        return statistics.median(fn(*a) for _unused in range(args.repeat))

    with Node() as node:
        rows.append(("starting 8 workers (spawn_worker, each waited for)", f"{median(start_eight, node) * 1000:.0f} ms", "-"))
        rows.append(
            ("full query of 8 GPUs through pynvml (memory v2 + compute processes)", f"{median(full_query, node) * 1000:.2f} ms", "0.56 ms (0.07 per GPU)")
        )
        rows.append(("nvidia-smi --query-gpu call", f"{median(smi_call, node) * 1000:.1f} ms", "22 ms"))
        for label, sig, count, real in (
            ("SIGTERM, one worker: gone / memory back", signal.SIGTERM, 1, "0.21-0.31 s / at the same time"),
            ("SIGKILL, one worker: gone / memory back", signal.SIGKILL, 1, "memory back 148-192 ms"),
            ("SIGKILL, four workers on one GPU: all gone / memory back", signal.SIGKILL, 4, "all freed by 361-376 ms"),
        ):
            runs = [kill_to(node, sig, count) for _unused in range(args.repeat)]
            gone = statistics.median(r[0] for r in runs)
            clean = statistics.median(r[1] for r in runs)
            rows.append((label, f"{gone * 1000:.0f} / {clean * 1000:.0f} ms", real))
        rows.append(("teardown in the kernel (FUSE) available", "yes" if node.teardown else "no", "-"))
    rows.append(("one fake pct call (default latency)", f"{median(pct_call) * 1000:.0f} ms", "about 1 s"))
    width = max(len(r[0]) for r in rows)
    print(f"{'':{width}}  {'simulator':>18}  real (docs/validation.md, gpu-facts.md)")
    for label, sim, real in rows:
        print(f"{label:{width}}  {sim:>18}  {real}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
