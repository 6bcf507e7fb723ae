"""_node: the clean_slate_node umbrella. Every selected phase's options are checked before anything runs, each
refusal names its phase; a kill never runs on GPUs that were not read; the pre-stop commands are real processes,
run only when the plan has targets and stopped at the first failure."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
import typing as t

import pytest

from ansible_collections.gpuops.clean_slate.plugins.module_utils import _kill, _node, _verify
from ansible_collections.gpuops.clean_slate.plugins.module_utils._errors import CleanSlateError
from ansible_collections.gpuops.clean_slate.plugins.module_utils._residue import module as residue


class Host:
    """What the module bodies use of an AnsibleModule, for a run outside Ansible."""

    def __init__(self, params: dict[str, t.Any], check_mode: bool = False) -> None:
        self.params = {**{k: v.get("default") for k, v in _node.argument_spec().items()}, **params}
        self.check_mode = check_mode
        self._diff = False
        self.warnings: list[str] = []

    def warn(self, warning: str) -> None:
        self.warnings.append(warning)

    def run_command(self, argv: list[str], expand_user_and_vars: bool = True, handle_exceptions: bool = True) -> tuple[int, str, str]:
        assert not expand_user_and_vars and not handle_exceptions  # nothing expanded; a missing program is the caller's to report
        done = subprocess.run(argv, capture_output=True, text=True, check=False)
        return done.returncode, done.stdout, done.stderr

    def get_bin_path(self, name: str, *args: t.Any, **kwargs: t.Any) -> str | None:
        return shutil.which(name)


def test_the_phases_options_are_their_modules_own() -> None:
    """One source: the umbrella checks each phase against the spec its module is built with."""
    for name, spec in (("verify", _verify.argument_spec()), ("kill", _kill.argument_spec()), ("residue", residue.argument_spec())):
        checked = _node.phase_params(name, spec, {})
        assert set(checked) == set(spec), name
        assert all(checked[k] == v.get("default") for k, v in spec.items() if v.get("type") not in ("path",)), name
    assert _node.phase_params("kill", _kill.argument_spec(), {"grace_period": "2.5"})["grace_period"] == 2.5


@pytest.mark.parametrize(
    ("params", "phase", "says"),
    [
        ({"kill": {"grace_period": "soon"}}, "kill", "kill: "),
        ({"kill": {"no_such_option": 1}}, "kill", "no_such_option"),
        ({"kill": {"grace_period": -1}}, "kill", "grace_period"),
        ({"kill": {"where": "targets[?"}}, "kill", "where"),
        ({"kill": {"patterns": ["("]}}, "kill", "patterns"),
        ({"verify": {"interval": 0}}, "preflight", "interval"),
        ({"residue": {"ports": [70000]}}, "residue", "ports"),
        ({"residue": {"shm": ["relative/*"]}}, "residue", "shm"),
        ({"pre_stop_timeout": 0}, "arguments", "pre_stop_timeout"),
        ({"kill": "grace"}, "kill", "must be a dictionary"),
    ],
)
def test_bad_options_are_refused_before_any_phase_runs(params: dict[str, t.Any], phase: str, says: str, tmp_path) -> None:
    # The device directory exists, so that only the option under test is wrong.
    params = {**params, "verify": {"device_dir": str(tmp_path), **params.get("verify", {})}}
    with pytest.raises(CleanSlateError) as err:
        _node.run(Host(params))
    assert err.value.reason == "bad_arguments"
    assert err.value.details["phase"] == phase and says in err.value.msg, (err.value.details, err.value.msg)


def test_only_the_selected_phases_options_are_checked(tmp_path) -> None:
    # A wrong kill option does not stop a run that does not kill; the verify options are still checked.
    host = Host({"phases": ["residue"], "kill": {"grace_period": -1}, "residue": {"shm": [f"{tmp_path}/nccl-*"], "sockets": [], "locks": [], "dirs": []}})
    result = _node.run(host)
    assert result["phases"] == ["residue"] and set(result) >= {"residue", "python", "elapsed_s"} and "kill" not in result
    assert result["phase"] == "done" and result["residue"]["summary"]["removed"] == 0


def test_a_kill_never_runs_on_gpus_that_were_not_read(tmp_path) -> None:
    host = Host({"phases": ["kill"], "kill": {"patterns": ["^never-matches-anything$"], "device_dir": str(tmp_path)}})
    with pytest.raises(CleanSlateError) as err:
        _node.run(host)
    assert err.value.reason == "gpus_not_read" and err.value.details["phase"] == "kill"
    assert "kill" not in err.value.details and err.value.details["guard"]["failed"] is True
    assert "Nothing was signalled" in err.value.msg


def test_pre_stop_commands_run_in_order_and_stop_at_the_first_failure(tmp_path) -> None:
    marks = tmp_path / "ran"
    commands = [f"touch {marks}-1", "false", f"touch {marks}-3"]
    ran = _node.run_pre_stop(Host({}), commands, 10, [], check_mode=False)
    assert [r["item"] for r in ran] == commands[:2]
    assert ran[0]["rc"] == 0 and not ran[0].get("failed") and os.path.exists(f"{marks}-1")
    assert ran[1]["failed"] is True and ran[1]["rc"] == 1 and ran[1]["reason"] == "command_failed"
    assert not os.path.exists(f"{marks}-3")


def test_a_pre_stop_command_is_split_not_given_to_a_shell(tmp_path) -> None:
    out = _node.run_local(Host({}), f"printf %s 'two words' {tmp_path}/$HOME", 10)
    assert out["cmd"] == ["printf", "%s", "two words", f"{tmp_path}/$HOME"] and out["stdout"] == "two words" + f"{tmp_path}/$HOME"


def test_a_pre_stop_command_that_hangs_is_killed_at_its_timeout() -> None:
    start = time.monotonic()
    out = _node.run_local(Host({}), "sleep 30", 0.3)
    assert time.monotonic() - start < 10
    assert out["failed"] is True and out["reason"] == "timeout" and "0.3 s" in out["msg"]


def test_a_missing_pre_stop_program_fails_with_its_error() -> None:
    out = _node.run_local(Host({}), "/nonexistent/stop-the-server", 5)
    assert out["failed"] is True and out["reason"] == "command_failed" and out["rc"] == 127 and "No such file" in out["stderr"]


def test_check_mode_runs_no_pre_stop_command_on_the_host(tmp_path) -> None:
    ran = _node.run_pre_stop(Host({}, check_mode=True), [f"touch {tmp_path}/x"], 10, [], check_mode=True)
    assert ran[0]["skipped"] is True and not os.path.exists(tmp_path / "x")


def test_a_reading_counts_only_when_it_read_the_gpus() -> None:
    assert _node.read_ok({"clean": True, "gpus": []})
    assert not _node.read_ok({"clean": False, "gpus": [], "reason": "driver_not_loaded"})
    assert not _node.read_ok({"clean": False, "gpus": [], "diagnosis": "library_not_found"})
    assert not _node.read_ok({})


def test_the_restore_phase_runs_only_when_it_declares_something() -> None:
    assert _node.selected_phases(Host({}).params) == ["preflight", "kill", "residue", "verify"]
    assert _node.selected_phases(Host({"restore": {"mps": "stopped"}}).params) == ["preflight", "kill", "residue", "restore", "verify"]
    assert _node.selected_phases(Host({"phases": ["restore", "verify"], "restore": {"compute_mode": "default"}}).params) == ["restore", "verify"]
    with pytest.raises(CleanSlateError) as err:
        _node.run(Host({"phases": ["restore"], "restore": {"compute_mode": "sometimes"}}))
    assert err.value.reason == "bad_arguments" and err.value.details["phase"] == "restore"
