"""gpu_procs_kill stops SGLang and vLLM in their own order (issue 38), on server-shaped process trees (gpusim.servers)
that stop themselves as their source does, with the role's own server profiles (roles/clean_slate/profiles/): a live
root gets the first signal alone and its server tears itself down; a dead root (vLLM's API server SIGKILLed, its
engine core and workers left on the GPUs: vllm#55510) leaves the rest to be ended at once, the resource tracker last,
on its own. A GPU teardown that still makes progress is waited for past the deadline, and gpu_mem_verify waits for a
GPU whose memory is still going down; one that makes none is red at the deadline, as before (test_realism.py, with the
new defaults: teardown_timeout 120 s does not extend it)."""

from __future__ import annotations

import os
import signal
import time
import typing as t

import pytest
from gpusim.servers import Server, ServerStartError, start_sglang, start_vllm
from support.ansible import ROOT

from ansible_collections.gpuops.clean_slate.plugins.plugin_utils import _profiles

PROFILES = _profiles.resolve(["sglang", "vllm"], str(ROOT / "roles" / "clean_slate"))
#: SGLang's watchdog notices SIGTERM on its next poll, every 5 s; the test's server polls every 0.5 s.
FAST = {"sigterm_poll_s": 0.5}


def by_pid(result: dict[str, t.Any]) -> dict[int, dict[str, t.Any]]:
    return {x["pid"]: x for x in result["targets"]}


def left(srv: Server) -> set[str]:
    return {p for p in srv.shm + srv.sockets if os.path.lexists(srv.path(p))}


def kill_args(**kw: t.Any) -> dict[str, t.Any]:
    return {"patterns": PROFILES["patterns"], "servers": PROFILES["servers"], "grace_period": 5, **kw}


def test_live_sglang_and_vllm_servers_stop_themselves_root_first_in_one_run(mod, node, shm_sandbox, stand_in_tmp) -> None:
    sandbox, work = shm_sandbox, str(stand_in_tmp)
    sgl = start_sglang(node, sandbox=sandbox, tmp=work, tp=4, port=0, nccl_port=0, mib=20000, timing=FAST)
    vllm = start_vllm(node, sandbox=sandbox, tmp=work, tp=4, port=0, mib=20000)
    r = mod("gpu_procs_kill", kill_args())
    assert r["_status"] == "ok", r
    ended = by_pid(r)
    assert set(ended) == {m.ns_pid for m in sgl.members + vllm.members} and r["summary"]["rounds"] == 1
    for srv, name, grace in ((sgl, "sglang", 25.0), (vllm, "vllm", 15.0)):
        root = ended[srv.launcher.ns_pid]
        # The root alone got a signal, and exited within its grace, its own teardown run.
        assert (root["step"], root["server"], root["grace"]) == ("root", name, grace), root
        assert (root["outcome"], root["ended_by"], root["signals_sent"]) == ("terminated", "own_stop", ["TERM"]), root
        for m in srv.members[1:]:
            x = ended[m.ns_pid]
            assert (x["outcome"], x["ended_by"], x["signals_sent"]) == ("stopped", "server_stop", []), x
    assert r["summary"]["stopped"] == len(sgl.members) + len(vllm.members) - 2 and r["summary"]["signals"] == {"TERM": 2}
    # SGLang's schedulers got ShutdownReq and removed their queues, CUDA IPC segments and sockets themselves; what its
    # own stop leaves is what its source leaves: the load snapshot (never unlinked), the detokenizer's socket (SIGKILLed
    # by kill_process_tree) and the semaphores of the resource tracker it SIGKILLs (sglang PR #28089).
    sgl_left = left(sgl)
    sems = {p for p in sgl_left if os.path.basename(p).startswith("sem.mp-")}
    loads = {p for p in sgl_left if os.path.basename(p).startswith("sglang_loads_")}
    sockets = sgl_left & set(sgl.sockets)
    assert (len(sems), len(loads), len(sockets)) == (3, 1, 1) and sgl_left == sems | loads | sockets, sgl_left
    # vLLM's engine core stopped its workers, every queue was removed by its creator, and the resource tracker, its last
    # client gone, unlinked what was still registered: nothing is left.
    assert left(vllm) == set()
    node.wait_clean(timeout=10)


