"""Server-shaped process trees (gpusim.servers): SGLang's and vLLM's processes, sessions, names, ports and residue
as their source makes them, their crash as the seeds' servers crashed, and what that leaves for the next start."""

from __future__ import annotations

import os
import re
import signal
import socket
import time

import pytest
from gpusim import CONTEXT_OVERHEAD_MIB
from gpusim.procfs import device_fds, holders, ppid, state
from gpusim.residue import private_shm
from gpusim.servers import ServerStartError, start_sglang, start_vllm

pytestmark = pytest.mark.pidns


def stat(pid: int) -> dict[str, int]:
    with open(f"/proc/{pid}/stat") as fh:
        rest = fh.read().rsplit(")", 1)[1].split()
    return {"ppid": int(rest[1]), "pgid": int(rest[2]), "sid": int(rest[3])}


def cmdline(pid: int) -> str:
    with open(f"/proc/{pid}/cmdline", "rb") as fh:
        return fh.read().rstrip(b"\0").replace(b"\0", b" ").decode()


def comm(pid: int) -> str:
    with open(f"/proc/{pid}/comm") as fh:
        return fh.read().strip()


def free_ports(count: int) -> int:
    """A port p with p .. p+count-1 free (the server derives its store port from --port)."""
    for _unused in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + count > 65535:
            continue
        try:
            for p in range(base, base + count):
                with socket.socket() as t:
                    t.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
    raise RuntimeError("no free port range")


@pytest.fixture
def sandbox(node):
    sb = node.sandbox()
    private_shm(sb)
    yield sb
    sb.stop()


