"""Pure parts of _nvml: GPU selectors, selection, error classification."""

from __future__ import annotations

import pytest

from ansible_collections.gpuops.clean_slate.plugins.module_utils import _nvml
from ansible_collections.gpuops.clean_slate.plugins.module_utils._errors import CleanSlateError

UUID0 = "GPU-5f2d3b0e-8c1a-4d6e-9b7f-2a4c6e8d0f13"
UUID1 = "GPU-00000000-1111-2222-3333-444444444444"


def test_selectors_accept_indices_and_uuids() -> None:
    assert _nvml.parse_gpu_selectors([0, "3", " 7 ", UUID0, "MIG-5f2d3b0e-8c1a-4d6e-9b7f-2a4c6e8d0f13"]) == [
        0,
        3,
        7,
        UUID0,
        "MIG-5f2d3b0e-8c1a-4d6e-9b7f-2a4c6e8d0f13",
    ]
    assert _nvml.parse_gpu_selectors(None) == []
    assert _nvml.parse_gpu_selectors(["/dev/nvidia3", "nvidia0"]) == ["/dev/nvidia3", "nvidia0"]


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (-1, "gpus: GPU index -1 is negative"),
        ("GPU-1234", "gpus: 'GPU-1234' is neither a GPU index, a GPU UUID nor a device path"),
        ("/dev/nvidiactl", "gpus: '/dev/nvidiactl' is neither"),
        ("first", "gpus: 'first' is neither"),
        (1.5, "gpus: '1.5' is neither"),
    ],
)
def test_bad_selectors_name_the_option(value: object, message: str) -> None:
    with pytest.raises(CleanSlateError) as err:
        _nvml.parse_gpu_selectors([value])
    assert err.value.msg.startswith(message)
    assert err.value.reason == "bad_arguments"


def test_select_by_index_and_uuid_in_index_order() -> None:
    gpus = [_nvml.Gpu(index=0, uuid=UUID0, minor=0), _nvml.Gpu(index=1, uuid=UUID1, minor=1)]
    assert [g.index for g in _nvml.select_gpus(gpus, [])] == [0, 1]
    assert [g.index for g in _nvml.select_gpus(gpus, [UUID1.lower(), 0, 1])] == [0, 1]
    with pytest.raises(CleanSlateError, match=r"gpus: GPU index 9 does not exist; this host has 2 GPU\(s\) \(indices 0-1\)"):
        _nvml.select_gpus(gpus, [9])
    gpus[1].minor = 5
    assert [g.index for g in _nvml.select_gpus(gpus, ["/dev/nvidia5"])] == [1]
    with pytest.raises(CleanSlateError, match="gpus: no GPU on this host has the device file /dev/nvidia1"):
        _nvml.select_gpus(gpus, ["/dev/nvidia1"])
    with pytest.raises(CleanSlateError, match="gpus: no GPU on this host has UUID"):
        _nvml.select_gpus(gpus, ["GPU-99999999-1111-2222-3333-444444444444"])


@pytest.mark.parametrize(
    ("code", "reason", "advice"),
    [
        (_nvml.NVML_ERROR_LIBRARY_NOT_FOUND, "library_not_found", "libnvidia-ml.so.1 was not found"),
        (_nvml.NVML_ERROR_DRIVER_NOT_LOADED, "driver_not_loaded", "kernel driver is not loaded"),
        (_nvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH, "driver_library_mismatch", "different versions"),
        (_nvml.NVML_ERROR_GPU_IS_LOST, "gpu_lost", "fallen off the bus"),
        (_nvml.NVML_ERROR_NO_PERMISSION, "no_permission", "become: true"),
        (_nvml.NVML_ERROR_TIMEOUT, "timeout", "timed out"),
        (999, "nvml_error", "code 999"),
    ],
)
def test_nvml_errors_become_diagnoses(code: int, reason: str, advice: str) -> None:
    err = _nvml.NvmlError(code, "nvmlInit", gpu=3)
    assert err.reason == reason
    assert advice in err.msg
    assert err.msg.startswith("nvmlInit (GPU 3): ")
    assert err.result()["nvml_code"] == code


def test_mib_rounding_and_recovery_names() -> None:
    assert _nvml._mib(615 * 1024 * 1024) == 615
    assert _nvml._mib(1024 * 1024 - 1) == 1
    assert _nvml._mib(0) == 0
    assert _nvml.recovery_action_name(0) == "none"
    assert _nvml.recovery_action_name(1) == "gpu_reset"
    assert _nvml.recovery_action_name(None) is None
    assert _nvml.recovery_action_name(42) == "unknown_42"


def test_device_files_problem(tmp_path) -> None:
    assert _nvml.device_files_problem(str(tmp_path)) == (
        f"{tmp_path} holds no GPU device file (nvidia0, nvidia1, ...): the driver is not loaded, or the GPUs are not passed through"
    )
    (tmp_path / "nvidiactl").write_text("")
    assert "holds no GPU device file" in (_nvml.device_files_problem(str(tmp_path)) or "")
    (tmp_path / "nvidia3").write_text("")
    assert _nvml.device_files_problem(str(tmp_path)) is None
    assert _nvml.device_files_problem(str(tmp_path / "none")).startswith(f"{tmp_path / 'none'} cannot be listed")
