"""The Node API itself: life cycle, cleanup, environment, waiting, performance, CLI."""

from __future__ import annotations

import json
import os
import shlex
import stat
import subprocess
import time
from pathlib import Path

import psutil
import pytest
from gpusim import CONTEXT_OVERHEAD_MIB, Node, paths
from gpusim.procfs import daemon_running

pytestmark = pytest.mark.pidns

GPUSIM = str(paths.SIM_ROOT / "bin" / "gpusim")


def test_stop_leaves_no_process_behind(node) -> None:
    sb = node.sandbox(vmid=140)
    ws = [
        node.spawn_worker(gpus=[0], mib=1000),
        node.spawn_worker(gpus=[1], mib=1000, fork_child=True),
        node.spawn_worker(gpus=[2], mib=1000, stop=True),
        node.spawn_worker(gpus=[3], mib=1000, ignore_term=True),
        node.spawn_worker(hold_only=True),
        node.spawn_worker(nvml=True),
        node.spawn_daemon("nv-hostengine"),
        sb.spawn_worker(gpus=[4], mib=1000),
        sb.spawn_worker(gpus=[5], mib=1000, fork_child=True),
        sb.spawn_daemon("dcgm-exporter"),
    ]
    # a worker started behind the node's back (as the CLI or a test script would)
    stray = subprocess.Popen(
        [str(paths.WORKER), "--gpu", "6", "--mib", "10", "--fork-child"], env={**os.environ, **node.env()}, stdout=subprocess.PIPE, start_new_session=True
    )
    assert stray.stdout is not None
    stray_child = int(stray.stdout.readline())
    stray.wait()
    daemon_pid = int((node.state_dir / "driver.pid").read_text())
    pids = {w.pid for w in ws} | {w.child_pid for w in ws if w.child_pid} | {stray_child, daemon_pid, sb.init_pid}
    pids = {p for p in pids if psutil.pid_exists(p)}
    assert len(pids) >= 12
    state_dir = node.state_dir
    node.stop()
    node.stop()  # idempotent
    alive = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    assert alive == []
    assert not state_dir.exists()
    me = psutil.Process()
    assert [c for c in me.children(recursive=True) if "gpusim" in " ".join(c.cmdline())] == []


def test_context_manager_and_explicit_path(tmp_path) -> None:
    with Node(path=tmp_path / "n", gpus=2, total_mib=81559, reserved_mib=500, name="NVIDIA H100 80GB HBM3") as n:
        assert n.dev_dir == tmp_path / "n" / "dev"
        assert sorted(p.name for p in n.dev_dir.iterdir()) == ["nvidia-caps", "nvidia-uvm", "nvidia-uvm-tools", "nvidia0", "nvidia1", "nvidiactl"]
        assert sorted(p.name for p in (n.dev_dir / "nvidia-caps").iterdir()) == ["nvidia-cap1", "nvidia-cap2"]
        # Character devices where the machine allows mknod (as root here), else mappable files.
        if n.char_devices:
            assert all(stat.S_ISCHR(p.stat().st_mode) and p.stat().st_rdev == os.makedev(1, 5) for p in n.device_files())
        else:
            assert all(p.stat().st_size >= 4096 for p in n.device_files())
        assert n.memory(1) == {"used_mib": 0, "reserved_mib": 500, "total_mib": 81559}
        assert n.memory_info(1)["free_mib"] == 81059 and n.memory_info(1)["v1_used_mib"] == 500
        assert n.gpus[1].name == "NVIDIA H100 80GB HBM3"
        assert daemon_running(n.state_dir)
    assert (tmp_path / "n").exists()  # not ours to remove
    assert not daemon_running(tmp_path / "n")


def test_uuids_are_deterministic_per_seed() -> None:
    a, b = Node(seed="host-a"), Node(seed="host-a")
    c = Node(seed="host-b")
    assert [g.uuid for g in a.gpus] == [g.uuid for g in b.gpus] != [g.uuid for g in c.gpus]
    assert [g.pci_bus_id for g in a.gpus][:3] == ["00000000:18:00.0", "00000000:2A:00.0", "00000000:3A:00.0"]
    for n in (a, b, c):
        n.stop()  # never started: nothing but the temp dir


def test_env_keeps_other_library_paths(node, monkeypatch) -> None:
    monkeypatch.setenv("LD_LIBRARY_PATH", f"/opt/x:{node.lib_dir}:/opt/y")
    env = node.env()
    # NVML's directory first, then libcuda's (a directory of its own, so that a node can leave CUDA out).
    assert env["LD_LIBRARY_PATH"] == f"{node.lib_dir}:{paths.CUDA_DIR}:/opt/x:/opt/y"
    assert env["GPUSIM_STATE"] == str(node.state_dir)
    assert env["PATH"].split(":")[0] == str(node.bin_dir)
    assert node.env(include_library=False)["LD_LIBRARY_PATH"] == "/opt/x:/opt/y"
    assert node.env(include_cuda=False)["LD_LIBRARY_PATH"] == f"{node.lib_dir}:/opt/x:/opt/y"


