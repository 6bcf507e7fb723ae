"""Contexts held by real processes: memory, process lists, release timing, capacity."""

from __future__ import annotations

import os
import signal
import time

import pytest
from gpusim import CONTEXT_OVERHEAD_MIB, WorkerError
from gpusim.procfs import device_fds, device_map_lines, state

pytestmark = pytest.mark.pidns

MIB = 1 << 20


def dev_fds(pid: int) -> set[str]:
    return device_fds(pid)


def dev_maps(pid: int) -> set[str]:
    return {os.path.basename(line.split()[-1]) for line in device_map_lines(pid)}


def test_worker_holds_memory_on_its_gpu_only(node, nvml) -> None:
    w = node.spawn_worker(gpus=[3], mib=20000)
    snap = nvml(node, "result = snapshot()")
    for g in snap:
        if g["index"] == 3:
            # The process is charged what it allocated; the device also counts the context's overhead.
            assert g["used"] == 20000 + CONTEXT_OVERHEAD_MIB and g["v1_used"] == 20615 + CONTEXT_OVERHEAD_MIB and g["reserved"] == 615
            assert g["free"] == 143771 - 615 - 20000 - CONTEXT_OVERHEAD_MIB
            assert g["procs"] == [[w.pid, 20000 * MIB]]
        else:
            assert g["used"] == 0 and g["procs"] == []
    # like a CUDA process: fds AND mappings of nvidia3, nvidiactl, nvidia-uvm
    # Like the CUDA driver (seen on an H200 pair), it opens and maps every GPU's device file,
    # while its memory is on GPU 3 only.
    assert dev_fds(w.pid) == {f"nvidia{i}" for i in range(8)} | {"nvidiactl", "nvidia-uvm"}
    assert dev_maps(w.pid) == {f"nvidia{i}" for i in range(8)} | {"nvidiactl", "nvidia-uvm"}
    used = 20000 + CONTEXT_OVERHEAD_MIB
    assert node.memory(3) == {"used_mib": used, "reserved_mib": 615, "total_mib": 143771}
    assert node.memory_info(3) == {
        "used_mib": used,
        "reserved_mib": 615,
        "total_mib": 143771,
        "free_mib": 143771 - 615 - used,
        "contexts_mib": 20000,
        "overhead_mib": CONTEXT_OVERHEAD_MIB,
        "orphan_mib": 0,
        "v1_used_mib": used + 615,
    }
    [ctx] = node.contexts()
    assert ctx["gpu"] == 3 and ctx["mib"] == 20000 and ctx["pid"] == w.pid and ctx["state"] == "live"
    assert ctx["levels"] == [(os.stat("/proc/self/ns/pid").st_ino, w.pid)]


def test_every_process_entry_point_and_struct(node, nvml) -> None:
    w = node.spawn_worker(gpus=[0], mib=1500)
    res = nvml(
        node,
        """
        nvmlInit(); h = nvmlDeviceGetHandleByIndex(0)
        def full(fn): return [[p.pid, p.usedGpuMemory, getattr(p, "gpuInstanceId", None),
                               getattr(p, "computeInstanceId", None)] for p in fn(h)]
        result = {
            "v3": full(nvmlDeviceGetComputeRunningProcesses), "v2": full(nvmlDeviceGetComputeRunningProcesses_v2),
            "gfx": full(nvmlDeviceGetGraphicsRunningProcesses), "mps": full(nvmlDeviceGetMPSComputeRunningProcesses),
            "detail": [[p.pid, p.usedGpuMemory, p.usedGpuCcProtectedMemory] for p in
                       nvmlDeviceGetRunningProcessDetailList(h, nvmlProcessDetailList_v1, NVML_PROCESS_MODE_COMPUTE)],
        }
        class V1(ctypes.Structure):  # pynvml has no v1 struct any more
            _fields_ = [("pid", ctypes.c_uint), ("usedGpuMemory", ctypes.c_ulonglong)]
        L = lib(); n = ctypes.c_uint(4); arr = (V1 * 4)()
        rc = L.nvmlDeviceGetComputeRunningProcesses(h, ctypes.byref(n), arr)
        result["v1"] = [rc, n.value, arr[0].pid, arr[0].usedGpuMemory]
    """,
    )
    none = 0xFFFFFFFF
    assert res["v3"] == res["v2"] == [[w.pid, 1500 * MIB, none, none]]
    assert res["v1"] == [0, 1, w.pid, 1500 * MIB]
    assert res["gfx"] == [] and res["mps"] == []
    assert res["detail"] == [[w.pid, 1500 * MIB, 0]]


