"""_holders: who holds a file, from one pass over /proc, /proc/locks and the unix socket tables, against real
processes that open, map, lock, bind and work in real files (under tools/pidns-run)."""

from __future__ import annotations

import ast
import fcntl
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from ansible_collections.gpuops.clean_slate.plugins.module_utils import _holders, _proctable


def key(path: Path) -> _holders.Key:
    st = os.stat(path)
    return (st.st_dev, st.st_ino)


def test_device_tokens_are_printed_as_the_kernel_prints_them() -> None:
    assert _holders.dev_token(os.makedev(0, 0x2A)) == "00:2a"
    assert _holders.dev_token(os.makedev(253, 1)) == "fd:01"


def test_open_mapped_and_working_directory_holders_are_found_by_inode(tmp_path: Path, hold) -> None:
    opened, mapped, idle, workdir = tmp_path / "opened", tmp_path / "mapped", tmp_path / "idle", tmp_path / "work"
    for f in (opened, mapped, idle):
        f.write_bytes(b"\0" * 4096)
    workdir.mkdir()
    a, b, c = hold("fd", opened), hold("map", mapped), hold("cwd", workdir)
    watch = _holders.Watch(keys={key(opened), key(mapped), key(idle)}, names={"opened", "mapped", "idle"}, cwd_keys={key(workdir)})
    scan = _holders.scan(watch, workers=1)
    assert [(h.pid, h.how) for h in scan.holds[key(opened)]] == [(a.pid, "fd")]
    assert (b.pid, "mmap") in [(h.pid, h.how) for h in scan.holds[key(mapped)]]
    assert {h.pid for h in scan.holds[key(mapped)]} == {b.pid}
    assert [(h.pid, h.how) for h in scan.holds[key(workdir)]] == [(c.pid, "cwd")]
    assert key(idle) not in scan.holds  # nothing holds it: an orphan
    assert scan.unreadable == [] and scan.processes >= 3


def test_two_workers_find_what_one_finds(tmp_path: Path, hold) -> None:
    files = []
    for i in range(3):
        f = tmp_path / f"seg{i}"
        f.write_bytes(b"\0" * 4096)
        files.append(f)
        hold("fd" if i % 2 else "map", f)
    watch = _holders.Watch(keys={key(f) for f in files}, names={f.name for f in files})
    one, two = _holders.scan(watch, workers=1), _holders.scan(watch, workers=2)
    assert {k: sorted((h.pid, h.how) for h in v) for k, v in one.holds.items()} == {k: sorted((h.pid, h.how) for h in v) for k, v in two.holds.items()}
    assert len(one.holds) == 3


def test_a_hold_is_recorded_once() -> None:
    scan = _holders.Scan()
    for _repeat in range(3):
        scan.add((1, 2), 42, "fd")
    scan.add((1, 2), 42, "mmap")
    assert [(h.pid, h.how) for h in scan.holds[(1, 2)]] == [(42, "fd"), (42, "mmap")]


def test_socket_owners_and_bound_paths(tmp_path: Path) -> None:
    path = str(tmp_path / "ipc.sock")
    server = socket.socket(socket.AF_UNIX)
    server.bind(path)
    abstract = socket.socket(socket.AF_UNIX)
    abstract.bind(f"\0clean-slate-test-{os.getpid()}")
    try:
        inode = os.fstat(server.fileno()).st_ino
        bound = {p: i for i, p in _holders.read_unix("self")}
        assert bound[path] == inode
        assert not any(p.startswith("@clean-slate-test") for p in bound)  # abstract names are no files
        # The scan skips this process; a child that inherits the socket is its owner there.
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], pass_fds=(server.fileno(),))
        try:
            deadline = time.monotonic() + 10
            owners: list[int] = []
            while not owners and time.monotonic() < deadline:
                owners = _holders.scan(_holders.Watch(sockets={inode}, netns=True), workers=1).socket_owners.get(inode, [])
            assert owners == [child.pid]
        finally:
            child.kill()
            child.wait()
    finally:
        server.close()
        abstract.close()


