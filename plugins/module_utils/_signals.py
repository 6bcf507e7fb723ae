# Copyright (c) 2026, gpuops.clean_slate maintainers
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# Note: this module_util is PRIVATE to the collection; it may change without notice.

"""End processes: SIGTERM (+SIGCONT for stopped ones), a grace period, SIGKILL,
and waiting on facts rather than sleeps.

Identity is pid + start time (+ comm, cmdline, exe and owner, since start
times tick every 10 ms). Each target is pinned with a pidfd (``pidfd_open``)
and its identity is read again through /proc after the pidfd is open and
compared with what discovery saw; every signal goes through that pidfd. A pid
reused between discovery and signal can never be hit, and the pidfd becomes
readable the moment the
process exits, so waiting returns as soon as the last target is gone instead
of sleeping. Where pidfds are unavailable (kernel < 5.3), psutil's own
reuse check and a short polling loop stand in.

A process that is already exiting (the kernel has set PF_EXITING: it is
dying, or its leader is a zombie while another thread finishes) is in its
teardown: a GPU process sits in the driver until its contexts are freed, and
no signal can shorten that (on the H200 0.12-0.22 s; pathological cases more
than 30 s). Such a process is never signalled again: it is waited for, until
the run's deadline, and reported with the seconds that took
(``teardown_s``). One that is still there at the deadline, or that has not
even begun to exit ``kill_timeout`` after SIGKILL, is ``unkillable``. A teardown that still makes progress at the
deadline (``progress``: the memory of its GPUs going down, its state or CPU time changing) is waited for longer, while
it moves, up to a cap (``cap``); one that has not moved for ``stall`` seconds is unkillable then, on time.

Each victim ends with ``ended_by``: the first signal's name (it exited on it), ``KILL``, ``waited`` (it was already
exiting and got no signal), ``gone`` (it had exited before its signal); the kill sets the server's own stop
(``own_stop``, ``server_stop``, ``own_exit``: ``_kill``).
"""

from __future__ import annotations

import os
import select
import signal
import time
import typing as t
from dataclasses import dataclass, field

from ansible_collections.gpuops.clean_slate.plugins.module_utils import _proctable

try:
    import psutil

    HAS_PSUTIL = True
except ImportError:  # pragma: no cover - depends on the target host
    HAS_PSUTIL = False

SIGNALS = {
    "TERM": signal.SIGTERM,
    "INT": signal.SIGINT,
    "HUP": signal.SIGHUP,
    "QUIT": signal.SIGQUIT,
    "USR1": signal.SIGUSR1,
    "USR2": signal.SIGUSR2,
    "KILL": signal.SIGKILL,
}
_POLL_FALLBACK_S = 0.005
_POLL_SLICE_S = 60.0
PF_EXITING = _proctable.PF_EXITING


@dataclass
class Victim:
    """A process being ended, pinned by pid + start time (and a pidfd where possible)."""

    pid: int
    identity: tuple[t.Any, ...] | None
    proc: t.Any = None  # psutil.Process
    pidfd: int | None = None
    signals_sent: list[str] = field(default_factory=list)
    outcome: str | None = None  # terminated | killed | vanished | unkillable
    seconds: float | None = None
    state: str | None = None
    wchan: str | None = None
    exiting_since: float | None = None  #: when it was first seen exiting (clock of the run)
    teardown_s: float | None = None  #: seconds waited for its teardown, from exiting_since until it was gone
    first: str | None = None  #: its own first signal, instead of escalate's (a server's root already had its TERM: KILL)
    ended_by: str | None = None  #: how it ended (module docstring)

    @property
    def done(self) -> bool:
        return self.outcome is not None


def exiting(pid: int, identity: tuple[t.Any, ...] | None) -> bool:
    """Whether the process (still this one) has begun to exit: PF_EXITING, or a zombie whose threads are ending. A
    process whose main thread alone has exited is not exiting: its other threads live on and hold what it holds."""
    st = _proctable.read_stat(pid)
    if st is None or identity is None or st["starttime"] != identity[0]:
        return False
    return (bool(st["flags"] & PF_EXITING) or st["state"] in ("Z", "X")) and not _proctable.live_threads(pid)


