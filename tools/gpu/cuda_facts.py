"""Facts for the startability probe, read on a real GPU (issue 29/33): what a CUDA start through
libcuda.so.1 costs, and what NVML shows while and after it runs.

    python3 tools/gpu/cuda_facts.py [--gpu 0] > cuda-facts.json

Each probe is a fresh process (``python3 -I -S -c``) that loads libcuda.so.1 with ctypes and runs
cuInit, cuDeviceGet, cuDevicePrimaryCtxRetain, cuCtxSetCurrent, cuMemGetInfo_v2, cuMemAlloc_v2,
cuMemsetD8_v2, cuCtxSynchronize, cuMemFree_v2, cuDevicePrimaryCtxRelease, timing each step. The
parent measures the process's whole life and then how long NVML takes to show the GPU's memory
and process list back at idle. Sizes: 256 MiB, 4 GiB, 64 GiB and 90 % of the GPU's total (what a
server asks for with gpu_memory_utilization 0.9). Then the same while a torch process holds a
context only, and while it holds 120 GiB (the allocation must fail with CUDA_ERROR_OUT_OF_MEMORY).
No mode, clock or power is changed; nothing is reset.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

PROBE = r"""
import ctypes, json, sys, time
t0 = time.monotonic()
out = {"steps": {}}
def step(name, fn, *args):
    s = time.monotonic()
    rc = fn(*args)
    out["steps"][name] = round(time.monotonic() - s, 4)
    if rc != 0:
        out["failed"] = name
        out["code"] = rc
        print(json.dumps(out)); sys.stdout.flush(); raise SystemExit(0)
s = time.monotonic()
cu = ctypes.CDLL("libcuda.so.1")
out["steps"]["dlopen"] = round(time.monotonic() - s, 4)
gpu, size = int(sys.argv[1]), int(sys.argv[2])
dev = ctypes.c_int()
ctx = ctypes.c_void_p()
ptr = ctypes.c_uint64()
free = ctypes.c_size_t(); total = ctypes.c_size_t()
step("cuInit", cu.cuInit, 0)
step("cuDeviceGet", cu.cuDeviceGet, ctypes.byref(dev), gpu)
step("cuDevicePrimaryCtxRetain", cu.cuDevicePrimaryCtxRetain, ctypes.byref(ctx), dev)
step("cuCtxSetCurrent", cu.cuCtxSetCurrent, ctx)
step("cuMemGetInfo_v2", cu.cuMemGetInfo_v2, ctypes.byref(free), ctypes.byref(total))
out["free"] = free.value; out["total"] = total.value
if size < 0:
    size = int(total.value * (-size) / 100)
