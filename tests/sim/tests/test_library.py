"""The simulated libnvidia-ml.so.1 as a library: exports, stubs, errors, basic NVML semantics."""

from __future__ import annotations

import ctypes
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from gpusim import paths

pytestmark = pytest.mark.pidns

IMPLEMENTED = {
    "nvmlInit", "nvmlInit_v2", "nvmlInitWithFlags", "nvmlShutdown", "nvmlErrorString",
    "nvmlSystemGetDriverVersion", "nvmlSystemGetNVMLVersion", "nvmlSystemGetCudaDriverVersion",
    "nvmlSystemGetCudaDriverVersion_v2", "nvmlSystemGetProcessName",
    "nvmlDeviceGetCount", "nvmlDeviceGetCount_v2",
    "nvmlDeviceGetHandleByIndex", "nvmlDeviceGetHandleByIndex_v2", "nvmlDeviceGetHandleByUUID",
    "nvmlDeviceGetHandleByPciBusId", "nvmlDeviceGetHandleByPciBusId_v2",
    "nvmlDeviceGetName", "nvmlDeviceGetUUID", "nvmlDeviceGetIndex", "nvmlDeviceGetMinorNumber",
    "nvmlDeviceGetPciInfo", "nvmlDeviceGetPciInfo_v2", "nvmlDeviceGetPciInfo_v3", "nvmlDeviceGetPciInfoExt",
    "nvmlDeviceGetMemoryInfo", "nvmlDeviceGetMemoryInfo_v2",
    "nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetComputeRunningProcesses_v2",
    "nvmlDeviceGetComputeRunningProcesses_v3", "nvmlDeviceGetGraphicsRunningProcesses",
    "nvmlDeviceGetGraphicsRunningProcesses_v2", "nvmlDeviceGetGraphicsRunningProcesses_v3",
    "nvmlDeviceGetMPSComputeRunningProcesses", "nvmlDeviceGetMPSComputeRunningProcesses_v2",
    "nvmlDeviceGetMPSComputeRunningProcesses_v3", "nvmlDeviceGetRunningProcessDetailList",
    "nvmlDeviceGetFieldValues", "nvmlDeviceGetMigMode", "nvmlDeviceGetComputeMode", "nvmlDeviceGetPersistenceMode", "nvmlDeviceValidateInforom",
    # Health (issue 12, nvml/health.c).
    "nvmlDeviceSetComputeMode", "nvmlDeviceGetRemappedRows", "nvmlDeviceGetRetiredPagesPendingStatus",
    "nvmlDeviceGetRetiredPages", "nvmlDeviceGetTotalEccErrors", "nvmlDeviceGetGpuFabricInfo", "nvmlDeviceGetGpuFabricInfoV",
    # Links, clocks, temperature and P2P (issue 39, nvml/links.c).
    "nvmlDeviceGetNvLinkState", "nvmlDeviceGetNvLinkVersion", "nvmlDeviceGetNvLinkRemoteDeviceType",
    "nvmlDeviceGetNvLinkErrorCounter", "nvmlDeviceGetCurrPcieLinkGeneration", "nvmlDeviceGetMaxPcieLinkGeneration",
    "nvmlDeviceGetGpuMaxPcieLinkGeneration", "nvmlDeviceGetCurrPcieLinkWidth", "nvmlDeviceGetMaxPcieLinkWidth",
    "nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetCurrentClocksThrottleReasons", "nvmlDeviceGetTemperature",
    "nvmlDeviceGetTemperatureV", "nvmlDeviceGetTemperatureThreshold", "nvmlDeviceGetMarginTemperature", "nvmlDeviceGetP2PStatus",
}  # fmt: skip


def nvml_header() -> Path:
    found = sorted(Path(sys.prefix).glob("lib/python3*/site-packages/nvidia/cu*/include/nvml.h"))
    found = found or sorted((paths.REPO_ROOT / ".venv").glob("lib/python3*/site-packages/nvidia/cu*/include/nvml.h"))
    assert found, "nvml.h (nvidia-nvml-dev) not found"
    return found[-1]


