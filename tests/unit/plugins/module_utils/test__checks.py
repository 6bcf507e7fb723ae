"""_checks: numbers must be finite and in range, paths must exist, every failure carries a reason."""

from __future__ import annotations

import json
import math

import pytest
from ansible.module_utils.testing import patch_module_args

from ansible_collections.gpuops.clean_slate.plugins.module_utils import _checks
from ansible_collections.gpuops.clean_slate.plugins.module_utils._errors import CleanSlateError


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, "10", True, None])
def test_only_finite_numbers_pass(value) -> None:
    if value is None:
        _checks.number("timeout", value, 0, 10)  # an unset option is not checked
        return
    with pytest.raises(CleanSlateError) as err:
        _checks.number("timeout", value, 0, 10, unit="seconds")
    assert err.value.reason == "bad_arguments"
    assert err.value.msg == f"timeout must be a finite number from 0 to 10 seconds, got {value!r}."


def test_bounds_are_inclusive_unless_open() -> None:
    for ok in (0, 0.0, 5, 10, 10.0):
        _checks.number("grace_period", ok, 0, 10)
    for bad, text in ((-0.5, "-0.5"), (10.5, "10.5"), (2**31, str(2**31))):
        with pytest.raises(CleanSlateError, match=rf"^grace_period must be from 0 to 10, got {text}\.$"):
            _checks.number("grace_period", bad, 0, 10)
    with pytest.raises(CleanSlateError, match=r"^interval must be more than 0 and at most 60 seconds, got 0\.$"):
        _checks.number("interval", 0, 0, 60, low_open=True, unit="seconds")
    _checks.number("interval", 0.001, 0, 60, low_open=True)


def test_paths(tmp_path) -> None:
    _checks.existing_dir("device_dir", str(tmp_path))
    with pytest.raises(CleanSlateError, match=f"^device_dir: {tmp_path}/nope does not exist on this host"):
        _checks.existing_dir("device_dir", str(tmp_path / "nope"))
    (tmp_path / "file").write_text("")
    with pytest.raises(CleanSlateError, match=f"^device_dir: {tmp_path}/file is not a directory"):
        _checks.existing_dir("device_dir", str(tmp_path / "file"))
    _checks.executable("pct_path", None)
    _checks.executable("pct_path", "/bin/sh")
    with pytest.raises(CleanSlateError, match=f"^pct_path: {tmp_path}/pct does not exist on this host"):
        _checks.executable("pct_path", str(tmp_path / "pct"))
    for not_runnable in (tmp_path, tmp_path / "file"):
        with pytest.raises(CleanSlateError, match=f"^pct_path: {not_runnable} is not an executable file"):
            _checks.executable("pct_path", str(not_runnable))


def run_module(args: dict, capsys, ready: bool = True, fail: dict | None = None) -> dict:
    with patch_module_args(args), pytest.raises(SystemExit):
        module = _checks.Module(argument_spec={"count": {"type": "int", "required": True}})
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
