"""gpu_procs_kill against server-shaped process trees (gpusim.servers): SGLang and vLLM tp=8, live and crashed as the
seeds' servers crashed. One run ends each whole tree, found through the GPUs, the names and the sessions and process
groups that survive reparenting; with a GPU subset, a tree that runs on other GPUs keeps its shared members."""

from __future__ import annotations

import os
import typing as t

from gpusim.servers import start_sglang, start_vllm
from support.modules import assert_no_traceback


def by_pid(result: dict[str, t.Any]) -> dict[int, dict[str, t.Any]]:
    return {x["pid"]: x for x in result["targets"]}


def test_one_run_ends_a_live_sglang_tree_its_resource_tracker_included(mod, node, shm_sandbox, stand_in_tmp) -> None:
    sandbox = shm_sandbox
    work = str(stand_in_tmp)
    srv = start_sglang(node, sandbox=sandbox, tmp=work, tp=8, port=0, nccl_port=0, mib=20000)
    [tracker] = srv.role("resource_tracker")
    # Names find the launcher, the detokenizer and the schedulers (the GPUs find those too); the resource tracker
    # holds no GPU and matches no name, but it is in the session the launcher leads.
    r = mod("gpu_procs_kill", {"patterns": ["sglang"], "grace_period": 5})
    assert r["_status"] == "ok", r
    ended = by_pid(r)
    assert set(ended) == {m.ns_pid for m in srv.members}, [x["cmdline"] for x in r["targets"]]
    assert all(x["round"] == 1 for x in r["targets"]) and r["summary"]["rounds"] == 1
    assert ended[tracker.ns_pid]["reasons"] == [f"in the session of PID {srv.launcher.ns_pid} ({srv.launcher.title}), which a target leads"]
    assert srv.alive() == [] and node.contexts() == []
    assert_no_traceback(r)


def test_one_run_ends_a_crashed_vllm_tree_its_orphans_found_through_the_dead_servers_group(mod, node, shm_sandbox, stand_in_tmp) -> None:
    sandbox = shm_sandbox
    work = str(stand_in_tmp)
    srv = start_vllm(node, sandbox=sandbox, tmp=work, tp=8, port=0, mib=20000)
    api = srv.launcher
    survivors = srv.crash()  # the engine core OOM-killed: the API server exits, the workers are orphans
    [tracker] = srv.role("resource_tracker")
    assert survivors == [*srv.ranks, tracker]
    r = mod("gpu_procs_kill", {"patterns": ["^VLLM::"], "grace_period": 5})
    assert r["_status"] == "ok", r
    ended = by_pid(r)
    assert set(ended) == {m.ns_pid for m in survivors} and r["summary"]["rounds"] == 1
    assert ended[tracker.ns_pid]["reasons"] == [f"in process group {api.ns_pid} of PID {srv.ranks[0].ns_pid} (VLLM::Worker_TP0), whose leader has exited"]
    assert srv.alive() == [] and node.contexts() == []


def test_with_a_gpu_subset_a_crashed_tree_on_other_gpus_keeps_its_shared_members(mod, node, shm_sandbox, stand_in_tmp) -> None:
    sandbox = shm_sandbox
    work = str(stand_in_tmp)
    srv = start_vllm(node, sandbox=sandbox, tmp=work, tp=8, port=0, mib=20000)
    srv.crash()
    [tracker] = srv.role("resource_tracker")
    r = mod("gpu_procs_kill", {"gpus": [3], "patterns": ["^VLLM::"], "grace_period": 5})
    assert r["_status"] == "ok", r
    assert [x["cmdline"] for x in r["targets"]] == ["VLLM::Worker_TP3"]
    left = {x["pid"]: x["why"] for x in r["ignored"]}
    assert "which is not selected" in left[tracker.ns_pid] and "it holds GPU 0" in left[srv.ranks[0].ns_pid], left
    assert [m.title for m in srv.alive()] == [f"VLLM::Worker_TP{k}" for k in (0, 1, 2, 4, 5, 6, 7)] + [tracker.title]
    assert {c["gpu"] for c in node.contexts()} == {0, 1, 2, 4, 5, 6, 7}
    srv.stop()
    assert os.path.exists(srv.path(srv.sockets[0]))  # nothing but the kill touched the files
