"""Every switchable fault, observed through the real pynvml (and nvidia-smi where it matters)."""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest
from gpusim import CONTEXT_OVERHEAD_MIB, Node, paths

pytestmark = pytest.mark.pidns

MIB = 1 << 20


@pytest.fixture
def live(node: Node, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """pynvml initialised in this very process, to watch faults switch at runtime.
    Loading the library by path first makes pynvml's CDLL("libnvidia-ml.so.1")
    find it (same soname) without LD_LIBRARY_PATH."""
    monkeypatch.setenv("GPUSIM_STATE", str(node.state_dir))
    ctypes.CDLL(str(paths.LIBRARY))
    import pynvml

    pynvml.nvmlInit()
    try:
        yield pynvml
    finally:
        pynvml.nvmlShutdown()


def smi(node: Node, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(paths.NVIDIA_SMI), *args], capture_output=True, text=True, env={**os.environ, **node.env(), **env}, check=False)


# 1 -------------------------------------------------------------- library absent
def test_library_absent_environment(node, nvml) -> None:
    absent = node.env(include_library=False)
    assert str(node.lib_dir) not in absent["LD_LIBRARY_PATH"].split(":")
    assert nvml(node, "result = error_name(nvmlInit)", env=absent) == "NVMLError_LibraryNotFound"
    node.set_fault(library_absent=True)  # the same, as the node's default environment
    assert node.env() == absent
    assert nvml(node, "result = error_name(nvmlInit)") == "NVMLError_LibraryNotFound"
    r = smi(node, "-L")
    assert r.returncode == 12 and "couldn't find libnvidia-ml.so" in r.stdout
    node.clear_faults()
    assert nvml(node, "nvmlInit(); result = nvmlDeviceGetCount()") == 8


# 2 -------------------------------------------------------------- init errors
@pytest.mark.parametrize(
    ("error", "exc", "smi_rc"),
    [
        ("LIB_RM_VERSION_MISMATCH", "NVMLError_LibRmVersionMismatch", 18),
        ("NVML_ERROR_DRIVER_NOT_LOADED", "NVMLError_DriverNotLoaded", 9),
        ("no_permission", "NVMLError_NoPermission", 4),
        (17, "NVMLError_OperatingSystem", 17),
    ],
)
def test_init_error(node, nvml, error, exc, smi_rc) -> None:
    node.set_fault(init_error=error)
    assert nvml(node, "result = error_name(nvmlInit)") == exc
    assert smi(node).returncode == smi_rc
    node.set_fault(init_error=None)
    assert nvml(node, "result = error_name(nvmlInit)") is None


def test_init_error_messages_of_nvidia_smi(node) -> None:
    node.set_fault(init_error="LIB_RM_VERSION_MISMATCH")
    assert smi(node, "-L").stdout == "Failed to initialize NVML: Driver/library version mismatch\n"
    node.set_fault(init_error="DRIVER_NOT_LOADED")
    assert smi(node, "-L").stdout.startswith("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver")


# 3 -------------------------------------------------------------- lost GPU
def test_lost_gpu(node, nvml) -> None:
    node.set_fault(lost=[3])
    res = nvml(
        node,
        """
        nvmlInit()
        result = {"count": nvmlDeviceGetCount(), "lost": error_name(nvmlDeviceGetHandleByIndex, 3),
                  "by_uuid": error_name(nvmlDeviceGetHandleByUUID, nvmlDeviceGetUUID(nvmlDeviceGetHandleByIndex(2))),
                  "others": [gpu(i)["used"] for i in (0, 1, 2, 4, 5, 6, 7)]}
    """,
    )
    assert res == {"count": 8, "lost": "NVMLError_GpuIsLost", "by_uuid": None, "others": [0] * 7}
    r = smi(node, "--query-gpu=index,memory.used", "--format=csv,noheader")
    assert r.returncode == 15
    assert r.stdout.splitlines() == [
        "0, 0 MiB",
        "1, 0 MiB",
        "2, 0 MiB",
        "Unable to determine the device handle for GPU3: GPU is lost.  Reboot the system to recover this GPU",
        "4, 0 MiB",
        "5, 0 MiB",
        "6, 0 MiB",
        "7, 0 MiB",
    ]


