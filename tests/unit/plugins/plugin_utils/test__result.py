"""_result: the role's per-host result from its phases' registered results (the clean_slate_result filter)."""

from __future__ import annotations

import typing as t

import pytest
from ansible.errors import AnsibleFilterError

from ansible_collections.gpuops.clean_slate.plugins.filter.clean_slate_result import clean_slate_result
from ansible_collections.gpuops.clean_slate.plugins.plugin_utils import _result

CTX = {
    "host": "gpu-node-1",
    "label": "gpu-node-1",
    "mode": "local",
    "delegate": "gpu-node-1",
    "check_mode": False,
    "fail_on_dirty": True,
    "option_vars": {"where": "clean_slate_where"},
    "step_messages": {"pre_stop_host": {"msg": "a pre-stop command failed on gpu-node-1", "advice": "Fix it."}},
}


def gpu(index: int, used: int = 0, diagnosis: str = "clean") -> dict[str, t.Any]:
    return {"index": index, "used_mib": used, "clean": diagnosis == "clean", "diagnosis": diagnosis}


def steps(**results: t.Any) -> list[list[t.Any]]:
    order = [
        ("arguments", "args", "bad_variable"),
        ("preflight", "before", "gpus_unreadable"),
        ("pre_stop", "pre_stop_host", "command_failed"),
        ("kill", "guard", "gpus_not_read"),
        ("kill", "kill", "kill_failed"),
        ("residue", "residue", "residue_failed"),
        ("verify", "verify", "not_clean"),
    ]
    return [[phase, name, results.get(name, {}), default] for phase, name, default in order]


BEFORE = {"clean": False, "gpus": [gpu(0, 8000, "busy"), gpu(1)], "msg": "1/2 GPUs clean"}
KILL = {"summary": {"terminated": 2, "killed": 1, "signals": {"TERM": 3, "KILL": 1}}, "targets": [{"pid": 1}, {"pid": 2}, {"pid": 3}], "elapsed_s": 1.2}
VERIFY = {"clean": True, "gpus": [gpu(0), gpu(1)], "clean_count": 2, "time_to_clean_s": 0.1, "elapsed_s": 0.15}
RESIDUE = {"summary": {"removed": 2, "msg": "2 stale segments removed"}}


def test_a_clean_run() -> None:
    r = _result.result(steps(before=BEFORE, kill=KILL, residue=RESIDUE, verify=VERIFY), CTX)
    assert (r["clean"], r["phase"], r["reason"], r["failure"]) == (True, "done", "", "")
    assert r["summary"] == "gpu-node-1: 2/2 GPUs clean in 1.3 s, 3 processes ended (3 TERM, 1 KILL); 2 stale segments removed"
    assert (r["ended"], r["before"], r["after"], r["gpu_count"], r["clean_count"]) == (3, [8000, 0], [0, 0], 2, 2)
    assert r["residue"] == RESIDUE["summary"] and r["targets"] == KILL["targets"]


def test_the_first_failed_step_is_the_hosts_failure() -> None:
    failed_kill = {**KILL, "failed": True, "reason": "bad_arguments", "msg": "where: 'targets[?' is not a valid JMESPath expression"}
    r = _result.result(steps(before=BEFORE, kill=failed_kill), CTX)
    assert (r["clean"], r["phase"], r["reason"]) == (False, "kill", "bad_arguments")
    # The option is renamed to the role variable that feeds it.
    assert r["msg"].startswith("clean_slate_where: 'targets[?'") and r["failure"] == r["msg"]
    assert " - FAILED in kill (bad_arguments): clean_slate_where" in r["summary"]


def test_a_failed_command_item_says_which_with_the_roles_words() -> None:
    pre_stop = {"results": [{"item": "/bin/true", "rc": 0}, {"item": "/bin/false", "rc": 1, "failed": True, "stderr": ""}]}
    r = _result.result(steps(before=BEFORE, pre_stop_host=pre_stop), CTX)
    assert (r["phase"], r["reason"]) == ("pre_stop", "command_failed")
    assert r["msg"] == 'a pre-stop command failed on gpu-node-1 ("/bin/false"): exit status 1. Fix it.'


