"""_proctable against real processes holding real files."""

from __future__ import annotations

import os
import subprocess
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from ansible_collections.gpuops.clean_slate.plugins.module_utils import _proctable

ROOT = Path(__file__).resolve().parents[4]

HOLDER = textwrap.dedent(
    """
    import ctypes, mmap, os, sys, time
    dev, mode = sys.argv[1], sys.argv[2]
    keep = []
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    for name in sys.argv[3:]:
        fd = os.open(os.path.join(dev, name), os.O_RDWR)
        if mode == "map":
            keep.append(mmap.mmap(fd, 4096))
        if mode == "maponly":
            # A raw mmap (Python's mmap keeps a dup of the fd), then close: only the mapping holds the file.
            keep.append(libc.mmap(None, 4096, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0))
            os.close(fd)
        else:
            keep.append(fd)
    print("ready", flush=True)
    time.sleep(60)
    """
)


@pytest.fixture
def devdir(tmp_path: Path) -> Path:
    d = tmp_path / "dev"
    d.mkdir()
    for name in ("nvidia0", "nvidia1", "nvidia7", "nvidiactl", "nvidia-uvm", "nvidia-modeset"):
        (d / name).write_bytes(b"\0" * 4096)
    (d / "nvidia-caps").mkdir()
    (d / "nvidia-caps" / "nvidia-cap1").write_bytes(b"\0" * 4096)
    return d


@pytest.fixture
def spawn(start_ready):
    return lambda devdir, mode, *names: start_ready(HOLDER, str(devdir), mode, *names)


def test_fd_and_mmap_holders_are_told_apart(devdir: Path, spawn) -> None:
    compute = spawn(devdir, "map", "nvidia1", "nvidiactl", "nvidia-uvm")
    mgmt = spawn(devdir, "fd", "nvidiactl", "nvidia0", "nvidia7", "nvidia-caps/nvidia-cap1")
    maponly = spawn(devdir, "maponly", "nvidia7")
    holders, unreadable = _proctable.scan_device_holders(str(devdir))
    assert unreadable == []
    c = holders[compute.pid]
    assert c.gpu_fds == {1} and c.gpu_maps == {1}
    assert c.other_maps == {"nvidiactl", "nvidia-uvm"} and c.has_mmaps
    m = holders[mgmt.pid]
    assert m.minors == {0, 7} and not m.has_mmaps
    assert m.other_fds == {"nvidiactl", "nvidia-caps/nvidia-cap1"}
    # Closing the fd after mmap keeps the device (and its memory) held: only the maps scan sees it.
    mo = holders[maponly.pid]
    assert mo.gpu_fds == set() and mo.gpu_maps == {7}
    assert "holds nvidia1 (fd+mmap)" in c.describe()
    assert "holds nvidia7 (mmap)" in mo.describe()
    assert os.getpid() not in holders


def test_other_device_dirs_are_not_confused(devdir: Path, tmp_path: Path, spawn) -> None:
    other = tmp_path / "other"
    other.mkdir()
    (other / "nvidia0").write_bytes(b"\0" * 4096)
    p = spawn(other, "map", "nvidia0")
    holders, _unreadable = _proctable.scan_device_holders(str(devdir))
    assert p.pid not in holders
    holders, _unreadable = _proctable.scan_device_holders(str(other))
    assert holders[p.pid].minors == {0}


def test_holder_of_a_gpu_file_does_not_count_nvidia_prefixed_paths_elsewhere(tmp_path: Path, spawn) -> None:
    d = tmp_path / "dev"
    d.mkdir()
    (d / "nvidia0").write_bytes(b"\0" * 4096)
    (tmp_path / "nvidia0").write_bytes(b"\0" * 4096)
    p = spawn(tmp_path, "map", "nvidia0")
    holders, _unreadable = _proctable.scan_device_holders(str(d))
    assert p.pid not in holders


def test_stat_ancestry_and_kernel_threads() -> None:
    st = _proctable.read_stat(os.getpid())
    assert st is not None and st["ppid"] == os.getppid()
    chain = _proctable.ancestors(os.getpid())
    # Every parent up to the namespace's init (pid 1 here: pidns-run's init, or the machine's).
    expected, pid = [], os.getpid()
    while pid != 1:
        with open(f"/proc/{pid}/stat") as fh:
            pid = int(fh.read().rpartition(")")[2].split()[1])
        expected.append(pid)
    assert chain == expected and chain[-1] == 1
    assert not _proctable.is_kernel_thread(os.getpid())
    assert _proctable.read_stat(_proctable.pid_max() + 1) is None


def test_comm_with_spaces_and_parentheses_is_parsed(tmp_path: Path) -> None:
    # comm may contain ") (" and spaces; the parser must split on the last ')'.
    script = tmp_path / "weird) (name"
    script.write_text("#!/bin/sh\nsleep 30\n")
    script.chmod(0o755)
    p = subprocess.Popen([str(script)])
    try:
        time.sleep(0.1)
        st = _proctable.read_stat(p.pid)
        assert st is not None
        assert st["comm"] == "weird) (name"
        assert st["ppid"] == os.getpid()
    finally:
        p.kill()
        p.wait()


