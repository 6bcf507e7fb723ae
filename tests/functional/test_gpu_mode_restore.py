"""gpu_mode_restore through Ansible on the simulated node: the compute mode and an MPS daemon (a stand-in process named
nvidia-cuda-mps-control) left by the last job are put back, with check mode, diff, idempotence and the busy guard."""

from __future__ import annotations

from support.modules import assert_no_traceback, wait_for


def test_check_mode_reports_and_changes_nothing_then_a_run_restores_and_a_second_changes_nothing(mod, node, sandbox) -> None:
    node.set_compute_mode(2, "exclusive_process")
    node.set_compute_mode(5, "prohibited")
    mps = node.spawn_daemon("nvidia-cuda-mps-control", sandbox=sandbox)
    args = {"compute_mode": "default", "mps": "stopped", "mps_timeout": 5}

    r = mod("gpu_mode_restore", args, check=True, diff=True)
    assert r["_status"] == "ok" and r["changed"] is True, r
    assert node.compute_mode(2) == 3 and node.compute_mode(5) == 2 and mps.alive()
    assert [g["index"] for g in r["gpus"] if g["changed"]] == [2, 5]
    assert r["gpus"][2]["compute_mode_before"] == "exclusive_process" and r["gpus"][2]["compute_mode_after"] == "default"
    assert r["mps"]["before"] == [mps.ns_pid] and r["mps"]["ended"] == []
    assert r["diff"]["before"]["compute_mode"]["2"] == "exclusive_process" and r["diff"]["after"]["compute_mode"]["2"] == "default"
    assert r["msg"].startswith("would restore compute mode default on GPU 2, 5 and MPS stopped")

    r = mod("gpu_mode_restore", args, diff=True)
    assert r["_status"] == "ok" and r["changed"] is True, r
    assert [node.compute_mode(i) for i in range(8)] == [0] * 8
    assert wait_for(lambda: not mps.alive())
    assert r["mps"] == {"before": [mps.ns_pid], "after": [], "ended": [mps.ns_pid]}
    assert r["diff"]["after"] == {"compute_mode": {str(i): "default" for i in range(8)}, "mps_daemon": []}

    r = mod("gpu_mode_restore", args)
    assert r["_status"] == "ok" and r["changed"] is False and r["msg"].startswith("nothing to restore")
    # What gpu_mem_verify then sees: no leftover, health ok.
    r = mod("gpu_mem_verify", {"timeout": 0, "kernel_log": str(node.kernel_log)})
    assert r["health"]["verdict"] == "ok" and r["health"]["host"]["mps_daemon"] == []


def test_a_gpu_still_in_use_is_not_changed(mod, node, sandbox) -> None:
    node.set_compute_mode(1, "exclusive_process")
    node.set_compute_mode(3, "exclusive_process")
    w = sandbox.spawn_worker(gpus=[1], mib=1000)
    r = mod("gpu_mode_restore", {"compute_mode": "default"})
    assert (r["_status"], r["reason"]) == ("failed", "busy"), r
    assert f"GPU 1: PID(s) {w.ns_pid}" in r["msg"] and "nothing was changed" in r["msg"]
    # Guarded: judged before anything changed, so GPU 3 (idle) is not half-done either.
    assert node.compute_mode(1) == 3 and node.compute_mode(3) == 3 and w.alive()
    # Only GPU 3 selected: it is restored while GPU 1 keeps its job and its mode.
    r = mod("gpu_mode_restore", {"compute_mode": "default", "gpus": [3]})
    assert r["_status"] == "ok" and r["changed"] is True and node.compute_mode(3) == 0 and node.compute_mode(1) == 3
    assert_no_traceback(r)


def test_nothing_declared_is_refused(mod) -> None:
    r = mod("gpu_mode_restore", {})
    assert (r["_status"], r["reason"], r["option"]) == ("failed", "bad_arguments", "compute_mode"), r