def header_functions() -> set[str]:
    """Every function the header declares (straight from its text)."""
    text = nvml_header().read_text()
    return set(re.findall(r"\bDECLDIR\b[^;(]*?\b(nvml\w+)\s*\(", text))


def header_error_codes() -> dict[str, int]:
    body = nvml_header().read_text().split("typedef enum nvmlReturn_enum", 1)[1].split("} nvmlReturn_t;")[0]
    return {m[0]: int(m[1]) for m in re.findall(r"(NVML_\w+)\s*=\s*(\d+)", body)}


@pytest.mark.host_safe
def test_every_nvml_function_in_the_header_is_exported() -> None:
    names = header_functions()
    assert len(names) > 400
    lib = ctypes.CDLL(str(paths.LIBRARY))
    missing = [n for n in sorted(names) if not hasattr(lib, n)]
    assert missing == []


@pytest.mark.host_safe
def test_only_the_nvml_api_is_exported() -> None:
    out = subprocess.run(["nm", "-D", "--defined-only", str(paths.LIBRARY)], capture_output=True, text=True, check=True).stdout
    symbols = {line.split()[-1] for line in out.splitlines() if line.strip()}
    assert {s for s in symbols if not s.startswith("nvml") and not s.startswith("LIBNVIDIA")} == set()
    assert symbols >= header_functions()


@pytest.mark.host_safe
def test_hand_written_functions_are_exactly_the_modelled_set() -> None:
    implemented = set((paths.GEN_DIR / "implemented.txt").read_text().split())
    assert implemented == IMPLEMENTED


