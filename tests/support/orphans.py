"""Processes that are not descendants of the test process.

Tests that run discovery in-process play the module, and discovery protects
every process the module started; a target must come from elsewhere, as GPU
jobs do. ``spawn_orphan`` double-forks, so the process is re-parented to the
PID namespace's init at once (tests that signal run under tools/pidns-run,
whose init reaps it).
"""

from __future__ import annotations

import os
import signal
import time
import typing as t

import psutil


def spawn_orphan(argv: list[str], ready: bytes | None = None, timeout: float = 10.0) -> int:
    """Start ``argv`` detached (own session, init as parent); returns its pid once its command line shows ``ready``."""
    r, w = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - runs in the forked child
        try:
            os.close(r)
            grandchild = os.fork()
            if grandchild == 0:
                os.close(w)
                os.setsid()
                os.execvp(argv[0], argv)
            os.write(w, str(grandchild).encode())
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r) as fh:
        pid = int(fh.read())
    os.waitpid(child, 0)
    deadline = time.monotonic() + timeout
    while ready is not None and time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                if ready in fh.read():
                    break
        except OSError:
            break
        time.sleep(0.005)
    return pid


def end(pid: int, timeout: float = 10.0) -> None:
    """SIGKILL ``pid`` through a pidfd (never a recycled pid) and wait until init has reaped it."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    try:
        signal.pidfd_send_signal(fd, signal.SIGKILL)
    except ProcessLookupError:
        pass
    finally:
        os.close(fd)
    gone(pid, timeout)


def gone(pid: int, timeout: float = 10.0) -> bool:
    """Wait until /proc/PID is gone (exited and reaped)."""
    deadline = time.monotonic() + timeout
    while os.path.exists(f"/proc/{pid}"):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


def renamed(sandbox: t.Any, names: list[str]) -> dict[str, psutil.Process]:
    """A process per name in ``sandbox``, each renamed (``exec -a``) as a server renames its workers and holding no GPU,
    so that only name patterns can find them; returned by name once every one shows its name."""
    for name in names:
        sandbox.spawn_detached(["bash", "-c", f'exec -a "{name}" sleep 300'])
    procs: dict[str, psutil.Process] = {}
    for _attempt in range(500):
        procs = {p.info["cmdline"][0]: p for p in psutil.process_iter(["cmdline"]) if p.info["cmdline"] and p.info["cmdline"][0] in names}
        if len(procs) == len(names):
            break
        psutil.wait_procs([], timeout=0.01)
    assert set(procs) == set(names), procs
    return procs
