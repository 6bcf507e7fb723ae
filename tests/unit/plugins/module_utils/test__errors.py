"""_errors: the collection's one error type carries a reason, a sentence and details, in the failure shape."""

from __future__ import annotations

import pytest

from ansible_collections.gpuops.clean_slate.plugins.module_utils import _reasons
from ansible_collections.gpuops.clean_slate.plugins.module_utils._errors import CleanSlateError
from ansible_collections.gpuops.clean_slate.plugins.module_utils._nvml import NVML_ERROR_DRIVER_NOT_LOADED, NvmlError


def test_a_reason_is_required() -> None:
    with pytest.raises(TypeError):
        raise CleanSlateError("something went wrong")  # type: ignore[call-arg]  # the constructor refuses before the raise


def test_the_result_is_the_failure_shape() -> None:
    err = CleanSlateError("vmid: 5 is not a valid Proxmox vmid (100-999999999).", reason=_reasons.BAD_ARGUMENTS, option="vmid", vmid=5)
    assert str(err) == err.msg
    assert err.result() == {"msg": "vmid: 5 is not a valid Proxmox vmid (100-999999999).", "reason": "bad_arguments", "option": "vmid", "vmid": 5}


def test_details_cannot_replace_the_message_or_the_reason() -> None:
    err = CleanSlateError("the command exited with rc 1 in container 129", reason=_reasons.COMMAND_FAILED, rc=1, reason_hint="kept")
    # Details are added on the way up (every signal sent, say); whatever is added, msg and reason stay the error's.
    err.details.update(msg="ignored", reason="ignored")
    result = err.result()
    assert (result["msg"], result["reason"], result["rc"], result["reason_hint"]) == (
        "the command exited with rc 1 in container 129",
        "command_failed",
        1,
        "kept",
    )


def test_nvml_errors_are_clean_slate_errors_with_a_diagnosis() -> None:
    err = NvmlError(NVML_ERROR_DRIVER_NOT_LOADED, "nvmlInit")
    assert isinstance(err, CleanSlateError)
    assert err.reason == _reasons.DRIVER_NOT_LOADED and err.details == {"nvml_code": NVML_ERROR_DRIVER_NOT_LOADED}
    assert err.msg.startswith("nvmlInit: the NVIDIA kernel driver is not loaded")