@pytest.mark.host_safe
def test_build_is_warning_free_with_werror(tmp_path: Path) -> None:
    venv = paths._venv()
    proc = subprocess.run(
        ["make", "-s", "-j2", "-C", str(paths.SIM_ROOT), f"VENV={venv}", f"BUILD={tmp_path}/b", "CFLAGS=-O2 -Werror"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "warning" not in (proc.stdout + proc.stderr)
    assert (tmp_path / "b/lib/libnvidia-ml.so.1").exists()


def test_unimplemented_functions_return_not_supported(node, nvml) -> None:
    stubs = sorted(header_functions() - IMPLEMENTED)
    res = nvml(
        node,
        f"""
        L = lib()
        names = {stubs!r}
        before = {{n: getattr(L, n)() for n in names}}
        assert L.nvmlInit_v2() == 0
        after = {{n: getattr(L, n)() for n in names}}
        L.nvmlShutdown()
        result = [before, after]
    """,
    )
    before, after = res
    assert len(stubs) > 360
    assert set(before.values()) == {1}  # NVML_ERROR_UNINITIALIZED
    assert {n: rc for n, rc in after.items() if rc != 3} == {}  # NVML_ERROR_NOT_SUPPORTED
    # and through pynvml, as the collection would meet it
    assert (
        nvml(
            node,
            """
        nvmlInit(); h = nvmlDeviceGetHandleByIndex(0)
        result = [error_name(nvmlDeviceGetFanSpeed, h), error_name(nvmlDeviceGetPowerUsage, h),
                  error_name(nvmlDeviceGetUtilizationRates, h)]
    """,
        )
        == ["NVMLError_NotSupported"] * 3
    )


def test_error_strings_cover_every_code(node, nvml) -> None:
    codes = header_error_codes()
    res = nvml(
        node,
        f"""
        L = lib(); L.nvmlErrorString.restype = ctypes.c_char_p
        result = {{name: L.nvmlErrorString(code).decode() for name, code in {codes!r}.items()}}
        result["bogus"] = L.nvmlErrorString(12345).decode()
    """,
    )
    assert all(res[name] for name in codes)
    assert res["NVML_ERROR_GPU_IS_LOST"] == "GPU is lost"
    assert res["NVML_ERROR_DRIVER_NOT_LOADED"] == "Driver Not Loaded"
    assert res["NVML_ERROR_NOT_SUPPORTED"] == "Not Supported"
    assert res["NVML_SUCCESS"] == "Success"
    assert res["bogus"] == "Unknown Error"


def test_init_fails_as_driver_not_loaded_without_a_node(node, nvml, tmp_path) -> None:
    code = "result = error_name(nvmlInit)"
    assert nvml(node, code, env={"GPUSIM_STATE": ""}) == "NVMLError_DriverNotLoaded"
    assert nvml(node, code, env={"GPUSIM_STATE": str(tmp_path / "nothing")}) == "NVMLError_DriverNotLoaded"
    env = {k: v for k, v in os.environ.items() if k != "GPUSIM_STATE"}
    env["LD_LIBRARY_PATH"] = node.env()["LD_LIBRARY_PATH"]
    proc = subprocess.run(
        [sys.executable, "-c", "import pynvml\ntry: pynvml.nvmlInit()\nexcept pynvml.NVMLError as e: print(type(e).__name__)"],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.stdout.strip() == "NVMLError_DriverNotLoaded"


def test_uninitialized_and_reference_counted_init(node, nvml) -> None:
    res = nvml(
        node,
        """
        L = lib(); c = ctypes.c_uint(); h = ctypes.c_void_p()
        r = {"before": [L.nvmlDeviceGetCount_v2(ctypes.byref(c)), L.nvmlShutdown(),
                        L.nvmlSystemGetDriverVersion(ctypes.create_string_buffer(80), 80)]}
        r["init"] = [L.nvmlInit_v2(), L.nvmlInit(), L.nvmlInitWithFlags(0)]
        L.nvmlDeviceGetHandleByIndex_v2(0, ctypes.byref(h))
        r["fds_open"] = fds()
        r["shutdowns"] = [L.nvmlShutdown(), L.nvmlShutdown()]
        r["still"] = [L.nvmlDeviceGetCount_v2(ctypes.byref(c)), c.value]
        r["last"] = L.nvmlShutdown()
        r["after"] = [L.nvmlDeviceGetCount_v2(ctypes.byref(c)), L.nvmlShutdown()]
        r["fds_closed"] = fds()
        result = r
    """,
    )
    assert res["before"] == [1, 1, 1]
    assert res["init"] == [0, 0, 0]
    assert res["fds_open"] == ["nvidia-uvm", "nvidia0", "nvidiactl"]
    assert res["shutdowns"] == [0, 0]
    assert res["still"] == [0, 8]
    assert res["last"] == 0
    assert res["after"] == [1, 1]
    assert res["fds_closed"] == []


def test_a_forked_child_must_initialise_nvml_itself(node, nvml) -> None:
    """As the real library (H200, driver 580): the parent's nvmlInit does not carry over a fork."""
    res = nvml(
        node,
        """
        L = lib(); c = ctypes.c_uint()
        L.nvmlInit_v2()
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            first = L.nvmlDeviceGetCount_v2(ctypes.byref(c))
            init = L.nvmlInit_v2()
            second = L.nvmlDeviceGetCount_v2(ctypes.byref(c))
            os.write(w, json.dumps([first, init, second, c.value]).encode())
            os._exit(0)
        os.close(w)
        child = json.loads(os.read(r, 1000))
        os.waitpid(pid, 0)
        result = {"child": child, "parent": [L.nvmlDeviceGetCount_v2(ctypes.byref(c)), c.value]}
    """,
    )
    assert res["child"] == [1, 0, 0, 8]  # UNINITIALIZED, then its own init works
    assert res["parent"] == [0, 8]  # the parent's stays initialised


def test_null_pointers_are_invalid_arguments(node, nvml) -> None:
    res = nvml(
        node,
        """
        L = lib(); assert L.nvmlInit_v2() == 0
        h = ctypes.c_void_p(); assert L.nvmlDeviceGetHandleByIndex_v2(0, ctypes.byref(h)) == 0
        N = None
        calls = {
            "GetCount_v2": L.nvmlDeviceGetCount_v2(N),
            "GetCount": L.nvmlDeviceGetCount(N),
            "ByIndex_v2": L.nvmlDeviceGetHandleByIndex_v2(0, N),
            "ByIndex_bad": L.nvmlDeviceGetHandleByIndex_v2(99, ctypes.byref(ctypes.c_void_p())),
            "ByUUID": L.nvmlDeviceGetHandleByUUID(N, ctypes.byref(ctypes.c_void_p())),
            "ByPci": L.nvmlDeviceGetHandleByPciBusId_v2(b"0000:18:00.0", N),
            "Name": L.nvmlDeviceGetName(h, N, 96),
            "UUID": L.nvmlDeviceGetUUID(h, N, 96),
            "Index": L.nvmlDeviceGetIndex(h, N),
            "Minor": L.nvmlDeviceGetMinorNumber(h, N),
            "Pci_v3": L.nvmlDeviceGetPciInfo_v3(h, N),
            "Mem": L.nvmlDeviceGetMemoryInfo(h, N),
            "Mem_v2": L.nvmlDeviceGetMemoryInfo_v2(h, N),
            "Procs_v3": L.nvmlDeviceGetComputeRunningProcesses_v3(h, N, N),
            "Procs": L.nvmlDeviceGetComputeRunningProcesses(h, N, N),
            "Gfx_v2": L.nvmlDeviceGetGraphicsRunningProcesses_v2(h, N, N),
            "Mps_v3": L.nvmlDeviceGetMPSComputeRunningProcesses_v3(h, N, N),
            "Fields": L.nvmlDeviceGetFieldValues(h, 1, N),
            "Mig": L.nvmlDeviceGetMigMode(h, N, N),
            "Compute": L.nvmlDeviceGetComputeMode(h, N),
            "Persist": L.nvmlDeviceGetPersistenceMode(h, N),
            "Driver": L.nvmlSystemGetDriverVersion(N, 80),
            "NvmlVer": L.nvmlSystemGetNVMLVersion(N, 80),
            "Cuda": L.nvmlSystemGetCudaDriverVersion(N),
            "Cuda_v2": L.nvmlSystemGetCudaDriverVersion_v2(N),
            "ProcName": L.nvmlSystemGetProcessName(1, N, 64),
            "NullHandle": L.nvmlDeviceGetName(N, ctypes.create_string_buffer(96), 96),
            "BogusHandle": L.nvmlDeviceGetName(ctypes.c_void_p(16), ctypes.create_string_buffer(96), 96),
            "MisalignedHandle": L.nvmlDeviceGetName(ctypes.c_void_p(h.value + 4), ctypes.create_string_buffer(96), 96),
            "ShortName": L.nvmlDeviceGetName(h, ctypes.create_string_buffer(4), 4),
        }
        result = calls
    """,
    )
    short = res.pop("ShortName")
    assert short == 7  # NVML_ERROR_INSUFFICIENT_SIZE
    assert res == dict.fromkeys(res, 2)  # NVML_ERROR_INVALID_ARGUMENT


def test_idle_default_node(node, nvml) -> None:
    res = nvml(node, "result = snapshot()")
    assert len(res) == 8
    for g in res:
        assert g["name"] == "NVIDIA H200"
        assert g["total"] == g["v1_total"] == 143771
        assert g["v1_used"] == 615  # v1 counts reserved memory: the idle-GPU trap
        assert g["used"] == 0 and g["reserved"] == 615
        assert g["free"] == 143771 - 615 and g["v1_free"] == 143771 - 615
        assert g["procs"] == []
    assert len({g["uuid"] for g in res}) == 8


def test_memory_v2_checks_the_struct_version(node, nvml) -> None:
    assert nvml(
        node,
        """
        nvmlInit(); h = nvmlDeviceGetHandleByIndex(0)
        result = [error_name(nvmlDeviceGetMemoryInfo, h, 2), nvmlMemory_v2 == ctypes.sizeof(c_nvmlMemory_v2_t) | 2 << 24]
    """,
    ) == ["NVMLError_ArgumentVersionMismatch", True]


def test_identity_versions_and_lookups(node, nvml) -> None:
    res = nvml(
        node,
        """
        nvmlInit()
        h = nvmlDeviceGetHandleByIndex(2)
        uuid = nvmlDeviceGetUUID(h)
        pci = nvmlDeviceGetPciInfo(h)
        def idx(handle): return nvmlDeviceGetIndex(handle)
        result = {
            "driver": nvmlSystemGetDriverVersion(), "nvml": nvmlSystemGetNVMLVersion(),
            "cuda": nvmlSystemGetCudaDriverVersion(), "cuda_v2": nvmlSystemGetCudaDriverVersion_v2(),
            "uuid": uuid, "bus": pci.busId, "legacy": pci.busIdLegacy, "pci": [pci.domain, pci.bus, pci.device],
            "devid": pci.pciDeviceId, "minor": nvmlDeviceGetMinorNumber(h), "index": idx(h),
            "by_uuid": idx(nvmlDeviceGetHandleByUUID(uuid)),
            "by_bus": [idx(nvmlDeviceGetHandleByPciBusId(b)) for b in
                       ("00000000:3A:00.0", "0000:3a:00.0", "3A:00.0")],
            "unknown_uuid": error_name(nvmlDeviceGetHandleByUUID, "GPU-00000000-0000-0000-0000-000000000000"),
            "unknown_bus": error_name(nvmlDeviceGetHandleByPciBusId, "0000:01:00.0"),
            "mig": nvmlDeviceGetMigMode(h), "compute": nvmlDeviceGetComputeMode(h),
            "persistence": nvmlDeviceGetPersistenceMode(h),
            "self_name": nvmlSystemGetProcessName(os.getpid()),
            "dead_name": error_name(nvmlSystemGetProcessName, 4194300),
        }
    """,
    )
    assert res["driver"] == "580.159.04" and res["nvml"] == "13.580.159.04"
    assert res["cuda"] == res["cuda_v2"] == 13000
    assert re.fullmatch(r"GPU-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", res["uuid"])
    assert res["bus"] == "00000000:3A:00.0" and res["legacy"] == "0000:3A:00.0" and res["pci"] == [0, 0x3A, 0]
    assert res["devid"] == 0x233510DE
    assert res["minor"] == res["index"] == res["by_uuid"] == 2
    assert res["by_bus"] == [2, 2, 2]
    assert res["unknown_uuid"] == res["unknown_bus"] == "NVMLError_NotFound"
    assert res["mig"] == [0, 0] and res["compute"] == 0 and res["persistence"] == 1
    assert res["self_name"] == sys.executable
    assert res["dead_name"] == "NVMLError_NotFound"
    # deterministic per node: a second node with the same seed has the same UUIDs
    assert node.gpus[2].uuid == res["uuid"]


def test_an_nvml_client_holds_device_fds_but_no_mappings(node, nvml) -> None:
    res = nvml(
        node,
        """
        nvmlInit()
        r = {"init": fds()}
        nvmlDeviceGetHandleByIndex(5)
        r["handle"] = fds()
        with open("/proc/self/maps") as f:
            r["maps"] = [l for l in f if "/dev/nvidia" in l]
        nvmlShutdown()
        r["shutdown"] = fds()
        result = r
    """,
    )
    assert res["init"] == ["nvidia-uvm", "nvidiactl"]
    assert res["handle"] == ["nvidia-uvm", "nvidia5", "nvidiactl"]
    assert res["maps"] == []
    assert res["shutdown"] == []


def test_field_values(node, nvml) -> None:
    res = nvml(
        node,
        """
        nvmlInit(); h = nvmlDeviceGetHandleByIndex(0)
        v = nvmlDeviceGetFieldValues(h, [NVML_FI_DEV_GET_GPU_RECOVERY_ACTION, NVML_FI_DEV_MEMORY_TEMP, 230])
        result = [[x.fieldId, x.nvmlReturn, x.valueType, x.value.uiVal, x.timestamp > 0] for x in v]
    """,
    )
    assert res == [[230, 0, 1, 0, True], [res[1][0], 3, res[1][2], 0, True], [230, 0, 1, 0, True]]
