"""gpu_procs_kill through Ansible, with real processes and signals on the simulated node."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from gpusim import CONTEXT_OVERHEAD_MIB, paths
from support.ansible import local_play, run_playbook
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
    r = mod("gpu_procs_kill", {"patterns": ["sglang::"], "discovery": [], "allow_name_only": True, **FAST})
    assert by_pid(r)[w.ns_pid]["reasons"] == ["matches pattern 'sglang::'"]
    assert not w.alive()
    # Name-only matching is allowed explicitly, and said out loud.
    assert any("processes are ended by name only" in x for x in r["warnings"])


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


def under_async(node, sandbox, args: dict) -> dict:
    """gpu_procs_kill through ansible-playbook in the sandbox, as an async task polled every second."""
    task = {"name": "Kill under async", "gpuops.clean_slate.gpu_procs_kill": {"device_dir": str(node.dev_dir), **args}, "async": 120, "poll": 1}
    env = node.env()
    env["PATH"] = f"{node.bin_dir}:{os.environ.get('PATH', '')}"
    run = run_playbook(local_play([task]), inventory="localhost,", env=env, wrapper=sandbox.nsenter_prefix())
    record = run.task("Kill under async")
    return {**record["result"], "_status": record["status"], "_run": run}


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_protected_daemons_management_clients_module_and_ansible_survive_a_catch_all(mod, node, sandbox, mode) -> None:
    daemons = {name: node.spawn_daemon(name, sandbox=sandbox) for name in ("nvidia-persistenced", "nv-hostengine", "dcgm-exporter")}
    mgmt = sandbox.spawn_worker(gpus=[0], hold_only=True, mib=0)
    nvml_client = sandbox.spawn_worker(gpus=[1], nvml=True, mib=0)
    worker = sandbox.spawn_worker(gpus=[3], mib=20000, title="python3 -m sglang.launch_server")
    args = {"patterns": ["python3", ".*"], "discovery": ["nvml", "device_files"], **FAST}
    r = mod("gpu_procs_kill", args) if mode == "sync" else under_async(node, sandbox, args)
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
    if mode == "async":
        # Detached from the controller, which is no longer an ancestor and is protected as what it is.
        assert any(w.startswith("an Ansible program (ansible-playbook") for w in whys), whys
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
    r = mod("gpu_procs_kill", {"patterns": ["torchrun-launcher"], "include_children": True, "discovery": [], "allow_name_only": True, **FAST})
    reasons = sorted(t["reasons"][0] for t in r["targets"])
    assert len(reasons) == 2
    assert reasons[0].startswith("descendant of PID ") and reasons[1] == "matches pattern 'torchrun-launcher'"
    launcher.wait(timeout=5)
    node.wait_clean(timeout=5)
    # Without include_children the child is left alone.
    launcher = sandbox.popen(["python3", "-c", script])
    assert wait_for(lambda: any(c["gpu"] == 4 for c in node.contexts()))
    r = mod("gpu_procs_kill", {"patterns": ["torchrun-launcher"], "discovery": [], "allow_name_only": True, **FAST})
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
        ({"grace_period": -1}, "grace_period must be from 0 to 86400 seconds, got -1"),
        ({"gpus": [12]}, "gpus: GPU index 12 does not exist"),
        ({"where": "[?used_mib >"}, "where: '[?used_mib >' is not a valid JMESPath expression"),
        ({"where": "length(@)"}, "where: the expression must return a list of candidate records"),
        ({"containers": [999]}, "containers: container 999 does not exist on"),
        ({"containers": [42]}, "containers: 42 is not a valid Proxmox vmid"),
        ({"unprotect": ["python3"]}, "unprotect: python3 is not in the default protect list"),
        # Not finite, or beyond the documented day: refused before the first signal (they used to be accepted,
        # signalled, then crashed with targets: []).
        ({"grace_period": "nan"}, "grace_period must be a finite number from 0 to 86400 seconds, got nan"),
        ({"grace_period": "inf"}, "grace_period must be a finite number from 0 to 86400 seconds, got inf"),
        ({"kill_timeout": "nan"}, "kill_timeout must be a finite number from 0 to 86400 seconds, got nan"),
        ({"kill_timeout": 2200000}, "kill_timeout must be from 0 to 86400 seconds, got 2200000"),
        ({"grace_period": 86400.5}, "grace_period must be from 0 to 86400 seconds, got 86400.5"),
        ({"deadline": "-inf"}, "deadline must be a finite number from 0 to 86400 seconds, got -inf"),
        ({"device_dir": "/nonexistent/dev"}, "device_dir: /nonexistent/dev does not exist on this host"),
        ({"device_dir": "/etc/hostname"}, "device_dir: /etc/hostname is not a directory"),
        ({"containers": [129], "pct_path": "/nonexistent/pct"}, "pct_path: /nonexistent/pct does not exist on this host"),
        ({"pct_path": "/etc"}, "pct_path: /etc is not an executable file"),
        ({"patterns": ["sglang", ""]}, "patterns: an empty pattern matches every process"),
        ({"discovery": []}, "discovery is empty and no patterns are given"),
        ({"users": ["987654"]}, "users: no user with uid 987654 on this host"),
        ({"users": ["no-such-user-x"]}, "users: no user named 'no-such-user-x' on this host"),
        # Ansible's own argument checks fail with a reason too.
        ({"signal": "FOO"}, "value of signal must be one of"),
        ({"grace_period": "soon"}, "grace_period"),
    ],
)
def test_bad_input_fails_clearly_and_signals_nothing(mod, node, sandbox, tmp_path, args, message) -> None:
    w = sandbox.spawn_worker(gpus=[0], mib=1000)
    env = {"PCTSIM_DIR": str(tmp_path)}
    (tmp_path / "node").write_text("pve1")
    r = mod("gpu_procs_kill", args, env=env)
    assert r["_status"] == "failed"
    assert message in r["msg"], r["msg"]
    assert r["reason"] in ("bad_arguments", "no_such_container"), r
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
        assert r["_status"] == "failed" and r["reason"] == "unkillable"
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


# --------------------------------------------------------------------------- protection follows the executable


def test_a_borrowed_daemon_name_protects_nothing(mod, node, sandbox) -> None:
    """exec -a and a title (cut to 15 characters in comm) cannot borrow nvidia-persistenced's protection."""
    titled = sandbox.spawn_worker(gpus=[0], mib=30000, title="nvidia-persistenced")
    worker = f"{node.bin_dir}/gpusim-worker --state {node.state_dir} --gpu 1 --mib 30000"
    execa = sandbox.popen(["bash", "-c", f"exec -a nvidia-persistenced {worker}"])
    assert wait_for(lambda: any(c["gpu"] == 1 for c in node.contexts()))
    r = mod("gpu_procs_kill", {"patterns": [".*"], **FAST})
    assert r["_status"] == "ok", r
    names = {t["pid"]: (t["name"], t["cmdline"]) for t in r["targets"]}
    assert names[titled.ns_pid] == ("nvidia-persiste", "nvidia-persistenced")
    assert any(cmd.startswith("nvidia-persistenced --state") for _name, cmd in names.values()), names
    assert not any("nvidia-persistenced" in p["why"] for p in r["protected"]), [p for p in r["protected"] if "nvidia" in p["why"]]
    assert not titled.alive()
    execa.wait(timeout=5)
    node.wait_clean(timeout=5)


