"""The clean_slate role after the seeds' servers crashed, on server-shaped process trees (gpusim.servers), through real
ansible-playbook: a crashed SGLang tp=8 server (its launcher SIGKILLed) and a crashed vLLM tp=8 server (its engine core
OOM-killed), side by side on one node, each leave their residue; one run ends both whole trees, waits for their
teardown and reports it; the role removes exactly the orphaned part and keeps a segment younger than the minimum age,
a segment whose named creator lives and everything held; both next starts succeed. Bad input is refused before
anything is ended or removed. Two ansible-playbook runs in all (CI's time is short); a process that SIGKILL cannot
end is red on time in test_realism.py (the kill's own test)."""

from __future__ import annotations

import json
import os
import time
import typing as t
from pathlib import Path

import pytest
from gpusim.residue import spawn
from gpusim.servers import Server, ServerStartError, start_sglang, start_vllm
from support.ansible import ROOT, local_inventory, run_playbook
from support.modules import sockets_under

PLAYBOOK = ROOT / "playbooks" / "clean_slate.yml"
MIN_AGE = 3
MIB = 60000  # each server's share of every GPU: both fit on an H200 (143 771 MiB), a third start does not


def inventory(path: Path, node: t.Any, work: str, **extra: t.Any) -> Path:
    host = {
        "clean_slate_device_dir": str(node.dev_dir),
        "clean_slate_residue_sockets": sockets_under(work),
        "clean_slate_expected_gpus": 8,
        "clean_slate_grace_period": 1,
        "clean_slate_kill_timeout": 1,
        "clean_slate_residue_min_age": MIN_AGE,
        "clean_slate_residue_list_limit": 200,  # every path in the result (20 by default)
        "clean_slate_report_dir": str(path / "reports"),
        **extra,
    }
    return local_inventory(path / "inventory.yml", {"gpu-node-1": host})


def left(*servers: Server) -> set[str]:
    """What the servers made that is still there."""
    return {p for s in servers for p in s.shm + s.sockets if os.path.lexists(s.path(p))}


def age(*servers: Server) -> float:
    """Seconds since the newest change of anything the servers made and left."""
    paths = [s.path(p) for s in servers for p in s.shm + s.sockets if os.path.lexists(s.path(p))]
    return time.time() - max(max(st.st_mtime, st.st_ctime) for st in map(os.stat, paths))