out["size"] = size
step("cuMemAlloc_v2", cu.cuMemAlloc_v2, ctypes.byref(ptr), ctypes.c_size_t(size))
step("cuMemsetD8_v2", cu.cuMemsetD8_v2, ptr, ctypes.c_ubyte(0xA5), ctypes.c_size_t(size))
step("cuCtxSynchronize", cu.cuCtxSynchronize)
step("cuMemFree_v2", cu.cuMemFree_v2, ptr)
step("cuDevicePrimaryCtxRelease", cu.cuDevicePrimaryCtxRelease, dev)
out["inside_s"] = round(time.monotonic() - t0, 4)
print(json.dumps(out))
"""

HOLDER = r"""
import sys, time, torch
gib = float(sys.argv[2])
d = torch.device("cuda:%s" % sys.argv[1])
x = torch.empty(max(1, int(gib * (1 << 30))), dtype=torch.uint8, device=d)
x.fill_(1); torch.cuda.synchronize(d)
print("ready", flush=True)
time.sleep(3600)
"""


def nvml_state(gpu: int) -> tuple[int, list[int]]:
    import pynvml

    h = pynvml.nvmlDeviceGetHandleByIndex(gpu)
    try:
        info = pynvml.nvmlDeviceGetMemoryInfo(h, version=pynvml.nvmlMemory_v2)
    except Exception:  # noqa: BLE001 - older drivers
        info = pynvml.nvmlDeviceGetMemoryInfo(h)
    procs = [p.pid for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h)]
    return int(info.used), procs


def wait_idle(gpu: int, idle_used: int, pid: int | None, limit: float = 20.0) -> dict:
    start = time.monotonic()
    seen_proc = None
    while time.monotonic() - start < limit:
        used, procs = nvml_state(gpu)
        if pid is not None and pid in procs:
            seen_proc = True
        if used <= idle_used + (64 << 20) and (pid is None or pid not in procs):
            return {"idle_after_s": round(time.monotonic() - start, 4), "used_mib": used >> 20, "proc_seen_after_exit": bool(seen_proc)}
        time.sleep(0.005)
    used, procs = nvml_state(gpu)
    return {"idle_after_s": None, "used_mib": used >> 20, "procs": procs}


def probe(gpu: int, size: int, idle_used: int, flags: list[str]) -> dict:
    start = time.monotonic()
    proc = subprocess.Popen([sys.executable, *flags, "-c", PROBE, str(gpu), str(size)], stdout=subprocess.PIPE, text=True)
    out = proc.communicate(timeout=120)[0]
    wall = time.monotonic() - start
    res = json.loads(out.strip().splitlines()[-1]) if out.strip() else {"error": "no output", "rc": proc.returncode}
    res["wall_s"] = round(wall, 4)
    res["after_exit"] = wait_idle(gpu, idle_used, proc.pid)
    return res


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpu", type=int, default=0)
    a = ap.parse_args()
    import pynvml

    pynvml.nvmlInit()
    idle_used, procs = nvml_state(a.gpu)
    report: dict = {"idle_used_mib": idle_used >> 20, "idle_procs": procs, "runs": []}
    flags = ["-I", "-S"]
    # The first probe of this call meets the driver as the last user left it (cold when persistence is off).
    h = pynvml.nvmlDeviceGetHandleByIndex(a.gpu)
    try:
        report["persistence_mode"] = pynvml.nvmlDeviceGetPersistenceMode(h)
        report["compute_mode"] = pynvml.nvmlDeviceGetComputeMode(h)
    except pynvml.NVMLError as e:
        report["mode_error"] = str(e)
    plan = [("first", 256 << 20)] + [("256MiB", 256 << 20)] * 3 + [("4GiB", 4 << 30)] * 3 + [("64GiB", 64 << 30)] * 2 + [("90pct", -90)] * 3
    for label, size in plan:
        r = probe(a.gpu, size, idle_used, flags)
        r["label"] = label
        report["runs"].append(r)
        print(label, r.get("wall_s"), r.get("inside_s"), r.get("failed"), r["after_exit"], file=sys.stderr, flush=True)
    # Interpreter start alone, the floor of a helper process.
    s = time.monotonic()
    subprocess.run([sys.executable, "-I", "-S", "-c", "import ctypes"], check=True)
    report["python_start_s"] = round(time.monotonic() - s, 4)
    # While a torch process holds a context only, then most of the memory.
    for gib, label in ((0.0, "torch_context_only"), (120.0, "torch_holds_120GiB")):
        holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(a.gpu), str(gib)], stdout=subprocess.PIPE, text=True)
        assert holder.stdout is not None
        holder.stdout.readline()
        busy_used = nvml_state(a.gpu)[0]
        for size, slabel in ((256 << 20, "256MiB"), (-90, "90pct")):
            r = probe(a.gpu, size, busy_used, flags)
            r["label"] = f"{label}:{slabel}"
            r["busy_used_mib"] = busy_used >> 20
            report["runs"].append(r)
            print(r["label"], r.get("wall_s"), r.get("failed"), r.get("code"), file=sys.stderr, flush=True)
        holder.kill()
        holder.wait()
        report[f"{label}_released"] = wait_idle(a.gpu, idle_used, holder.pid)
    json.dump(report, sys.stdout, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
