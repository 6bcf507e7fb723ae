# Copyright (c) 2026, gpuops.clean_slate maintainers
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# Note: this module_util is PRIVATE to the collection; it may change without notice.

"""The stop in a server's own order: which of the kill's targets is a server's root, which is a resource tracker,
and who still needs a tracker. Pure reading of /proc; the kill (``_kill``) sends the signals.

A server is not a set of equal processes. SGLang's launcher, on SIGTERM, asks its schedulers to release their
resources and exit (ShutdownReq), then kills the rest of its tree and waits until it is reaped; its schedulers,
detokenizer and data-parallel controller have no SIGTERM handler, so a TERM sent to them directly is a raw crash
that leaves their files. vLLM's API server, on SIGTERM, has its engine core stop its workers. So the root goes
first, alone, with the grace its own teardown needs (``servers``: the server profiles' roots and grace); what is
left of the tree after it is ended as before. A root that is already dead (a crash: the workers reparented) has no
teardown to run, and the rest goes at once.

Python's multiprocessing resource tracker (``python -c 'from multiprocessing.resource_tracker import main;main(FD)'``,
and loky's) ignores SIGINT and SIGTERM and, when the last process holding its pipe is gone, unlinks every shared
memory segment and semaphore its clients registered and exits. Ending it while a client lives guarantees the leak (a
client in a long GPU teardown outlives any grace period). So a tracker is spared while any process still holds the
write end of its pipe (its clients, found by the pipe's inode), given a moment after the last one to unlink and exit
on its own, and only then ended if it is still there; one whose client is a process the kill does not end (it is
still needed) is left alone.
"""

from __future__ import annotations

import os
import re
import typing as t
from dataclasses import dataclass

from ansible_collections.gpuops.clean_slate.plugins.module_utils import _checks, _reasons
from ansible_collections.gpuops.clean_slate.plugins.module_utils._errors import CleanSlateError

#: The command line of a resource tracker, with the fd of its pipe's read end: CPython's
#: (Lib/multiprocessing/resource_tracker.py, ensure_running: 'from multiprocessing.resource_tracker import main;main(%d)')
#: and loky's (joblib/externals/loky/backend/resource_tracker.py: 'from ...loky.backend.resource_tracker import main; main(%d, %d)').
TRACKER = re.compile(r"-c from (?:multiprocessing|[\w.]*loky\.backend)\.resource_tracker import main; ?main\((\d+)")


@dataclass
class Server:
    """A server whose root gets the first signal alone: a process whose command line matches ``roots``."""

    name: str
    roots: list[re.Pattern[str]]
    grace: float


def parse_servers(entries: t.Sequence[t.Mapping[str, t.Any]], grace_period: float) -> list[Server]:
    """The ``servers`` option, checked: each root pattern compiles, its grace is a number of seconds in range (the
    kill's ``grace_period`` when not given). Raises ``bad_arguments`` naming ``servers``."""
    out = []
    for e in entries:
        name = str(e.get("name") or "")
        roots = e.get("roots") or []
        if not name or not roots:
            raise CleanSlateError(
                f"servers: every server needs a name and at least one root pattern, got {dict(e)!r}.", reason=_reasons.BAD_ARGUMENTS, option="servers"
            )
        compiled = []
        for pattern in roots:
            if not pattern:
                raise CleanSlateError(f"servers: {name}: an empty root pattern matches every process.", reason=_reasons.BAD_ARGUMENTS, option="servers")
            try:
                compiled.append(re.compile(pattern))
            except re.error as exc:
                raise CleanSlateError(
                    f"servers: {name}: {pattern!r} is not a valid regular expression ({exc}).", reason=_reasons.BAD_ARGUMENTS, option="servers"
                ) from None
        grace = grace_period if e.get("grace") is None else e["grace"]
        try:
            _checks.number(f"servers: {name}: grace", grace, 0, _checks.MAX_SECONDS, unit="seconds")
        except CleanSlateError as exc:
            exc.details["option"] = "servers"
            raise
        out.append(Server(name=name, roots=compiled, grace=float(grace)))
    return out


def server_of(cmdline: str, servers: t.Sequence[Server]) -> Server | None:
    """The server whose root this command line is (the first that matches), or None."""
    for server in servers:
        if any(rx.search(cmdline) for rx in server.roots):
            return server
    return None


def tracker_fd(cmdline: str) -> int | None:
    """The fd of a resource tracker's pipe (its read end, in the tracker), or None when ``cmdline`` is no tracker's."""
    m = TRACKER.search(cmdline)
    return int(m.group(1)) if m else None


def pipe_of(pid: int, fd: int) -> str | None:
    """What ``/proc/PID/fd/FD`` links to when it is a pipe (``pipe:[inode]``), else None."""
    try:
        link = os.readlink(f"/proc/{pid}/fd/{fd}")
    except OSError:
        return None
    return link if link.startswith("pipe:[") else None


def clients(tracker: int, pipe: str) -> list[int]:
    """Every other process holding ``pipe`` (a tracker's clients hold its write end; each spawned child inherits it)."""
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == tracker:
            continue
        try:
            fds = os.listdir(f"/proc/{name}/fd")
        except OSError:
            continue  # gone, or not readable: the kill runs as root to see them
        for fd in fds:
            try:
                if os.readlink(f"/proc/{name}/fd/{fd}") == pipe:
                    out.append(int(name))
                    break
            except OSError:
                continue
    return out