def test_crashed_sglang_and_vllm_tp8_servers_are_cleaned_in_one_run_and_start_again(node, shm_sandbox, stand_in_tmp, tmp_path: Path) -> None:
    sandbox = shm_sandbox
    work = str(stand_in_tmp)
    sgl = start_sglang(node, sandbox=sandbox, tmp=work, tp=8, port=0, nccl_port=0, mib=MIB, tokenizer_workers=2)
    vllm = start_vllm(node, sandbox=sandbox, tmp=work, tp=8, port=0, mib=MIB)
    # The seeds' crashes: SGLang's launcher SIGKILLed (its schedulers, each in a session of its own, are reparented
    # and keep their GPUs), vLLM's engine core OOM-killed (the API server exits, the workers are orphans).
    sgl_left = sgl.crash()
    vllm_left = vllm.crash()
    assert sgl_left[: len(sgl.ranks)] == sgl.ranks and set(map(id, vllm.ranks)) <= set(map(id, vllm_left))
    [vllm_tracker] = vllm.role("resource_tracker")
    mq = next(p for p in sgl.shm if os.path.basename(p).startswith("sgl_shm_mq_"))
    daemon = spawn(sandbox, "hold", "--comm", "nv-hostengine", "--map", mq)  # a protected daemon maps a dead queue
    beside = spawn(sandbox, "creator", "--comm", "pt_main_thread")  # a live torch process whose segment nothing holds
    made = left(sgl, vllm)
    # What blocks the next start: the store port the survivors hold (and their GPU memory behind it).
    with pytest.raises(ServerStartError, match="is used by a process already"):
        start_sglang(node, sandbox=sandbox, tmp=work, tp=8, port=sgl.ports["http"], nccl_port=sgl.ports["store"], mib=MIB)

    # Bad input is refused before anything is ended or removed, naming the variable (Ansible's float check lets -1
    # through; the module refuses it with bad_arguments, which the role records as its bad_variable). The other bad
    # values (NaN, infinity, a pattern outside the roots, a root that is a system directory) are refused by the same
    # check: tests/unit/plugins/module_utils/_residue/test_keep.py.
    run = run_playbook(PLAYBOOK, inventory=inventory(tmp_path, node, work, clean_slate_residue_min_age=-1), env=node.env(), wrapper=sandbox.nsenter_prefix())
    assert run.rc != 0
    report = json.loads((tmp_path / "reports" / "gpu-node-1.json").read_text())
    assert report["reason"] == "bad_variable" and "clean_slate_residue_min_age must be from 0 to 86400 seconds" in report["msg"], report
    assert all(m.alive() for m in sgl_left + vllm_left) and left(sgl, vllm) == made

    # A slow teardown: each rank stays in the driver 2.5 s after its signal, longer than the grace period.
    node.set_release_timing(delay_ms=2500, per_gib_ms=0)
    time.sleep(max(0.0, MIN_AGE + 0.5 - age(sgl, vllm)))
    # A server starting beside the run hands a segment over by name the moment the kill ends the first scheduler.
    starter = spawn(sandbox, "handoff", "--after-pid", str(sgl.ranks[0].ns_pid))
    run = run_playbook(PLAYBOOK, inventory=inventory(tmp_path, node, work), env=node.env(), wrapper=sandbox.nsenter_prefix())
    assert run.rc == 0, run.output
    kill = run.phase("kill")
    ended = {x["pid"]: x for x in kill["targets"]}
    # One run, one round: both whole trees (SGLang's schedulers; vLLM's orphaned workers and its resource tracker,
    # found through the dead API server's group), and nothing else.
    assert set(ended) == {m.ns_pid for m in sgl.ranks + vllm_left} and kill["summary"]["rounds"] == 1, sorted(ended)
    assert "whose leader has exited" in ended[vllm_tracker.ns_pid]["reasons"][0]
    # The role's server profiles stop in order (issue 38): no root was alive (both crashed), so the rest went at once and
    # vLLM's resource tracker last, never signalled: it unlinked what its clients registered and exited on its own.
    assert (ended[vllm_tracker.ns_pid]["step"], ended[vllm_tracker.ns_pid]["ended_by"], ended[vllm_tracker.ns_pid]["signals_sent"]) == (
        "tracker",
        "own_exit",
        [],
    )
    assert not [x for x in kill["targets"] if x["step"] == "root"]
    for r in sgl.ranks + vllm.ranks:
        # Waited for through its teardown, never SIGKILLed (it would change nothing), reported with the time waited.
        x = ended[r.ns_pid]
        assert x["signals_sent"] == ["TERM"] and x["outcome"] == "terminated" and x["teardown_s"] > 0, x
    assert kill["summary"]["teardown"] == 16 and kill["summary"]["teardown_s"] > 0
    assert sgl.alive() == [] and vllm.alive() == [] and daemon.alive() and beside.alive()

    residue = run.phase("residue")
    # Exactly the orphaned part goes: everything the trees made but the queue the daemon maps. The semaphores go with
    # a resource tracker that outlives its tree (it unlinks them), or with the residue phase when it did not.
    sems = {p for p in made if os.path.basename(p).startswith("sem.mp-")}
    removed = {x["path"] for x in residue["removed"]}
    assert made - sems - {mq} <= removed <= made - {mq}, (residue["kept"], residue["held"], residue["ignored"])
    assert left(sgl, vllm) == {mq}
    assert [(x["path"], x["holders"][0]["name"]) for x in residue["held"]] == [(mq, "nv-hostengine")]
    kept = {x["path"]: x for x in residue["kept"]}
    assert set(kept) == {beside.info["path"], starter.info["path"]}, residue["kept"]
    assert kept[starter.info["path"]]["why"].startswith("younger than min_age")
    assert kept[beside.info["path"]]["creator"] == {"pid": beside.ns_pid, "name": "pt_main_thread"}
    assert all(os.path.exists(sgl.path(p)) for p in (beside.info["path"], starter.info["path"]))
    assert run.phase("verify")["clean"] is True
    # The ports of both profiles were checked by default (SGLang's 30000 and its data-parallel plan, vLLM's four).
    server_ports = {(p["server"], p["port"]) for p in residue["ports"] if "server" in p}
    assert {("sglang", 30000), ("sglang", 30239), ("vllm", 8000), ("vllm", 29550)} <= server_ports and len(server_ports) == 12
    assert "12 server ports free for the next start" in run.summary()

    # Both next starts bind the ports the crashed servers held and create their queues.
    again = start_sglang(node, sandbox=sandbox, tmp=work, tp=8, port=sgl.ports["http"], nccl_port=sgl.ports["store"], mib=MIB)
    assert again.ports["http"] == sgl.ports["http"] and again.ports["store"] == sgl.ports["store"]
    assert all(os.path.exists(again.path(p)) for p in again.shm)
    again_vllm = start_vllm(node, sandbox=sandbox, tmp=work, tp=8, port=vllm.ports["http"], mib=MIB)
    assert again_vllm.ports["http"] == vllm.ports["http"]
    again.stop()
    again_vllm.stop()