def test_namespaces_and_nspid() -> None:
    assert _proctable.pidns_inode("self") == _proctable.pidns_inode(os.getpid())
    assert _proctable.pidns_inode(_proctable.pid_max() + 1) is None
    # A process one namespace down has two levels: the pid outside, then its pid inside.
    inner = subprocess.Popen(["unshare", "--pid", "--fork", "--mount-proc", "sleep", "30"])
    try:
        deadline = time.monotonic() + 10
        child = None
        while child is None and time.monotonic() < deadline:
            kids = Path(f"/proc/{inner.pid}/task/{inner.pid}/children").read_text().split()
            child = int(kids[0]) if kids else None
            time.sleep(0.01)
        assert child is not None
        levels = _proctable.nspids(child)
        assert levels[0] == child and levels[1] == 1 and len(levels) == len(_proctable.nspids(os.getpid())) + 1
        assert _proctable.pidns_inode(child) != _proctable.pidns_inode("self")
    finally:
        inner.kill()
        inner.wait()


def test_container_of_reads_proxmox_cgroup_paths(monkeypatch, tmp_path: Path) -> None:
    samples = {
        "0::/lxc/129/ns/init.scope\n": 129,
        "12:pids:/lxc/4501/ns\n0::/lxc/4501/ns/system.slice\n": 4501,
        "0::/lxc.payload.130/init.scope\n": 130,
        "0::/lxc.monitor/129\n": None,
        "0::/system.slice/sshd.service\n": None,
        "0::/user.slice/lxc/notanumber\n": None,
    }
    real_open = open

    for text, expected in samples.items():
        f = tmp_path / "cgroup"
        f.write_text(text)

        def fake_open(path, *a, _f=f, **kw):
            if path == "/proc/4242/cgroup":
                return real_open(_f, *a, **kw)
            return real_open(path, *a, **kw)

        monkeypatch.setattr("builtins.open", fake_open)
        assert _proctable.container_of(4242) == expected, text
        monkeypatch.undo()


def test_kernel_threads_are_recognised_by_their_flag(monkeypatch, tmp_path: Path) -> None:
    """Only the PF_KTHREAD flag counts: a process named like a kernel thread is not one, and in
    a child PID namespace pid 2 is an ordinary process. Checked on made-up /proc/PID/stat lines
    (the real kernel threads are met by tests/host, in the initial namespace)."""
    kthread = "2 (kthreadd) S 0 0 0 0 -1 2129984 0 0 0 0 0 0 0 0 20 0 1 0 9 0 0 18446744073709551615 0 0 0 0 0 0 0 2147483647 0 0 0 0 17 1 0 0 0 0 0\n"
    impostor = "2 (kworker/0:1) S 1 1 1 0 -1 4194560 0 0 0 0 0 0 0 0 20 0 1 0 9 0 0 18446744073709551615 0 0 0 0 0 0 0 2147483647 0 0 0 0 17 1 0 0 0 0 0\n"
    real_open = open
    for text, expected in ((kthread, True), (impostor, False)):

        def fake_open(path, *a, _t=text, **kw):
            if path == "/proc/2/stat":
                f = tmp_path / "stat"
                f.write_text(_t)
                return real_open(f, *a, **kw)
            return real_open(path, *a, **kw)

        monkeypatch.setattr("builtins.open", fake_open)
        assert _proctable.is_kernel_thread(2) is expected, text
        monkeypatch.undo()
    # And on this machine's real process list: our own pid is never a kernel thread.
    assert _proctable.is_kernel_thread(os.getpid()) is False


