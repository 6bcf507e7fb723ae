"""gpu_procs_kill and gpu_mem_verify on the host path: initial PID namespace, /dev, root.

Read conftest.py first: it says why nothing here can signal anything but the test's victims.
"""

from __future__ import annotations

import os

from host.hostgate import TOKEN, Host


def by_pid(result: dict) -> dict[int, dict]:
    return {t["pid"]: t for t in result["targets"]}


def kernel_thread() -> int:
    """A kernel thread other than kthreadd (pid 2), e.g. ksoftirqd/0."""
    for entry in sorted(os.listdir("/proc"), key=lambda x: (len(x), x)):
        if entry.isdigit() and int(entry) > 2:
            try:
                with open(f"/proc/{entry}/stat") as fh:
                    flags = int(fh.read().rpartition(")")[2].split()[6])
            except (OSError, ValueError, IndexError):
                continue
            if flags & 0x00200000:
                return int(entry)
    raise AssertionError("no kernel thread in view: not the initial PID namespace?")


def test_victims_are_found_under_dev_and_ended_in_the_initial_namespace(host: Host) -> None:
    plain = host.victim("scheduler_TP0", gpus=[0])
    forked = host.victim("data_loader", gpus=[1], fork_child=True)
    stubborn = host.victim("worker_TP2", gpus=[2], ignore_term=True)
    assert forked.wait(5) == 0 and forked.child_alive()
    # No device_dir: the default, /dev, where the node's files are published.
    r = host.module("gpu_procs_kill", {"patterns": [TOKEN], "grace_period": 1, "kill_timeout": 10})
    assert r["_status"] == "ok", r
    ended = by_pid(r)
    assert set(ended) == {plain.pid, forked.child_pid, stubborn.pid}
    assert "holds nvidia0-3 (fd+mmap)" in ended[forked.child_pid]["reasons"]  # found through /dev
    assert any(x.startswith("listed by NVML on GPU 0") for x in ended[plain.pid]["reasons"])
    assert all(t["container"] is None for t in r["targets"])  # host processes: no lxc cgroup
    # What reached each victim, in order, as the kernel saw it (the guard's log).
    assert host.guard.sent_to(plain.pid) == ["TERM"]
    assert host.guard.sent_to(forked.child_pid) == ["TERM"]
    assert host.guard.sent_to(stubborn.pid) == ["TERM", "KILL"]
    assert not plain.alive() and not forked.child_alive() and not stubborn.alive()
    v = host.module("gpu_mem_verify", {"timeout": 10})
    assert v["clean"] is True and v["clean_count"] == 4


def test_the_protection_rules_hold_for_the_machines_own_processes(host: Host) -> None:
    """A skewed driver can list any pid (nvitop#181): here NVML names the machine's PID 1,
    kthreadd, another kernel thread and this test's runner (an ancestor of the module). With
    NVML as the only source nothing corroborates or refutes them: only the protection rules stand
    between them and a signal, and the guard would refuse and report it if they did not."""
    kthread = kernel_thread()
    named = [1, 2, kthread, os.getpid()]
    host.node.set_fault(phantom_pids={0: named})
    worker = host.victim("scheduler_TP3", gpus=[3])
    r = host.module("gpu_procs_kill", {"discovery": ["nvml"], "grace_period": 1, "kill_timeout": 5})
    assert r["_status"] == "ok", r
    protected = {p["pid"]: p["why"] for p in r["protected"]}
    assert protected[1] == "PID 1 of its namespace (an init)"
    assert protected[2] == "kernel thread" and protected[kthread] == "kernel thread"
    assert protected[os.getpid()] == "an ancestor of this module (its interpreter, Ansible, sshd or the become chain)"
    assert set(by_pid(r)) == {worker.pid}
    attempted = {d.target for d in host.guard.log if d.signal}
    # Not even an attempt on the named ones (Ansible signalling its own workers is its business).
    assert worker.pid in attempted and not attempted & set(named), host.guard.log


def test_a_listed_pid_that_holds_nothing_here_is_not_trusted(host: Host) -> None:
    # With the device files as a second source (the default), a pid NVML lists but that holds no
    # GPU file is ignored, whatever it is: here a process of this test that is no victim.
    import subprocess

    innocent = subprocess.Popen(["sleep", "60"])
    try:
        host.node.set_fault(phantom_pids={1: [innocent.pid]})
        r = host.module("gpu_procs_kill", {"grace_period": 1, "kill_timeout": 5})
        assert r["_status"] == "ok", r
        assert innocent.pid not in by_pid(r)
        assert any(i["pid"] == innocent.pid and "does not hold nvidia1" in i["why"] for i in r["ignored"])
        assert innocent.poll() is None
    finally:
        innocent.kill()
        innocent.wait()


def test_an_unflagged_orphan_is_an_orphaned_context_on_the_host(host: Host) -> None:
    """Inside a container, memory no visible process holds may belong to the host; on the host
    itself nothing else could hold it: the initial-namespace branch says orphaned_context."""
    host.node.set_fault(orphan={2: 8000})  # recovery action none, as real leaked memory reports
    v = host.module("gpu_mem_verify", {"timeout": 0.3})
    g2 = v["gpus"][2]
    assert v["clean"] is False and g2["recovery_action"] == "none"
    assert g2["diagnosis"] == "orphaned_context", g2
    assert "nvidia-smi -r" in g2["detail"]


def test_verify_names_a_host_holder_it_finds_under_dev(host: Host) -> None:
    forked = host.victim("pt_data_worker", gpus=[1], mib=3000, fork_child=True)
    assert forked.wait(5) == 0
    v = host.module("gpu_mem_verify", {"gpus": [1], "timeout": 0.3})
    g1 = v["gpus"][0]
    assert g1["diagnosis"] == "busy" and f"{forked.child_pid} (" in g1["detail"]
    assert [p["visible"] for p in g1["processes"]] == [False]  # NVML lists the dead parent
    host.module("gpu_procs_kill", {"gpus": [1], "grace_period": 1})
    assert host.module("gpu_mem_verify", {"gpus": [1], "timeout": 10})["clean"] is True
