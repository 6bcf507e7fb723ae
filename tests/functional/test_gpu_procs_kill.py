"""gpu_procs_kill through Ansible, with real processes and signals on the simulated node."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from gpusim import CONTEXT_OVERHEAD_MIB
from support.modules import ModuleRunner, assert_no_traceback, wait_for

FREEZER = Path("/sys/fs/cgroup/freezer")
FAST = {"grace_period": 2, "kill_timeout": 2}


def by_pid(result: dict) -> dict[int, dict]:
    return {t["pid"]: t for t in result["targets"]}


def test_renamed_sglang_and_vllm_workers_are_found_and_ended(mod, node, sandbox) -> None:
    sg = [sandbox.spawn_worker(gpus=[i], mib=20000, title=f"sglang::scheduler_TP{i}") for i in range(4)]
    vl = [sandbox.spawn_worker(gpus=[4 + i], mib=20000, title=f"VLLM::Worker_TP{i}") for i in range(2)]
    r = mod("gpu_procs_kill", {"patterns": ["(?i)sglang|vllm"], **FAST})
    assert r["_status"] == "ok", r
    assert r["changed"] is True
    targets = by_pid(r)
    for w, title in [(w, f"sglang::scheduler_TP{i}") for i, w in enumerate(sg)] + [(w, f"VLLM::Worker_TP{i}") for i, w in enumerate(vl)]:
        t = targets[w.ns_pid]
        assert t["cmdline"] == title
        assert t["outcome"] == "terminated" and t["signals_sent"] == ["TERM"]
        assert any(x.startswith("listed by NVML on GPU") for x in t["reasons"])
        assert any(x.startswith("holds nvidia") and "fd+mmap" in x for x in t["reasons"])
        assert "matches pattern '(?i)sglang|vllm'" in t["reasons"]
        assert t["used_mib"] == 20000 and len(t["gpus"]) == 1
        assert not w.alive()
    assert r["summary"]["terminated"] == 6 and r["summary"]["signals"] == {"TERM": 6}
    node.wait_clean(timeout=5)
    v = mod("gpu_mem_verify", {"timeout": 5})
    assert v["clean"] is True


def test_renamed_workers_are_found_by_pattern_alone(mod, sandbox) -> None:
    # Without NVML and device files, only the pattern finds them: proof that it matches the rewritten cmdline.
    w = sandbox.spawn_worker(gpus=[0], mib=1000, title="sglang::scheduler_TP0")
    r = mod("gpu_procs_kill", {"patterns": ["sglang::"], "discovery": [], **FAST})
    assert by_pid(r)[w.ns_pid]["reasons"] == ["matches pattern 'sglang::'"]
    assert not w.alive()


def test_forked_child_found_through_the_device_file(mod, node, sandbox) -> None:
    w = sandbox.spawn_worker(gpus=[6], mib=12000, fork_child=True)
    assert wait_for(lambda: not w.alive()) and w.child_alive()
    r = mod("gpu_procs_kill", FAST)
    t = by_pid(r)[w.child_ns_pid]
    # Like the CUDA driver, the child maps every GPU's device file.
    assert t["reasons"] == ["holds nvidia0-7 (fd+mmap)"]
    assert t["outcome"] == "terminated"
    # NVML still lists the dead parent; it is reported and left alone.
    assert any(i["pid"] == w.ns_pid and "does not exist here" in i["why"] for i in r["ignored"])
    assert not w.child_alive()
    node.wait_clean(timeout=5)


def test_a_forked_child_counts_only_for_the_gpu_whose_memory_it_holds(mod, node, sandbox) -> None:
    # The child maps every GPU's device file (as CUDA does) and NVML does not list it: it is tied to
    # GPU 0 only through NVML's stale entry for its dead parent there.
    w = sandbox.spawn_worker(gpus=[0], mib=6000, fork_child=True)
    other = sandbox.spawn_worker(gpus=[1], mib=6000, title="sglang::scheduler_TP1")
    assert wait_for(lambda: not w.alive()) and w.child_alive()
    r = mod("gpu_procs_kill", {"gpus": [1], **FAST})
    assert set(by_pid(r)) == {other.ns_pid}
    assert w.child_alive()
    r = mod("gpu_procs_kill", {"gpus": [0], **FAST})
    assert by_pid(r)[w.child_ns_pid]["reasons"] == ["holds nvidia0 (fd+mmap)"]
    assert not w.child_alive()
    node.wait_clean(timeout=5)


def test_another_jobs_forked_child_is_not_tied_to_the_selected_gpu(mod, node, sandbox) -> None:
    # Two jobs each left a forked child (both map every GPU's file, NVML lists neither): cleaning GPU 0
    # ends only the child whose dead parent NVML lists there (it led the child's session), not the
    # other job's, on GPU 1 - on a Proxmox node, another container's.
    ours = sandbox.spawn_worker(gpus=[0], mib=6000, fork_child=True)
    theirs = sandbox.spawn_worker(gpus=[1], mib=6000, fork_child=True)
    assert wait_for(lambda: not ours.alive() and not theirs.alive())
    r = mod("gpu_procs_kill", {"gpus": [0], **FAST})
    assert set(by_pid(r)) == {ours.child_ns_pid}
    assert not ours.child_alive() and theirs.child_alive()
    assert node.memory(1)["used_mib"] == 6000 + CONTEXT_OVERHEAD_MIB


def test_a_foreign_pid_from_an_old_driver_never_reaches_the_process_that_has_that_number_here(mod, node, sandbox) -> None:
    """Drivers before 535.113 report host pids inside containers: the number may name an innocent here."""
    outside = node.spawn_worker(gpus=[1], mib=8000)
    node.set_fault(legacy_pids=True)
    # Make a process in the sandbox take exactly that number, then let NVML name it.
    innocent = sandbox.popen(["sh", "-c", f"echo {outside.pid - 1} > /proc/sys/kernel/ns_last_pid; exec sleep 60 & wait"])
    assert wait_for(lambda: any(n[-1] == outside.pid for n in sandbox_nspids(sandbox)))
    r = mod("gpu_procs_kill", FAST)
    assert r["_status"] == "ok", r
    assert outside.pid not in by_pid(r)
    assert any(i["pid"] == outside.pid and "does not hold nvidia1" in i["why"] for i in r["ignored"])
    assert any(n[-1] == outside.pid for n in sandbox_nspids(sandbox)), "the innocent process was signalled"
    assert outside.alive()
    innocent.kill()


def sandbox_nspids(sandbox) -> list[list[int]]:
    """NSpid of every process in the sandbox, read from this namespace."""
    out = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/status") as fh:
                    levels = next(line.split()[1:] for line in fh if line.startswith("NSpid:"))
                if os.stat(f"/proc/{pid}/ns/pid").st_ino == os.stat(f"/proc/{sandbox.init_pid}/ns/pid").st_ino:
                    out.append([int(x) for x in levels])
            except (OSError, StopIteration):
                continue
    return out


def test_sigterm_ignoring_worker_is_killed_after_the_grace_period_not_before(mod, sandbox) -> None:
    w = sandbox.spawn_worker(gpus=[1], mib=4000, ignore_term=True)
    r = mod("gpu_procs_kill", {"grace_period": 1.5, "kill_timeout": 5})
    t = by_pid(r)[w.ns_pid]
    # KILL only after TERM was ignored for the whole grace period (a lower bound: never early).
    assert t["outcome"] == "killed" and t["signals_sent"] == ["TERM", "KILL"]
    assert t["seconds"] >= 1.5
    assert not w.alive()


def test_graceful_worker_gets_its_grace(mod, sandbox) -> None:
    w = sandbox.spawn_worker(gpus=[1], mib=4000, term_delay_ms=600)
    r = mod("gpu_procs_kill", {"grace_period": 60, "kill_timeout": 5})
    t = by_pid(r)[w.ns_pid]
    # It shut down on its own (no KILL), and was waited for until it had (a lower bound).
    assert t["outcome"] == "terminated" and t["signals_sent"] == ["TERM"]
    assert t["seconds"] >= 0.6
    # Returned as soon as the worker was gone, not after the 60 s grace period: 30 s is far
    # above any delay a loaded machine adds to a 0.6 s shutdown, and far below the grace.
    assert r["elapsed_s"] < 30


def test_stopped_worker_ends_on_sigterm_thanks_to_sigcont(mod, sandbox) -> None:
    w = sandbox.spawn_worker(gpus=[2], mib=4000, stop=True)
    r = mod("gpu_procs_kill", {"grace_period": 5, "kill_timeout": 5})
    t = by_pid(r)[w.ns_pid]
    # Continued after TERM, so it acted on it: terminated, no KILL (without the CONT it would
    # have sat out the grace period and been killed).
    assert t["signals_sent"] == ["TERM", "CONT"]
    assert t["outcome"] == "terminated"
    assert not w.alive()


def test_protected_daemons_management_clients_module_and_ansible_survive_a_catch_all(mod, node, sandbox) -> None:
    daemons = {name: node.spawn_daemon(name, sandbox=sandbox) for name in ("nvidia-persistenced", "nv-hostengine", "dcgm-exporter")}
    mgmt = sandbox.spawn_worker(gpus=[0], hold_only=True, mib=0)
    nvml_client = sandbox.spawn_worker(gpus=[1], nvml=True, mib=0)
    worker = sandbox.spawn_worker(gpus=[3], mib=20000, title="python3 -m sglang.launch_server")
    r = mod("gpu_procs_kill", {"patterns": ["python3", ".*"], "discovery": ["nvml", "device_files"], **FAST})
    assert r["_status"] == "ok", r
    assert not worker.alive()
    for name, d in daemons.items():
        assert d.alive(), name
    assert mgmt.alive() and nvml_client.alive()
    protected = {p["pid"]: p["why"] for p in r["protected"]}
    for name, d in daemons.items():
        assert protected[d.ns_pid] == f"protected daemon ({name})"
    assert protected[mgmt.ns_pid].startswith("management client")
    assert protected[nvml_client.ns_pid].startswith("management client")
    assert protected[1] == "PID 1 of its namespace (an init)"
    whys = set(protected.values())
    assert "this module's own process" in whys
    assert "an ancestor of this module (its interpreter, Ansible, sshd or the become chain)" in whys
    # The Ansible run itself came back: the controller and the module survived.
    assert r["_run"].rc == 0
    targets = {t["pid"] for t in r["targets"]}
    assert not targets & set(protected)


def test_management_clients_can_be_ended_on_request(mod, sandbox) -> None:
    mgmt = sandbox.spawn_worker(gpus=[0], hold_only=True, mib=0)
    r = mod("gpu_procs_kill", {"kill_management_clients": True, **FAST})
    assert by_pid(r)[mgmt.ns_pid]["outcome"] == "terminated"


def test_only_the_selected_gpu_is_cleaned(mod, sandbox) -> None:
    keep = [sandbox.spawn_worker(gpus=[i], mib=1000, title=f"sglang::scheduler_TP{i}") for i in (0, 2)]
    target = sandbox.spawn_worker(gpus=[1], mib=1000, title="sglang::scheduler_TP1")
    r = mod("gpu_procs_kill", {"gpus": [1], "patterns": ["sglang"], **FAST})
    assert set(by_pid(r)) == {target.ns_pid}
    assert all(w.alive() for w in keep) and not target.alive()


def test_where_filters_the_candidates(mod, sandbox) -> None:
    big = sandbox.spawn_worker(gpus=[0], mib=20000)
    small = sandbox.spawn_worker(gpus=[1], mib=512)
    r = mod("gpu_procs_kill", {"where": "[?used_mib > `1024`]", **FAST})
    assert set(by_pid(r)) == {big.ns_pid}
    assert small.alive() and not big.alive()
    assert any(i["pid"] == small.ns_pid and i["why"] == "filtered out by where" for i in r["ignored"])


def test_children_of_a_match_are_included(mod, node, sandbox) -> None:
    # A launcher that matches by name and holds no GPU, with a GPU child that matches nothing.
    worker = f"['{node.bin_dir}/gpusim-worker', '--state', '{node.state_dir}', '--gpu', '4', '--mib', '1000']"
    script = f"import subprocess; subprocess.run({worker})  # torchrun-launcher"
    launcher = sandbox.popen(["python3", "-c", script])
    assert wait_for(lambda: any(c["gpu"] == 4 for c in node.contexts()))
    r = mod("gpu_procs_kill", {"patterns": ["torchrun-launcher"], "include_children": True, "discovery": [], **FAST})
    reasons = sorted(t["reasons"][0] for t in r["targets"])
    assert len(reasons) == 2
    assert reasons[0].startswith("descendant of PID ") and reasons[1] == "matches pattern 'torchrun-launcher'"
    launcher.wait(timeout=5)
    node.wait_clean(timeout=5)
    # Without include_children the child is left alone.
    launcher = sandbox.popen(["python3", "-c", script])
    assert wait_for(lambda: any(c["gpu"] == 4 for c in node.contexts()))
    r = mod("gpu_procs_kill", {"patterns": ["torchrun-launcher"], "discovery": [], **FAST})
    assert [t["reasons"] for t in r["targets"]] == [["matches pattern 'torchrun-launcher'"]]
    assert any(c["gpu"] == 4 for c in node.contexts())


def test_check_mode_kills_nothing_and_diff_shows_the_plan(mod, sandbox) -> None:
    w = sandbox.spawn_worker(gpus=[0], mib=1000, title="sglang::scheduler_TP0")
    r = mod("gpu_procs_kill", {"patterns": ["sglang"]}, check=True, diff=True)
    assert r["changed"] is True
    t = by_pid(r)[w.ns_pid]
    assert t["outcome"] is None and t["signals_sent"] == []
    assert w.alive()
    assert f"{w.ns_pid} sglang::schedul" in r["diff"]["before"] and r["diff"]["after"] == ""
    assert r["msg"].startswith("would end 1 process")


def test_second_run_reports_no_change(mod, sandbox) -> None:
    sandbox.spawn_worker(gpus=[0], mib=1000)
    first = mod("gpu_procs_kill", FAST)
    assert first["changed"] is True
    second = mod("gpu_procs_kill", FAST)
    assert second["changed"] is False and second["targets"] == []


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ({"patterns": ["sglang(("]}, "patterns: 'sglang((' is not a valid regular expression"),
        ({"grace_period": -1}, "grace_period must be >= 0 seconds"),
        ({"gpus": [12]}, "gpus: GPU index 12 does not exist"),
        ({"where": "[?used_mib >"}, "where: '[?used_mib >' is not a valid JMESPath expression"),
        ({"where": "length(@)"}, "where: the expression must return a list of candidate records"),
        ({"containers": [999]}, "containers: container 999 does not exist on"),
        ({"containers": [42]}, "containers: 42 is not a valid Proxmox vmid"),
        ({"unprotect": ["python3"]}, "unprotect: python3 is not in the default protect list"),
    ],
)
def test_bad_input_fails_clearly_and_signals_nothing(mod, node, sandbox, tmp_path, args, message) -> None:
    w = sandbox.spawn_worker(gpus=[0], mib=1000)
    env = {"PCTSIM_DIR": str(tmp_path)}
    (tmp_path / "node").write_text("pve1")
    r = mod("gpu_procs_kill", args, env=env)
    assert r["_status"] == "failed"
    assert message in r["msg"], r["msg"]
    assert r.get("targets", []) == []
    assert w.alive()
    assert_no_traceback(r)


@pytest.mark.skipif(not FREEZER.is_dir(), reason="cgroup v1 freezer not available")
def test_process_stuck_in_d_state_is_reported_unkillable(mod, sandbox) -> None:
    w = sandbox.spawn_worker(gpus=[5], mib=1000)
    group = FREEZER / f"gpuops-ft-{os.getpid()}"
    group.mkdir()
    try:
        (group / "cgroup.procs").write_text(str(w.pid))
        (group / "freezer.state").write_text("FROZEN")
        r = mod("gpu_procs_kill", {"grace_period": 0.2, "kill_timeout": 0.5})
        assert r["_status"] == "failed"
        t = by_pid(r)[w.ns_pid]
        assert t["outcome"] == "unkillable" and t["state"] == "D" and t["wchan"]
        assert f"PID {w.ns_pid}" in r["msg"] and "state D" in r["msg"]
        # It gave up after grace + kill_timeout (0.7 s) instead of hanging on the frozen task; 30 s
        # is far above what a loaded machine adds and far below "never returns".
        assert r["elapsed_s"] < 30
    finally:
        (group / "freezer.state").write_text("THAWED")
        w.wait_gone(5)
        group.rmdir()


def test_container_scope_ends_only_that_containers_processes(node, tmp_path) -> None:
    """The module runs on the 'hypervisor' (this test's namespace) with two containers inside it."""
    registry = tmp_path / "pct"
    registry.mkdir()
    (registry / "node").write_text("pve1")
    ct129 = node.sandbox(vmid=129)
    ct130 = node.sandbox(vmid=130)
    try:
        ct129.register_pct(str(registry), node_name="pve1")
        ct130.register_pct(str(registry), node_name="pve1")
        mine = [ct129.spawn_worker(gpus=[i], mib=2000, title=f"sglang::scheduler_TP{i}") for i in (0, 1)]
        other = ct130.spawn_worker(gpus=[2], mib=2000, title="sglang::scheduler_TP0")
        host = node.spawn_worker(gpus=[3], mib=2000, title="sglang::scheduler_TP9")
        run = ModuleRunner(node, None)
        r = run("gpu_procs_kill", {"containers": [129], "patterns": ["sglang"], **FAST}, env={"PCTSIM_DIR": str(registry)})
        assert r["_status"] == "ok", r
        assert {t["pid"] for t in r["targets"]} == {w.pid for w in mine}
        assert {t["container"] for t in r["targets"]} == {129}
        assert not any(w.alive() for w in mine)
        assert other.alive() and host.alive()
        whys = {p["pid"]: p["why"] for p in r["protected"]}
        assert whys[other.pid] == "outside the container scope (129)"
        assert whys[host.pid] == "outside the container scope (129)"
        # Stopped container: a clear error, nothing signalled.
        ct130_entry = json.loads((registry / "130.json").read_text())
        ct130_entry.update(status="stopped", pid=None)
        (registry / "130.json").write_text(json.dumps(ct130_entry))
        r = run("gpu_procs_kill", {"containers": [130], **FAST}, env={"PCTSIM_DIR": str(registry)})
        assert r["_status"] == "failed" and "container 130 is not running" in r["msg"]
        assert other.alive()
    finally:
        ct129.stop()
        ct130.stop()
