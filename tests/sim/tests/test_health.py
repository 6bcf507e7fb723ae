"""The simulated driver's health state (issue 12): what each GPU model answers, the readings set_health()
changes, the compute mode (set through NVML, root only), and Xid lines in the kernel log."""

from __future__ import annotations

import os
import re
import time

import pytest
from gpusim import Node

HEALTH = """
def ask(fn, *a):
    try:
        return fn(*a)
    except NVMLError as e:
        return "ERR%d" % e.value
h = nvmlDeviceGetHandleByIndex(0)
info = c_nvmlGpuFabricInfo_v2_t()
rc = ask(nvmlDeviceGetGpuFabricInfoV, h, byref(info))
result = {
    "rows": ask(nvmlDeviceGetRemappedRows, h),
    "retired": ask(nvmlDeviceGetRetiredPagesPendingStatus, h),
    "ecc": ask(nvmlDeviceGetTotalEccErrors, h, NVML_MEMORY_ERROR_TYPE_UNCORRECTED, NVML_VOLATILE_ECC),
    "fabric": [rc, info.state, info.status] if rc == 0 else rc,
    "mig": ask(nvmlDeviceGetMigMode, h),
    "persistence": ask(nvmlDeviceGetPersistenceMode, h),
    "compute": ask(nvmlDeviceGetComputeMode, h),
}
"""
PREAMBLE = "from ctypes import byref\nnvmlInit()\n"


@pytest.mark.parametrize(
    ("name", "supported"),
    [
        ("NVIDIA H200", {"rows", "ecc", "fabric", "mig"}),
        ("NVIDIA A100-SXM4-80GB", {"rows", "ecc", "mig"}),
        ("Tesla V100-SXM2-32GB", {"retired", "ecc"}),
        ("NVIDIA GeForce RTX 4090", set()),
    ],
)
def test_each_model_answers_what_the_real_one_does(nvml, name: str, supported: set) -> None:
    with Node(gpus=1, name=name) as node:
        r = nvml(node, PREAMBLE + HEALTH)
    for key in ("rows", "retired", "ecc", "fabric", "mig"):
        assert (r[key] != "ERR3") == (key in supported), (key, r[key])  # 3: NVML_ERROR_NOT_SUPPORTED
    assert r["persistence"] == 1 and r["compute"] == 0


def test_set_health_reaches_a_running_client(nvml, node) -> None:
    node.set_health(0, remap_correctable=2, remap_uncorrectable=1, remap_pending=1, ecc_volatile_uncorrected=4,
                    fabric_state="in_progress", mig_pending=1, persistence=0)  # fmt: skip
    node.set_compute_mode(0, "exclusive_process")
    r = nvml(node, PREAMBLE + HEALTH)
    assert r["rows"] == [2, 1, 1, 0] and r["ecc"] == 4 and r["fabric"] == [0, 2, 0]
    assert r["mig"] == [0, 1] and r["persistence"] == 0 and r["compute"] == 3


def test_fabric_info_checks_its_struct_version(nvml, node) -> None:
    r = nvml(
        node,
        PREAMBLE
        + """
h = nvmlDeviceGetHandleByIndex(0)
bad = c_nvmlGpuFabricInfo_v2_t(); bad.version = 0x01000024
v1 = c_nvmlGpuFabricInfo_t()
L = lib()
result = [L.nvmlDeviceGetGpuFabricInfoV(h, byref(bad)), L.nvmlDeviceGetGpuFabricInfo(h, byref(v1)), v1.state]
""",
    )
    assert r == [25, 0, 3]  # ARGUMENT_VERSION_MISMATCH; v1: SUCCESS, COMPLETED


def test_the_compute_mode_is_set_through_nvml_by_root_only(nvml, node) -> None:
    r = nvml(
        node,
        PREAMBLE
        + """
h = nvmlDeviceGetHandleByIndex(2)
nvmlDeviceSetComputeMode(h, NVML_COMPUTEMODE_PROHIBITED)
try:
    nvmlDeviceSetComputeMode(h, NVML_COMPUTEMODE_EXCLUSIVE_THREAD)
    thread = "set"
except NVMLError as e:
    thread = e.value
result = [nvmlDeviceGetComputeMode(h), thread]
""",
    )
    assert r == [2, 3] and node.compute_mode(2) == 2  # EXCLUSIVE_THREAD: NOT_SUPPORTED (removed with CUDA 8)
    if os.geteuid() == 0:
        r = nvml(
            node,
            PREAMBLE
            + """
os.setuid(65534)
try:
    nvmlDeviceSetComputeMode(nvmlDeviceGetHandleByIndex(2), NVML_COMPUTEMODE_DEFAULT)
    result = "set"
except NVMLError as e:
    result = e.value
""",
        )
        assert r == 4 and node.compute_mode(2) == 2  # NO_PERMISSION


def test_an_xid_is_a_kernel_log_record_as_the_driver_prints_it(node) -> None:
    before = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    message = node.xid(1, 79)
    assert message == "NVRM: Xid (PCI:0000:2a:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus."
    last = node.kernel_log.read_text().splitlines()[-1]
    m = re.fullmatch(r"(\d+),(\d+),(\d+),-;(.*)", last)
    assert m and m[1] == "4" and m[4] == message
    assert before <= int(m[3]) <= time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    assert int(m[2]) == len(node.kernel_log.read_text().splitlines()) - 1  # sequence numbers from 0
    assert "NVRM: loading NVIDIA UNIX Open Kernel Module" in node.kernel_log.read_text()
