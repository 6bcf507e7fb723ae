# Copyright (c) 2026, gpuops.clean_slate maintainers
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# Note: this module_util is PRIVATE to the collection; it may change without notice.

"""What is kept although nothing holds it: a file whose named creator lives, a file younger than the minimum age,
a compile lock whose directory a process works in.

"Nothing holds it" (:mod:`.owners`) is not the only proof a file is unused:

* A name that carries its creator's pid (:data:`.walk.CREATOR_PID`) may be unheld while its creator lives and
  still needs it: torch's CUDA IPC ref counter ``torch_<pid>_<rand>_<n>`` was held by no file descriptor while its
  creator ran (H200, server-facts 2026-12-02), SGLang's ``multi_tokenizer_args_<pid>`` is written, closed, and read
  later by the tokenizer workers. While that process lives, and started no later than the file last changed (else
  its pid was reused by a newer process, and the creator is dead), the file is kept. The pid is the creator's as
  it saw itself, so in a container scope it is looked up in the container's own ``/proc``.
* A server starting beside the run has a segment between ``shm_open`` and ``mmap`` that nothing holds yet (SGLang's
  own sweep waits 10 minutes for that reason): a file that changed (mtime or ctime, for a directory anything in
  it) less than ``min_age`` seconds ago is kept, unless its name carries its creator's pid and that creator is
  known to be gone (then nobody is starting with it: a crashed server's queues go at once, as SGLang's sweep has
  it); a creator that cannot be looked up (its scope's /proc unreadable) leaves the age rule in force.
* torch's ``cpp_extension`` baton (``<build dir>/lock``) is held by no process while its compile runs, but the
  compile's ninja works in that directory (``subprocess.run(..., cwd=build_directory)``): a lock whose directory
  is a live process's working directory or root is held.

Each rule marks the item ``kept`` (or ``held``) with a sentence saying why; check mode applies the same rules.
"""

from __future__ import annotations

import os
import re
import time
import typing as t
from dataclasses import dataclass

from ansible_collections.gpuops.clean_slate.plugins.module_utils import _holders, _procs, _proctable
from ansible_collections.gpuops.clean_slate.plugins.module_utils._residue.owners import Holders, scope_of
from ansible_collections.gpuops.clean_slate.plugins.module_utils._residue.walk import Glob, Item, Key, Root, creator_pid, path_matches

#: A process's start time has a clock tick's resolution (10 ms), a file's times a nanosecond's: a creator that
#: started up to this long after the file's last change is still taken for its creator (the safe side).
START_SLACK_NS = 20_000_000


def _clock_offset_ns() -> int:
    """Wall-clock ns at boot: /proc/PID/stat's start time counts clock ticks since boot (CLOCK_BOOTTIME)."""
    boottime = getattr(time, "CLOCK_BOOTTIME", time.CLOCK_MONOTONIC)
    return time.time_ns() - time.clock_gettime_ns(boottime)