def test_a_vllm_whose_api_server_was_killed_is_ended_without_a_root_and_its_tracker_unlinks_on_its_own(mod, node, shm_sandbox, stand_in_tmp) -> None:
    sandbox, work = shm_sandbox, str(stand_in_tmp)
    vllm = start_vllm(node, sandbox=sandbox, tmp=work, tp=4, port=0, mib=100000)
    survivors = vllm.crash("api_server")  # vllm#55510: the engine core has no parent-death detection
    [tracker] = vllm.role("resource_tracker")
    assert survivors == [*vllm.role("engine_core"), *vllm.ranks, tracker]
    # The port is free, so a supervisor starts the next server at once, into CUDA out of memory.
    with pytest.raises(ServerStartError, match="CUDA out of memory"):
        start_vllm(node, sandbox=sandbox, tmp=work, tp=4, port=vllm.ports["http"], mib=100000)
    began = time.monotonic()
    r = mod("gpu_procs_kill", kill_args())
    assert r["_status"] == "ok", r
    ended = by_pid(r)
    assert set(ended) == {m.ns_pid for m in survivors}
    # No live root: nothing waits out a grace, the rest is ended at once, the tracker last and on its own.
    assert all(x["step"] == "tree" and x["ended_by"] in ("TERM", "waited") for p, x in ended.items() if p != tracker.ns_pid), ended
    assert (ended[tracker.ns_pid]["step"], ended[tracker.ns_pid]["ended_by"], ended[tracker.ns_pid]["signals_sent"]) == ("tracker", "own_exit", [])
    assert time.monotonic() - began < 15
    # Its semaphores are gone (the tracker unlinked them); what is left (the dead API server's sockets, the queues of
    # workers TERMed before their engine core's stop reached them) is the residue phase's.
    remaining = left(vllm)
    assert set(vllm.sockets) <= remaining and not [p for p in remaining if os.path.basename(p).startswith("sem.mp-")], remaining
    again = start_vllm(node, sandbox=sandbox, tmp=work, tp=4, port=vllm.ports["http"], mib=100000)
    assert again.ports["http"] == vllm.ports["http"]
    again.stop()


def test_a_teardown_that_makes_progress_is_waited_for_past_the_deadline_and_the_gpu_is_verified_after_it(mod, node, sandbox) -> None:
    # A GB300-like teardown: the killed worker's memory goes down step by step for 5 s before it is gone.
    node.set_release_timing(delay_ms=5000, gap_ms=0)
    node.set_teardown(gradual=True)
    w = sandbox.spawn_worker(gpus=[0], mib=60000, title="python3 train.py")
    began = time.monotonic()
    r = mod("gpu_procs_kill", {"gpus": [0], "grace_period": 0.5, "kill_timeout": 1, "deadline": 2, "teardown_stall": 1.5})
    took = time.monotonic() - began
    assert r["_status"] == "ok", r
    [x] = r["targets"]
    assert x["pid"] == w.ns_pid and x["outcome"] == "terminated" and x["teardown_s"] > 2.5, x
    assert took > 4.5, took
    # gpu_mem_verify: a GPU whose memory is still going down at its timeout is waited for while it does.
    w2 = sandbox.spawn_worker(gpus=[1], mib=60000, title="python3 train.py")
    w2.kill(signal.SIGKILL)
    v = mod("gpu_mem_verify", {"gpus": [1], "timeout": 1, "progress_timeout": 30, "progress_window": 1.5, "cuda_probe": False, "health": False})
    assert v["_status"] == "ok" and v["clean"] is True and v["time_to_clean_s"] > 2, v