def pin(pid: int, identity: tuple[t.Any, ...] | None) -> Victim:
    """Pin a process for signalling; a process that is gone or was replaced comes back ``vanished``."""
    victim = Victim(pid=pid, identity=identity)
    if hasattr(os, "pidfd_open"):
        try:
            victim.pidfd = os.pidfd_open(pid)
        except ProcessLookupError:
            victim.outcome, victim.seconds = "vanished", 0.0
            return victim
        except OSError:
            victim.pidfd = None
    # With the pidfd open, the pid can no longer change hands: whatever /proc shows
    # now is the pinned process, and it must be the one discovery chose.
    st = _proctable.read_stat(pid)
    if identity is None or st is None or st["starttime"] != identity[0]:
        close(victim)
        victim.outcome, victim.seconds = "vanished", 0.0
        return victim
    if (st["flags"] & PF_EXITING or st["state"] in ("Z", "X")) and not _proctable.live_threads(pid):
        # Dying already (a crash, the OOM killer): nothing to signal, but its teardown may still hold the GPU. (A
        # process whose main thread alone has exited is signalled: its other threads receive it.)
        # A pidfd tells when it is gone; without one, psutil cannot wait for a zombie's threads, so it counts as gone.
        if victim.pidfd is None:
            victim.outcome, victim.seconds = "vanished", 0.0
        return victim
    if _proctable.identity(pid) != identity:
        close(victim)
        victim.outcome, victim.seconds = "vanished", 0.0
        return victim
    try:
        victim.proc = psutil.Process(pid)
    except psutil.Error:
        close(victim)
        victim.outcome, victim.seconds = "vanished", 0.0
    return victim


def close(victim: Victim) -> None:
    """Release the pidfd."""
    if victim.pidfd is not None:
        try:
            os.close(victim.pidfd)
        except OSError:
            pass
        victim.pidfd = None


def send(victim: Victim, name: str) -> bool:
    """Send signal ``name``; False when the process is already gone."""
    sig = SIGNALS.get(name, getattr(signal, f"SIG{name}", None))
    if sig is None:
        raise ValueError(f"unknown signal {name}")
    try:
        if victim.pidfd is not None:
            signal.pidfd_send_signal(victim.pidfd, sig)
        else:
            victim.proc.send_signal(sig)  # psutil refuses a reused pid (NoSuchProcess)
    except (ProcessLookupError, psutil.NoSuchProcess):
        return False
    victim.signals_sent.append(name)
    return True


def exited(victim: Victim) -> bool:
    """True once the process has exited (a zombie holds no GPU memory, so it counts as gone)."""
    if victim.pidfd is not None:
        ready = select.select([victim.pidfd], [], [], 0)[0]
        return bool(ready)
    try:
        return not victim.proc.is_running() or victim.proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def wait_exit(victims: list[Victim], deadline: float, start: float, outcome: str, clock: t.Callable[[], float]) -> None:
    """Block until every victim has exited or ``deadline`` passes, stamping each one as it goes."""
    pending = [v for v in victims if not v.done]
    while pending:
        for v in pending:
            if exited(v):
                v.outcome, v.seconds = outcome, round(clock() - start, 4)
        pending = [v for v in pending if not v.done]
        now = clock()
        if not pending or now >= deadline:
            return
        fds = [v.pidfd for v in pending if v.pidfd is not None]
        if len(fds) == len(pending):
            poller = select.poll()
            for fd in fds:
                poller.register(fd, select.POLLIN)
            # poll() takes a C int of milliseconds: wait in slices of at most a minute, the loop re-checks.
            poller.poll(max(1, int(min(deadline - now, _POLL_SLICE_S) * 1000)))
        else:
            time.sleep(min(_POLL_FALLBACK_S, deadline - now))


def _is_stopped(victim: Victim) -> bool:
    st = _proctable.read_stat(victim.pid)
    return bool(st and victim.identity and st["starttime"] == victim.identity[0] and st["state"] in ("T", "t"))


def wait_teardown(
    dying: list[Victim],
    deadline: float,
    start: float,
    clock: t.Callable[[], float],
    progress: t.Callable[[list[Victim]], bool] | None = None,
    cap: float | None = None,
    stall: float = 10.0,
) -> None:
    """Wait for victims in their teardown until ``deadline``; past it, while their teardown moves (``progress`` says it
    moved since it was last asked), up to ``cap``, until ``stall`` seconds pass without a move. Without ``progress`` or
    ``cap`` (or with a cap not past the deadline) this is the wait until the deadline, no more."""
    pending = [v for v in dying if not v.done]
    moved: float | None = None
    watch = progress is not None and cap is not None and cap > deadline
    if watch:
        t.cast(t.Callable[[t.List[Victim]], bool], progress)(pending)  # the first reading: moves are counted from it
    step = max(0.05, min(1.0, stall / 4))
    while pending:
        now = clock()
        limit = deadline
        if watch and moved is not None:
            limit = max(deadline, min(t.cast(float, cap), moved + stall))
        if now >= limit:
            return
        wait_exit(pending, min(limit, now + step) if watch else limit, start, "killed", clock)
        pending = [v for v in pending if not v.done]
        if watch and pending and t.cast(t.Callable[[t.List[Victim]], bool], progress)(pending):
            moved = clock()