class Creators:
    """Looks up the processes names point at, once each, in each scope's own /proc."""

    def __init__(self) -> None:
        self.ticks = os.sysconf("SC_CLK_TCK")
        self.offset = _clock_offset_ns()
        self._cache: dict[tuple[int | None, int], tuple[int, str] | None] = {}
        #: (scope, pid) whose /proc entry could not be read for another reason than its absence: alive or not, unknown.
        self._unknown: set[tuple[int | None, int]] = set()

    def started(self, root: Root, pid: int) -> tuple[int, str] | None:
        """(wall-clock start in ns, name) of the live process ``pid`` as ``root``'s scope numbers it, or None."""
        key = (root.init_pid, pid)
        if key not in self._cache:
            proc = "/proc" if root.init_pid is None else f"/proc/{root.init_pid}/root/proc"
            self._cache[key] = None
            try:
                with open(f"{proc}/{pid}/stat", encoding="utf-8", errors="replace") as fh:
                    head, _sep, rest = fh.read().rpartition(")")
                fields = rest.split()
                if fields and fields[0] not in ("Z", "X"):  # a zombie has exited: it created nothing that lives
                    self._cache[key] = (self.offset + int(fields[19]) * 1_000_000_000 // self.ticks, head.partition("(")[2])
            except FileNotFoundError:
                # No such process, unless the scope's /proc itself cannot be read (its PID 1 is always there).
                if not os.path.isdir(f"{proc}/1"):
                    self._unknown.add(key)
            except (OSError, ValueError, IndexError):
                self._unknown.add(key)
        return self._cache[key]

    def dead(self, root: Root, pid: int) -> bool:
        """Whether ``pid`` (looked up by :meth:`started`) is known not to be a live process in ``root``'s scope."""
        return self._cache.get((root.init_pid, pid)) is None and (root.init_pid, pid) not in self._unknown


@dataclass
class KeepWhile:
    """Files a server opens only while it uses them (a torch FileStore, a daemon's marker): kept while a process of that
    server (one of ``patterns``) runs in the file's scope."""

    server: str
    globs: list[Glob]
    patterns: list[re.Pattern[str]]


class Running:
    """The live processes of each scope, read once when a rule first asks (command line, name, executable)."""

    def __init__(self, roots: t.Mapping[int | None, Root]) -> None:
        self.roots = roots
        self._facts: list[_procs.ProcFacts] | None = None

    def match(self, rule: KeepWhile, root: Root) -> _procs.ProcFacts | None:
        """A live process of ``rule``'s server in ``root``'s scope (any on the host for the host's own files), or None."""
        if self._facts is None:
            self._facts = [f for pid in _proctable.pids() if (f := _procs.read_facts(pid)) is not None and not f.kernel]
        for f in self._facts:
            if _proctable.exited(f.state, f.threads) or _procs.matches_patterns(f, rule.patterns) is None:
                continue
            if root.scope is None or scope_of(f.pid, [root.scope]) is not None:
                return f
        return None


def apply(
    items: t.Sequence[Item],
    roots: t.Mapping[int | None, Root],
    min_age: float,
    now_ns: int | None = None,
    keep_while: t.Sequence[KeepWhile] = (),
) -> None:
    """Keep the orphans whose named creator lives, those a running server may still use (``keep_while``), and those
    younger than ``min_age`` seconds unless this run's kill released them (``item.released``)."""
    now = time.time_ns() if now_ns is None else now_ns
    creators = Creators()
    running = Running(roots)
    young = int(min_age * 1_000_000_000)
    for item in items:
        if item.verdict != "remove":
            continue
        changed = item.changed_ns()
        if changed is None:
            continue  # gone: the removal says so
        rule = next((r for r in keep_while if any(path_matches(g, item.path) for g in r.globs)), None)
        if rule is not None:
            server = running.match(rule, roots[item.vmid])
            if server is not None:
                item.verdict = "kept"
                item.why = f"a process of {rule.server} runs, PID {server.pid} ({server.comm}): it opens this file only while it uses it; kept while one runs"
                continue
        pid = creator_pid(item.name)
        if pid is not None:
            root = roots[item.vmid]
            found = creators.started(root, pid)
            if found is not None and found[0] <= changed + START_SLACK_NS:
                item.verdict = "kept"
                item.creator = {"pid": pid, "name": found[1]}
                item.why = f"its creator, PID {pid} ({found[1]}), is alive; kept while it lives"
                continue
            if found is not None or creators.dead(root, pid):
                # Its creator is gone (its pid dead, or now a process that started after the file last changed): the
                # process between shm_open and mmap that min_age protects was that creator, so the file goes whatever
                # its age. SGLang's own sweep applies its minimum age to pid-less names only; a server that crashes
                # and is restarted at once would otherwise leave its queues for a minute each time.
                continue
        if item.released:
            # Its holders, seen before the kill, were all ended by this run: no server starting now holds it.
            continue
        if now - changed < young:
            item.verdict = "kept"
            item.why = f"younger than min_age ({max(0.0, (now - changed) / 1e9):.1f} s < {min_age:g} s): a process starting now may not hold it yet"


def lock_directories(items: t.Sequence[Item]) -> dict[Key, list[Item]]:
    """The directories of the lock candidates (device, inode), with their locks."""
    out: dict[Key, list[Item]] = {}
    seen: dict[int, Key] = {}
    for item in items:
        if item.kind != "locks" or item.verdict == "skipped":
            continue
        if item.dir_fd not in seen:
            st = os.fstat(item.dir_fd)
            seen[item.dir_fd] = (st.st_dev, st.st_ino)
        out.setdefault(seen[item.dir_fd], []).append(item)
    return out


def worked_in(directories: t.Mapping[Key, list[Item]], scan: _holders.Scan, holders: Holders) -> None:
    """Hold every unheld lock whose directory a live process works in (its cwd or root)."""
    for key, locks in directories.items():
        holds = [h for h in scan.holds.get(key, ()) if h.how in ("cwd", "root")]
        if not holds:
            continue
        records = []
        for h in holds[:10]:
            rec = holders.describe(h.pid)
            rec["how"] = [f"{h.how} in its directory"]
            records.append(rec)
        for item in locks:
            if item.verdict == "remove":
                item.verdict, item.holders, item.holder_pids = "held", records, frozenset(h.pid for h in holds)