def test_an_unreachable_host() -> None:
    r = _result.result(steps(before={"unreachable": True, "msg": "ssh: connect to host: Connection refused\n"}), CTX)
    assert (r["phase"], r["reason"]) == ("preflight", "unreachable")
    assert r["msg"].startswith("gpu-node-1 is unreachable (ssh: connect to host: Connection refused). Nothing more was done")


def test_a_verification_that_failed_names_the_first_dirty_gpus_diagnosis() -> None:
    dirty = {"failed": True, "reason": "not_clean", "clean": False, "gpus": [gpu(0), gpu(1, 4096, "orphaned_context")], "clean_count": 1, "msg": "GPU 1"}
    r = _result.result(steps(before=BEFORE, kill=KILL, verify=dirty), CTX)
    assert (r["phase"], r["reason"]) == ("verify", "orphaned_context")
    too_few = {**dirty, "reason": "missing_gpus", "gpus": [gpu(0)]}
    assert _result.result(steps(before=BEFORE, kill=KILL, verify=too_few), CTX)["reason"] == "too_few_gpus"


def test_what_the_tags_left_out_cannot_prove_anything() -> None:
    # A kill without a verification: red, whatever the tags say.
    r = _result.result(steps(before=BEFORE, kill=KILL), CTX)
    assert (r["clean"], r["phase"], r["reason"]) == (False, "verify", "not_verified") and r["failure"]
    assert r["summary"].startswith("gpu-node-1: GPUs not verified in 1.2 s, 3 processes ended")
    # Only the reading: its verdict, and nothing read at all is not verified.
    r = _result.result(steps(before=BEFORE), CTX)
    assert (r["phase"], r["reason"]) == ("preflight", "busy") and "Only the GPUs were read" in r["msg"]
    assert _result.result(steps(before={**BEFORE, "clean": True}), CTX)["clean"] is True
    r = _result.result(steps(), CTX)
    assert (r["phase"], r["reason"], r["summary"]) == (
        "verify",
        "not_verified",
        "gpu-node-1: GPUs not read, no process ended - FAILED in verify (not_verified): " + r["msg"],
    )


def test_check_mode_and_fail_on_dirty_false_only_report() -> None:
    r = _result.result(steps(before=BEFORE, kill=KILL), {**CTX, "check_mode": True})
    assert r["clean"] is False and r["failure"] == "" and r["would_end"] == 3
    assert "3 processes would be ended (check mode)" in r["summary"] and r["summary"].endswith(" - NOT CLEAN (not_verified)")
    assert _result.result(steps(before=BEFORE, kill=KILL), {**CTX, "fail_on_dirty": False})["failure"] == ""


def test_the_filter_refuses_what_is_not_a_list_of_steps() -> None:
    with pytest.raises(AnsibleFilterError):
        clean_slate_result([["verify", "verify", {}]], CTX)
    with pytest.raises(AnsibleFilterError):
        clean_slate_result(steps(), "not a context")
    assert clean_slate_result(steps(verify=VERIFY), CTX)["clean"] is True


def test_the_health_verdict_reaches_the_result_and_the_summary() -> None:
    sick = {**VERIFY, "health": {"verdict": "reset_gpu", "evidence": ["reset_gpu: a row remapping is pending."], "readings": {}}}
    r = _result.result(steps(before=BEFORE, kill=KILL, verify=sick), CTX)
    assert r["health"] == {"verdict": "reset_gpu", "evidence": ["reset_gpu: a row remapping is pending."]}
    assert "; health: reset_gpu" in r["summary"] and r["clean"] is True
    fine = {**VERIFY, "health": {"verdict": "ok", "evidence": []}}
    r = _result.result(steps(before=BEFORE, kill=KILL, verify=fine), CTX)
    assert r["health"]["verdict"] == "ok" and "health:" not in r["summary"]
    assert _result.result(steps(before=BEFORE, kill=KILL, verify=VERIFY), CTX)["health"] is None
    # Reported only (check mode): the host whose memory is clean is not clean because of its health.
    reported = {**sick, "clean": False}
    r = _result.result(steps(before=BEFORE, kill=KILL, verify=reported), {**CTX, "check_mode": True, "health_fail_on": "reset_gpu"})
    assert (r["clean"], r["reason"]) == (False, "unhealthy")
    r = _result.result(steps(before=BEFORE, kill=KILL, verify=reported), {**CTX, "check_mode": True, "health_fail_on": "reboot"})
    assert r["reason"] == "too_few_gpus"
