"""PID namespaces: sandboxes as LXC stand-ins, pid conversion, cgroups, the fake pct registry."""

from __future__ import annotations

import json
import os
import sys
import time

import psutil
import pytest
from gpusim import CONTEXT_OVERHEAD_MIB
from gpusim.procfs import nspid, pidns_inode, state
from gpusim.sandbox import cgroup2_base, cgroup_parent

pytestmark = pytest.mark.pidns

MIB = 1 << 20


def test_sandboxed_worker_is_listed_with_the_pid_of_each_viewer(node, nvml) -> None:
    sb = node.sandbox()
    w = sb.spawn_worker(gpus=[3], mib=20000)
    assert w.ns_pid is not None and w.ns_pid <= 3  # among the first after the sandbox's init (setsid -f forks once)
    assert w.pid != w.ns_pid and nspid(w.pid) == [w.pid, w.ns_pid]
    assert pidns_inode(w.pid) == sb.ns_inode == pidns_inode(sb.init_pid)
    inside = nvml(node, "result = snapshot()", sandbox=sb)
    outside = nvml(node, "result = snapshot()")
    assert inside[3]["procs"] == [[w.ns_pid, 20000 * MIB]]
    assert outside[3]["procs"] == [[w.pid, 20000 * MIB]]
    assert inside[3]["used"] == outside[3]["used"] == 20000 + CONTEXT_OVERHEAD_MIB
    levels = node.contexts()[0]["levels"]
    assert levels == [(pidns_inode(), w.pid), (sb.ns_inode, w.ns_pid)]


def test_host_worker_is_invisible_inside_but_its_memory_counts(node, nvml) -> None:
    sb = node.sandbox()
    host = node.spawn_worker(gpus=[1], mib=9000)
    inside = nvml(node, "result = snapshot()", sandbox=sb)
    assert inside[1]["procs"] == [] and inside[1]["used"] == 9000 + CONTEXT_OVERHEAD_MIB  # "memory used, no processes"
    assert nvml(node, "result = snapshot()")[1]["procs"] == [[host.pid, 9000 * MIB]]


def test_legacy_pids_report_the_host_pid_inside_a_namespace(node, nvml) -> None:
    sb = node.sandbox()
    w = sb.spawn_worker(gpus=[0], mib=1000)
    host = node.spawn_worker(gpus=[1], mib=1000)
    node.set_fault(legacy_pids=True)
    inside = nvml(node, "result = snapshot()", sandbox=sb)
    assert inside[0]["procs"] == [[w.pid, 1000 * MIB]]  # a number that means nothing in there
    assert inside[1]["procs"] == [[host.pid, 1000 * MIB]]  # and host processes become "visible"
    assert nvml(node, "result = snapshot()")[0]["procs"] == [[w.pid, 1000 * MIB]]


def test_the_sandbox_has_its_own_proc_and_a_reaping_init(node) -> None:
    sb = node.sandbox()
    out = sb.run(["sh", "-c", "ls /proc | grep -E '^[0-9]+$' | sort -n | head -1; cat /proc/1/cmdline"], capture_output=True, text=True)
    first, init_cmd = out.stdout.split("\n", 1)
    assert first == "1" and "_sbinit.py" in init_cmd
    w = sb.spawn_worker(gpus=[4], mib=1000, fork_child=True)
    # the parent's orphaned child now belongs to the sandbox init, which reaps it when it dies
    assert psutil.Process(w.child_pid).ppid() == sb.init_pid
    assert nspid(w.child_pid)[-1] == w.child_ns_pid
    w.kill_child()
    deadline = time.monotonic() + 2
    while state(w.child_pid) is not None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert state(w.child_pid) is None  # reaped, not a zombie
    node.wait_clean(timeout=2)


