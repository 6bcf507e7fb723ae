"""_signals against real processes: escalation, SIGCONT, grace, vanishing, unkillable."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import typing as t
from pathlib import Path

import pytest

from ansible_collections.gpuops.clean_slate.plugins.module_utils import _proctable, _signals

CHILD = textwrap.dedent(
    """
    import signal, sys, time
    mode = sys.argv[1]
    if mode == "ignore":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    elif mode.startswith("slow:"):
        delay = float(mode.split(":")[1])
        signal.signal(signal.SIGTERM, lambda *_: (time.sleep(delay), sys.exit(0)))
    elif mode in ("dying", "dies-on-term"):
        # A process in its teardown, as a killed torch worker is: it exits (exit_group), and one of its threads is stuck
        # in the kernel with SIGKILL pending (in the driver, there; here frozen by the test through the cgroup v1
        # freezer before the exit), so the process is gone only once that thread can die (the test thaws it).
        import os, threading
        stuck = threading.Thread(target=lambda: time.sleep(3600), daemon=True)
        stuck.start()
        print(stuck.native_id, flush=True)
        signal.signal(signal.SIGUSR1 if mode == "dying" else signal.SIGTERM, lambda *_: os._exit(0))
    print("ready", flush=True)
    while True:
        time.sleep(1)
    """
)


@pytest.fixture
def spawn():
    procs: list[subprocess.Popen] = []

    def _spawn(mode: str = "default") -> subprocess.Popen:
        p = subprocess.Popen([sys.executable, "-c", CHILD, mode], stdout=subprocess.PIPE, text=True)
        assert p.stdout is not None
        if mode in ("dying", "dies-on-term"):
            p.stuck_tid = int(p.stdout.readline())  # type: ignore[attr-defined]
        assert p.stdout.readline().strip() == "ready"
        procs.append(p)
        return p

    yield _spawn
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()


def victim(p: subprocess.Popen) -> _signals.Victim:
    ident = _proctable.identity(p.pid)
    assert ident is not None
    return _signals.pin(p.pid, ident)


def test_term_ends_a_plain_process_at_once(spawn) -> None:
    p = spawn()
    v = victim(p)
    took = _signals.escalate([v], grace_period=10, kill_timeout=10)
    assert v.outcome == "terminated"
    assert v.signals_sent == ["TERM"]
    # Returned when it was gone, not after the 10 s grace period (5 s: far above what a loaded
    # machine adds, far below the grace).
    assert took < 5
    assert p.wait(timeout=5) == -signal.SIGTERM


def test_grace_period_is_honoured_before_sigkill(spawn) -> None:
    p = spawn("ignore")
    v = victim(p)
    start = time.monotonic()
    _signals.escalate([v], grace_period=0.6, kill_timeout=5)
    elapsed = time.monotonic() - start
    # KILL came after TERM and not before the grace period was over (lower bounds: never early).
    assert v.outcome == "killed"
    assert v.signals_sent == ["TERM", "KILL"]
    assert elapsed >= 0.6, elapsed
    assert v.seconds is not None and v.seconds >= 0.6
    assert p.wait(timeout=5) == -signal.SIGKILL


def test_stopped_process_is_continued_so_it_can_act_on_sigterm(spawn) -> None:
    p = spawn()
    os.kill(p.pid, signal.SIGSTOP)
    deadline = time.time() + 2
    while _proctable.read_stat(p.pid)["state"] != "T" and time.time() < deadline:
        time.sleep(0.01)
    v = victim(p)
    _signals.escalate([v], grace_period=5, kill_timeout=5)
    # Continued, so it acted on TERM within the grace period: terminated, no KILL.
    assert v.signals_sent == ["TERM", "CONT"]
    assert v.outcome == "terminated"


def test_waiting_returns_when_the_last_target_is_gone(spawn) -> None:
    procs = [spawn(f"slow:{d}") for d in (0.05, 0.1, 0.2, 0.3)]
    victims = [victim(p) for p in procs]
    took = _signals.escalate(victims, grace_period=10, kill_timeout=10)
    assert all(v.outcome == "terminated" for v in victims)
    # Not before the slowest was gone; well before the 10 s grace (5 s: room for a loaded machine).
    assert 0.3 <= took < 5, took
    # Each one is stamped when it went, not when the wait ended: in the order they exited.
    seconds = [v.seconds for v in victims]
    assert seconds == sorted(seconds) and seconds[0] < seconds[-1], seconds


def test_first_signal_kill_skips_the_grace_period(spawn) -> None:
    p = spawn("ignore")
    v = victim(p)
    took = _signals.escalate([v], first="KILL", grace_period=30, kill_timeout=5)
    assert v.outcome == "killed" and v.signals_sent == ["KILL"]
    assert took < 15  # the 30 s grace period was skipped (15 s: room for a loaded machine)


def test_a_process_that_is_gone_or_replaced_is_never_signalled(spawn) -> None:
    p = spawn()
    ident = _proctable.identity(p.pid)
    p.kill()
    p.wait()
    v = _signals.pin(p.pid, ident)
    assert v.outcome == "vanished" and v.pidfd is None
    _signals.escalate([v])
    assert v.signals_sent == []
    # Same pid, another identity (start time, or the same tick but another program): refused as well.
    q = spawn()
    ident_q = _proctable.identity(q.pid)
    assert ident_q is not None
    for other in ((ident_q[0] + 1, *ident_q[1:]), (ident_q[0], ident_q[1], b"sleep\x0060\x00", *ident_q[3:])):
        w = _signals.pin(q.pid, other)
        assert w.outcome == "vanished" and w.pidfd is None
    w = _signals.pin(q.pid, (ident_q[0] + 1, *ident_q[1:]))
    _signals.escalate([w])
    assert w.outcome == "vanished" and w.signals_sent == []
    assert q.poll() is None


FREEZER = Path("/sys/fs/cgroup/freezer")


@pytest.mark.skipif(not (FREEZER / "freezer.state").exists() and not FREEZER.is_dir(), reason="cgroup v1 freezer not available")
def test_a_process_stuck_in_d_state_is_reported_unkillable(spawn, tmp_path: Path) -> None:
    # A task frozen by the cgroup v1 freezer sits in D state and ignores SIGKILL until thawed:
    # the same picture as a task stuck inside the NVIDIA driver.
    p = spawn()
    group = FREEZER / f"gpuops-test-{os.getpid()}"
    group.mkdir()
    try:
        (group / "cgroup.procs").write_text(str(p.pid))
        (group / "freezer.state").write_text("FROZEN")
        deadline = time.time() + 2
        while _proctable.read_stat(p.pid)["state"] != "D" and time.time() < deadline:
            time.sleep(0.01)
        v = victim(p)
        start = time.monotonic()
        _signals.escalate([v], grace_period=0.2, kill_timeout=0.3)
        # Gave up after grace + kill_timeout instead of waiting on the frozen task (15 s: room
        # for a loaded machine, far from "forever").
        assert time.monotonic() - start < 15
        assert v.outcome == "unkillable"
        assert v.state == "D"
        assert v.wchan  # the kernel function it waits in, for the diagnosis
        assert v.signals_sent == ["TERM", "KILL"]
    finally:
        (group / "freezer.state").write_text("THAWED")
        p.wait(timeout=5)
        group.rmdir()


@contextlib.contextmanager
def stuck_thread(p: subprocess.Popen) -> t.Iterator[t.Callable[[float], None]]:
    """Freeze the child's other thread (cgroup v1 freezer: D state, deaf to SIGKILL until thawed), as a thread stuck in
    the driver; yields ``thaw_in(seconds)``; thawed at the end whatever happened."""
    group = FREEZER / f"gpuops-test-{os.getpid()}-{p.pid}"
    group.mkdir()
    tid = p.stuck_tid  # type: ignore[attr-defined]
    timers: list[threading.Timer] = []

    def thaw() -> None:
        (group / "freezer.state").write_text("THAWED")

    def thaw_in(seconds: float) -> None:
        timers.append(threading.Timer(seconds, thaw))
        timers[-1].start()

    try:
        (group / "tasks").write_text(str(tid))
        (group / "freezer.state").write_text("FROZEN")
        deadline = time.time() + 5
        while (group / "freezer.state").read_text().strip() != "FROZEN" and time.time() < deadline:
            time.sleep(0.01)
        yield thaw_in
    finally:
        for timer in timers:
            timer.cancel()
        thaw()
        p.kill()
        p.wait()
        deadline = time.time() + 5
        while group.exists() and time.time() < deadline:
            try:
                group.rmdir()
            except OSError:
                time.sleep(0.05)


def exit_now(p: subprocess.Popen) -> None:
    """Make the child exit (exit_group) while its other thread is stuck: until its leader is a zombie."""
    os.kill(p.pid, signal.SIGUSR1)
    deadline = time.time() + 5
    while (_proctable.read_stat(p.pid) or {}).get("state") != "Z" and time.time() < deadline:
        time.sleep(0.01)


needs_freezer = pytest.mark.skipif(not (FREEZER / "freezer.state").exists() and not FREEZER.is_dir(), reason="cgroup v1 freezer not available")


@needs_freezer
def test_a_process_already_in_its_teardown_is_waited_for_never_signalled(spawn) -> None:
    # Dying before the kill came (a crash, the OOM killer): its leader has exited, its last thread is stuck in the
    # kernel with SIGKILL pending and ends 1.5 s later.
    p = spawn("dying")
    with stuck_thread(p) as thaw_in:
        exit_now(p)
        v = victim(p)
        assert v.outcome is None and _signals.exiting(p.pid, v.identity)
        thaw_in(1.5)
        start = time.monotonic()
        _signals.escalate([v], grace_period=0.2, kill_timeout=0.2, deadline=start + 30)
        # Waited past grace and kill_timeout, up to its end; nothing sent (SIGKILL cannot shorten a teardown).
        assert v.outcome == "exited" and v.signals_sent == []
        assert v.teardown_s is not None and v.teardown_s >= 1.0, v
        assert p.wait(timeout=5) == 0  # it ended by itself: a SIGKILL would read -9


@needs_freezer
def test_a_teardown_longer_than_the_grace_period_gets_no_sigkill(spawn) -> None:
    # SIGTERM makes it exit, but its teardown outlasts the grace period: it is on its way, SIGKILL would change nothing.
    p = spawn("dies-on-term")
    with stuck_thread(p) as thaw_in:
        v = victim(p)
        thaw_in(1.5)
        start = time.monotonic()
        _signals.escalate([v], grace_period=0.3, kill_timeout=0.3, deadline=start + 30)
        assert v.outcome == "terminated" and v.signals_sent == ["TERM"], v
        assert v.teardown_s is not None and v.teardown_s >= 0.5
        assert p.wait(timeout=5) == 0


@needs_freezer
def test_a_teardown_that_outlasts_the_deadline_is_unkillable_on_time(spawn) -> None:
    p = spawn("dying")
    with stuck_thread(p):
        exit_now(p)
        v = victim(p)
        start = time.monotonic()
        _signals.escalate([v], grace_period=0.2, kill_timeout=0.2, deadline=start + 1.0)
        # Given up at the deadline, not after the stuck thread ends (15 s: room for a loaded machine).
        assert time.monotonic() - start < 15
        assert v.outcome == "unkillable" and v.exiting_since is not None and v.state == "Z"
        assert v.teardown_s is not None and v.teardown_s >= 0.9


def test_a_process_whose_main_thread_alone_has_exited_is_signalled_not_waited_for(start_ready) -> None:
    """Its main thread reads as a zombie and as exiting, but its other thread lives on and holds what the process
    holds (issue 26): it is no teardown. The kill signals it, and it ends."""
    from support.threads import THREAD_HOLDER

    p = start_ready(THREAD_HOLDER, "exit-fd", "/dev/null")
    st = _proctable.read_stat(p.pid)
    assert st is not None and st["state"] == "Z" and st["threads"] == 2
    v = victim(p)
    assert v.outcome is None and not _signals.exiting(p.pid, v.identity)
    _signals.escalate([v], grace_period=0.5, kill_timeout=5, deadline=time.monotonic() + 30)
    assert v.outcome in ("terminated", "killed") and v.signals_sent[:1] == ["TERM"], v
    assert p.wait(timeout=5) in (-signal.SIGTERM, -signal.SIGKILL)
