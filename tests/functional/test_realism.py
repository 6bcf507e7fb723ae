"""The modules against the simulator's realism knobs, through real Ansible (issue 19).

Each test meets one way the world is less kind than the old simulator was, and asserts what the
product does about it: a worker that takes its time to die and may hang in the driver, a
supervisor that respawns its worker, a child forked during shutdown, GPU memory no listed process
explains, device minors that are not the NVML indices, graphics and MPS clients, MIG, leaked
memory without a recovery action, character device files, a pct that takes a second and speaks
PVE 8 or 9, and an unprivileged container whose root is uid 100000 on the host.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
import time
import typing as t
from pathlib import Path

import pytest
from gpusim import Node
from support.modules import ModuleRunner, assert_no_traceback, wait_for

FAST = {"grace_period": 2, "kill_timeout": 5}


def by_pid(result: dict) -> dict[int, dict]:
    return {t["pid"]: t for t in result["targets"]}


def live_contexts(node: Node) -> list[dict[str, t.Any]]:
    return [c for c in node.contexts() if c["state"] == "live"]


# ---------------------------------------------------------------------- teardown after a signal
def test_the_kill_waits_until_a_worker_has_torn_down_and_is_gone(mod, node, sandbox) -> None:
    """A torch process is not gone when SIGTERM lands: it sits in the driver (state D) until its
    context is freed. gpu_procs_kill must report it ended only once it really is gone."""
    if not node.teardown:
        pytest.fail("the simulated node needs its teardown mount (FUSE, root) on the test machine")
    node.set_teardown(hang_ms=3000)  # 3 s in the driver after its memory is back
    w = sandbox.spawn_worker(gpus=[0], mib=8000, title="sglang::scheduler_TP0")
    r = mod("gpu_procs_kill", {"patterns": ["sglang::"], "grace_period": 10, "kill_timeout": 10})
    t = by_pid(r)[w.ns_pid]
    assert t["signals_sent"] == ["TERM"] and t["outcome"] == "terminated"
    # Lower bounds only (safe on a loaded machine): it was waited for, not declared gone at once.
    assert t["seconds"] >= 3.0
    assert not w.alive()  # gone by the time the module returned
    v = mod("gpu_mem_verify", {"timeout": 10})
    assert v["clean"] is True


def test_a_teardown_is_never_sigkilled_and_one_that_outlasts_the_deadline_is_unkillable(mod, node, sandbox) -> None:
    node.set_teardown(hang_ms=30000)
    w = sandbox.spawn_worker(gpus=[1], mib=4000, title="sglang::scheduler_TP1")
    r = mod("gpu_procs_kill", {"patterns": ["sglang::"], "grace_period": 0.5, "kill_timeout": 1, "deadline": 3})
    assert r["_status"] == "failed"
    t = by_pid(r)[w.ns_pid]
    # TERM made it exit; in the driver it was waited for (SIGKILL cannot shorten a teardown, so none was sent)
    # until the deadline, then reported with where it waits, the time it was given and the verdict.
    assert t["signals_sent"] == ["TERM"] and t["outcome"] == "unkillable" and t["exiting"] is True
    assert t["state"] == "D" and t["wchan"] == "request_wait_answer" and t["teardown_s"] >= 2
    assert f"PID {w.ns_pid} (sglang::scheduler_TP1) was still in its teardown after" in r["msg"] and "state D" in r["msg"], r["msg"]
    assert r["verdict"] == "reboot" and "verdict reboot" in r["msg"]
    # It returned at the deadline, while the 30 s teardown went on (15 s: far above what a loaded machine adds).
    assert r["elapsed_s"] < 15 and w.alive()
    assert_no_traceback(r)
    # When the driver finishes, the same process ends and the GPU comes back.
    with node.teardown_paused():
        assert w.wait_gone(15)
    node.set_teardown(hang_ms=0)
    assert mod("gpu_mem_verify", {"timeout": 10})["clean"] is True


# ---------------------------------------------------------------------- holders born during the kill
def test_a_worker_respawned_by_its_supervisor_during_the_kill_is_ended_too(mod, node, sandbox) -> None:
    """torchrun-like: the agent ignores SIGTERM and restarts its worker 100 ms after it dies; by the
    time the agent gets SIGKILL after the grace period, a new worker holds the GPU."""
    sup = sandbox.spawn_worker(
        gpus=[2], mib=6000, supervise=5, respawn_delay_ms=100, ignore_term=True, title="torchrun --nproc-per-node 1", child_title="python3 train.py"
    )
    first = sup.worker_pid
    r = mod("gpu_procs_kill", {"patterns": ["torchrun", "train\\.py"], "grace_period": 1, "kill_timeout": 5})
    assert r["_status"] == "ok", r
    ended = by_pid(r)
    assert sup.ns_pid in ended and ended[sup.ns_pid]["outcome"] == "killed"
    assert len(ended) >= 3, ended  # the agent, its first worker and at least the respawned one
    time.sleep(0.5)  # longer than the respawn delay: nothing may come back
    assert live_contexts(node) == [], node.contexts()
    assert first is not None


def test_a_child_forked_during_shutdown_is_ended_too(mod, node, sandbox) -> None:
    """The worker answers SIGTERM by forking a helper (which inherits its device files, hence its
    context) and exiting: the GPU is still held by a process that did not exist at discovery."""
    w = sandbox.spawn_worker(gpus=[3], mib=9000, title="VLLM::Worker_TP0", fork_on_term=True, term_delay_ms=50, child_title="VLLM::Worker_TP0")
    r = mod("gpu_procs_kill", {"patterns": ["VLLM::"], **FAST})
    assert r["_status"] == "ok", r
    assert by_pid(r)[w.ns_pid]["outcome"] == "terminated"
    assert len(r["targets"]) == 2, r["targets"]  # the helper born during the kill is found and ended
    assert live_contexts(node) == [], node.contexts()


# ---------------------------------------------------------------------- memory no process explains
def test_driver_memory_within_the_slack_is_clean_beyond_it_is_not(mod, node) -> None:
    # 40 MiB held by no process (a driver allocation) is within the default 64 MiB slack...
    node.set_fault(orphan={5: 40})
    v = mod("gpu_mem_verify", {"gpus": [5], "timeout": 0.5})
    assert v["_status"] == "ok" and v["clean"] is True and v["gpus"][0]["used_mib"] == 40
    # ...200 MiB is not: reported, with a diagnosis, not passed as clean.
    node.set_fault(orphan={5: 200})
    v = mod("gpu_mem_verify", {"gpus": [5], "timeout": 0.5})
    assert v["_status"] == "failed" and v["clean"] is False
    assert v["gpus"][0]["used_mib"] == 200 and v["gpus"][0]["processes"] == []
    assert v["gpus"][0]["diagnosis"] in ("held_outside_namespace", "orphaned_context")


def test_context_overhead_beyond_the_slack_does_not_blame_another_jobs_process(mod, node, sandbox) -> None:
    """Eight workers on GPU 4 cost the device 8 x 9 MiB more than NVML charges them: 72 MiB that no
    listed process explains. Another job's forked child maps every GPU's device file (as CUDA
    does), but its memory is on GPU 1: the busy GPU 4 must be blamed on its own workers only."""
    ws = [sandbox.spawn_worker(gpus=[4], mib=1000, title=f"sglang::scheduler_TP{i}") for i in range(8)]
    other = sandbox.spawn_worker(gpus=[1], mib=1000, fork_child=True, child_title="pt_data_worker")
    assert wait_for(lambda: not other.alive()) and other.child_alive()
    v = mod("gpu_mem_verify", {"gpus": [4], "timeout": 0.3})
    g4 = v["gpus"][0]
    assert g4["diagnosis"] == "busy" and g4["used_mib"] == 8 * 1009
    named = {int(p) for p in re.findall(r"(\d+) \(", g4["detail"])}
    assert named == {w.ns_pid for w in ws}, g4["detail"]
    assert other.child_ns_pid not in named
    k = mod("gpu_procs_kill", {"gpus": [4], **FAST})
    assert set(by_pid(k)) == {w.ns_pid for w in ws}
    assert other.child_alive()
    assert mod("gpu_mem_verify", {"gpus": [4], "timeout": 10})["clean"] is True


# ---------------------------------------------------------------------- minor != index
def test_gpus_are_matched_to_device_files_by_minor_not_index(tmp_path) -> None:
    """NVML orders GPUs by PCI bus id; the kernel numbers /dev/nvidiaN in its probe order."""
    with Node(gpus=4, minors=[3, 2, 1, 0]) as node:
        sb = node.sandbox()
        mod = ModuleRunner(node, sb)
        on2 = sb.spawn_worker(gpus=[2], mib=1000, fork_child=True, child_title="dl_worker")  # holds /dev/nvidia1
        on1 = sb.spawn_worker(gpus=[1], mib=1000, title="sglang::scheduler_TP1")  # holds /dev/nvidia2
        assert wait_for(lambda: not on2.alive()) and on2.child_alive()
        # GPU index 2 is /dev/nvidia1: its holder is the forked child, found through that file only.
        r = mod("gpu_procs_kill", {"gpus": [2], **FAST})
        assert set(by_pid(r)) == {on2.child_ns_pid}
        assert by_pid(r)[on2.child_ns_pid]["gpus"] == [2]
        assert by_pid(r)[on2.child_ns_pid]["reasons"] == ["holds nvidia1 (fd+mmap)"]
        assert on1.alive()
        # A device path names the minor: /dev/nvidia2 is GPU index 1.
        r = mod("gpu_procs_kill", {"gpus": ["/dev/nvidia2"], **FAST})
        assert set(by_pid(r)) == {on1.ns_pid} and by_pid(r)[on1.ns_pid]["gpus"] == [1]
        v = mod("gpu_mem_verify", {"timeout": 10})
        assert v["clean"] is True
        assert [g["minor"] for g in v["gpus"]] == [3, 2, 1, 0]
        sb.stop()


# ---------------------------------------------------------------------- graphics and MPS processes
def test_graphics_and_mps_clients_are_found_through_their_own_lists(mod, node, sandbox) -> None:
    gfx = sandbox.spawn_worker(gpus=[1], mib=2000, kind="graphics", title="blender --background")
    mps = sandbox.spawn_worker(gpus=[2], mib=3000, kind="mps", title="python3 infer.py")
    keep = sandbox.spawn_worker(gpus=[3], mib=1000, title="python3 other.py")
    v = mod("gpu_mem_verify", {"gpus": [1, 2], "timeout": 0.3})
    procs = {g["index"]: g["processes"] for g in v["gpus"]}
    assert [(p["pid"], p["types"], p["used_mib"]) for p in procs[1]] == [(gfx.ns_pid, ["graphics"], 2000)]
    assert [(p["pid"], p["types"], p["used_mib"]) for p in procs[2]] == [(mps.ns_pid, ["mps"], 3000)]
    # A subset of GPUs: device files alone tie nothing (every CUDA process maps every GPU's file),
    # so only NVML's graphics and MPS lists can name these two.
    r = mod("gpu_procs_kill", {"gpus": [1, 2], **FAST})
    ended = by_pid(r)
    assert set(ended) == {gfx.ns_pid, mps.ns_pid}
    assert "listed by NVML on GPU 1 (2000 MiB)" in ended[gfx.ns_pid]["reasons"]
    assert "listed by NVML on GPU 2 (3000 MiB)" in ended[mps.ns_pid]["reasons"]
    assert keep.alive()
    assert mod("gpu_mem_verify", {"gpus": [1, 2], "timeout": 10})["clean"] is True


# ---------------------------------------------------------------------- MIG
def test_mig_gpu_processes_have_no_per_process_memory_and_are_still_ended(mod, node, sandbox) -> None:
    node.set_mig([6])
    w = sandbox.spawn_worker(gpus=[6], mib=10000, title="VLLM::Worker_TP0")
    v = mod("gpu_mem_verify", {"gpus": [6], "timeout": 0.3})
    g = v["gpus"][0]
    assert g["diagnosis"] == "busy" and g["used_mib"] == 10009
    assert [(p["pid"], p["used_mib"]) for p in g["processes"]] == [(w.ns_pid, None)]  # N/A under MIG, not a number
    r = mod("gpu_procs_kill", {"gpus": [6], **FAST})
    t = by_pid(r)[w.ns_pid]
    assert t["used_mib"] is None and "listed by NVML on GPU 6" in t["reasons"]
    assert mod("gpu_mem_verify", {"gpus": [6], "timeout": 10})["clean"] is True


# ---------------------------------------------------------------------- leaked memory, no recovery action
def test_leaked_memory_without_a_recovery_action_is_not_taken_for_a_clean_gpu(mod, node) -> None:
    """Real leaked memory usually carries recovery action NONE. In a PID namespace (a container,
    like this sandbox) it cannot be told from memory held by the host, and is reported so; on the
    host it is an orphaned context (tests/host checks that branch)."""
    node.set_fault(orphan={2: 8000})
    v = mod("gpu_mem_verify", {"gpus": [2], "timeout": 0.3})
    g = v["gpus"][0]
    assert v["clean"] is False and g["recovery_action"] == "none"
    assert g["diagnosis"] == "held_outside_namespace"
    assert "containers: [<vmid>]" in g["detail"]


def test_a_driver_before_r550_reports_no_recovery_action(tmp_path) -> None:
    with Node(gpus=2, driver_version="535.183.01") as node:
        sb = node.sandbox()
        mod = ModuleRunner(node, sb)
        node.set_fault(orphan={1: 3000}, recovery_action={1: 1})  # the flag exists, the old driver cannot say
        v = mod("gpu_mem_verify", {"timeout": 0.3})
        g1 = v["gpus"][1]
        assert g1["recovery_action"] is None and g1["used_mib"] == 3000 and not g1["clean"]
        assert v["gpus"][0]["clean"] is True and v["driver_version"] == "535.183.01"
        assert_no_traceback(v)
        sb.stop()


# ---------------------------------------------------------------------- character device files
def test_holders_of_character_device_files_are_found_by_fd_and_mapping(tmp_path) -> None:
    with Node(gpus=2, char_devices=True) as node:
        sb = node.sandbox()
        mod = ModuleRunner(node, sb)
        w = sb.spawn_worker(gpus=[1], mib=500, fork_child=True)
        assert wait_for(lambda: not w.alive())
        r = mod("gpu_procs_kill", FAST)
        assert by_pid(r)[w.child_ns_pid]["reasons"] == ["holds nvidia0-1 (fd+mmap)"]
        assert not w.child_alive()
        sb.stop()


# ---------------------------------------------------------------------- pct as Proxmox has it
def test_container_scope_with_a_pct_that_takes_a_second_and_speaks_pve_8_or_9(node, tmp_path) -> None:
    registry = tmp_path / "pct"
    registry.mkdir()
    (registry / "node").write_text("pve1")
    cts = [node.sandbox(vmid=vmid) for vmid in (129, 130)]
    try:
        for ct in cts:
            ct.register_pct(str(registry), node_name="pve1")
        workers = {ct.vmid: ct.spawn_worker(gpus=[i], mib=2000, title="sglang::scheduler_TP0") for i, ct in enumerate(cts)}
        run = ModuleRunner(node, None)
        for major in ("8", "9"):
            (registry / "pve").write_text(major)
            r = run("gpu_procs_kill", {"containers": [129, 130], "patterns": ["sglang"]}, env={"PCTSIM_DIR": str(registry)}, check=True)
            assert r["_status"] == "ok", r
            assert {t["container"] for t in r["targets"]} == {129, 130}
            # One `pct status --verbose` per container, each a second long: waited for, not cut short.
            assert r["elapsed_s"] >= 2.0
        calls = [json.loads(line) for line in (registry / "calls.jsonl").read_text().splitlines()]
        assert [c["argv"] for c in calls] == [["status", str(v), "--verbose"] for v in (129, 130)] * 2
        assert all(w.alive() for w in workers.values())  # check mode
    finally:
        for ct in cts:
            ct.stop()


# ---------------------------------------------------------------------- unprivileged containers
def test_an_unprivileged_containers_processes_from_the_host_and_from_inside(node, tmp_path) -> None:
    registry = tmp_path / "pct"
    registry.mkdir()
    (registry / "node").write_text("pve1")
    ct = node.sandbox(vmid=140, unprivileged=True)
    try:
        ct.register_pct(str(registry), node_name="pve1")
        a = ct.spawn_worker(gpus=[0], mib=1000, title="sglang::scheduler_TP0")
        b = ct.spawn_worker(gpus=[1], mib=1000, title="sglang::scheduler_TP1")
        # From the host (the hypervisor), the container's root is uid 100000.
        host = ModuleRunner(node, None)
        # In a container scope a user is the container's (its passwd, through its uid_map): its root, host uid 100000.
        r = host("gpu_procs_kill", {"containers": [140], "users": ["root"], "gpus": [0]}, env={"PCTSIM_DIR": str(registry)})
        assert r["_status"] == "ok", r
        t = by_pid(r)[a.pid]
        assert (t["user"], t["container"], t["outcome"]) == ("100000", 140, "terminated")
        assert b.alive()
        # From inside (Ansible run as the container's root, as through pct): root, its own pids.
        # Its root is host uid 100000: it gets a home of its own (pytest's tmp dirs are root's, 0700).
        home = Path(tempfile.mkdtemp(prefix="gpuops-ct140-"))
        os.chmod(home, 0o755)
        os.chown(home, 100000, 100000)
        env = {"HOME": str(home), "ANSIBLE_LOCAL_TEMP": str(home / "at"), "ANSIBLE_REMOTE_TEMP": str(home / "rt")}
        inside = ModuleRunner(node, ct)
        r = inside("gpu_procs_kill", {"users": ["root"], **FAST}, env=env)
        assert r["_status"] == "ok", r
        t = by_pid(r)[b.ns_pid]
        assert (t["user"], t["outcome"]) == ("root", "terminated")
        assert not b.alive()
        shutil.rmtree(home, ignore_errors=True)
    finally:
        ct.stop()