def test_a_real_daemon_holding_gpu_memory_is_protected_and_reported_by_both_modules(mod, node, sandbox) -> None:
    exe = node.state_dir / "bin" / "nvidia-persistenced"
    shutil.copy2(paths.WORKER, exe)
    daemon = sandbox.spawn_worker(gpus=[3], mib=30000, executable=exe)
    r = mod("gpu_procs_kill", {"patterns": [".*"], **FAST})
    assert r["_status"] == "ok", r
    assert daemon.alive(), ([t for t in r["targets"] if t["pid"] == daemon.ns_pid], r["protected"])
    rec = {p["pid"]: p for p in r["protected"]}[daemon.ns_pid]
    assert rec["why"] == "protected daemon (nvidia-persistenced)"
    assert (rec["holds_gpu_memory"], rec["gpus"], rec["used_mib"]) == (True, [3], 30000)
    assert any(w.startswith(f"PID {daemon.ns_pid} (nvidia-persiste) holds 30000 MiB on GPU 3 and is not ended") for w in r["warnings"]), r["warnings"]
    assert "1 of them holding GPU memory" in r["msg"]
    v = mod("gpu_mem_verify", {"timeout": 0.2})
    assert (v["_status"], v["reason"]) == ("failed", "not_clean")
    g3 = v["gpus"][3]
    assert g3["diagnosis"] == "held_by_protected"
    assert f"held by protected daemon PID(s) {daemon.ns_pid} (nvidia-persistenced)" in g3["detail"]
    assert "unprotect" in g3["detail"]
    assert [g["diagnosis"] for i, g in enumerate(v["gpus"]) if i != 3] == ["clean"] * 7


