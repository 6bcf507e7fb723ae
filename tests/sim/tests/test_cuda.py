"""The simulated libcuda.so.1: a CUDA start through the driver API on the simulated node, sharing its state with
NVML (a live context is a listed process with memory; the release frees it inside the call), and every way the
world makes a start fail, each answered with the CUresult the real driver gives."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from gpusim import Node, WorkerError

# A start as the collection's probe makes it: every step's CUresult, the memory CUDA reports, then hold or end.
START = r"""
import ctypes, json, sys, time
cu = ctypes.CDLL("libcuda.so.1")
out = {"rc": {}}
dev, ctx, ptr = ctypes.c_int(), ctypes.c_void_p(), ctypes.c_uint64()
free, total = ctypes.c_size_t(), ctypes.c_size_t()
def step(name, fn, *args):
    out["rc"][name] = fn(*args)
    if out["rc"][name]:
        name_p = ctypes.c_char_p(); cu.cuGetErrorName(out["rc"][name], ctypes.byref(name_p))
        out["error"] = name_p.value.decode(); print(json.dumps(out), flush=True); sys.exit(0)
step("cuInit", cu.cuInit, 0)
step("cuDeviceGet", cu.cuDeviceGet, ctypes.byref(dev), 0)
step("cuDevicePrimaryCtxRetain", cu.cuDevicePrimaryCtxRetain, ctypes.byref(ctx), dev)
step("cuCtxSetCurrent", cu.cuCtxSetCurrent, ctx)
step("cuMemGetInfo_v2", cu.cuMemGetInfo_v2, ctypes.byref(free), ctypes.byref(total))
out["free_mib"], out["total_mib"] = free.value >> 20, total.value >> 20
size = int(total.value * float(sys.argv[1]))
step("cuMemAlloc_v2", cu.cuMemAlloc_v2, ctypes.byref(ptr), ctypes.c_size_t(size))
step("cuMemsetD8_v2", cu.cuMemsetD8_v2, ptr, ctypes.c_ubyte(0xA5), ctypes.c_size_t(size))
step("cuCtxSynchronize", cu.cuCtxSynchronize)
if len(sys.argv) > 2:
    print("holding", flush=True); time.sleep(float(sys.argv[2]))
