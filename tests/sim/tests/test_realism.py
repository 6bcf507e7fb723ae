"""The simulator's realism knobs (issue 19): each behaves like the real thing it stands for.

Teardown in the kernel, driver overhead per context, minor != index, graphics and MPS contexts,
MIG mode, character device files, a respawning supervisor, children forked during shutdown, and
the node published under a private /dev. The collection's handling of each is tested through
Ansible in tests/functional/test_realism.py.
"""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import textwrap
import time

import pytest
from gpusim import CONTEXT_OVERHEAD_MIB, Node
from gpusim.procfs import children, device_fds, device_map_lines, state

pytestmark = pytest.mark.pidns

MIB = 1 << 20


def wait_until(cond, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


# ---------------------------------------------------------------------- teardown in the kernel
def test_an_exiting_worker_waits_in_the_driver_until_its_context_is_freed(node) -> None:
    if not node.teardown:
        pytest.fail("the node has no teardown mount: /dev/fuse and root are needed (the test machine has both)")
    node.set_release_timing(delay_ms=1500)  # long enough that every "still" below is certain
    w = node.spawn_worker(gpus=[0], mib=1000)
    pidfd = os.pidfd_open(w.pid)
    w.kill(signal.SIGTERM)  # default action: it dies, as a torch process does
    assert wait_until(lambda: state(w.pid) == "D")
    with open(f"/proc/{w.pid}/wchan") as fh:
        assert fh.read() == "request_wait_answer"  # in the kernel, waiting on the "driver"
    w.kill(signal.SIGKILL)  # cannot shorten it
    time.sleep(0.2)
    ctx = node.contexts()[0]
    if time.monotonic_ns() < ctx["release_ns"] - 300_000_000:
        assert state(w.pid) == "D" and node.memory(0)["used_mib"] == 1000 + CONTEXT_OVERHEAD_MIB
    import select

    select.select([pidfd], [], [])  # the pidfd becomes readable only when it is gone...
    assert time.monotonic_ns() >= ctx["release_ns"]  # ...which is once its memory is freed
    os.close(pidfd)
    assert w.wait(timeout=10) in (-signal.SIGTERM, -signal.SIGKILL)


def test_a_hang_in_the_teardown_keeps_the_process_unkillable(node) -> None:
    node.set_teardown(hang_ms=3000)
    w = node.spawn_worker(gpus=[1], mib=500)
    start = time.monotonic()
    w.kill(signal.SIGKILL)
    assert wait_until(lambda: state(w.pid) == "D")
    w.wait(timeout=20)
    assert time.monotonic() - start >= 3.0  # a lower bound: the hang was served
    node.set_teardown(hang_ms=0)


def test_the_parent_of_a_forked_child_exits_at_once_the_child_waits(node) -> None:
    # The parent's exit frees nothing (the child still holds the context); the child's does.
    node.set_release_timing(delay_ms=1000)
    w = node.spawn_worker(gpus=[2], mib=800, fork_child=True)  # ready: the parent has exited
    assert w.wait(timeout=5) == 0 and w.child_alive()
    assert node.contexts()[0]["state"] == "live"
    w.kill_child(signal.SIGKILL)
    assert wait_until(lambda: state(w.child_pid) == "D")
    assert w.wait_gone(10)
    node.wait_clean(timeout=10)


def test_a_paused_teardown_lets_a_sandbox_stop_at_once(node) -> None:
    node.set_release_timing(delay_ms=5000)
    sb = node.sandbox()
    sb.spawn_worker(gpus=[3], mib=100)
    start = time.monotonic()
    sb.stop()
    # Upper bound with a reason: without the pause this waits the 5 s release delay.
    assert time.monotonic() - start < 4.5


# ---------------------------------------------------------------------- memory no process explains
def test_each_context_costs_the_device_more_than_its_process_is_charged(node, nvml) -> None:
    ws = [node.spawn_worker(gpus=[4], mib=500) for _unused in range(8)]
    snap = nvml(node, "result = snapshot()")[4]
    listed = sum(mem for _pid, mem in snap["procs"]) // MIB
    assert listed == 8 * 500
    # 8 contexts: 72 MiB that no listed process explains, beyond a 64 MiB slack
    assert snap["used"] - listed == 8 * CONTEXT_OVERHEAD_MIB == 72
    node.set_context_overhead(0)
    assert nvml(node, "result = snapshot()")[4]["used"] == 4000
    for w in ws:
        w.kill()


# ---------------------------------------------------------------------- minor != index
def test_minor_numbers_need_not_follow_the_indices(nvml) -> None:
    with Node(gpus=4, minors=[2, 3, 0, 1]) as node:
        w = node.spawn_worker(gpus=[0], mib=700)
        res = nvml(node, "nvmlInit(); result = [nvmlDeviceGetMinorNumber(nvmlDeviceGetHandleByIndex(i)) for i in range(4)]")
        assert res == [2, 3, 0, 1]
        [ctx] = node.contexts()
        assert ctx["gpu"] == 0 and ctx["minor"] == 2  # the context lives on /dev/nvidia2
        assert device_fds(w.pid) >= {"nvidia0", "nvidia1", "nvidia2", "nvidia3"}
    with pytest.raises(ValueError, match="distinct"):
        Node(gpus=2, minors=[1, 1])


# ---------------------------------------------------------------------- graphics and MPS
def test_graphics_and_mps_contexts_show_in_their_own_lists(node, nvml) -> None:
    g = node.spawn_worker(gpus=[5], mib=300, kind="graphics", title="Xorg-like")
    m = node.spawn_worker(gpus=[5], mib=400, kind="mps", title="mps-client")
    c = node.spawn_worker(gpus=[5], mib=500)
    res = nvml(
        node,
        """
        nvmlInit(); h = nvmlDeviceGetHandleByIndex(5)
        def pids(fn): return sorted([p.pid, p.usedGpuMemory // MIB] for p in fn(h))
        result = {"compute": pids(nvmlDeviceGetComputeRunningProcesses), "graphics": pids(nvmlDeviceGetGraphicsRunningProcesses),
                  "mps": pids(nvmlDeviceGetMPSComputeRunningProcesses), "used": nvmlDeviceGetMemoryInfo(h, version=nvmlMemory_v2).used // MIB}
        """,
    )
    assert res["compute"] == [[c.pid, 500]]
    assert res["graphics"] == [[g.pid, 300]]
    assert res["mps"] == [[m.pid, 400]]
    assert res["used"] == 1200 + 3 * CONTEXT_OVERHEAD_MIB
    # All three map the device files like any CUDA or graphics client.
    assert all(device_map_lines(w.pid) for w in (g, m, c))


# ---------------------------------------------------------------------- MIG
def test_mig_mode_instances_and_no_per_process_memory(node, nvml) -> None:
    node.set_mig([6])
    w = node.spawn_worker(gpus=[6], mib=2000)
    res = nvml(
        node,
        """
        nvmlInit()
        h6, h7 = nvmlDeviceGetHandleByIndex(6), nvmlDeviceGetHandleByIndex(7)
        [p] = nvmlDeviceGetComputeRunningProcesses(h6)
        result = {"mig6": list(nvmlDeviceGetMigMode(h6)), "mig7": list(nvmlDeviceGetMigMode(h7)),
                  "proc": [p.pid, p.usedGpuMemory, p.gpuInstanceId, p.computeInstanceId],
                  "used": nvmlDeviceGetMemoryInfo(h6, version=nvmlMemory_v2).used // MIB}
        """,
    )
    assert res["mig6"] == [1, 1] and res["mig7"] == [0, 0]
    assert res["proc"] == [w.pid, None, 1, 0]  # pynvml maps NVML_VALUE_NOT_AVAILABLE to None
    assert res["used"] == 2000 + CONTEXT_OVERHEAD_MIB  # device memory is still reported


# ---------------------------------------------------------------------- character devices
def test_device_files_are_character_devices_that_map_with_their_path(node) -> None:
    if not node.char_devices:
        pytest.fail("mknod and a file-backed private mapping of a character device are expected here (root, kernel 6.x)")
    st = os.stat(node.dev_dir / "nvidia0")
    assert stat.S_ISCHR(st.st_mode) and os.major(st.st_rdev) == 1 and os.minor(st.st_rdev) == 5
    w = node.spawn_worker(gpus=[0], mib=100)
    lines = device_map_lines(w.pid)
    assert any(line.rstrip("\n").endswith(f"{node.dev_dir}/nvidia0") for line in lines), lines


# ---------------------------------------------------------------------- supervisor, shutdown forks
def test_a_supervisor_restarts_its_worker_a_bounded_number_of_times(node) -> None:
    sup = node.spawn_worker(gpus=[7], mib=300, supervise=2, respawn_delay_ms=50, title="torchrun", child_title="python3 train.py")
    assert sup.worker_pid and not device_fds(sup.pid)  # the supervisor itself holds no GPU
    seen = {sup.worker_pid}
    for _round in range(2):
        current = next(iter(children(sup.pid)))
        os.kill(current, signal.SIGKILL)
        # One read of the children per try: between two reads the list can change (a respawn under way).
        assert wait_until(lambda c=current: any(k != c for k in children(sup.pid)))
        new = next(k for k in children(sup.pid) if k != current)
        assert wait_until(lambda n=new: any(ctx["pid"] == n and ctx["state"] == "live" for ctx in node.contexts()))
        seen.add(new)
    assert len(seen) == 3
    os.kill(children(sup.pid)[0], signal.SIGKILL)
    assert sup.wait(timeout=10) == 0  # gave up after two restarts, as torchrun --max-restarts=2 does


def test_a_worker_forks_a_child_during_shutdown_that_keeps_its_memory(node) -> None:
    w = node.spawn_worker(gpus=[1], mib=600, fork_on_term=True, term_delay_ms=100, child_title="shutdown-helper")
    w.kill(signal.SIGTERM)
    assert w.wait(timeout=10) == 0
    [ctx] = node.contexts()
    assert ctx["state"] == "live"  # the child holds it
    helpers = [p for p in map(int, filter(str.isdigit, os.listdir("/proc"))) if _cmdline(p) == "shutdown-helper"]
    assert len(helpers) == 1
    os.kill(helpers[0], signal.SIGKILL)
    node.wait_clean(timeout=10)


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return fh.read().rstrip(b"\0").decode(errors="replace")
    except OSError:
        return ""


# ---------------------------------------------------------------------- the node under /dev
def test_a_node_published_under_a_private_dev(tmp_path) -> None:
    """In a child process that owns a mount namespace with its own /dev (gpusim.devns): workers and
    NVML open /dev/nvidia*, the machine's /dev never sees them."""
    code = textwrap.dedent(
        """
        import json, os, sys
        from gpusim import Node
        from gpusim.devns import private_dev, dev_is_private
        from gpusim.procfs import device_fds
        private_dev()
        assert dev_is_private()
        with Node(gpus=2) as node:
            node.publish_devices("/dev")
            w = node.spawn_worker(gpus=[1], mib=100)
            links = sorted(os.readlink(f"/proc/{w.pid}/fd/{fd}") for fd in os.listdir(f"/proc/{w.pid}/fd"))
            print(json.dumps({"links": links, "env": node.env().get("GPUSIM_DEV_DIR"), "ctx": node.contexts()[0]["minor"]}))
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    import json

    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert {"/dev/nvidia0", "/dev/nvidia1", "/dev/nvidiactl", "/dev/nvidia-uvm"} <= set(out["links"])
    assert out["env"] == "/dev" and out["ctx"] == 1
    assert not os.path.exists("/dev/nvidia0")  # this machine has no GPU: nothing leaked into its /dev
