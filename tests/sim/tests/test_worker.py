"""gpusim-worker as /proc, psutil and NVML see it: titles, management clients, daemons."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import psutil
import pytest
from gpusim import CONTEXT_OVERHEAD_MIB, paths
from gpusim.procfs import device_fds, device_map_lines

pytestmark = pytest.mark.pidns


fds = device_fds
maps = device_map_lines


ALL_DEVICES = {f"nvidia{i}" for i in range(8)} | {"nvidiactl", "nvidia-uvm"}


def test_title_rewrites_cmdline_and_comm_like_setproctitle(node, nvml) -> None:
    w = node.spawn_worker(gpus=[0], mib=1000, title="sglang::scheduler_DP0_TP0_EP0")
    with open(f"/proc/{w.pid}/cmdline", "rb") as f:
        assert f.read() == b"sglang::scheduler_DP0_TP0_EP0\0"
    with open(f"/proc/{w.pid}/comm") as f:
        assert f.read() == "sglang::schedul\n"
    p = psutil.Process(w.pid)
    assert p.cmdline() == ["sglang::scheduler_DP0_TP0_EP0"]
    assert p.name() == "sglang::scheduler_DP0_TP0_EP0"  # psutil completes a 15-char comm from cmdline
    assert os.path.basename(p.exe()) == "gpusim-worker"  # exe is untouched, as for python + setproctitle
    assert nvml(node, f"nvmlInit(); result = nvmlSystemGetProcessName({w.pid})") == "sglang::scheduler_DP0_TP0_EP0"


def test_fork_child_can_have_its_own_title(node) -> None:
    w = node.spawn_worker(gpus=[1], mib=1000, title="VLLM::EngineCore", fork_child=True, child_title="pt_data_worker")
    assert psutil.Process(w.child_pid).cmdline() == ["pt_data_worker"]


def test_untitled_worker_shows_its_real_command_line(node) -> None:
    w = node.spawn_worker(gpus=[0], mib=10)
    cmd = psutil.Process(w.pid).cmdline()
    assert cmd[0] == str(paths.WORKER) and "--gpu" in cmd


def test_each_worker_has_its_own_session_and_process_group(node) -> None:
    w = node.spawn_worker(gpus=[0], mib=10)
    assert os.getpgid(w.pid) == w.pid and os.getsid(w.pid) == w.pid
    assert os.getpgid(0) != w.pid


def test_hold_only_management_client_has_fds_but_no_maps_and_no_context(node, nvml) -> None:
    every = node.spawn_worker(hold_only=True)  # gpus None: every device, like nvidia-persistenced
    one = node.spawn_worker(gpus=[3], hold_only=True)
    assert fds(every.pid) == ALL_DEVICES
    assert fds(one.pid) == {"nvidia3", "nvidiactl", "nvidia-uvm"}
    assert maps(every.pid) == [] and maps(one.pid) == []
    assert node.contexts() == []
    assert all(g["procs"] == [] and g["used"] == 0 for g in nvml(node, "result = snapshot()"))


def test_nvml_management_client(node) -> None:
    c = node.spawn_worker(gpus=[1], nvml=True)
    assert fds(c.pid) == {"nvidia1", "nvidiactl", "nvidia-uvm"}
    assert maps(c.pid) == []
    every = node.spawn_worker(nvml=True)
    assert fds(every.pid) == ALL_DEVICES
    assert node.contexts() == []


def test_protected_daemon_look_alikes(node) -> None:
    for name in ("nvidia-persistenced", "nv-hostengine", "dcgm-exporter"):
        d = node.spawn_daemon(name)
        p = psutil.Process(d.pid)
        assert os.path.basename(p.exe()) == name
        assert p.cmdline() == [name]
        with open(f"/proc/{d.pid}/comm") as f:
            assert f.read().strip() == name[:15]
        assert fds(d.pid) == ALL_DEVICES and maps(d.pid) == []
    assert node.contexts() == []


def test_exit_after_ms_ends_the_worker_and_frees_its_memory(node) -> None:
    w = node.spawn_worker(gpus=[5], mib=2000, exit_after_ms=200)
    assert w.wait(timeout=10) == 0
    node.wait_clean(timeout=10)


def test_ready_fd_protocol_and_cli_passthrough(node) -> None:
    r, wfd = os.pipe()
    proc = subprocess.Popen(
        [
            str(paths.SIM_ROOT / "bin" / "gpusim"),
            "worker",
            "--state",
            str(node.state_dir),
            "--gpu",
            "2",
            "--mib",
            "321",
            "--fork-child",
            "--ready-fd",
            str(wfd),
        ],
        pass_fds=(wfd,),
        stdout=subprocess.PIPE,
        start_new_session=True,
    )
    os.close(wfd)
    with os.fdopen(r) as f:
        line = f.readline().split()
    assert proc.wait(timeout=5) == 0
    assert line[0] == "ready" and int(line[1]) == proc.pid and line[2] == "child"
    child = int(line[3])
    assert proc.stdout is not None
    assert proc.stdout.readline().decode().strip() == str(child)  # the parent prints the child's pid
    proc.stdout.close()
    assert node.memory(2)["used_mib"] == 321 + CONTEXT_OVERHEAD_MIB
    os.kill(child, signal.SIGKILL)
    node.wait_clean(timeout=10)


def test_worker_usage_errors(node) -> None:
    p = subprocess.run([str(paths.WORKER), "--mib", "lots"], capture_output=True, text=True, env={**os.environ, **node.env()}, check=False)
    assert p.returncode == 2 and "--mib" in p.stderr
    p = subprocess.run(
        [str(paths.WORKER), "--gpu", "0"], capture_output=True, text=True, env={k: v for k, v in os.environ.items() if k != "GPUSIM_STATE"}, check=False
    )
    assert p.returncode == 2 and "no state directory" in p.stderr


def test_nvml_client_without_library_fails_with_status_3(node) -> None:
    t0 = time.monotonic()
    p = subprocess.run([str(paths.WORKER), "--nvml"], capture_output=True, text=True, env={**os.environ, **node.env(include_library=False)}, check=False)
    assert p.returncode == 3 and "libnvidia-ml.so.1" in p.stderr
    assert time.monotonic() - t0 < 30  # it fails at once; 30 s would mean it hung waiting for a library