def test_an_ordinary_user_may_signal_only_its_own_processes(tmp_path: Path) -> None:
    """may_signal() says what kill(2) would: as root, anything; as uid 65534, only its own."""
    import shutil

    assert _proctable.may_signal(os.getpid())  # root
    python = shutil.which("python3", path="/usr/bin:/bin")
    if os.geteuid() != 0 or not python or not shutil.which("setpriv"):
        pytest.fail("needs root, setpriv and a python3 every user can run in /usr/bin")
    # The checkout may not be readable by uid 65534 (CI clones into a 0700 `mktemp -d`): the user imports a
    # world-readable copy of the collection's plugins instead.
    readable = Path(tempfile.mkdtemp(prefix="gpuops-nobody-", dir="/tmp"))
    readable.chmod(0o755)
    shutil.copytree(ROOT / "plugins", readable / "ansible_collections" / "gpuops" / "clean_slate" / "plugins")
    for folder in [readable, *[p for p in readable.rglob("*") if p.is_dir()]]:
        folder.chmod(0o755)
    root_owned = subprocess.Popen(["sleep", "30"])
    code = (
        "import subprocess\n"
        "from ansible_collections.gpuops.clean_slate.plugins.module_utils import _proctable\n"
        "own = subprocess.Popen(['sleep', '30'])\n"
        f"print(_proctable.may_signal({root_owned.pid}), _proctable.may_signal(own.pid), _proctable.may_signal(1))\n"
        "own.kill()\n"
    )
    try:
        out = subprocess.run(
            ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", python, "-c", code],
            # /usr/bin/python3 is not the venv's: it finds the collection through PYTHONPATH.
            env={**os.environ, "PYTHONPATH": str(readable)},
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
        assert out.returncode == 0, out.stderr
        assert out.stdout.split() == ["False", "True", "False"]
    finally:
        root_owned.kill()
        root_owned.wait()
        shutil.rmtree(readable, ignore_errors=True)


def test_attribution_prefers_nvml_then_maps_then_fds() -> None:
    # CUDA opens every visible GPU's device file; only some of them are really used.
    torch_like = _proctable.Holding(gpu_fds={0, 1}, gpu_maps={0}, other_fds={"nvidiactl"}, other_maps={"nvidiactl"})
    assert _proctable.attribute(torch_like, {0}) == {0}
    assert _proctable.attribute(torch_like, None) == {0}
    every_map = _proctable.Holding(gpu_fds={0, 1}, gpu_maps={0, 1})
    assert _proctable.attribute(every_map, {1}) == {1}
    assert _proctable.attribute(every_map, None) == {0, 1}
    nvml_client = _proctable.Holding(gpu_fds={0, 1}, other_fds={"nvidiactl"})
    assert _proctable.attribute(nvml_client, None) == {0, 1}


def test_reasons_compress_runs_of_device_files() -> None:
    h = _proctable.Holding(gpu_fds={0, 1, 2, 3, 5}, gpu_maps={0, 1, 2, 3})
    assert h.describe() == ["holds nvidia0-3 (fd+mmap)", "holds nvidia5 (fd)"]
    assert h.describe({2, 5}) == ["holds nvidia2 (fd+mmap)", "holds nvidia5 (fd)"]
    assert _proctable.Holding(other_fds={"nvidiactl"}).describe() == ["holds nvidiactl"]


def test_reads_of_a_process_in_state_d_are_made_under_a_deadline(tmp_path: Path) -> None:
    # A FIFO without a writer blocks its reader in the kernel, as the maps or command line of a process
    # whose memory-map lock a task stuck in the driver holds would.
    fifo = tmp_path / "blocks"
    os.mkfifo(fifo)
    with pytest.raises(TimeoutError, match="state D"):
        _proctable.read_guarded(str(fifo), "D", limit=0.2)
    # The abandoned reader is still waiting; a writer releases it (the test's own clean-up).
    fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
    os.close(fd)
    plain = tmp_path / "plain"
    plain.write_bytes(b"a\0b\0")
    assert _proctable.read_guarded(str(plain), "D") == b"a\0b\0" == _proctable.read_guarded(str(plain), "S")
    with pytest.raises(FileNotFoundError):
        _proctable.read_guarded(str(tmp_path / "gone"), "D")
    # A live process read as if it were in state D gives the same answer as a direct read.
    me = os.getpid()
    assert _proctable.read_command(me, "D") == _proctable.read_command(me)


@pytest.mark.parametrize(("mode", "fds", "maps"), [("files", {0}, set()), ("exit-fd", {0}, set()), ("exit-map", {0}, {0})])
def test_a_gpu_file_only_another_thread_holds_is_found(devdir: Path, thread_hold, mode: str, fds: set[int], maps: set[int]) -> None:
    """A thread with a file table of its own, or the threads of a process whose main thread has exited, hold what the
    process holds: the kill must find them as the residue does (issue 26)."""
    p = thread_hold(mode, devdir / "nvidia0")
    holders, _unreadable = _proctable.scan_device_holders(str(devdir), only=[p.pid])
    assert p.pid in holders, mode
    assert (holders[p.pid].gpu_fds, holders[p.pid].gpu_maps) == (fds, maps)
    st = _proctable.read_stat(p.pid)
    assert st is not None
    if mode.startswith("exit"):
        # Its main thread reads as a zombie, and as exiting; the process lives on in its other thread.
        assert st["state"] == "Z" and st["threads"] == 2 and _proctable.live_threads(p.pid)
    assert not _proctable.exited(st["state"], st["threads"])


def test_a_real_zombie_has_exited_and_no_live_thread(tmp_path: Path) -> None:
    child = subprocess.Popen(["true"])
    deadline = time.monotonic() + 10
    while (_proctable.read_stat(child.pid) or {}).get("state") != "Z" and time.monotonic() < deadline:
        time.sleep(0.01)
    st = _proctable.read_stat(child.pid)
    assert st is not None and st["state"] == "Z"
    assert _proctable.exited(st["state"], st["threads"]) and not _proctable.live_threads(child.pid)
    child.wait()