def test_sglang_tp8_tree_its_crash_and_the_next_start(node, sandbox) -> None:
    port = free_ports(2)
    srv = start_sglang(node, sandbox=sandbox, tp=8, port=port, mib=100000, tokenizer_workers=2)
    launcher, [detok], ranks = srv.launcher, srv.role("detokenizer"), srv.ranks
    assert "-m sglang.launch_server --model-path " in cmdline(launcher.pid) and f"--tp-size 8 --port {port}" in cmdline(launcher.pid)
    # The launcher leads its own session; the detokenizer is its child in it; each scheduler is the
    # launcher's child in a session of its own (start_new_session), holding its GPU's device file.
    assert stat(launcher.pid)["sid"] == launcher.pid
    assert stat(detok.pid) == {"ppid": launcher.pid, "pgid": launcher.pid, "sid": launcher.pid}
    assert cmdline(detok.pid) == "sglang::detokenizer" and comm(detok.pid) == "sglang::detoken"
    assert [r.title for r in ranks] == [f"sglang::scheduler_TP{k}" for k in range(8)]
    for k, r in enumerate(ranks):
        assert stat(r.pid) == {"ppid": launcher.pid, "pgid": r.pid, "sid": r.pid}
        assert cmdline(r.pid) == f"sglang::scheduler_TP{k}" and comm(r.pid) == "sglang::schedul"
        assert {f"nvidia{k}", "nvidiactl", "nvidia-uvm"} <= device_fds(r.pid)
        assert node.memory(k)["used_mib"] == 100000 + CONTEXT_OVERHEAD_MIB
    assert {c["gpu"]: c["pid"] for c in node.contexts()} == {k: r.pid for k, r in enumerate(ranks)}
    # Names as the sources make them, each carrying its creator's pid as that process sees it (decimal, or hex for CUDA).
    names = {os.path.basename(p) for p in srv.shm}
    tp0 = ranks[0]
    assert f"multi_tokenizer_args_{launcher.ns_pid}" in names
    assert any(re.fullmatch(rf"sgl_shm_mq_{tp0.ns_pid}_[0-9a-f]{{8}}", n) for n in names), names
    assert any(re.fullmatch(r"sglang_loads_tmp\w{8}_[0-9a-f]{8}\.shm", n) for n in names), names
    for r in ranks:
        assert any(re.fullmatch(rf"torch_{r.ns_pid}_\d+_1", n) for n in names), (r, names)
        assert f"cuda.shm.0.{r.ns_pid:x}.1" in names
    assert len(srv.sockets) == 5 and all(re.fullmatch(r"/tmp/tmp\w{8}", s) for s in srv.sockets)
    # Who holds what: the CUDA segment its creator, the queue every rank, the ref counter and the tokenizer args nobody.
    held = {os.path.basename(p): holders([srv.path(p)]) for p in srv.shm}
    assert held[f"cuda.shm.0.{tp0.ns_pid:x}.1"] == {tp0.pid}
    assert held[next(n for n in names if n.startswith("sgl_shm_mq_"))] == {r.pid for r in ranks}
    assert held[f"multi_tokenizer_args_{launcher.ns_pid}"] == set()
    assert held[next(n for n in names if n.startswith(f"torch_{tp0.ns_pid}_"))] == set()
    assert srv.ports["http"] == port and srv.ports["store"] == port + 1

    [tracker] = srv.role("resource_tracker")
    assert "from multiprocessing.resource_tracker import main;main(" in cmdline(tracker.pid)
    assert stat(tracker.pid) == {"ppid": launcher.pid, "pgid": launcher.pid, "sid": launcher.pid}
    sems = [p for p in srv.shm if os.path.basename(p).startswith("sem.mp-")]
    assert len(sems) == 3

    survivors = srv.crash()
    # The launcher is gone, its detokenizer died with it (PR_SET_PDEATHSIG); the schedulers live on,
    # reparented to the sandbox's PID 1, with their GPU memory, their store port and their files, and so
    # does the resource tracker, whose pipe they inherited.
    assert survivors == [*ranks, tracker]
    init = sandbox.init_pid
    assert all(ppid(r.pid) == init for r in [*ranks, tracker])
    assert all(node.memory(k)["used_mib"] == 100000 + CONTEXT_OVERHEAD_MIB for k in range(8))
    assert all(os.path.lexists(srv.path(p)) for p in srv.shm + srv.sockets)
    # The launcher checks its port plan first: the failed start makes nothing (no process, no file).
    before = set(os.listdir(srv.path("/dev/shm")))
    with pytest.raises(
        ServerStartError, match=rf"sglang.launch_server: the torch.distributed store \(nccl_port\) port {port + 1} is used by a process already"
    ):
        start_sglang(node, sandbox=sandbox, tp=8, port=port)
    assert set(os.listdir(srv.path("/dev/shm"))) == before
    # Nothing of the failed start is left behind.
    assert {c["pid"] for c in node.contexts()} == {r.pid for r in ranks}

    # A killed scheduler tears down in the driver for the H200's time for its size (85 ms + 1.1 ms/GiB: the daemon's stamps).
    ranks[7].handle.signal(signal.SIGKILL)
    deadline = time.monotonic() + 10
    while not any(c["gpu"] == 7 and c["release_ns"] for c in node.contexts()) and time.monotonic() < deadline:
        time.sleep(0.005)
    [ctx] = [c for c in node.contexts() if c["gpu"] == 7]
    assert ctx["release_ns"] - ctx["dead_ns"] == 85_000_000 + 1100 * 1000 * 100000 // 1024
    for r in ranks[:7]:
        r.handle.signal(signal.SIGKILL)
    # With the last scheduler gone, the tracker unlinks the semaphores still registered and exits (the H200's sem.mp-*).
    assert tracker.handle.wait_exit(10)
    assert not any(os.path.lexists(srv.path(p)) for p in sems)
    srv.stop()
    node.wait_clean(timeout=10)
    # Once the survivors are gone the next start gets the ports and the GPUs (the dead files stay: new names).
    again = start_sglang(node, sandbox=sandbox, tp=8, port=port)
    assert again.ports["http"] == port and len(again.alive()) == 11
    again.stop()


def test_sglang_data_parallel_controller_starts_the_schedulers(node, sandbox) -> None:
    srv = start_sglang(node, sandbox=sandbox, tp=2, dp=2, port=free_ports(2), mib=1000)
    [ctl] = srv.role("data_parallel_controller")
    assert cmdline(ctl.pid) == "sglang::data_parallel_controller" and stat(ctl.pid)["ppid"] == srv.launcher.pid
    assert [(r.title, r.gpu) for r in srv.ranks] == [(f"sglang::scheduler_DP{d}_TP{t}", 2 * d + t) for d in (0, 1) for t in (0, 1)]
    assert all(stat(r.pid)["ppid"] == ctl.pid and stat(r.pid)["sid"] == r.pid for r in srv.ranks)
    assert srv.crash() == [*srv.ranks, *srv.role("resource_tracker")]  # the controller dies with the launcher, the schedulers do not
    srv.stop()