def test_two_call_count_protocol(node, nvml) -> None:
    a = node.spawn_worker(gpus=[0], mib=1000)
    b = node.spawn_worker(gpus=[0], mib=2000)
    res = nvml(
        node,
        """
        L = lib(); L.nvmlInit_v2()
        h0 = ctypes.c_void_p(); h1 = ctypes.c_void_p()
        L.nvmlDeviceGetHandleByIndex_v2(0, ctypes.byref(h0)); L.nvmlDeviceGetHandleByIndex_v2(1, ctypes.byref(h1))
        fn = L.nvmlDeviceGetComputeRunningProcesses_v3
        out = {}
        for label, count, array in (("zero_null", 0, False), ("five_null", 5, False), ("one", 1, True),
                                    ("two", 2, True), ("eight", 8, True)):
            n = ctypes.c_uint(count); arr = (c_nvmlProcessInfo_v2_t * 8)()
            rc = fn(h0, ctypes.byref(n), arr if array else None)
            out[label] = [rc, n.value] + ([[arr[i].pid, arr[i].usedGpuMemory // MIB] for i in range(n.value)]
                                          if array and rc == 0 else [])
        n = ctypes.c_uint(0)
        out["idle_gpu"] = [fn(h1, ctypes.byref(n), None), n.value]
        n = ctypes.c_uint(0)
        out["graphics"] = [L.nvmlDeviceGetGraphicsRunningProcesses_v3(h0, ctypes.byref(n), None), n.value]
        result = out
    """,
    )
    assert res["zero_null"] == [7, 2]  # NVML_ERROR_INSUFFICIENT_SIZE, count needed
    assert res["five_null"] == [7, 2]
    assert res["one"] == [7, 2]
    assert res["two"] == [0, 2, [a.pid, 1000], [b.pid, 2000]]
    assert res["eight"] == [0, 2, [a.pid, 1000], [b.pid, 2000]]
    assert res["idle_gpu"] == [0, 0]
    assert res["graphics"] == [0, 0]


def releasing(node, count: int = 1, timeout: float = 10.0) -> list[dict]:
    """The contexts once ``count`` of them carry the daemon's death and release stamps."""
    deadline = time.monotonic() + timeout
    while True:
        ctxs = [c for c in node.contexts() if c["state"] == "releasing"]
        if len(ctxs) >= count or time.monotonic() > deadline:
            return sorted(ctxs, key=lambda c: c["release_ns"])
        time.sleep(0.002)


# Release timing. The model's numbers are asserted on the daemon's own stamps (dead_ns, release_ns:
# exact, whatever the load); wall-clock checks assert the order of events and only generous bounds,
# because this suite runs on a loaded 2-core machine. The measured latencies are a benchmark:
# tools/bench/sim.py prints them.
def test_sigkill_frees_the_memory_release_delay_after_death(node, nvml) -> None:
    w = node.spawn_worker(gpus=[3], mib=20000)
    drops = nvml(node, f"result = watch_release(3, [{w.pid}])")
    assert len(drops) == 1, drops
    # Never before the release delay (a lower bound cannot be broken by a slow machine); the upper
    # bound only catches a release that never happens (5 s: far above any scheduling delay here).
    assert 0.185 <= drops[0] < 5, drops


def test_release_is_stamped_release_delay_after_death_and_the_process_waits_for_it(node) -> None:
    # A long delay makes every "not yet" below certain however slow the machine is.
    node.set_release_timing(delay_ms=1500)
    w = node.spawn_worker(gpus=[3], mib=20000)
    w.kill()
    [ctx] = releasing(node)
    assert ctx["release_ns"] - ctx["dead_ns"] == 1_500_000_000
    if time.monotonic_ns() < ctx["release_ns"] - 500_000_000:
        assert node.memory(3)["used_mib"] == 20000 + CONTEXT_OVERHEAD_MIB  # still being torn down
        if node.teardown:
            # Like a torch process on the real driver: the exiting worker sits in the kernel
            # (state D, unkillable) until its context is freed.
            assert state(w.pid) == "D" and w.alive()
            w.kill()  # SIGKILL again changes nothing
            assert w.alive()
    w.wait()
    assert time.monotonic_ns() >= ctx["release_ns"] or not node.teardown
    node.wait_clean(timeout=10)
    assert node.memory(3)["used_mib"] == 0