def test_run_and_popen_environment(node) -> None:
    sb = node.sandbox()
    code = "import os; print(os.environ['GPUSIM_STATE'], os.environ.get('LD_LIBRARY_PATH', ''), os.getcwd())"
    out = sb.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out[0] == str(node.state_dir) and str(node.lib_dir) in out[1] and out[2] == os.getcwd()
    out = sb.run(
        [sys.executable, "-c", code], include_library=False, env={"GPUSIM_STATE": "/x"}, cwd="/tmp", capture_output=True, text=True, check=True
    ).stdout.split()
    assert out[0] == "/x" and out[-1] == "/tmp" and str(node.lib_dir) not in " ".join(out[1:-1])
    p = sb.popen(["sh", "-c", "echo $$; exec cat /proc/self/status"], stdout=-1, text=True)
    out = p.communicate(timeout=5)[0]
    assert f"NSpid:\t{out.split()[0]}\n" in out  # its own pid, in the sandbox's /proc
    assert sb.nsenter_prefix() == ["nsenter", "-t", str(sb.init_pid), "-p", "-m", "--"]


def test_vmid_sandbox_looks_like_a_proxmox_container(node, tmp_path) -> None:
    sb = node.sandbox(vmid=129)
    assert sb.name == "ct129"
    with open(f"/proc/{sb.init_pid}/environ", "rb") as f:
        assert b"container=lxc" in f.read().split(b"\0")
    base = cgroup2_base()
    w = sb.spawn_worker(gpus=[0], mib=100)
    if base is not None:
        # pve-container (PVE 8 and 9): lxc.cgroup.dir.container = lxc/<vmid>, .inner = ns
        assert sb.cgroup_path == base / cgroup_parent() / "lxc" / "129" / "ns"
        for pid in (sb.init_pid, w.pid):
            with open(f"/proc/{pid}/cgroup") as f:
                assert f"0::/{cgroup_parent()}/lxc/129/ns\n" in f.read()
    entry = sb.register_pct(tmp_path / "pct", node_name="pve1")
    # Its lxc.environment: the simulated driver's address and libraries, not the node's PATH.
    driver = {"GPUSIM_STATE": str(node.state_dir), "LD_LIBRARY_PATH": node.env()["LD_LIBRARY_PATH"]}
    expected = {"vmid": 129, "status": "running", "pid": sb.init_pid, "node": "pve1", "hostname": "ct129", "environment": driver}
    if sb.cgroup_path is not None:
        expected["cgroup"] = str(sb.cgroup_path)  # pct exec joins it, as lxc-attach does
    assert json.loads(entry.read_text()) == expected
    sb.stop()
    assert json.loads(entry.read_text()) == {**expected, "status": "stopped", "pid": None}
    if base is not None:
        assert not (base / cgroup_parent()).exists()


def test_sandboxed_workers_are_orphans_of_the_init_and_report_their_status(node) -> None:
    sb = node.sandbox()
    w = sb.spawn_worker(gpus=[0], mib=10, stop=True)
    assert psutil.Process(w.pid).ppid() == sb.init_pid
    assert os.getsid(w.pid) == w.pid and os.getpgid(w.pid) == w.pid
    w.kill(15)
    time.sleep(0.1)
    assert w.alive()  # stopped: SIGTERM stays pending
    w.kill(18)
    assert w.wait(timeout=2) == -15
    graceful = sb.spawn_worker(gpus=[0], mib=10, term_delay_ms=50)
    graceful.kill(15)
    assert graceful.wait(timeout=2) == 0


def test_stopping_a_sandbox_ends_everything_inside(node) -> None:
    sb = node.sandbox(vmid=131, cgroup=False)
    ws = [
        sb.spawn_worker(gpus=[0], mib=1000),
        sb.spawn_worker(gpus=[1], mib=1000, stop=True),
        sb.spawn_worker(gpus=[2], mib=1000, ignore_term=True),
        sb.spawn_worker(gpus=[3], mib=1000, fork_child=True),
        sb.spawn_daemon("nvidia-persistenced"),
    ]
    inside = [w.pid for w in ws if w.alive()] + [ws[3].child_pid, sb.init_pid]
    sb.stop()
    assert not any(psutil.pid_exists(p) for p in inside)
    assert not sb.alive()
    node.wait_clean(timeout=10)  # the killed namespace's contexts are freed