def test_locks_table_names_the_holder(tmp_path: Path) -> None:
    path = tmp_path / "x.lock"
    path.write_bytes(b"")
    with open(path, "r+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        st = os.fstat(fh.fileno())
        locks = _holders.read_locks({(st.st_dev, st.st_ino)})
        assert [(h.pid, h.how) for h in locks[(st.st_dev, st.st_ino)]] == [(os.getpid(), "lock")]
    assert _holders.read_locks({(st.st_dev, st.st_ino)}) == {}


def test_lock_lines_of_every_kind_are_parsed(tmp_path: Path) -> None:
    text = (
        "1: POSIX  ADVISORY  WRITE 1234 00:2a:183 0 EOF\n"
        "1: -> POSIX  ADVISORY  WRITE 1240 00:2a:183 0 EOF\n"
        "2: OFDLCK ADVISORY  READ  -1 00:2a:184 0 0\n"
        "3: FLOCK  ADVISORY  WRITE 99 fd:01:184 0 EOF\n"
        "4: LEASE  ACTIVE    READ  77 00:2a:185 0 EOF\n"
    )
    path = tmp_path / "locks"
    path.write_text(text)
    dev = os.makedev(0, 0x2A)
    found = _holders.read_locks({(dev, 183), (dev, 184), (dev, 185)}, str(path))
    assert [h.pid for h in found[(dev, 183)]] == [1234, 1240]
    assert [h.pid for h in found[(dev, 184)]] == [-1]  # the fd:01 line is another device
    assert [h.pid for h in found[(dev, 185)]] == [77]


def test_zombies_are_seen_without_signalling_anything() -> None:
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    try:
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            scan = _holders.scan(_holders.Watch())
            if any(z[0] == pid for z in scan.zombies):
                break
            time.sleep(0.01)
        assert (pid, os.getpid()) in [(z[0], z[1]) for z in scan.zombies]
    finally:
        os.waitpid(pid, 0)


def test_every_thread_counts_and_a_process_whose_main_thread_exited_is_alive(tmp_path: Path, thread_hold) -> None:
    """What each task has open, mapped or as its working directory, not only the main thread's."""
    files = {mode: tmp_path / mode for mode in ("files", "exit-fd", "exit-map")}
    for f in files.values():
        f.write_bytes(b"\0" * 4096)
    workdir = tmp_path / "work"
    workdir.mkdir()
    procs = {mode: thread_hold(mode, path) for mode, path in [*files.items(), ("fs", workdir)]}
    for mode in ("exit-fd", "exit-map"):
        status = Path(f"/proc/{procs[mode].pid}/status").read_text()
        assert "State:\tZ (zombie)" in status and "Threads:\t2" in status
    # The main threads hold none of them.
    assert not any(os.readlink(f"/proc/{procs['files'].pid}/fd/{fd}") == str(files["files"]) for fd in os.listdir(f"/proc/{procs['files'].pid}/fd"))
    assert os.readlink(f"/proc/{procs['fs'].pid}/cwd") != str(workdir)
    watch = _holders.Watch(keys={key(f) for f in files.values()}, names=set(files), cwd_keys={key(workdir)})
    for workers in (1, 2):
        scan = _holders.scan(watch, workers=workers)
        held = {k: sorted((h.pid, h.how) for h in v) for k, v in scan.holds.items()}
        assert held[key(files["files"])] == [(procs["files"].pid, "fd")]
        assert held[key(files["exit-fd"])] == [(procs["exit-fd"].pid, "fd")]
        assert (procs["exit-map"].pid, "mmap") in held[key(files["exit-map"])]
        assert held[key(workdir)] == [(procs["fs"].pid, "cwd")]
        assert not {procs["exit-fd"].pid, procs["exit-map"].pid} & {z[0] for z in scan.zombies}, "a living process reported as a zombie"


def test_a_socket_bound_in_a_threads_own_file_table_has_its_owner(tmp_path: Path, thread_hold) -> None:
    path = tmp_path / "ipc.sock"
    proc = thread_hold("files-bind", path)
    [inode] = [i for i, p in _holders.read_unix(proc.pid) if p == str(path)]
    scan = _holders.scan(_holders.Watch(sockets={inode}, netns=True), workers=1)
    assert scan.socket_owners[inode] == [proc.pid]


TARGET = r"""
import ctypes, os, sys, time
held = open(sys.argv[1], "rb")  # the file this process holds, opened while it is root
go, said = int(sys.argv[2]), int(sys.argv[3])
os.write(said, b"r")
os.read(go, 1)
# What an exec that changes credentials does for a moment: another uid, undumpable until told otherwise.
os.setgroups([])
os.setresgid(65534, 65534, 65534)
os.setresuid(65534, 65534, 65534)
ctypes.CDLL(None).prctl(4, 1, 0, 0, 0)  # PR_SET_DUMPABLE 1
os.write(said, b"d")
time.sleep(60)
"""


def test_a_process_that_refuses_one_read_is_read_again_and_one_that_keeps_refusing_is_unreadable(tmp_path: Path) -> None:
    """The pass runs as nobody: root's processes refuse it. One of them holds a file and turns into nobody's, as a
    process in mid-exec would, while the pass pauses before reading the refusers again: it is read then, and what it
    holds is found; the others still refuse and stay unreadable (the residue phase then proves nothing orphaned)."""
    held = tmp_path / "segment"
    held.write_bytes(b"\0" * 4096)
    go_r, go_w = os.pipe()
    said_r, said_w = os.pipe()
    target = subprocess.Popen([sys.executable, "-c", TARGET, str(held), str(go_r), str(said_w)], pass_fds=(go_r, said_w))
    try:
        assert os.read(said_r, 1) == b"r"
        watch = _holders.Watch(keys={key(held)}, names={held.name})  # stat'ed as root: nobody cannot reach tmp_path
        _proctable.kcmp()  # its lazy imports (ctypes) while root: nobody cannot read this interpreter's library
        out_r, out_w = os.pipe()
        child = os.fork()
        if child == 0:  # the pass, as nobody
            try:
                os.setgroups([])
                os.setresgid(65534, 65534, 65534)
                os.setresuid(65534, 65534, 65534)

                class Pause:
                    """The pass's pause before the second read: the moment the target changes."""

                    @staticmethod
                    def sleep(_seconds: float) -> None:
                        os.write(go_w, b"g")
                        os.read(said_r, 1)

                _holders.time = Pause  # type: ignore[assignment]
                scan = _holders.scan(watch, workers=1)
                found = [(h.pid, h.how) for hs in scan.holds.values() for h in hs]
                os.write(out_w, repr((found, scan.unreadable)).encode())
            except BaseException as exc:  # said to the test, which fails on it
                os.write(out_w, repr(([], [repr(exc)])).encode())
            finally:
                os._exit(0)
        os.close(out_w)
        with os.fdopen(out_r) as fh:
            found, unreadable = ast.literal_eval(fh.read())
        os.waitpid(child, 0)
        assert found == [(target.pid, "fd")], (found, unreadable, target.pid)
        assert target.pid not in unreadable
        assert os.getpid() in unreadable  # root's pytest refuses the pass both times
    finally:
        target.kill()
        target.wait()