# --------------------------------------------------------------------------- processes born during the kill

LAUNCHER = """
import signal, subprocess, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)  # ignored here, and so in every worker it starts
worker = sys.argv[1:]
while True:  # respawn-launcher
    subprocess.Popen(worker)
    time.sleep(0.1)
"""


def start_launcher(node, sandbox, title: str):
    argv = [str(paths.WORKER), "--state", str(node.state_dir), "--gpu", "0", "--mib", "100", "--title", title]
    launcher = sandbox.popen(["python3", "-c", LAUNCHER, *argv])
    assert wait_for(lambda: len(node.contexts()) >= 3)
    return launcher


def test_workers_a_launcher_forks_during_the_kill_are_ended_too(mod, node, sandbox) -> None:
    launcher = start_launcher(node, sandbox, "respawn-worker")
    # kill_timeout is generous: a SIGKILLed worker tears its contexts down for ~0.2 s, serialised per GPU
    # (60 ms apart), so a dozen late workers on one GPU take over a second on a loaded machine; the kill
    # returns as soon as they are gone.
    r = mod("gpu_procs_kill", {"patterns": ["respawn"], "grace_period": 1, "kill_timeout": 10})
    assert r["_status"] == "ok", r
    late = [t for t in r["targets"] if t["round"] > 1]
    assert late, r["targets"]
    # Born during the first round's grace period, holding the GPU, and ended in a later round.
    assert all(t["outcome"] in ("terminated", "killed") for t in r["targets"])
    assert all("holds nvidia0 (fd+mmap)" in t["reasons"] for t in late)
    assert r["summary"]["rounds"] >= 2 and r["summary"]["respawned"] == len(late)
    assert f"{len(late)} of them appeared during the kill" in r["msg"]
    launcher.wait(timeout=5)
    node.wait_clean(timeout=5)


def test_holders_still_appearing_at_the_deadline_fail_the_kill(mod, node, sandbox) -> None:
    # The launcher is not a target (no pattern, no GPU): its workers keep coming until the deadline.
    launcher = start_launcher(node, sandbox, "gpu-worker")
    # kill_timeout leaves the SIGKILLed workers time to tear down (see above); the deadline ends the rounds. 8 s, not
    # less: on a loaded machine the module's start and its first round took most of 6 s, leaving no second round.
    r = mod("gpu_procs_kill", {"grace_period": 0.5, "kill_timeout": 10, "deadline": 8})
    assert (r["_status"], r["reason"]) == ("failed", "holders_remain"), r
    assert r["remaining"] and all(x["name"] == "gpu-worker" for x in r["remaining"]), [x for x in r["remaining"] if x["name"] != "gpu-worker"]
    assert r["summary"]["rounds"] >= 2
    assert "Something keeps starting them" in r["msg"] and "raise deadline" in r["msg"]
    # Every signal sent is listed, remaining or not.
    assert r["summary"]["signals"]["KILL"] == sum(1 for t in r["targets"] if "KILL" in t["signals_sent"]) > 0
    assert launcher.poll() is None
    launcher.kill()


def test_zombies_are_neither_targets_nor_counted_as_ended(mod, sandbox) -> None:
    # A child that exited, whose parent never reaps it.
    script = "import os, time\nif os.fork() == 0:\n    open('/proc/self/comm', 'w').write('zombie' + '-job')\n    os._exit(0)\ntime.sleep(60)"
    parent = sandbox.popen(["python3", "-c", script])
    assert wait_for(lambda: any("zombie-job" in line for line in sandbox.run(["ps", "-eo", "stat,comm"], capture_output=True, text=True).stdout.splitlines()))
    r = mod("gpu_procs_kill", {"patterns": ["zombie-job"], "discovery": [], "allow_name_only": True, **FAST})
    assert r["_status"] == "ok", r
    assert r["targets"] == [] and r["changed"] is False
    assert any(i["why"].startswith("a zombie") for i in r["ignored"])
    assert r["msg"].startswith("ended 0 process(es)")
    parent.kill()


