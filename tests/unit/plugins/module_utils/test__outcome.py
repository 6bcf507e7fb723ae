"""_outcome: a host's outcome from clean_slate_node's run, as the module (metrics) and the role's filter compute it."""

from __future__ import annotations

import typing as t

from ansible_collections.gpuops.clean_slate.plugins.module_utils import _outcome

CTX = {
    "host": "gpu-node-1",
    "label": "gpu-node-1",
    "mode": "local",
    "delegate": "gpu-node-1",
    "check_mode": False,
    "fail_on_dirty": True,
    "option_vars": {"kill.where": "clean_slate_where", "kill.grace_period": "clean_slate_grace_period", "metrics": "clean_slate_metrics_dir"},
}


def gpu(index: int, used: int = 0, diagnosis: str = "clean") -> dict[str, t.Any]:
    return {"index": index, "used_mib": used, "clean": diagnosis == "clean", "diagnosis": diagnosis}


def result(run: dict[str, t.Any], records: dict[str, t.Any] | None = None, **ctx: t.Any) -> dict[str, t.Any]:
    c = {**CTX, **ctx}
    return _outcome.result(_outcome.steps(_outcome.phase_results(run, c["mode"]), records), c)


BEFORE = {"clean": False, "gpus": [gpu(0, 8000, "busy"), gpu(1)], "msg": "1/2 GPUs clean"}
KILL = {"summary": {"terminated": 2, "killed": 1, "signals": {"TERM": 3, "KILL": 1}}, "targets": [{"pid": 1}, {"pid": 2}, {"pid": 3}], "elapsed_s": 1.2}
VERIFY = {"clean": True, "gpus": [gpu(0), gpu(1)], "clean_count": 2, "time_to_clean_s": 0.1, "elapsed_s": 0.15}
RESIDUE = {"summary": {"removed": 2, "msg": "2 stale segments removed"}}
DONE = {"phase": "done", "before": BEFORE, "kill": KILL, "residue": RESIDUE, "verify": VERIFY}


def stopped(phase: str, reason: str, msg: str, **out: t.Any) -> dict[str, t.Any]:
    """A clean_slate_node run that stopped, as the role registers it (failed_when: false: failed is false)."""
    return {**out, "failed": False, "phase": phase, "reason": reason, "msg": msg}


def test_a_clean_run() -> None:
    r = result(DONE)
    assert (r["clean"], r["phase"], r["reason"], r["failure"]) == (True, "done", "", "")
    # The two ways a process ended add up to the count.
    # The seconds are the kill's and everything the verification waited for (its elapsed_s, not only its polling).
    assert r["summary"] == "gpu-node-1: 2/2 GPUs clean in 1.35 s, 3 processes ended (2 by TERM, 1 by KILL); 2 stale segments removed"
    assert r["lines"] == [r["summary"]] and r["cuda_s"] is None and r["reset_plan"] is None
    # With a CUDA start, its share is said and kept.
    r = result({**DONE, "verify": {**VERIFY, "elapsed_s": 0.75, "cuda_s": 0.6}})
    assert r["cuda_s"] == 0.6 and r["summary"].startswith("gpu-node-1: 2/2 GPUs clean in 1.95 s (CUDA start 0.60 s), 3 processes ended")
    assert (r["ended"], r["before"], r["after"], r["gpu_count"], r["clean_count"]) == (3, [8000, 0], [0, 0], 2, 2)
    assert r["residue"] == RESIDUE["summary"] and r["targets"] == KILL["targets"]


def test_the_phase_the_run_stopped_in_is_the_hosts_failure_with_the_variable_named() -> None:
    failed_kill = {**KILL, "failed": True, "reason": "bad_arguments", "option": "where", "msg": "where: 'targets[?' is not a valid JMESPath expression"}
    r = result(stopped("kill", "bad_arguments", failed_kill["msg"], before=BEFORE, kill=failed_kill))
    assert (r["clean"], r["phase"], r["reason"]) == (False, "kill", "bad_arguments")
    # The option is renamed to the role variable that feeds it.
    assert r["msg"].startswith("clean_slate_where: 'targets[?'") and r["failure"] == r["msg"]
    assert " - FAILED in kill (bad_arguments): clean_slate_where" in r["summary"]


def test_a_run_refused_before_any_phase_is_the_failure_of_the_refused_phase() -> None:
    refused = stopped("kill", "bad_arguments", "grace_period must be from 0 to 86400 seconds, got -3.", option="grace_period")
    r = result(refused)
    # Refused before anything ran, every option fed by a role variable: the role's arguments phase.
    assert (r["phase"], r["reason"], r["msg"]) == ("arguments", "bad_variable", "clean_slate_grace_period must be from 0 to 86400 seconds, got -3.")
    metrics = stopped("arguments", "bad_arguments", "metrics.dir: /m does not exist", option="metrics.dir")
    assert result(metrics)["msg"] == "clean_slate_metrics_dir: /m does not exist."
    # The role's own stop (a refused variable, dependencies) is recorded under its phase.
    for phase, reason in (("arguments", "bad_variable"), ("dependencies", "dependency_install_failed")):
        r = result(stopped(phase, reason, "why."))
        assert (r["clean"], r["phase"], r["reason"], r["msg"], r["failure"]) == (False, phase, reason, "why.", "why.")


def test_a_failed_command_item_says_which_with_the_roles_words() -> None:
    pre_stop = [{"item": "/bin/true", "rc": 0}, {"item": "/bin/false", "rc": 1, "failed": True, "stderr": ""}]
    r = result(stopped("pre_stop", "command_failed", "non-zero return code", before=BEFORE, pre_stop=pre_stop))
    assert (r["phase"], r["reason"]) == ("pre_stop", "command_failed")
    assert r["msg"] == (
        'a pre-stop command failed on gpu-node-1 ("/bin/false"): exit status 1. Fix it or remove it from clean_slate_pre_stop_commands; nothing was ended.'
    )


