"""Benchmark: what the hang-proof NVML wrapper (plugins/module_utils/_probe.py) costs, and how fast it gives up.

Compares the modules' NVML work made in-process (as before issue 12) with the same work made through a
``Prober`` (a forked helper process that announces every call over a pipe):

* open: NVML opened and every GPU's identity read (in-process: ``NvmlSession`` open + ``gpus()`` + close;
  helper: ``Prober.start()`` + ``close()``: fork, the same work in the helper, kill and reap);
* poll: one reading of every GPU (memory, three process lists, recovery action: gpu_mem_verify's poll);
* one call: ``nvmlDeviceGetMemoryInfo_v2`` of one GPU, one round trip;
* per NVML call: (helper poll - in-process poll) / NVML calls announced in a poll;
* hang (simulator only): from the start of a poll whose call hangs on one GPU until the module has the answer
  of every GPU (the hung one as driver_hung), with ``probe_timeout`` 0.2 s: the deadline, plus the kill, the
  reap and a fresh helper for the rest.

Runs on the simulated 8 x H200 node by default (under tools/pidns-run), or against the machine's real
driver with ``--real`` (nvidia-ml-py installed, read-only: it only reads memory and process lists). Prints a
table of median and p95 in milliseconds.

    tools/pidns-run .venv/bin/python tools/bench/probe.py            # simulator
    .venv/bin/python tools/bench/probe.py --real --runs 200                # a GPU host
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import sys
import time

from ansible_collections.gpuops.clean_slate.plugins.module_utils import _nvml, _probe, _verify


def memory(session: _nvml.NvmlSession, gpu: _nvml.Gpu) -> _nvml.Memory:
    return session.memory(gpu)


def timed(fn, runs: int) -> list[float]:
    out = []
    for _run in range(runs):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1000)
    return out


def row(name: str, base: list[float] | None, wrapped: list[float], note: str = "") -> str:
    def cell(xs: list[float] | None) -> str:
        if not xs:
            return "-"
        xs = sorted(xs)
        return f"{statistics.median(xs):.3f} / {xs[int(len(xs) * 0.95) - 1 if len(xs) > 1 else 0]:.3f}"

    extra = ""
    if base:
        extra = f"{statistics.median(wrapped) - statistics.median(base):+.3f}"
    return f"| {name} | {cell(base)} | {cell(wrapped)} | {extra} | {note} |"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--real", action="store_true", help="use the machine's NVIDIA driver instead of the simulator")
    ap.add_argument("--runs", type=int, default=100)
    args = ap.parse_args()
    node = None
    if not args.real:
        from gpusim import Node, paths

        node = Node(gpus=8).start()
        os.environ.update(node.env())
        ctypes.CDLL(str(paths.LIBRARY))  # pynvml's CDLL("libnvidia-ml.so.1") then finds the simulated one
    try:
        with _nvml.NvmlSession() as session:
            gpus = session.gpus()
            driver = session.driver_version()
        kind = "simulated" if node else "real"
        lines = [
            f"{kind} node: {len(gpus)} x {gpus[0].name if gpus else '?'}, driver {driver}, {args.runs} runs, python {sys.version.split()[0]}",
            "",
            "| what | in-process ms (median / p95) | helper ms (median / p95) | added (median) | note |",
            "|---|---|---|---|---|",
        ]

        def open_inprocess() -> None:
            with _nvml.NvmlSession() as s:
                s.gpus()

        def open_helper() -> None:
            with _probe.Prober(10) as p:
                p.start()

        lines.append(row("open (init + identity of every GPU)", timed(open_inprocess, args.runs), timed(open_helper, args.runs), "once per module run"))
        with _nvml.NvmlSession() as s, _probe.Prober(10) as p:
            sgpus = s.gpus()
            pgpus = p.start()
            base = timed(lambda: [_verify.read_gpu(s, g) for g in sgpus], args.runs)
            before = p.stats.calls
            wrapped = timed(lambda: p.each(_verify.read_gpu, pgpus), args.runs)
            per_poll = (p.stats.calls - before) / args.runs
            lines.append(row(f"poll of {len(gpus)} GPUs", base, wrapped, f"{per_poll:.0f} NVML calls announced per poll"))
            one_base = timed(lambda: s.memory(sgpus[0]), args.runs)
            one_wrapped = timed(lambda: p.each(memory, pgpus[:1]), args.runs)
            lines.append(row("one call (memory v2 of GPU 0)", one_base, one_wrapped, "a whole round trip"))
            per_call = (statistics.median(wrapped) - statistics.median(base)) / per_poll if per_poll else 0.0
            lines.append(f"| per NVML call in a poll | | | {per_call * 1000:+.1f} us | (helper poll - in-process poll) / calls |")
        if node is not None:
            hang_runs = max(5, args.runs // 20)
            node.set_fault(hang={"functions": ["nvmlDeviceGetMemoryInfo"], "gpus": [3]})
            took = []
            for _run in range(hang_runs):
                with _probe.Prober(0.2) as p:
                    every = p.start()
                    t0 = time.perf_counter()
                    answers = p.each(_verify.read_gpu, every)
                    took.append((time.perf_counter() - t0) * 1000)
                    assert [a.hung for a in answers] == [i == 3 for i in range(len(every))]
            node.clear_faults()
            lines.append(row("poll with GPU 3 hung, probe_timeout 200 ms", None, took, f"{hang_runs} runs: deadline + kill + reap + fresh helper"))
        print("\n".join(lines))
    finally:
        if node is not None:
            node.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