def test_gpu_lost_at_runtime_breaks_existing_handles(node, live) -> None:
    h3, h0 = live.nvmlDeviceGetHandleByIndex(3), live.nvmlDeviceGetHandleByIndex(0)
    assert live.nvmlDeviceGetName(h3) == "NVIDIA H200"
    node.set_fault(lost=[3])
    for call in (
        live.nvmlDeviceGetName,
        live.nvmlDeviceGetMemoryInfo,
        live.nvmlDeviceGetComputeRunningProcesses,
        live.nvmlDeviceGetUUID,
        live.nvmlDeviceGetPciInfo,
        live.nvmlDeviceGetMigMode,
    ):
        with pytest.raises(live.NVMLError_GpuIsLost):
            call(h3)
    with pytest.raises(live.NVMLError_GpuIsLost):
        live.nvmlDeviceGetFieldValues(h3, [230])
    assert live.nvmlDeviceGetName(h0) == "NVIDIA H200"
    node.clear_faults()
    assert live.nvmlDeviceGetMemoryInfo(h3).total == 143771 * MIB


# 4 -------------------------------------------------------------- timeouts
def test_timeout_for_named_functions_on_one_gpu(node, live) -> None:
    h0, h1 = live.nvmlDeviceGetHandleByIndex(0), live.nvmlDeviceGetHandleByIndex(1)
    node.set_fault(timeout={"functions": ["nvmlDeviceGetMemoryInfo", "nvmlDeviceGetComputeRunningProcesses_v3"], "gpus": [1]})
    with pytest.raises(live.NVMLError_Timeout):
        live.nvmlDeviceGetMemoryInfo(h1)  # the unversioned name covers v1 ...
    with pytest.raises(live.NVMLError_Timeout):
        live.nvmlDeviceGetMemoryInfo(h1, version=live.nvmlMemory_v2)  # ... and v2
    with pytest.raises(live.NVMLError_Timeout):
        live.nvmlDeviceGetComputeRunningProcesses(h1)
    assert live.nvmlDeviceGetComputeRunningProcesses_v2(h1) == []  # only _v3 was named
    assert live.nvmlDeviceGetMemoryInfo(h0).used == 615 * MIB
    assert live.nvmlDeviceGetName(h1) == "NVIDIA H200"


def test_timeout_with_a_hang_and_on_system_calls(node, live) -> None:
    node.set_fault(timeout={"functions": ["nvmlSystemGetDriverVersion", "nvmlDeviceGetHandleByIndex"], "delay_ms": 200})
    t0 = time.monotonic()
    with pytest.raises(live.NVMLError_Timeout):
        live.nvmlSystemGetDriverVersion()
    assert time.monotonic() - t0 >= 0.2
    with pytest.raises(live.NVMLError_Timeout):
        live.nvmlDeviceGetHandleByIndex(4)
    node.set_fault(timeout=None)
    assert live.nvmlSystemGetDriverVersion() == "580.159.04"


# 4b ------------------------------------------------------------- driver hang: a call that never returns
HANG_CLIENT = r"""
import os, sys, threading, pynvml
pynvml.nvmlInit()
h0, h1 = pynvml.nvmlDeviceGetHandleByIndex(0), pynvml.nvmlDeviceGetHandleByIndex(1)
print("mem0", pynvml.nvmlDeviceGetMemoryInfo(h0).total >> 20, flush=True)
def other():
    # While the main thread is stuck in the driver, another thread still gets answers for other GPUs.
    print("thread-mem2", pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(2)).total >> 20, flush=True)
print("calling", flush=True)
threading.Timer(0.3, other).start()
pynvml.nvmlDeviceGetMemoryInfo(h1)
print("returned", flush=True)
"""