step("cuMemFree_v2", cu.cuMemFree_v2, ptr)
step("cuDevicePrimaryCtxRelease", cu.cuDevicePrimaryCtxRelease, dev)
print(json.dumps(out), flush=True)
"""


def start(node: Node, gpu: int, fraction: float = 0.9, sandbox=None, env=None) -> dict:
    extra = {"CUDA_VISIBLE_DEVICES": node.gpus[gpu].uuid, **(env or {})}
    argv = [sys.executable, "-I", "-S", "-c", START, str(fraction)]
    if sandbox is not None:
        proc = sandbox.run(argv, env=extra, capture_output=True, text=True, timeout=30)
    else:
        proc = subprocess.run(argv, env={**os.environ, **node.env(), **extra}, capture_output=True, text=True, timeout=30, check=False)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.splitlines()[-1])


def test_a_start_is_a_listed_context_with_memory_and_its_release_frees_it_at_once(node) -> None:
    node.set_cuda_timing(init_ms=0, ctx_ms=0, release_ms=0)
    r = start(node, 3)
    assert set(r["rc"].values()) == {0} and "error" not in r
    # CUDA's total is NVML's total less the reserved memory; free is that less the probe's own context (527 MiB).
    assert (r["total_mib"], r["free_mib"]) == (143771 - 615, 143771 - 615 - 527)
    assert node.contexts() == [] and node.memory(3)["used_mib"] == 0  # nothing left once the release returned
    # While it holds its allocation, NVML lists it with the memory, like the real driver.
    env = {**os.environ, **node.env(), "CUDA_VISIBLE_DEVICES": "3"}
    holder = subprocess.Popen([sys.executable, "-I", "-S", "-c", START, "0.5", "30"], env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "holding"
        [ctx] = node.contexts()
        assert ctx["pid"] == holder.pid and ctx["gpu"] == 3 and ctx["mib"] == 518 + 71578  # 0.5 x 143156 MiB, in 2 MiB pages
        assert node.memory(3)["used_mib"] == 518 + 71578 + 9
        # Killed while it holds it, it goes through the driver's teardown like any CUDA process.
        holder.send_signal(signal.SIGKILL)
        holder.wait(10)
        node.wait_clean(5)
    finally:
        holder.kill()
        holder.wait()


def test_each_failure_is_the_real_drivers_code(node) -> None:
    node.set_cuda_timing(init_ms=0, ctx_ms=0, release_ms=0)
    w = node.spawn_worker(gpus=[1], mib=120000)
    assert start(node, 1)["error"] == "CUDA_ERROR_OUT_OF_MEMORY" and "error" not in start(node, 1, 0.1)  # 22 GiB still free
    node.set_compute_mode(1, "exclusive_process")  # another process holds a context: every other start is refused
    assert start(node, 1, 0.0001)["rc"] == {"cuInit": 0, "cuDeviceGet": 0, "cuDevicePrimaryCtxRetain": 46}
    node.set_compute_mode(2, "prohibited")
    assert start(node, 2, 0.0001)["error"] == "CUDA_ERROR_DEVICE_UNAVAILABLE"
    node.set_health(4, fabric_state="in_progress")
    assert start(node, 4)["rc"] == {"cuInit": 802} and start(node, 5)["rc"]["cuInit"] == 0  # only where it is visible
    node.ecc_error(6)
    assert start(node, 6)["error"] == "CUDA_ERROR_ECC_UNCORRECTABLE"
    node.set_fault(hidden={7: 30000})  # NVML still reads it free
    r = start(node, 7)
    assert r["error"] == "CUDA_ERROR_OUT_OF_MEMORY" and r["free_mib"] == 143156 - 527 - 30000 and node.memory(7)["used_mib"] == 0
    assert start(node, 7, 0.5)["rc"]["cuDevicePrimaryCtxRelease"] == 0
    w.kill()


def test_a_container_without_nvidia_uvm_reads_nvml_and_cannot_start_cuda(node, nvml) -> None:
    sb = node.sandbox(vmid=131)
    try:
        assert "nvidia-uvm" not in sb.pass_devices(omit=["nvidia-uvm", "nvidia-uvm-tools"])
        ls = sb.run(["ls", str(node.dev_dir)], capture_output=True, text=True).stdout.split()
        assert "nvidia-uvm" not in ls and "nvidia0" in ls and os.path.exists(node.dev_dir / "nvidia-uvm")  # only inside
        assert nvml(node, "nvmlInit(); result = nvmlDeviceGetCount()", sandbox=sb) == 8
        r = start(node, 0, sandbox=sb)
        assert r["rc"] == {"cuInit": 999} and r["error"] == "CUDA_ERROR_UNKNOWN"
        # A CUDA job cannot start there either.
        with pytest.raises(WorkerError, match="nvidia-uvm"):
            node.spawn_worker(gpus=[0], sandbox=sb)
    finally:
        sb.stop()


def test_a_hang_never_returns_and_sigkill_ends_it(node) -> None:
    node.set_cuda_timing(init_ms=0, ctx_ms=0, release_ms=0)
    node.set_fault(hang={"functions": ["cuDevicePrimaryCtxRetain"], "gpus": [2]})
    assert start(node, 3)["rc"]["cuDevicePrimaryCtxRelease"] == 0  # another GPU still starts
    env = {**os.environ, **node.env(), "CUDA_VISIBLE_DEVICES": "2"}
    hung = subprocess.Popen([sys.executable, "-I", "-S", "-c", START, "0.1"], env=env, stdout=subprocess.PIPE, text=True)
    try:
        time.sleep(0.5)
        assert hung.poll() is None
        hung.send_signal(signal.SIGKILL)
        assert hung.wait(5) == -signal.SIGKILL
    finally:
        hung.kill()
        hung.wait()


def test_no_library_no_node_and_a_fork_after_init(node) -> None:
    env = {**os.environ, **node.env(include_cuda=False)}
    proc = subprocess.run([sys.executable, "-I", "-S", "-c", START, "0.1"], env=env, capture_output=True, text=True, check=False)
    assert proc.returncode == 1 and "libcuda.so.1: cannot open shared object file" in proc.stderr
    node.set_fault(cuda_absent=True)
    assert str(node.lib_dir) in node.env()["LD_LIBRARY_PATH"] and "cuda" not in node.env()["LD_LIBRARY_PATH"].split(":")[0]
    node.set_fault(cuda_absent=False)
    code = (
        "import ctypes, os; cu = ctypes.CDLL('libcuda.so.1'); a = cu.cuInit(0); n = ctypes.c_int()\n"
        "pid = os.fork()\n"
        "if pid == 0: os._exit(cu.cuDeviceGetCount(ctypes.byref(n)))\n"
        "print(a, os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))"
    )
    out = subprocess.run([sys.executable, "-I", "-S", "-c", code], env={**os.environ, **node.env()}, capture_output=True, text=True, check=True).stdout
    assert out.split() == ["0", "3"]  # CUDA_ERROR_NOT_INITIALIZED in a child forked after cuInit
    env = {**os.environ, **node.env(), "GPUSIM_STATE": ""}
    assert json.loads(subprocess.run([sys.executable, "-I", "-S", "-c", START, "0.1"], env=env, capture_output=True, text=True, check=True).stdout)["rc"] == {
        "cuInit": 100
    }