def test_an_unreachable_host_and_a_role_step_that_failed() -> None:
    r = result({"unreachable": True, "msg": "ssh: connect to host: Connection refused\n"})
    assert (r["phase"], r["reason"]) == ("preflight", "unreachable")
    assert r["msg"].startswith("gpu-node-1 is unreachable (ssh: connect to host: Connection refused). Nothing more was done")
    r = result({}, {"error": {"failed": True, "msg": "Clean the GPUs: 'nope' is undefined"}})
    assert (r["phase"], r["reason"]) == ("arguments", "bad_variable") and "'nope' is undefined" in r["msg"]
    r = result(DONE, {"report": {"failed": True, "msg": "Permission denied"}}, report_path="/r/h.json")
    assert (r["phase"], r["reason"]) == ("report", "report_not_written")
    assert r["msg"].startswith("could not write the JSON report /r/h.json on the controller: Permission denied. Set clean_slate_report_dir")


def test_a_verification_that_failed_names_the_first_dirty_gpus_diagnosis() -> None:
    dirty = {"failed": True, "reason": "not_clean", "clean": False, "gpus": [gpu(0), gpu(1, 4096, "orphaned_context")], "clean_count": 1, "msg": "GPU 1"}
    assert result(stopped("verify", "not_clean", "GPU 1", before=BEFORE, kill=KILL, verify=dirty))["reason"] == "orphaned_context"
    too_few = {**dirty, "reason": "missing_gpus", "gpus": [gpu(0)]}
    assert result(stopped("verify", "missing_gpus", "", before=BEFORE, kill=KILL, verify=too_few))["reason"] == "too_few_gpus"


def test_what_the_tags_left_out_cannot_prove_anything() -> None:
    # A kill without a verification: red, whatever the tags say.
    r = result({"phase": "done", "before": BEFORE, "kill": KILL})
    assert (r["clean"], r["phase"], r["reason"]) == (False, "verify", "not_verified") and r["failure"]
    assert r["summary"].startswith("gpu-node-1: GPUs not verified in 1.2 s, 3 processes ended")
    # Only the reading: its verdict; nothing read at all (a skipped run) is not verified.
    r = result({"phase": "done", "before": BEFORE})
    assert (r["phase"], r["reason"]) == ("preflight", "busy") and "Only the GPUs were read" in r["msg"]
    assert result({"phase": "done", "before": {**BEFORE, "clean": True}})["clean"] is True
    r = result({"skipped": True, "in_run": True, "phases": []})
    assert (r["phase"], r["reason"]) == ("verify", "not_verified")
    assert r["summary"] == "gpu-node-1: GPUs not read, no process ended - FAILED in verify (not_verified): " + r["msg"]


def test_check_mode_and_fail_on_dirty_false_only_report() -> None:
    r = result({"phase": "done", "before": BEFORE, "kill": KILL}, check_mode=True)
    assert r["clean"] is False and r["failure"] == "" and r["would_end"] == 3
    assert "3 processes would be ended (check mode)" in r["summary"] and r["summary"].endswith(" - NOT CLEAN (not_verified)")
    assert result({"phase": "done", "before": BEFORE, "kill": KILL}, fail_on_dirty=False)["failure"] == ""


def test_the_health_verdict_reaches_the_result_and_the_summary() -> None:
    sick = {**VERIFY, "health": {"verdict": "reset_gpu", "evidence": ["reset_gpu: a row remapping is pending."], "readings": {}}}
    r = result({**DONE, "verify": sick})
    assert r["health"] == {"verdict": "reset_gpu", "evidence": ["reset_gpu: a row remapping is pending."], "findings": []}
    assert "; health: reset_gpu" in r["summary"] and r["clean"] is True
    r = result({**DONE, "verify": {**VERIFY, "health": {"verdict": "ok", "evidence": []}}})
    assert r["health"]["verdict"] == "ok" and "health:" not in r["summary"]
    assert result(DONE)["health"] is None
    # Reported only (check mode): the host whose memory is clean is not clean because of its health.
    reported = {**DONE, "verify": {**sick, "clean": False}}
    assert result(reported, check_mode=True, health_fail_on="reset_gpu")["reason"] == "unhealthy"
    assert result(reported, check_mode=True, health_fail_on="reboot")["reason"] == "too_few_gpus"


def test_missing_dependencies_and_what_is_published() -> None:
    run = stopped("preflight", "missing_library", "Failed to import pynvml", python={"missing": ["psutil"]})
    assert _outcome.deps_missing(run) and not _outcome.deps_missing(DONE)
    assert _outcome.published({"clean": True, "gpus": [1], "targets": [2], "summary": "s"}) == {"clean": True, "summary": "s"}


def test_clean_one_by_one_and_not_together_is_its_own_reason() -> None:
    """Issue 39: every GPU clean, a pair broken; failed (the module's reason kept) or only reported (fail_on_dirty false)."""
    apart = {**VERIFY, "clean": False, "together": {"ready": False, "findings": [{"name": "p2p_broken", "verdict": "fix_config", "gpus": [2, 5]}]}}
    failed = {**apart, "failed": True, "reason": "not_ready_together", "msg": "The GPUs are clean one by one, but not ready together"}
    assert result(stopped("verify", "not_ready_together", failed["msg"], before=BEFORE, kill=KILL, verify=failed))["reason"] == "not_ready_together"
    r = result({**DONE, "verify": apart}, fail_on_dirty=False)
    assert (r["reason"], r["failure"], r["clean"]) == ("not_ready_together", "", False)