# --------------------------------------------------------------------------- discovery sources


def test_without_any_discovery_source_the_kill_refuses_unless_name_only_is_allowed(mod, node, sandbox, tmp_path) -> None:
    w = sandbox.spawn_worker(gpus=[0], mib=1000, title="sglang::scheduler_TP0")
    empty = tmp_path / "dev"
    empty.mkdir()
    no_source = {"patterns": ["^sglang::"], "device_dir": str(empty), **FAST}
    r = mod("gpu_procs_kill", no_source, library=False)
    assert (r["_status"], r["reason"]) == ("failed", "no_discovery_source"), r
    assert "allow_name_only" in r["msg"] and "libnvidia-ml.so.1" in r["msg"] and f"{empty} holds no GPU device file" in r["msg"]
    assert r["targets"] == [] and w.alive()
    r = mod("gpu_procs_kill", {"patterns": ["^sglang::"], "discovery": [], **FAST})
    assert (r["_status"], r["reason"]) == ("failed", "no_discovery_source") and w.alive()
    r = mod("gpu_procs_kill", {**no_source, "allow_name_only": True}, library=False)
    assert r["_status"] == "ok", r
    assert by_pid(r)[w.ns_pid]["reasons"] == ["matches pattern '^sglang::'"] and not w.alive()
    warnings = " | ".join(r["warnings"])
    assert "NVML cannot be read" in warnings and "The GPU device files cannot be used" in warnings and "ended by name only" in warnings


def test_a_missing_source_is_a_warning_and_the_other_still_finds_the_holders(mod, node, sandbox, tmp_path) -> None:
    first = sandbox.spawn_worker(gpus=[0], mib=1000)
    r = mod("gpu_procs_kill", FAST, library=False)
    assert r["_status"] == "ok", r
    assert by_pid(r)[first.ns_pid]["reasons"] == ["holds nvidia0-7 (fd+mmap)"]
    assert any(w.startswith("NVML cannot be read (") for w in r["warnings"]), r.get("warnings")
    second = sandbox.spawn_worker(gpus=[1], mib=1000)
    empty = tmp_path / "dev"
    empty.mkdir()
    r = mod("gpu_procs_kill", {"device_dir": str(empty), **FAST})
    assert r["_status"] == "ok", r
    # NVML's word alone is trusted when the device files cannot corroborate it.
    assert by_pid(r)[second.ns_pid]["reasons"] == ["listed by NVML on GPU 1 (1000 MiB)"]
    assert any(w.startswith("The GPU device files cannot be used (") for w in r["warnings"]), r.get("warnings")
    assert not first.alive() and not second.alive()


@pytest.mark.parametrize("mode", ["files", "exit-fd"])
def test_a_gpu_that_only_another_thread_holds_is_found_and_its_process_ended(mod, node, sandbox, mode) -> None:
    """Issue 26, the kill's side: a thread with a file table of its own holds the GPU's device file, or the process's
    main thread has exited while another thread keeps it open (its main thread reads Z and PF_EXITING: no teardown,
    it lives on). The kill finds both (fd holders: management clients, ended on request) and ends them; the
    mapped case is tests/unit/plugins/module_utils/test__proctable.py's (the simulated device maps as /dev/zero)."""
    from support.threads import THREAD_HOLDER

    proc = sandbox.popen([sys.executable, "-c", THREAD_HOLDER, mode, str(node.dev_dir / "nvidia3")], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        # Every GPU: a holder NVML does not list is tied to one selected GPU only through memory nobody owns.
        r = mod("gpu_procs_kill", {**FAST, "kill_management_clients": True})
        assert r["_status"] == "ok", r
        found = [x for x in r["targets"] if "nvidia3" in " ".join(x["reasons"])]
        assert found, json.dumps({k: r.get(k) for k in ("targets", "ignored", "msg", "protected")}, default=str)[:3000]
        t = found[0]
        assert t["outcome"] in ("terminated", "killed"), t
        assert wait_for(lambda: proc.poll() is not None)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
