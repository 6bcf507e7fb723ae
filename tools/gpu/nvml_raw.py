"""Raw pynvml readings of the health verdict's inputs, and what a helper process per NVML call costs.

    python3 tools/gpu/nvml_raw.py              JSON on stdout: each GPU's readings, straight from pynvml
    python3 tools/gpu/nvml_raw.py --time       also time one NVML call in-process, through a forked
                                               child per call (fork + pipe), and through a persistent helper

Standalone on purpose (pynvml only, no collection code): it is the third opinion beside the
module's `health.readings` and `nvidia-smi -q` (tools/gpu/health_compare.py). Every value is what
NVML answered, or the NVML error name when it refused (NOT_SUPPORTED on a GPU without the feature).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import pickle
import statistics
import subprocess
import sys
import time
import typing as t

import pynvml as n

RECOVERY = {0: "none", 1: "gpu_reset", 2: "node_reboot", 3: "drain_p2p", 4: "drain_and_reset"}
FABRIC = {0: "not_supported", 1: "not_started", 2: "in_progress", 3: "completed"}
COMPUTE = {0: "default", 1: "exclusive_thread", 2: "prohibited", 3: "exclusive_process"}


def _error(exc: BaseException) -> dict[str, str]:
    return {"error": type(exc).__name__.replace("NVMLError_", "") or str(exc), "text": str(exc)}


def _call(fn: t.Callable[[], t.Any]) -> t.Any:
    try:
        return fn()
    except n.NVMLError as exc:
        return _error(exc)


def _recovery(h: t.Any) -> t.Any:
    fv = n.nvmlDeviceGetFieldValues(h, [n.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION])[0]
    if fv.nvmlReturn != n.NVML_SUCCESS:
        raise n.NVMLError(fv.nvmlReturn)
    return RECOVERY.get(fv.value.uiVal, fv.value.uiVal)


def _fabric(h: t.Any) -> dict[str, t.Any]:
    # The versioned call with the struct version this nvidia-ml-py knows (v3 in 13.x, v2 before).
    if hasattr(n, "c_nvmlGpuFabricInfo_v3_t") and hasattr(n, "nvmlGpuFabricInfo_v3"):
        info = n.c_nvmlGpuFabricInfo_v3_t()
        info.version = n.nvmlGpuFabricInfo_v3
    else:
        info = n.c_nvmlGpuFabricInfoV_t()
        info.version = n.nvmlGpuFabricInfo_v2
    n.nvmlDeviceGetGpuFabricInfoV(h, ctypes.byref(info))
    return {"state": FABRIC.get(info.state, info.state), "status": int(info.status)}


def _fabric_v1(h: t.Any) -> dict[str, t.Any]:
    info = n.c_nvmlGpuFabricInfo_t()
    n.nvmlDeviceGetGpuFabricInfo(h, ctypes.byref(info))
    return {"state": FABRIC.get(info.state, info.state), "status": int(info.status)}


def _retired(h: t.Any) -> dict[str, t.Any]:
    single = n.nvmlDeviceGetRetiredPages(h, n.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS)
    double = n.nvmlDeviceGetRetiredPages(h, n.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR)
    pending = n.nvmlDeviceGetRetiredPagesPendingStatus(h)
    return {"pending": bool(pending), "single_bit": len(single), "double_bit": len(double)}


def _remapped(h: t.Any) -> dict[str, t.Any]:
    corr, unc, pending, failure = n.nvmlDeviceGetRemappedRows(h)
    return {"correctable": int(corr), "uncorrectable": int(unc), "pending": bool(pending), "failure": bool(failure)}


def readings(h: t.Any) -> dict[str, t.Callable[[], t.Any]]:
    """The shared interface's `readings` keys, each a call to pynvml."""
    return {
        "recovery_action": lambda: _recovery(h),
        "remapped_rows": lambda: _remapped(h),
        "retired_pages": lambda: _retired(h),
        "ecc_volatile_uncorrected": lambda: int(n.nvmlDeviceGetTotalEccErrors(h, n.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, n.NVML_VOLATILE_ECC)),
        "fabric": lambda: _fabric(h),
        "fabric_v1": lambda: _fabric_v1(h),
        "compute_mode": lambda: COMPUTE.get(n.nvmlDeviceGetComputeMode(h), n.nvmlDeviceGetComputeMode(h)),
        "mig_mode": lambda: dict(zip(("current", "pending"), (bool(x) for x in n.nvmlDeviceGetMigMode(h)))),
        "persistence_mode": lambda: bool(n.nvmlDeviceGetPersistenceMode(h)),
        "ecc_mode": lambda: dict(zip(("current", "pending"), (bool(x) for x in n.nvmlDeviceGetEccMode(h)))),
    }


def _isolated(index: int, key: str) -> t.Any:
    """One reading in a fresh process of its own (NVML initialised there): a call that crashes its
    process (a struct of the wrong size for this driver) is recorded as such and the others go on.
    Not a fork: on the real driver a forked child cannot use its parent's NVML (Uninitialized)."""
    proc = subprocess.run([sys.executable, __file__, "--one", str(index), key], capture_output=True, text=True, check=False)
    if proc.returncode < 0:
        return {"error": "crashed", "text": f"the call killed its process with signal {-proc.returncode}"}
    try:
        return json.loads(proc.stdout)
    except ValueError:
        return {"error": "no_answer", "text": (proc.stdout + proc.stderr)[-500:]}