def test_vllm_tp8_tree_and_its_crash(node, sandbox) -> None:
    port = free_ports(1)
    srv = start_vllm(node, sandbox=sandbox, tp=8, port=port, mib=129000)
    api, [core], ranks = srv.launcher, srv.role("engine_core"), srv.ranks
    assert re.search(rf"/vllm serve \S+ --tensor-parallel-size 8 --port {port}$", cmdline(api.pid)), cmdline(api.pid)
    assert cmdline(core.pid) == "VLLM::EngineCore" and stat(core.pid) == {"ppid": api.pid, "pgid": api.pid, "sid": api.pid}
    assert [r.title for r in ranks] == [f"VLLM::Worker_TP{k}" for k in range(8)]
    for k, r in enumerate(ranks):
        assert stat(r.pid) == {"ppid": core.pid, "pgid": api.pid, "sid": api.pid}
        assert node.memory(k)["used_mib"] == 129000 + CONTEXT_OVERHEAD_MIB
    names = [os.path.basename(p) for p in srv.shm]
    assert sum(1 for n in names if re.fullmatch(r"psm_[0-9a-f]{8}", n)) == 9  # the broadcast queue and each worker's response queue
    assert {f"cuda.shm.0.{r.ns_pid:x}.1" for r in ranks} <= set(names)
    assert len(srv.sockets) == 2 and all(re.fullmatch(r"/tmp/[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", s) for s in srv.sockets)
    # The engine core is OOM-killed: the API server shuts down, the workers are orphans that keep their GPUs
    # and the resource tracker, all in the dead API server's session and group.
    [tracker] = srv.role("resource_tracker")
    assert srv.crash() == [*ranks, tracker]
    assert all(ppid(r.pid) == sandbox.init_pid and stat(r.pid)["sid"] == api.pid for r in [*ranks, tracker])
    assert state(api.pid) is None or not api.alive()
    assert all(node.memory(k)["used_mib"] > 0 for k in range(8))
    srv.stop()


def test_sglang_stops_itself_on_sigterm_to_its_launcher_as_its_source_does(node, sandbox) -> None:
    private_shm(sandbox)
    srv = start_sglang(node, sandbox=sandbox, tp=2, port=free_ports(2), mib=1000, timing={"sigterm_poll_s": 0.3})
    [tracker] = srv.role("resource_tracker")
    loads = [p for p in srv.shm if os.path.basename(p).startswith("sglang_loads_")]
    sems = [p for p in srv.shm if os.path.basename(p).startswith("sem.mp-")]
    # A TERM to the launcher alone: its watchdog notices it on its next poll, ShutdownReq stops the schedulers (each
    # removes its own files), then its tree kill ends the detokenizer and the resource tracker.
    srv.launcher.handle.signal(signal.SIGTERM)
    assert srv.launcher.handle.wait_exit(20)
    assert srv.alive() == [] and not tracker.alive()
    node.wait_clean(timeout=10)
    left = {p for p in srv.shm + srv.sockets if os.path.lexists(srv.path(p))}
    # What SGLang's own stop leaves: the load snapshot (never unlinked), the detokenizer's socket and the tracker's
    # semaphores (both SIGKILLed by kill_process_tree); the schedulers' queue, segments and sockets are gone.
    assert set(loads) | set(sems) <= left and len(left - set(loads) - set(sems)) == 1, left
    srv.stop()


def test_vllms_api_server_killed_leaves_its_engine_on_the_gpus(node, sandbox) -> None:
    srv = start_vllm(node, sandbox=sandbox, tp=2, port=free_ports(1), mib=1000)
    [core], [tracker] = srv.role("engine_core"), srv.role("resource_tracker")
    assert srv.crash("api_server") == [core, *srv.ranks, tracker]  # vllm#55510: no parent-death detection
    assert ppid(core.pid) == sandbox.init_pid and all(ppid(r.pid) == core.pid for r in srv.ranks)
    assert all(node.memory(k)["used_mib"] > 0 for k in range(2))
    srv.stop()


def test_a_gradual_teardown_frees_its_memory_step_by_step(node, sandbox) -> None:
    node.set_release_timing(delay_ms=2000, gap_ms=0)
    node.set_teardown(gradual=True)
    w = sandbox.spawn_worker(gpus=[0], mib=40000)
    w.kill(signal.SIGKILL)
    seen = []
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and (not seen or seen[-1] > 0):
        seen.append(node.memory(0)["used_mib"])
        time.sleep(0.1)
    drops = [b for a, b in zip(seen, seen[1:]) if b < a]
    assert seen[-1] == 0 and len(drops) >= 4, seen  # down in steps, not all at once


def test_a_full_dev_shm_fails_the_start_with_enospc(node) -> None:
    sb = node.sandbox()
    try:
        private_shm(sb, size="512k")
        with pytest.raises(ServerStartError, match=r"sglang::scheduler_TP0: No space left on device creating its queues in /dev/shm"):
            start_sglang(node, sandbox=sb, tp=2, port=free_ports(2), mib=1000, mq_kib=1024)
        assert not node.contexts()  # the launcher ended what it had started
    finally:
        sb.stop()