def test_four_processes_dying_together_are_freed_one_by_one(node) -> None:
    ws = [node.spawn_worker(gpus=[0], mib=30000) for _unused in range(4)]
    for w in ws:
        w.kill()
    ctxs = releasing(node, 4)
    assert len(ctxs) == 4, ctxs
    releases = [c["release_ns"] for c in ctxs]
    first_death = min(c["dead_ns"] for c in ctxs)
    # The first is freed the release delay after its death, each next one the gap after the
    # previous (the driver tears contexts of one GPU down one at a time).
    assert releases[0] - ctxs[0]["dead_ns"] == 185_000_000
    assert all(b - a >= 60_000_000 for a, b in zip(releases, releases[1:])), releases
    assert releases[-1] - first_death >= 185_000_000 + 3 * 60_000_000
    for w in ws:
        w.wait()
    node.wait_clean(timeout=10)


def test_teardown_is_serialised_per_gpu_not_per_node(node) -> None:
    ws = [node.spawn_worker(gpus=[g], mib=1000) for g in (0, 1)]
    for w in ws:
        w.kill()
    a, b = releasing(node, 2)
    # In parallel: each is freed the release delay after its own death, no gap between GPUs.
    assert a["release_ns"] - a["dead_ns"] == b["release_ns"] - b["dead_ns"] == 185_000_000
    node.wait_clean(timeout=10)


def test_release_timing_is_configurable_at_runtime(node) -> None:
    node.set_release_timing(delay_ms=400, gap_ms=10)
    w = node.spawn_worker(gpus=[1], mib=1000)
    w.kill()
    [ctx] = releasing(node)
    assert ctx["release_ns"] - ctx["dead_ns"] == 400_000_000
    w.wait()
    node.wait_clean(timeout=10)
    assert node.description.release_gap_ms == 10


def test_a_zombie_holds_no_memory(node) -> None:
    w = node.spawn_worker(gpus=[2], mib=64000)
    w.kill()  # and do not reap it
    assert w.wait_gone(10)
    assert state(w.pid) == "Z"
    node.wait_clean(timeout=10)  # freed although nobody reaped it
    assert state(w.pid) == "Z"
    w.wait()


def test_stopped_worker_holds_memory_until_continued(node) -> None:
    w = node.spawn_worker(gpus=[2], mib=4000, stop=True)
    deadline = time.monotonic() + 2
    while state(w.pid) != "T" and time.monotonic() < deadline:
        time.sleep(0.005)
    assert state(w.pid) == "T"
    w.kill(signal.SIGTERM)
    time.sleep(0.4)
    assert w.alive() and node.memory(2)["used_mib"] == 4000 + CONTEXT_OVERHEAD_MIB
    assert node.contexts()[0]["state"] == "live"  # a stopped process is not dying
    w.kill(signal.SIGCONT)
    assert w.wait(timeout=10) == -signal.SIGTERM
    node.wait_clean(timeout=10)


def test_graceful_and_term_ignoring_workers(node) -> None:
    graceful = node.spawn_worker(gpus=[0], mib=1000, term_delay_ms=300)
    stubborn = node.spawn_worker(gpus=[1], mib=1000, ignore_term=True)
    t0 = time.monotonic()
    graceful.kill(signal.SIGTERM)
    stubborn.kill(signal.SIGTERM)
    assert graceful.wait(timeout=10) == 0
    assert time.monotonic() - t0 >= 0.3  # it took its time: a lower bound, safe under load
    time.sleep(0.1)
    assert stubborn.alive() and node.memory(1)["used_mib"] == 1000 + CONTEXT_OVERHEAD_MIB
    stubborn.kill()
    assert stubborn.wait(timeout=10) == -signal.SIGKILL


