"""Benchmark: what the health verdict (issue 12) costs, probe by probe, on the simulated 8 x H200 node or a real GPU.

Run with `.venv/bin/python tools/bench/health.py [--real] [--repeat N] [--kernel-log PATH] [--docs]`.

* default: a simulated 8 x H200 node (tests/sim), its kernel log (a file in /dev/kmsg's format) filled with
  --log-records records, a few of them Xid lines, as a busy host's ring buffer is;
* --real: the machine's own driver and /dev/kmsg (read-only: every probe only reads; nothing is reset or set).
  Run it as root (NVML's ECC and remap queries and /dev/kmsg need it). The readings are printed so that they
  can be compared with `nvidia-smi -q`.

Each NVML probe is timed per GPU (median and 95th percentile of --repeat calls per GPU, in microseconds), then
the whole per-GPU reading (`_health.read_gpu`) plus its verdict (`judge_gpu`), which is what the verdict adds
per GPU; the kernel log and the /proc scan for MPS and fabric manager are per host, paid once. The budget is
20 ms per GPU on the simulator.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]

BUDGET_MS_PER_GPU = 20.0


def timed(fn: Callable[[], Any], repeat: int) -> list[float]:
    out = []
    for _i in range(repeat):
        t0 = time.perf_counter_ns()
        fn()
        out.append((time.perf_counter_ns() - t0) / 1000.0)
    return out


def stats(samples: list[float]) -> tuple[float, float]:
    ordered = sorted(samples)
    return statistics.median(ordered), ordered[min(len(ordered) - 1, int(len(ordered) * 0.95))]


def fill_kernel_log(node: Any, records: int) -> None:
    """A busy host's ring buffer: mostly other drivers' lines, some Xids spread among them."""
    lines = []
    usec = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000 - records * 1000
    for seq in range(records):
        if seq % 1000 == 500:
            msg = f"NVRM: Xid (PCI:0000:{0x18:02x}:00): 13, pid={1000 + seq}, name=python3, Graphics SM Warp Exception"
        else:
            msg = f"mlx5_core 0000:{seq % 256:02x}:00.0: mlx5_cmd_out_err:838: QUERY_VPORT_COUNTER(0x770) op_mod(0x0) failed, status bad parameter(0x3)"
        lines.append(f"6,{seq},{usec + seq * 1000},-;{msg}\n")
    node.kernel_log.write_text("".join(lines))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--real", action="store_true", help="the machine's own driver and /dev/kmsg (read-only)")
    ap.add_argument("--repeat", type=int, default=200)
    ap.add_argument("--gpus", type=int, default=8, help="simulated GPUs")
    ap.add_argument("--log-records", type=int, default=8000, help="records in the simulated kernel log")
    ap.add_argument("--kernel-log", default=None, help="kernel log to read (default /dev/kmsg, or the simulator's)")
    ap.add_argument("--docs", action="store_true", help="write the table into docs/benchmarks.md")
    args = ap.parse_args()

    node = None
    if not args.real:
        from gpusim import Node

        node = Node(gpus=args.gpus).start()
        os.environ.update(node.env())
        # pynvml opens libnvidia-ml.so.1 by name: load the simulated one first, as LD_LIBRARY_PATH would.
        ctypes.CDLL(str(node.lib_dir / "libnvidia-ml.so.1"), mode=ctypes.RTLD_GLOBAL)
        fill_kernel_log(node, args.log_records)
    kernel_log = args.kernel_log or (str(node.kernel_log) if node else "/dev/kmsg")

    import pynvml

    from ansible_collections.gpuops.clean_slate.plugins.module_utils import _health

    pynvml.nvmlInit()
    try:
        driver = pynvml.nvmlSystemGetDriverVersion()
        count = pynvml.nvmlDeviceGetCount()
        handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
        name = pynvml.nvmlDeviceGetName(handles[0])

        def quiet(fn: Callable[[], Any]) -> Callable[[], Any]:
            def call() -> Any:
                try:
                    return fn()
                except pynvml.NVMLError:
                    return None

            return call

        probes: dict[str, Callable[[Any], Callable[[], Any]]] = {
            "recovery action (field 230)": lambda h: quiet(lambda: pynvml.nvmlDeviceGetFieldValues(h, [230])),
            "remapped rows": lambda h: quiet(lambda: pynvml.nvmlDeviceGetRemappedRows(h)),
            "retired pages pending": lambda h: quiet(lambda: pynvml.nvmlDeviceGetRetiredPagesPendingStatus(h)),
            "ECC volatile uncorrected": lambda h: quiet(
                lambda: pynvml.nvmlDeviceGetTotalEccErrors(h, pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, pynvml.NVML_VOLATILE_ECC)
            ),
            "fabric state": lambda h: lambda: _health._fabric(h),
            "compute mode": lambda h: quiet(lambda: pynvml.nvmlDeviceGetComputeMode(h)),
            "MIG mode": lambda h: quiet(lambda: pynvml.nvmlDeviceGetMigMode(h)),
            "persistence mode": lambda h: quiet(lambda: pynvml.nvmlDeviceGetPersistenceMode(h)),
            "read_gpu + judge_gpu (all of the above)": lambda h: lambda: _health.judge_gpu(_health.read_gpu(h)),
        }
        rows = []
        for label, make in probes.items():
            samples: list[float] = []
            for h in handles:
                samples += timed(make(h), args.repeat)
            rows.append((label, *stats(samples)))
        since = time.time() - 3600
        xid_samples = timed(lambda: _health.read_xids(since, kernel_log), max(5, args.repeat // 20))
        host_samples = timed(lambda: _health.host_findings(True), max(5, args.repeat // 20))
        source, events = _health.read_xids(since, kernel_log)
        readings = [_health.read_gpu(h) for h in handles]
    finally:
        pynvml.nvmlShutdown()
        if node is not None:
            node.stop()

    per_gpu_ms = rows[-1][1] / 1000.0
    host_ms = (stats(xid_samples)[0] + stats(host_samples)[0]) / 1000.0
    where = "real GPU" if args.real else f"simulated node ({args.gpus} GPUs, kernel log of {args.log_records} records)"
    out = [
        f"{count} x {name}, driver {driver}, {where}; median / p95 of {args.repeat} calls per GPU, in microseconds.",
        "",
        "| Probe | per GPU, median µs | p95 µs |",
        "|---|---:|---:|",
    ]
    out += [f"| {label} | {med:.1f} | {p95:.1f} |" for label, med, p95 in rows]
    out += [
        f"| kernel log: read + Xids since an hour ago ({source}, {len(events)} Xid events), per host"
        f" | {stats(xid_samples)[0]:.1f} | {stats(xid_samples)[1]:.1f} |",
        f"| /proc scan for MPS daemons and the fabric manager, per host | {stats(host_samples)[0]:.1f} | {stats(host_samples)[1]:.1f} |",
        "",
        f"The verdict adds {per_gpu_ms:.3f} ms per GPU plus {host_ms:.2f} ms per host: {per_gpu_ms + host_ms / count:.3f} ms per GPU on this"
        f" {count}-GPU node, against a budget of {BUDGET_MS_PER_GPU:.0f} ms per GPU"
        f" ({'within' if per_gpu_ms + host_ms / count <= BUDGET_MS_PER_GPU else 'OVER'} budget).",
    ]
    if args.real:
        out += ["", "Readings (compare with `nvidia-smi -q`):", ""]
        out += [f"- GPU {i}: {r}" for i, r in enumerate(readings)]
    text = "\n".join(out)
    print(text)
    if args.docs:
        from support.ansible import write_docs_section

        command = "tools/pidns-run .venv/bin/python tools/bench/health.py" + (" --real" if args.real else "")
        heading = "## Health verdict: what each probe costs (issue 12)" + (", real GPU" if args.real else ", simulator")
        notes = (
            "\n\nThe per-host cost is the kernel log: every record of the ring buffer is read (one read() per record from"
            " /dev/kmsg), and only the Xid lines are decoded, found with a byte search. The NVML probes are microseconds"
            " each; the /proc scan is cheap in the benchmark's PID namespace and grows with the host's process count"
            " (one comm read per process)."
        )
        write_docs_section(ROOT / "docs" / "benchmarks.md", heading, f"{heading}\n\n`{command}` ({time.strftime('%Y-%m-%d')}). {text}{notes}\n")
    return 0 if per_gpu_ms + host_ms / count <= BUDGET_MS_PER_GPU or args.real else 1


if __name__ == "__main__":
    sys.exit(main())
