"""Runs a snippet against the real pynvml, in a subprocess whose environment
is node.env() (so ctypes loads the simulated libnvidia-ml.so.1).

    python nvml_probe.py 'result = snapshot()'

The snippet runs with pynvml's names and the helpers below in scope; the JSON
of its ``result`` variable is printed on the last line of stdout.
"""

import ctypes
import json
import os
import signal
import sys
import time

import pynvml

MIB = 1 << 20


def fds() -> list[str]:
    """Targets of this process's fds that are gpusim device files."""
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if "/dev/nvidia" in target:
            out.append(os.path.basename(target))
    return sorted(out)


def procs(h, which=None) -> list[list[int]]:
    """[[pid, usedGpuMemory or None], ...] from the given process-list function."""
    fn = which or pynvml.nvmlDeviceGetComputeRunningProcesses
    return [[p.pid, p.usedGpuMemory] for p in fn(h)]


def gpu(i: int) -> dict:
    h = pynvml.nvmlDeviceGetHandleByIndex(i)
    m1 = pynvml.nvmlDeviceGetMemoryInfo(h)
    m2 = pynvml.nvmlDeviceGetMemoryInfo(h, version=pynvml.nvmlMemory_v2)
    return {
        "index": i,
        "name": pynvml.nvmlDeviceGetName(h),
        "uuid": pynvml.nvmlDeviceGetUUID(h),
        "bus_id": pynvml.nvmlDeviceGetPciInfo(h).busId,
        "v1_used": m1.used // MIB,
        "v1_total": m1.total // MIB,
        "v1_free": m1.free // MIB,
        "used": m2.used // MIB,
        "reserved": m2.reserved // MIB,
        "total": m2.total // MIB,
        "free": m2.free // MIB,
        "procs": procs(h),
    }


def snapshot() -> list[dict]:
    pynvml.nvmlInit()
    try:
        out = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            try:
                out.append(gpu(i))
            except pynvml.NVMLError as e:
                out.append({"index": i, "error": type(e).__name__})
        return out
    finally:
        pynvml.nvmlShutdown()


def error_name(fn, *args) -> str | None:
    """Call fn; the NVMLError subclass name it raised, or None."""
    try:
        fn(*args)
    except pynvml.NVMLError as e:
        return type(e).__name__
    return None


def lib() -> ctypes.CDLL:
    return ctypes.CDLL("libnvidia-ml.so.1")


def watch_release(gpu_index: int, pids: list[int], timeout: float = 3.0) -> list[float]:
    """SIGKILL `pids` together, then poll NVML every ~1 ms; returns the times (s
    after the kill) at which v2 used dropped, ending when the GPU is idle."""
    pynvml.nvmlInit()
    h = pynvml.nvmlDeviceGetHandleByIndex(gpu_index)
    v2 = pynvml.nvmlMemory_v2
    last = pynvml.nvmlDeviceGetMemoryInfo(h, version=v2).used
    drops: list[float] = []
    t0 = time.monotonic()
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    while time.monotonic() - t0 < timeout:
        used = pynvml.nvmlDeviceGetMemoryInfo(h, version=v2).used
        if used < last:
            t = time.monotonic() - t0
            plist = [p.pid for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h)]
            drops.append(round(t, 4))
            last = used
            if used == 0:
                assert plist == [], plist  # the entry and the memory go together
                break
        time.sleep(0.0005)
    return drops


if __name__ == "__main__":
    # The snippets use NVML's names directly, as if they had done `from pynvml import *`.
    scope = {name: getattr(pynvml, name) for name in dir(pynvml) if not name.startswith("__")}
    scope.update(globals())
    exec(sys.argv[1], scope)
    print(json.dumps(scope.get("result")))