def test_forked_child_keeps_the_memory_and_nvml_lists_the_dead_parent(node, nvml) -> None:
    w = node.spawn_worker(gpus=[6], mib=12000, fork_child=True)
    assert not w.alive() and w.child_alive()
    assert w.wait(timeout=2) == 0  # parent exited normally and is reaped
    assert not os.path.exists(f"/proc/{w.pid}")
    snap = nvml(node, "result = snapshot()")
    assert snap[6]["procs"] == [[w.pid, 12000 * MIB]]  # the dead parent, never the child
    assert snap[6]["used"] == 12000 + CONTEXT_OVERHEAD_MIB
    assert dev_fds(w.child_pid) == {f"nvidia{i}" for i in range(8)} | {"nvidiactl", "nvidia-uvm"}
    assert dev_maps(w.child_pid) == {f"nvidia{i}" for i in range(8)} | {"nvidiactl", "nvidia-uvm"}
    assert os.getpgid(w.child_pid) == w.pid  # same process group as its parent was
    w.kill_child()
    [ctx] = releasing(node)
    assert ctx["release_ns"] - ctx["dead_ns"] == 185_000_000
    node.wait_clean(timeout=10)
    assert nvml(node, "result = snapshot()")[6]["procs"] == []


def test_one_context_per_gpu_for_a_multi_gpu_worker(node, nvml) -> None:
    w = node.spawn_worker(gpus=[0, 1, 2, 1], mib=1000)
    snap = nvml(node, "result = snapshot()")
    assert [g["used"] for g in snap] == [1000 + CONTEXT_OVERHEAD_MIB] * 3 + [0] * 5
    assert [g["procs"] for g in snap[:3]] == [[[w.pid, 1000 * MIB]]] * 3
    assert dev_maps(w.pid) == {f"nvidia{i}" for i in range(8)} | {"nvidiactl", "nvidia-uvm"}


def test_out_of_memory_is_refused_like_cuda_malloc(node) -> None:
    node.spawn_worker(gpus=[1], mib=100000)
    with pytest.raises(WorkerError) as e:
        node.spawn_worker(gpus=[1], mib=50000)
    assert e.value.returncode == 3 and "out of memory" in str(e.value)
    # exactly what is left fits: each context also costs the driver its overhead
    node.spawn_worker(gpus=[1], mib=143771 - 615 - 100000 - 2 * CONTEXT_OVERHEAD_MIB)
    assert node.memory_info(1)["free_mib"] == 0


def test_memory_being_released_still_counts_against_capacity(node) -> None:
    node.set_release_timing(delay_ms=500)
    w = node.spawn_worker(gpus=[1], mib=100000)
    w.kill()
    releasing(node)
    with pytest.raises(WorkerError):  # the next job OOMs right after a kill (sglang PR#39545)
        node.spawn_worker(gpus=[1], mib=100000)
    node.wait_clean(timeout=10)
    node.spawn_worker(gpus=[1], mib=100000)


def test_worker_on_a_missing_or_lost_gpu_fails(node) -> None:
    with pytest.raises(WorkerError) as e:
        node.spawn_worker(gpus=[8], mib=1)
    assert e.value.returncode == 3 and "no GPU 8" in str(e.value)
    node.set_fault(lost=[2])
    with pytest.raises(WorkerError) as e:
        node.spawn_worker(gpus=[2], mib=1)
    assert "fallen off the bus" in str(e.value)


def test_without_the_daemon_contexts_follow_their_locks(node, nvml) -> None:
    w = node.spawn_worker(gpus=[2], mib=5000)
    node.stop_driver()
    assert nvml(node, "result = snapshot()")[2]["used"] == 5000 + CONTEXT_OVERHEAD_MIB  # still held: the lock says so
    with pytest.raises(WorkerError) as e:
        node.spawn_worker(gpus=[0], mib=1)
    assert e.value.returncode == 3 and "driver daemon not running" in str(e.value)
    w.kill()
    w.wait()
    assert nvml(node, "result = snapshot()")[2]["used"] == 0  # freed at once, no daemon to delay it
    assert node.memory(2)["used_mib"] == 0


def test_a_restarted_daemon_adopts_live_contexts(node) -> None:
    w = node.spawn_worker(gpus=[4], mib=7000)
    node.stop_driver()
    node.start_driver()
    assert node.memory(4)["used_mib"] == 7000 + CONTEXT_OVERHEAD_MIB
    w.kill()
    [ctx] = releasing(node)  # the new daemon watches the adopted context and times its release
    assert ctx["release_ns"] - ctx["dead_ns"] == 185_000_000
    node.wait_clean(timeout=10)
