"""_module: every failure of every module leaves through one ending, in one shape (reason, msg, the details)."""

from __future__ import annotations

import json
import os

import pytest
from ansible.module_utils._internal import _traceback
from ansible.module_utils.testing import patch_module_args

from ansible_collections.gpuops.clean_slate.plugins.module_utils import _module
from ansible_collections.gpuops.clean_slate.plugins.module_utils._errors import CleanSlateError

SPEC = {"count": {"type": "int", "required": True}}


def run_module(args: dict, capsys, ready: bool = True, fail: dict | None = None) -> dict:
    with patch_module_args(args), pytest.raises(SystemExit):
        module = _module.Module(argument_spec=SPEC)
        if ready:
            module.ready()
        module.fail_json(**(fail or {"msg": "x"}))
    return json.loads(capsys.readouterr().out)


def test_every_failure_carries_a_reason(capsys) -> None:
    # Ansible's own argument checks fail inside the constructor: bad arguments.
    assert run_module({"count": "many"}, capsys)["reason"] == "bad_arguments"
    assert run_module({}, capsys)["reason"] == "bad_arguments"
    # Afterwards a failure that forgot its reason is an internal error; a given reason is kept.
    assert run_module({"count": 1}, capsys)["reason"] == "internal_error"
    assert run_module({"count": 1}, capsys, fail={"msg": "x", "reason": "not_clean"})["reason"] == "not_clean"


def finish(capsys, body, libraries=(), details=None, args=None) -> tuple[int, dict]:
    seen: list[str] = []

    def record(reason: str) -> dict:
        seen.append(reason)
        return details(reason) if details else {}

    with patch_module_args(args or {"count": 3}), pytest.raises(SystemExit) as exc:
        module = _module.Module(argument_spec=SPEC).ready()
        _module.finish(module, body, "demo_module", libraries=libraries, details=record)
    result = json.loads(capsys.readouterr().out)
    result["_details_asked_for"] = seen
    return int(exc.value.code or 0), result


def test_a_result_exits_as_it_is_and_asks_for_no_failure_details(capsys) -> None:
    code, result = finish(capsys, lambda m: {"changed": True, "count": m.params["count"], "msg": "done"})
    assert code == 0
    assert (result["changed"], result["count"], result["msg"], result["_details_asked_for"]) == (True, 3, "done", [])
    assert "reason" not in result and "failed" not in result


def test_a_clean_slate_error_keeps_its_reason_message_and_details_over_the_defaults(capsys) -> None:
    def body(_m):
        raise CleanSlateError("gpus: GPU index 12 does not exist.", reason="bad_arguments", option="gpus", targets=["kept"])

    code, result = finish(capsys, body, details=lambda reason: {"targets": [], "protected": [], "reason": "overridden?", "msg": "overridden?"})
    assert code == 1 and result["failed"] is True
    assert (result["reason"], result["msg"], result["option"]) == ("bad_arguments", "gpus: GPU index 12 does not exist.", "gpus")
    # The error's own details win over the module's defaults; reason and msg are the error's, whatever the defaults say.
    assert (result["targets"], result["protected"]) == (["kept"], [])
    assert result["_details_asked_for"] == ["bad_arguments"]


@pytest.fixture
def tracebacks(monkeypatch):
    """Ansible (2.19 on) returns ``exception`` only when asked for error tracebacks (ANSIBLE_DISPLAY_TRACEBACK=error)."""
    monkeypatch.setattr(_traceback, "_is_traceback_enabled", lambda event: event == _traceback.TracebackEvent.ERROR)


def test_an_unexpected_exception_is_an_internal_error_with_its_traceback(capsys, tracebacks) -> None:
    def body(_m):
        return {}["missing key"]

    code, result = finish(capsys, body, details=lambda reason: {"clean": False, "diagnosis": reason})
    assert code == 1
    assert result["reason"] == "internal_error" and result["diagnosis"] == "internal_error"
    assert result["msg"].startswith("demo_module failed unexpectedly: 'missing key'. This is a bug")
    # The traceback is kept for -vvv, not printed as the message.
    assert "Traceback (most recent call last)" in result["exception"] and "KeyError: 'missing key'" in result["exception"]
    assert "Traceback" not in result["msg"]


def test_a_missing_library_fails_before_the_body_runs(capsys, tracebacks) -> None:
    ran = []
    lib = _module.Library("nvidia-ml-py", present=False, error="Traceback ...\nModuleNotFoundError: No module named 'pynvml'")
    code, result = finish(capsys, lambda m: ran.append(1) or {}, libraries=[_module.Library("psutil", True), lib], details=lambda r: {"clean": False})
    assert code == 1 and ran == []
    assert result["reason"] == "missing_library" and result["clean"] is False
    assert "nvidia-ml-py" in result["msg"] and result["exception"].endswith("No module named 'pynvml'")
    assert result["_details_asked_for"] == ["missing_library"]


def test_failing_through_the_module_itself_still_carries_a_reason(capsys) -> None:
    # A body that calls fail_json itself (it should raise instead) is still in the contract: internal_error by default.
    code, result = finish(capsys, lambda m: m.fail_json(msg="forgot its reason"))
    assert (code, result["reason"], result["msg"]) == (1, "internal_error", "forgot its reason")


def test_names_that_are_not_utf8_leave_as_escaped_text_in_results_and_failures(capsys, tmp_path) -> None:
    """A file name and a command's output as Python and Ansible decode them (surrogate escapes); the result arrives."""
    raw = bytes(tmp_path) + b"/nccl-\xff\xfe"
    open(raw, "w").close()
    [name] = os.listdir(tmp_path)  # the file system's own decoding: surrogate escapes
    assert name == "nccl-\udcff\udcfe"
    code, result = finish(capsys, lambda m: {"changed": True, "removed": [{"path": name}], name: [name], "msg": f"removed {name}"})
    assert code == 0
    assert result["removed"] == [{"path": "nccl-\\xff\\xfe"}] and result["nccl-\\xff\\xfe"] == ["nccl-\\xff\\xfe"]
    assert result["msg"] == "removed nccl-\\xff\\xfe"

    def failing(_m):
        raise CleanSlateError(f"cannot remove {name}", reason="remove_failed", errors=[{"path": name}])

    code, result = finish(capsys, failing)
    assert code == 1 and (result["reason"], result["msg"], result["errors"]) == (
        "remove_failed",
        "cannot remove nccl-\\xff\\xfe",
        [{"path": "nccl-\\xff\\xfe"}],
    )
    # Valid text, a lone surrogate and other values are kept as they are, or written out.
    assert _module.text(["naïve", "\ud800", 3, None, ("a",)]) == ["naïve", "\\ud800", 3, None, ["a"]]