def _wchan_state(pid: int) -> str:
    with open(f"/proc/{pid}/stat", encoding="ascii") as fh:
        return fh.read().rsplit(")", 1)[1].split()[0]


def test_hang_blocks_a_chosen_call_on_a_chosen_gpu_forever(node) -> None:
    node.set_fault(hang={"functions": ["nvmlDeviceGetMemoryInfo"], "gpus": [1]})
    proc = subprocess.Popen([sys.executable, "-c", HANG_CLIENT], env={**os.environ, **node.env()}, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().split() == ["mem0", "143771"]  # GPU 0 answers
        assert proc.stdout.readline().strip() == "calling"
        assert proc.stdout.readline().split() == ["thread-mem2", "143771"]  # the process is not wedged as a whole
        with pytest.raises(subprocess.TimeoutExpired):
            proc.wait(timeout=1.5)  # GPU 1's call does not come back ...
        node.set_fault(hang=None)
        with pytest.raises(subprocess.TimeoutExpired):
            proc.wait(timeout=0.5)  # ... not even once the fault is gone, as a real hang does not end by itself
        assert _wchan_state(proc.pid) == "S"
        proc.send_signal(signal.SIGINT)  # Python's handler cannot run: the thread never leaves the driver
        with pytest.raises(subprocess.TimeoutExpired):
            proc.wait(timeout=0.5)
        proc.kill()  # SIGKILL ends it
        assert proc.wait(timeout=5) == -signal.SIGKILL
        assert "returned" not in proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    # A fresh client after the fault is cleared gets its answer.
    assert node.memory_info(1)["total_mib"] == 143771


def test_hang_of_a_handle_lookup_only_on_its_gpu_and_of_a_system_call(node, nvml) -> None:
    node.set_fault(hang={"functions": ["nvmlDeviceGetHandleByIndex"], "gpus": [3]})
    assert nvml(node, "nvmlInit(); result = [nvmlDeviceGetUUID(nvmlDeviceGetHandleByIndex(i))[:4] for i in (0, 2, 4)]") == ["GPU-"] * 3
    hung = subprocess.Popen([sys.executable, "-c", "import pynvml; pynvml.nvmlInit(); pynvml.nvmlDeviceGetHandleByIndex(3)"], env={**os.environ, **node.env()})
    try:
        with pytest.raises(subprocess.TimeoutExpired):
            hung.wait(timeout=1)
    finally:
        hung.kill()
        hung.wait()
    node.set_fault(hang=["nvmlSystemGetDriverVersion"])
    ok = subprocess.run(
        [sys.executable, "-c", "import pynvml; pynvml.nvmlInit(); pynvml.nvmlDeviceGetCount()"], env={**os.environ, **node.env()}, timeout=30, check=False
    )
    assert ok.returncode == 0
    with pytest.raises(subprocess.TimeoutExpired):
        subprocess.run(
            [sys.executable, "-c", "import pynvml; pynvml.nvmlInit(); pynvml.nvmlSystemGetDriverVersion()"],
            env={**os.environ, **node.env()},
            timeout=1,
            check=False,
        )


def test_hang_through_the_cli(node) -> None:
    cli = [str(paths.SIM_ROOT / "bin" / "gpusim"), "fault", "--state", str(node.state_dir)]
    subprocess.run([*cli, "hang=nvmlDeviceGetMemoryInfo_v2", "hang_gpus=2,5"], check=True)
    f = node.description.faults
    assert (f.hang_functions, f.hang_gpus) == (["nvmlDeviceGetMemoryInfo_v2"], [2, 5])
    subprocess.run([*cli, "hang="], check=True)
    assert node.description.faults.hang_functions == []


# 5 -------------------------------------------------------------- orphaned context, recovery action
def test_orphaned_context_holds_memory_without_any_process(node, nvml) -> None:
    # Leaked memory alone carries no recovery action (real drivers usually say none).
    node.set_fault(orphan={2: 8000, 3: 100}, recovery_action={3: 1})
    res = nvml(
        node,
        """
        nvmlInit()
        def action(i):
            v = nvmlDeviceGetFieldValues(nvmlDeviceGetHandleByIndex(i), [NVML_FI_DEV_GET_GPU_RECOVERY_ACTION])[0]
            return [v.nvmlReturn, v.valueType, v.value.uiVal]
        result = {"g2": gpu(2), "g3": gpu(3), "a2": action(2), "a3": action(3)}
    """,
    )
    assert res["g2"]["used"] == 8000 and res["g2"]["v1_used"] == 8615 and res["g2"]["procs"] == []
    assert res["g3"]["used"] == 100
    assert res["a2"] == [0, 1, 0]  # NVML_GPU_RECOVERY_ACTION_NONE, unsigned int
    assert res["a3"] == [0, 1, 1]  # GPU_RESET where the driver asks for it
    assert node.memory(2)["used_mib"] == 8000 and node.memory_info(2)["orphan_mib"] == 8000
    assert node.contexts() == []
    # it also takes capacity away
    with pytest.raises(Exception, match="out of memory"):
        node.spawn_worker(gpus=[2], mib=143771 - 615 - 7999)


def test_recovery_action_alone(node, live) -> None:
    node.set_fault(recovery_action={4: 2, 5: 1})
    vals = [live.nvmlDeviceGetFieldValues(live.nvmlDeviceGetHandleByIndex(i), [230])[0].value.uiVal for i in range(8)]
    assert vals == [0, 0, 0, 0, 2, 1, 0, 0]
    assert live.nvmlDeviceGetMemoryInfo(live.nvmlDeviceGetHandleByIndex(4), version=live.nvmlMemory_v2).used == 0
    node.set_fault(orphan={4: 100}, recovery_action={4: None})  # back to the default: none, orphan or not
    assert live.nvmlDeviceGetFieldValues(live.nvmlDeviceGetHandleByIndex(4), [230])[0].value.uiVal == 0


def test_drivers_before_r550_do_not_report_the_recovery_action(nvml) -> None:
    # NVML_FI_DEV_GET_GPU_RECOVERY_ACTION came with R550: older drivers answer the field with
    # NOT_SUPPORTED in its own nvmlReturn (the call itself succeeds).
    with Node(gpus=2, driver_version="535.183.01") as old:
        old.set_fault(orphan={1: 4000}, recovery_action={1: 1})
        res = nvml(
            old,
            """
            nvmlInit()
            v = nvmlDeviceGetFieldValues(nvmlDeviceGetHandleByIndex(1), [NVML_FI_DEV_GET_GPU_RECOVERY_ACTION])[0]
            result = [v.nvmlReturn, gpu(1)["used"]]
            """,
        )
    assert res == [3, 4000]  # NVML_ERROR_NOT_SUPPORTED; the leaked memory still shows


# 6 -------------------------------------------------------------- legacy pids (also in test_namespaces)
def test_legacy_pids_change_nothing_for_a_caller_in_the_same_namespace(node, live) -> None:
    w = node.spawn_worker(gpus=[0], mib=100)
    node.set_fault(legacy_pids=True)
    assert [p.pid for p in live.nvmlDeviceGetComputeRunningProcesses(live.nvmlDeviceGetHandleByIndex(0))] == [w.pid]


# 7 -------------------------------------------------------------- forked child: see test_processes


# 8 -------------------------------------------------------------- old-driver APIs and N/A memory
def test_memory_v2_unsupported(node, live) -> None:
    h = live.nvmlDeviceGetHandleByIndex(0)
    node.set_fault(memory_v2_unsupported=True)
    with pytest.raises(live.NVMLError_FunctionNotFound):
        live.nvmlDeviceGetMemoryInfo(h, version=live.nvmlMemory_v2)
    assert live.nvmlDeviceGetMemoryInfo(h).used == 615 * MIB
    r = smi(node, "--query-gpu=memory.used,memory.reserved", "--format=csv,noheader", "-i", "0")
    assert r.stdout == "615 MiB, [N/A]\n"  # nvidia-smi falls back to v1 "used"


@pytest.mark.parametrize("api", ["v1", "v2"])
def test_old_process_apis(node, live, api) -> None:
    w = node.spawn_worker(gpus=[1], mib=1000)
    h = live.nvmlDeviceGetHandleByIndex(1)
    node.set_fault(process_api=api)
    with pytest.raises(live.NVMLError_FunctionNotFound):
        live.nvmlDeviceGetComputeRunningProcesses_v3(h)
    with pytest.raises(live.NVMLLibraryMismatchError):
        live.nvmlDeviceGetComputeRunningProcesses(h)  # pynvml's own wrapper over _v3
    with pytest.raises(live.NVMLError_FunctionNotFound):
        live.nvmlDeviceGetRunningProcessDetailList(h, live.nvmlProcessDetailList_v1, 0)
    if api == "v1":
        with pytest.raises(live.NVMLError_FunctionNotFound):
            live.nvmlDeviceGetComputeRunningProcesses_v2(h)
        with pytest.raises(live.NVMLError_FunctionNotFound):
            live.nvmlDeviceGetGraphicsRunningProcesses_v2(h)
    else:
        assert [p.pid for p in live.nvmlDeviceGetComputeRunningProcesses_v2(h)] == [w.pid]
    lib = ctypes.CDLL(str(paths.LIBRARY))
    n = ctypes.c_uint(4)
    arr = (ctypes.c_ulonglong * 8)()  # 4 v1 entries (pid + padding, usedGpuMemory)
    assert lib.nvmlDeviceGetComputeRunningProcesses(h, ctypes.byref(n), arr) == 0
    assert n.value == 1 and arr[0] & 0xFFFFFFFF == w.pid and arr[1] == 1000 * MIB
    r = smi(node, "--query-compute-apps=pid,used_memory", "--format=csv,noheader")
    assert r.stdout == f"{w.pid}, 1000 MiB\n"  # nvidia-smi falls back to the old entry point


def test_memory_not_available_per_process(node, live) -> None:
    w = node.spawn_worker(gpus=[0], mib=1000)
    node.set_fault(memory_na=True)
    [p] = live.nvmlDeviceGetComputeRunningProcesses(live.nvmlDeviceGetHandleByIndex(0))
    assert p.pid == w.pid and p.usedGpuMemory is None  # pynvml maps NVML_VALUE_NOT_AVAILABLE to None
    used = live.nvmlDeviceGetMemoryInfo(live.nvmlDeviceGetHandleByIndex(0), version=live.nvmlMemory_v2).used
    assert used == (1000 + CONTEXT_OVERHEAD_MIB) * MIB
    assert smi(node, "--query-compute-apps=pid,used_memory", "--format=csv,noheader").stdout == f"{w.pid}, [N/A]\n"


def test_clear_faults_and_bad_fault_names(node, nvml) -> None:
    node.set_fault(lost=[1], orphan={0: 10}, legacy_pids=True, process_api="v1", memory_na=True, timeout=["nvmlDeviceGetName"], init_error="UNKNOWN")
    node.clear_faults()
    assert node.description.faults == node.description.faults.__class__()
    assert len(nvml(node, "result = snapshot()")) == 8
    with pytest.raises(TypeError):
        node.set_fault(gpu_on_fire=True)
    with pytest.raises(ValueError):
        node.set_fault(lost=[8])
    with pytest.raises(ValueError):
        node.set_fault(process_api="v4")