def test_wait_clean(node, monkeypatch) -> None:
    # A clean node answers at once: without a single sleep.
    with monkeypatch.context() as m:
        m.setattr("gpusim.node.time.sleep", lambda _s: pytest.fail("wait_clean slept on a clean node"))
        assert node.wait_clean(timeout=1) >= 0
    w = node.spawn_worker(gpus=[0], mib=10)
    with pytest.raises(TimeoutError):
        node.wait_clean(timeout=0.2)
    w.kill()
    node.wait_clean(timeout=10)
    assert node.contexts() == []
    w.wait(10)


def test_eight_workers_start_and_hold_their_contexts(node) -> None:
    # How long it takes: tools/bench/sim.py.
    ws = [node.spawn_worker(gpus=[i], mib=20000, title=f"sglang::scheduler_TP{i}") for i in range(8)]
    assert sorted(c["gpu"] for c in node.contexts()) == list(range(8)) and all(w.alive() for w in ws)


def test_a_full_query_of_8_gpus_reads_every_gpu(node, nvml) -> None:
    # What one query costs: tools/bench/sim.py.
    for i in range(8):
        node.spawn_worker(gpus=[i], mib=1000)
    per_gpu = nvml(
        node,
        """
        nvmlInit()
        hs = [nvmlDeviceGetHandleByIndex(i) for i in range(nvmlDeviceGetCount())]
        result = [[nvmlDeviceGetMemoryInfo(h, version=nvmlMemory_v2).used // MIB, len(nvmlDeviceGetComputeRunningProcesses(h))] for h in hs]
    """,
    )
    assert per_gpu == [[1000 + CONTEXT_OVERHEAD_MIB, 1]] * 8


# ------------------------------------------------------------------ CLI
def gpusim(*args: str, **kw) -> subprocess.CompletedProcess[str]:
    return subprocess.run([GPUSIM, *args], capture_output=True, text=True, timeout=30, **kw, check=False)


def test_cli_start_status_fault_worker_stop(tmp_path: Path) -> None:
    state = tmp_path / "node"
    r = gpusim("node", "start", "--state", str(state), "--gpus", "4")
    assert r.returncode == 0, r.stderr
    exports = dict(line.removeprefix("export ").split("=", 1) for line in r.stdout.splitlines())
    env = {**os.environ, **{k: shlex.split(v)[0] for k, v in exports.items()}}
    assert env["GPUSIM_STATE"] == str(state) and str(paths.LIB_DIR) in env["LD_LIBRARY_PATH"]
    assert daemon_running(state)
    w = subprocess.Popen([GPUSIM, "worker", "--gpu", "2", "--mib", "3000", "--title", "VLLM::Worker_TP1"], env=env, start_new_session=True)
    deadline = time.monotonic() + 5
    while not json.loads(gpusim("status", "--json", env=env).stdout)["gpus"][2]["contexts"]:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    data = json.loads(gpusim("status", "--state", str(state), "--json").stdout)
    assert [g["used_mib"] for g in data["gpus"]] == [0, 0, 3000 + CONTEXT_OVERHEAD_MIB, 0]
    assert data["gpus"][2]["contexts"][0]["pid"] == w.pid and data["daemon_running"] is True
    assert (
        gpusim("fault", "--state", str(state), "lost=3", "orphan=1:500", "timeout=nvmlDeviceGetName", "timeout_gpus=0", "release_delay_ms=150").returncode == 0
    )
    text = gpusim("status", "--state", str(state)).stdout
    assert "lost=[3]" in text and "orphaned 500 MiB" in text and "release 150 ms" in text
    assert "#1 pid" in text and "3000 MiB live" in text
    smi = subprocess.run(["nvidia-smi", "-L"], env=env, capture_output=True, text=True, check=False)
    assert smi.returncode == 15
    assert gpusim("fault", "--state", str(state), "--clear").returncode == 0
    assert json.loads(gpusim("status", "--state", str(state), "--json").stdout)["faults"] == {}
    assert "LD_LIBRARY_PATH" in gpusim("env", "--state", str(state), "--no-library").stdout
    assert gpusim("fault", "--state", str(state), "bogus=1").returncode != 0
    r = gpusim("node", "stop", "--state", str(state), "--purge")
    assert r.returncode == 0, r.stderr
    assert w.wait(timeout=5) == -9  # a holder of the node's devices: ended with it
    assert not state.exists()
