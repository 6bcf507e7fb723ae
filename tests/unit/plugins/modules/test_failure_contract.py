"""Every module fails in the one shape (reason, msg, the details), whatever went wrong: main() runs in-process.

Nothing here reaches a GPU, a container or a process: the failures are forced before any of that (bad input, a
missing library) or where only a test can force them (a bug in the module's logic).
"""

from __future__ import annotations

import json
import math

import pytest
from ansible.module_utils.testing import patch_module_args

from ansible_collections.gpuops.clean_slate.plugins.module_utils import _kill, _nvml, _pct, _reasons, _restore, _signals, _verify
from ansible_collections.gpuops.clean_slate.plugins.module_utils._residue import module as residue
from ansible_collections.gpuops.clean_slate.plugins.modules import gpu_job_residue, gpu_mem_verify, gpu_mode_restore, gpu_procs_kill, pct_exec

MODULES = {
    "gpu_procs_kill": gpu_procs_kill,
    "gpu_mem_verify": gpu_mem_verify,
    "gpu_job_residue": gpu_job_residue,
    "pct_exec": pct_exec,
    "gpu_mode_restore": gpu_mode_restore,
}
# Arguments that pass Ansible's own checks, so that the failure comes from where the test puts it.
VALID = {
    "gpu_procs_kill": {"patterns": ["no-such-process-here"]},
    "gpu_mem_verify": {},
    "gpu_job_residue": {},
    "pct_exec": {"vmid": 129, "argv": ["true"]},
    "gpu_mode_restore": {"compute_mode": "default"},
}
# What each module's failures always carry besides reason and msg.
DETAILS = {
    "gpu_procs_kill": {"targets", "protected"},
    "gpu_mem_verify": {"clean", "gpus", "python", "diagnosis"},
    "gpu_job_residue": {"summary", "elapsed_s"},
    "pct_exec": {"vmid"},
    "gpu_mode_restore": set(),
}
# Where each module's logic starts: a bug there must come back as internal_error.
LOGIC = {
    "gpu_procs_kill": (_kill, "build_request"),
    "gpu_mem_verify": (_verify, "validate"),
    "gpu_job_residue": (residue, "build_request"),
    "pct_exec": (_pct, "validate_vmid"),
    "gpu_mode_restore": (_restore, "validate"),
}


def run_main(name: str, args: dict, capsys) -> tuple[int, dict]:
    with patch_module_args(args), pytest.raises(SystemExit) as exc:
        MODULES[name].main()
    return int(exc.value.code or 0), json.loads(capsys.readouterr().out)


def assert_contract(name: str, result: dict, reason: str) -> None:
    assert result["failed"] is True
    assert result["reason"] == reason, result
    assert reason in _reasons.MODULES[name], f"{name} documents no {reason}"
    assert isinstance(result["msg"], str) and result["msg"] and "Traceback" not in result["msg"]
    assert DETAILS[name] <= set(result), f"{name} failed without {DETAILS[name] - set(result)}"


@pytest.mark.parametrize("name", sorted(MODULES))
def test_ansibles_own_argument_checks_are_bad_arguments(name: str, capsys) -> None:
    code, result = run_main(name, {**VALID[name], "no_such_option": 1}, capsys)
    assert code == 1 and result["reason"] == "bad_arguments" and "no_such_option" in result["msg"]


@pytest.mark.parametrize("name", sorted(MODULES))
def test_a_bug_is_an_internal_error_with_the_modules_details(name: str, capsys, monkeypatch) -> None:
    def broken(*_args, **_kwargs):
        raise RuntimeError("a bug")

    monkeypatch.setattr(*LOGIC[name], broken)
    code, result = run_main(name, VALID[name], capsys)
    assert code == 1
    assert_contract(name, result, "internal_error")
    assert result["msg"].startswith(f"{name} failed unexpectedly: a bug.")


@pytest.mark.parametrize(
    ("name", "args", "option"),
    [
        ("gpu_procs_kill", {"grace_period": math.nan}, "grace_period"),
        ("gpu_procs_kill", {"containers": [42]}, "containers"),
        ("gpu_mem_verify", {"interval": math.inf}, "interval"),
        ("gpu_mem_verify", {"gpus": ["-1"]}, "gpus"),
        ("gpu_mem_verify", {"since": "after lunch"}, "since"),
        ("gpu_mode_restore", {"gpus": ["nvidia-zero"]}, "gpus"),
        ("gpu_mode_restore", {"mps_timeout": math.nan}, "mps_timeout"),
        ("gpu_job_residue", {"time_wait_timeout": math.nan}, "time_wait_timeout"),
        ("gpu_job_residue", {"list_limit": -1}, "list_limit"),
        ("gpu_job_residue", {"containers": [129], "pct_path": "/nonexistent/pct"}, "pct_path"),
        ("gpu_job_residue", {"shm": ["dev/shm/x"]}, "shm"),
        ("pct_exec", {"vmid": 42}, "vmid"),
        ("pct_exec", {"timeout": 0}, "timeout"),
    ],
)
def test_a_refused_option_is_named(name: str, args: dict, option: str, capsys) -> None:
    code, result = run_main(name, {**VALID[name], **args}, capsys)
    assert code == 1
    assert_contract(name, result, "bad_arguments")
    assert result["option"] == option and result["msg"].startswith(option)


@pytest.mark.parametrize(
    ("name", "where", "flag"), [("gpu_mem_verify", _nvml, "HAS_PYNVML"), ("gpu_procs_kill", _signals, "HAS_PSUTIL"), ("gpu_mode_restore", _nvml, "HAS_PYNVML")]
)
def test_a_missing_library_is_missing_library(name: str, where, flag: str, capsys, monkeypatch) -> None:
    monkeypatch.setattr(where, flag, False)
    code, result = run_main(name, VALID[name], capsys)
    assert code == 1
    assert_contract(name, result, "missing_library")


def test_verify_keeps_diagnosis_as_a_deprecated_alias_of_reason(capsys, monkeypatch) -> None:
    monkeypatch.setattr(_nvml, "HAS_PYNVML", False)
    _code, result = run_main("gpu_mem_verify", {}, capsys)
    assert result["diagnosis"] == result["reason"] == "missing_library"
    monkeypatch.undo()
    _code, result = run_main("gpu_mem_verify", {"timeout": -1}, capsys)
    assert result["diagnosis"] == result["reason"] == "bad_arguments"