def escalate(
    victims: list[Victim],
    first: str = "TERM",
    grace_period: float = 10.0,
    kill_timeout: float = 10.0,
    clock: t.Callable[[], float] = time.monotonic,
    deadline: float | None = None,
    progress: t.Callable[[list[Victim]], bool] | None = None,
    cap: float | None = None,
    stall: float = 10.0,
) -> float:
    """End ``victims``: ``first`` signal (a victim's own ``first`` wins), SIGCONT to stopped ones, grace, SIGKILL, wait.

    A victim already exiting (pinned so, or found so when its grace period ends) is not signalled
    (again): SIGKILL cannot shorten a teardown. ``deadline`` (absolute, on ``clock``; None: no later
    than ``kill_timeout`` after SIGKILL) is how long a teardown under way is waited for; past it, one
    that still makes ``progress`` is waited for up to ``cap`` (:func:`wait_teardown`). Returns the
    seconds it took; every victim ends with an ``outcome``: terminated, killed, exited (it was
    already exiting and got no signal), vanished or unkillable, and with ``ended_by``.
    """
    start = clock()
    live = [v for v in victims if not v.done]
    for v in live:
        if exiting(v.pid, v.identity):
            v.exiting_since = start
        elif not send(v, v.first or first):
            v.outcome, v.seconds = "vanished", round(clock() - start, 4)
    if any((v.first or first) != "KILL" for v in live):
        # A stopped process cannot act on SIGTERM until it is continued.
        for v in live:
            if not v.done and v.signals_sent and _is_stopped(v):
                send(v, "CONT")
        wait_exit(live, start + grace_period, start, "terminated", clock)
    survivors = [v for v in live if not v.done]
    if survivors:
        kill_start = clock()
        for v in survivors:
            if v.exiting_since is None and exiting(v.pid, v.identity):
                v.exiting_since = kill_start  # its teardown outlasted the grace period: no SIGKILL, it is on its way
            if v.exiting_since is None and (v.first or first) != "KILL" and not send(v, "KILL"):
                v.outcome, v.seconds = "killed", round(clock() - start, 4)
        wait_exit(survivors, kill_start + kill_timeout, start, "killed", clock)
        late = [v for v in survivors if not v.done]
        now = clock()
        for v in late:
            if v.exiting_since is None and exiting(v.pid, v.identity):
                v.exiting_since = now
        dying = [v for v in late if v.exiting_since is not None]
        if dying and deadline is not None and (deadline > now or (cap is not None and cap > now)):
            wait_teardown(dying, deadline, start, clock, progress, cap, stall)
    end = clock()
    for v in live:
        if v.exiting_since is not None:
            if v.done:
                v.teardown_s = round(start + (v.seconds or 0.0) - v.exiting_since, 4)
                if not v.signals_sent:
                    v.outcome = "exited"
                elif v.outcome == "killed" and "KILL" not in v.signals_sent:
                    v.outcome = "terminated"  # its first signal made it exit; the teardown took longer than the grace period
            else:
                v.teardown_s = round(end - v.exiting_since, 4)
        if not v.done:
            # Still there: stuck in the kernel (D state: its teardown in the driver, or an uninterruptible wait
            # that SIGKILL cannot interrupt), frozen, or the like.
            st = _proctable.read_stat(v.pid)
            v.state = st["state"] if st else None
            v.wchan = _proctable.wchan(v.pid)
            v.outcome, v.seconds = "unkillable", round(end - start, 4)
    for v in live:
        if v.outcome == "terminated" and (v.first or first) == "KILL":
            v.outcome = "killed"  # its first signal was SIGKILL (a root that had its TERM and its grace)
        if v.ended_by is None and v.outcome != "unkillable":
            v.ended_by = ended_by(v, v.first or first)
    for v in victims:
        close(v)
    return clock() - start


def ended_by(v: Victim, first: str) -> str | None:
    """How a victim of :func:`escalate` ended, from its outcome and the signals it got."""
    if v.outcome == "vanished":
        return "gone"
    if v.outcome == "exited":
        return "waited"
    if v.outcome == "killed" or "KILL" in v.signals_sent:
        return "KILL"
    if v.outcome == "terminated":
        return first
    return None
