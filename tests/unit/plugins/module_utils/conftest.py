"""Shared by the module_utils tests: real processes that hold real files (under tools/pidns-run)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
from support.threads import THREAD_HOLDER

HOLDER = textwrap.dedent(
    """
    import fcntl, mmap, os, socket, struct, sys, time
    mode, path = sys.argv[1], sys.argv[2]
    keep = []
    if mode == "cwd":
        os.chdir(path)
    elif mode == "bind":
        s = socket.socket(socket.AF_UNIX); s.bind(path); s.listen(); keep.append(s)
    else:
        fd = os.open(path, os.O_RDWR)
        if mode == "map":
            keep.append(mmap.mmap(fd, 4096)); os.close(fd)
        elif mode == "flock":
            fcntl.flock(fd, fcntl.LOCK_EX); keep.append(fd)
        elif mode == "posix":
            fcntl.lockf(fd, fcntl.LOCK_EX); keep.append(fd)
        elif mode == "ofd":
            # F_OFD_SETLK (37): the lock belongs to the open file description, /proc/locks shows pid -1
            fcntl.fcntl(fd, 37, struct.pack("hhqqi", fcntl.F_WRLCK, 0, 0, 0, 0) + bytes(4)); keep.append(fd)
        else:
            keep.append(fd)
    print("ready", flush=True)
    time.sleep(60)
    """
)


@pytest.fixture
def start_ready():
    """Start ``python -c SCRIPT ARGS...`` and wait until it prints ``ready``; every one is killed at the end."""
    procs: list[subprocess.Popen] = []

    def start(script: str, *args: str) -> subprocess.Popen:
        p = subprocess.Popen([sys.executable, "-c", script, *args], stdout=subprocess.PIPE, text=True)
        assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        procs.append(p)
        return p

    yield start
    for p in procs:
        p.kill()
        p.wait()


@pytest.fixture
def thread_hold(start_ready):
    """Start a process one of whose threads (not the main one) holds ``path``: ``files`` (an fd in its own file
    table), ``files-bind`` (a unix socket bound in its own file table), ``fs`` (its own working directory),
    ``exit-fd`` and ``exit-map`` (open or mapped, the main thread exited)."""
    return lambda mode, path: start_ready(THREAD_HOLDER, mode, str(path))


@pytest.fixture
def hold(start_ready):
    """Start a process that holds ``path``: ``fd`` (open), ``map`` (mapped), ``flock``, ``posix`` (lockf),
    ``ofd`` (an open file description lock), ``bind`` (a unix socket) or ``cwd``."""
    return lambda mode, path: start_ready(HOLDER, mode, str(path))