def read_all() -> dict[str, t.Any]:
    gpus = []
    for i in range(n.nvmlDeviceGetCount()):
        h = n.nvmlDeviceGetHandleByIndex(i)
        values = {key: _isolated(i, key) for key in readings(None)}
        gpus.append({"index": i, "uuid": n.nvmlDeviceGetUUID(h), "bus_id": n.nvmlDeviceGetPciInfo(h).busId, "readings": values})
    return {"driver": n.nvmlSystemGetDriverVersion(), "nvml": n.nvmlSystemGetNVMLVersion(), "nvidia_ml_py": getattr(n, "__version__", "?"), "gpus": gpus}


# ----------------------------------------------------------------------------- wrapper cost
def _one(h: t.Any) -> t.Any:
    m = n.nvmlDeviceGetMemoryInfo(h, version=n.nvmlMemory_v2)
    procs = n.nvmlDeviceGetComputeRunningProcesses(h)
    return (m.used, m.reserved, [p.pid for p in procs])


def _forked(h: t.Any, init: bool = False) -> t.Any:
    """One call in a forked child that sends its result back through a pipe (a per-call helper).
    init: the child calls nvmlInit itself (the parent's initialisation does not carry over a fork)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            try:
                if init:
                    n.nvmlInit()
                    value: t.Any = _one(n.nvmlDeviceGetHandleByIndex(0))
                    n.nvmlShutdown()
                else:
                    value = _one(h)
            except n.NVMLError as exc:
                value = _error(exc)
            os.write(w, pickle.dumps(value))
        finally:
            os._exit(0)
    os.close(w)
    chunks = []
    while True:
        data = os.read(r, 65536)
        if not data:
            break
        chunks.append(data)
    os.close(r)
    os.waitpid(pid, 0)
    return pickle.loads(b"".join(chunks))


HELPER = r"""
import sys, pickle, pynvml as n
n.nvmlInit()
hs = [n.nvmlDeviceGetHandleByIndex(i) for i in range(n.nvmlDeviceGetCount())]
sys.stdout.buffer.write(b"ready\n"); sys.stdout.buffer.flush()
for line in sys.stdin.buffer:
    h = hs[int(line)]
    m = n.nvmlDeviceGetMemoryInfo(h, version=n.nvmlMemory_v2)
    out = pickle.dumps((m.used, m.reserved, [p.pid for p in n.nvmlDeviceGetComputeRunningProcesses(h)]))
    sys.stdout.buffer.write(len(out).to_bytes(4, "little") + out); sys.stdout.buffer.flush()
"""


def timing(calls: int = 200) -> dict[str, t.Any]:
    h = n.nvmlDeviceGetHandleByIndex(0)

    def per_call(fn: t.Callable[[], t.Any], count: int) -> dict[str, float]:
        samples = []
        for _unused in range(count):
            start = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - start)
        return {"median_ms": round(statistics.median(samples) * 1e3, 4), "p90_ms": round(sorted(samples)[int(count * 0.9)] * 1e3, 4), "calls": count}

    out: dict[str, t.Any] = {"call": "nvmlDeviceGetMemoryInfo(v2) + nvmlDeviceGetComputeRunningProcesses on GPU 0"}
    out["in_process"] = per_call(lambda: _one(h), calls)
    # Does a forked child reach NVML through its parent's initialisation? (The real driver: no.)
    out["fork_without_init_answer"] = _forked(h)
    out["fork_with_init_answer"] = _forked(h, init=True)
    out["fork_per_call_with_init"] = per_call(lambda: _forked(h, init=True), max(20, calls // 4))
    start = time.perf_counter()
    helper = subprocess.Popen([sys.executable, "-c", HELPER], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert helper.stdout is not None and helper.stdin is not None
    helper.stdout.readline()
    out["helper_start_ms"] = round((time.perf_counter() - start) * 1e3, 2)

    def ask() -> t.Any:
        assert helper.stdout is not None and helper.stdin is not None
        helper.stdin.write(b"0\n")
        helper.stdin.flush()
        size = int.from_bytes(helper.stdout.read(4), "little")
        return pickle.loads(helper.stdout.read(size))

    out["persistent_helper"] = per_call(ask, calls)
    helper.stdin.close()
    helper.wait()
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--time", action="store_true", help="also time the wrapper variants")
    p.add_argument("--one", nargs=2, metavar=("INDEX", "KEY"), help=argparse.SUPPRESS)
    a = p.parse_args()
    n.nvmlInit()
    if a.one:
        fn = readings(n.nvmlDeviceGetHandleByIndex(int(a.one[0])))[a.one[1]]
        print(json.dumps(_call(fn)))
        return 0
    try:
        data = read_all()
        if a.time:
            data["timing"] = timing()
    finally:
        n.nvmlShutdown()
    json.dump(data, sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
