# Copyright (c) 2026, gpuops.clean_slate maintainers
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# Note: this module_util is PRIVATE to the collection; it may change without notice.

"""Who holds a file: one pass over /proc, plus /proc/locks and the unix socket tables.

A file is held while a live process has it open (``/proc/PID/fd``), maps it
(``/proc/PID/maps``), has its working directory or root in it, holds a lock on
it (``/proc/locks``), or (for a socket file) has a socket bound to it
(``/proc/PID/net/unix``). Every thread counts: a thread can have a file table,
a working directory and root, and a network namespace of its own
(``unshare(CLONE_FILES)``, ``unshare(CLONE_FS)``, ``unshare(CLONE_NEWNET)``),
read from ``/proc/PID/task/TID``; threads that share the main thread's are told
apart with ``kcmp(2)`` and read once (when kcmp cannot tell, each is read). A
process whose main thread has exited while others run is alive: its threads
hold what it holds, and it is not a zombie. Everything is matched by device and inode, never by
path: the same path names different files in different mount namespaces (a
container's ``/dev/shm`` is not the host's), and a path printed by the kernel
is relative to the reader's root. Paths only narrow down which fds to stat.

The pass is written for speed (it is the cost of the residue phase on a host
with thousands of processes): one stat of the task directory (its link count
gives the number of threads), one listdir and one readlink per fd, one read
of maps per process, a stat only for fds whose name is a candidate's, and for
a process with several threads one kcmp per thread.
Every reader tolerates processes that vanish mid-scan, and a process that
refuses a read is read once more a moment later (a transition such as an exec
that changes credentials refuses reads briefly).
"""

from __future__ import annotations

import os
import re
import threading
import time
import typing as t
from dataclasses import dataclass, field

from ansible_collections.gpuops.clean_slate.plugins.module_utils import _proctable

Key = t.Tuple[int, int]  # (st_dev, st_ino)

# "1: FLOCK  ADVISORY  WRITE 1234 00:1a:5678 0 EOF"; blocked waiters carry "->" after the id.
_LOCK_LINE = re.compile(r"^\d+:\s+(?:->\s+)?(\S+)\s+\S+\s+\S+\s+(-?\d+)\s+([0-9a-fA-F]+):([0-9a-fA-F]+):(\d+)\s")
_MAPS_BUFFER = 262144


def dev_token(dev: int) -> str:
    """A device number as /proc/PID/maps and /proc/locks print it (``%02x:%02x``)."""
    return f"{os.major(dev):02x}:{os.minor(dev):02x}"


@dataclass
class Hold:
    """One way one process holds one file."""

    pid: int
    how: str  # fd, mmap, cwd, root, lock, bound


@dataclass
class Watch:
    """What to look for in one pass."""

    keys: set[Key] = field(default_factory=set)  # files and directories whose holders are wanted
    names: set[str] = field(default_factory=set)  # their names: an fd is stat'ed only when its target has one of them
    any_name: bool = False  # some file has other hard links: stat every fd that names a path
    name_only: set[str] = field(default_factory=set)  # names on overlayfs, whose maps show the lower inode: match maps by name
    cwd_keys: set[Key] = field(default_factory=set)  # directories: processes whose cwd or root is one of them
    sockets: set[int] | None = field(default_factory=set)  # socket inodes whose owners are wanted (None: every socket)
    netns: bool = False  # find one process per network namespace
    zombies: bool = True


@dataclass
class Scan:
    """What one pass found."""

    holds: dict[Key, list[Hold]] = field(default_factory=dict)
    name_holds: dict[str, list[Hold]] = field(default_factory=dict)  # overlayfs names mapped (see Watch.name_only)
    socket_owners: dict[int, list[int]] = field(default_factory=dict)
    netns: dict[int, int | str] = field(default_factory=dict)  # network namespace inode -> a pid (or "pid/task/tid") in it
    zombies: list[tuple[int, int, str]] = field(default_factory=list)  # (pid, ppid, comm)
    unreadable: list[int] = field(default_factory=list)  # pids whose fds or maps could not be read (permission)
    processes: int = 0
    error: Exception | None = None

    def add(self, key: Key, pid: int, how: str) -> None:
        holds = self.holds.setdefault(key, [])
        for h in holds:
            if h.pid == pid and h.how == how:
                return
        holds.append(Hold(pid, how))


def _read_all(path: str, buf: bytearray) -> bytes | None:
    """The whole of a /proc file, reading into ``buf`` to spare an allocation per process."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        # A read of a seq_file returns whole records, not the whole file: read until EOF.
        chunks: list[bytes] = []
        while True:
            n = os.readv(fd, [buf])
            if not n:
                return b"".join(chunks)
            chunks.append(bytes(memoryview(buf)[:n]))
    except OSError:
        return None
    finally:
        os.close(fd)


def describe_unreadable(pids: list[int], limit: int = 5) -> str:
    """The processes a pass could not read, as ``pid (comm, state)``, the first ``limit`` of them."""
    shown = []
    for pid in pids[:limit]:
        line = _stat_line(str(pid))
        shown.append(f"{pid} ({line[2]}, state {line[0]})" if line else f"{pid} (gone)")
    return ", ".join(shown) + (f" and {len(pids) - limit} more" if len(pids) > limit else "")


def _stat_line(pid: str) -> tuple[str, int, str] | None:
    """(state, ppid, comm) from /proc/PID/stat."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            raw = fh.read().decode("utf-8", "backslashreplace")
    except OSError:
        return None
    head, _sep, rest = raw.rpartition(")")
    fields = rest.split()
    if len(fields) < 2:
        return None
    return fields[0], int(fields[1]), head.partition("(")[2]


def scan(watch: Watch, workers: int = 0) -> Scan:
    """One pass over every process in this /proc (this process excepted).

    The pass is bound by the kernel's work (generating maps, resolving fd
    links), so threads could share it: with ``workers`` threads (0: two on a
    machine with more than one CPU) the processes are split between them and
    the findings merged. More do not pay: measured on a 16-CPU H200 node with
    3 000 processes, 1 or 2 threads took 0.13 s, 4 took 0.25 s and 8 0.31 s
    (the kernel's per-process work and the GIL serialise them).
    """
    self_pid = str(os.getpid())
    names = [n for n in os.listdir("/proc") if n.isdigit() and n != self_pid]
    if workers <= 0:
        workers = 2 if (os.cpu_count() or 1) > 1 else 1
    workers = max(1, min(workers, len(names) // 256 or 1))
    parts = [Scan() for _unused in range(workers)]
    if workers == 1:
        _scan_part(names, watch, parts[0])
    else:
        threads = [threading.Thread(target=_scan_part, args=(names[i::workers], watch, parts[i]), daemon=True) for i in range(workers)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
    out = parts[0]
    for part in parts[1:]:
        for key, holds in part.holds.items():
            out.holds.setdefault(key, []).extend(holds)
        for name, holds in part.name_holds.items():
            out.name_holds.setdefault(name, []).extend(holds)
        for ino, pids in part.socket_owners.items():
            out.socket_owners.setdefault(ino, []).extend(pids)
        for ns, pid in part.netns.items():
            out.netns.setdefault(ns, pid)
        out.zombies.extend(part.zombies)
        out.unreadable.extend(part.unreadable)
        out.processes += part.processes
    if part_errors := [p.error for p in parts if p.error is not None]:
        raise part_errors[0]
    if out.unreadable:
        _read_again(out, watch)
    return out


#: How long a process that refused a read is left before it is read again (see _read_again).
RETRY_PAUSE_S = 0.05


def _read_again(out: Scan, watch: Watch) -> None:
    """Read the processes that refused a read once more, after a moment, and keep as unreadable only those that still
    refuse. A process caught in a transition (an exec that changes its credentials makes it undumpable for a moment;
    an exit under way) can refuse one read and allow the next, and one that has exited since holds nothing: without
    this, one such moment anywhere on the host makes the whole residue pass incomplete. What the second read finds is
    added to the first's (holds are kept once each)."""
    time.sleep(RETRY_PAUSE_S)
    again = Scan()
    _scan_part([str(pid) for pid in dict.fromkeys(out.unreadable)], watch, again)
    if again.error is not None:
        raise again.error
    for key, holds in again.holds.items():
        for hold in holds:
            out.add(key, hold.pid, hold.how)
    for name, holds in again.name_holds.items():
        known = out.name_holds.setdefault(name, [])
        known.extend(h for h in holds if h not in known)
    for ino, pids in again.socket_owners.items():
        owners = out.socket_owners.setdefault(ino, [])
        owners.extend(p for p in pids if p not in owners)
    for ns, where in again.netns.items():
        out.netns.setdefault(ns, where)
    out.zombies.extend(z for z in again.zombies if z not in out.zombies)
    out.unreadable = again.unreadable


def _scan_part(proc_names: list[str], watch: Watch, out: Scan) -> None:
    try:
        _scan_loop(proc_names, watch, out)
    except Exception as exc:  # noqa: BLE001 - re-raised by scan() in the caller's thread
        out.error = exc


def _scan_loop(proc_names: list[str], watch: Watch, out: Scan) -> None:
    keys, names, any_name = watch.keys, watch.names, watch.any_name
    want_sockets, all_sockets = watch.sockets, watch.sockets is None
    by_token = {dev_token(dev).encode(): dev for dev in {k[0] for k in keys}}
    tokens_sp = [b" " + tok + b" " for tok in by_token]
    name_tokens = [b"/" + n.encode("utf-8", "surrogateescape") for n in watch.name_only]
    read_maps = bool(tokens_sp or name_tokens)
    want_cwd = bool(watch.cwd_keys)
    need_fds = bool(keys) or all_sockets or bool(want_sockets)
    buf = bytearray(_MAPS_BUFFER)
    listdir, readlink, stat = os.listdir, os.readlink, os.stat
    kcmp = _proctable.kcmp()

    def scan_fds(pid: int, fd_dir: str, fds: list[str]) -> None:
        prefix = fd_dir + "/"
        for fd in fds:
            try:
                target = readlink(prefix + fd)
            except OSError:
                continue
            if target[:1] == "/":
                if not keys or target.endswith(" (deleted)"):
                    continue
                if any_name or target.rpartition("/")[2] in names:
                    try:
                        st = stat(prefix + fd)
                    except OSError:
                        continue
                    key = (st.st_dev, st.st_ino)
                    if key in keys:
                        out.add(key, pid, "fd")
            elif target[:8] == "socket:[":
                ino = int(target[8:-1])
                if all_sockets or ino in t.cast(t.Set[int], want_sockets):
                    owners = out.socket_owners.setdefault(ino, [])
                    if pid not in owners:
                        owners.append(pid)

    def scan_cwd(pid: int, base: str) -> None:
        for link in ("cwd", "root"):
            try:
                st = stat(base + "/" + link)
            except OSError:
                continue
            key = (st.st_dev, st.st_ino)
            if key in watch.cwd_keys:
                out.add(key, pid, link)

    for name in proc_names:
        base = "/proc/" + name
        pid = int(name)
        # The other threads: each may have a file table and a working directory and root of its own
        # (unshare(CLONE_FILES), unshare(CLONE_FS)), and a process whose main thread has exited lives on in them.
        # The task directory's link count is two more than the number of threads: one stat tells most processes
        # (one thread) apart, and only the others are listed.
        try:
            threads = stat(base + "/task").st_nlink - 2
        except OSError:
            continue  # gone
        tids = _other_tids(base, name) if threads > 1 else []
        fds: list[str] | None = None
        if need_fds:
            try:
                fds = listdir(base + "/fd")
            except PermissionError:
                out.unreadable.append(pid)
            except OSError:
                continue  # gone
        out.processes += 1
        if fds:
            scan_fds(pid, base + "/fd", fds)
        if need_fds and tids:
            fds = _scan_thread_fds(pid, base, tids, kcmp, listdir, scan_fds, out, fds)
        maps = b""
        if read_maps:
            data = _read_all(base + "/maps", buf)
            if not data and tids:
                # A main thread that has exited has no memory map of its own any more; its threads share one.
                data = next((d for d in (_read_all(f"{base}/task/{tid}/maps", buf) for tid in tids) if d), data)
            if data is None:
                if os.path.exists(base) and fds is not None:
                    out.unreadable.append(pid)
            else:
                maps = data
                if any(tok in data for tok in tokens_sp) or any(tok in data for tok in name_tokens):
                    _match_maps(data, by_token, watch, out, pid)
        if want_cwd:
            scan_cwd(pid, base)
            for task in _proctable.distinct_tasks(pid, tids, kcmp, _proctable.KCMP_FS):
                scan_cwd(pid, f"{base}/task/{task}")
        if watch.netns:
            # A thread may have a network namespace of its own (unshare(CLONE_NEWNET)): its unix table is its own.
            places: list[tuple[int | str, str]] = [(pid, base + "/ns/net")]
            places += [(f"{name}/task/{tid}", f"{base}/task/{tid}/ns/net") for tid in tids]
            for where, ns_link in places:
                try:
                    ns = readlink(ns_link)
                    out.netns.setdefault(int(ns[5:-1]), where)
                except (OSError, ValueError):
                    pass
        # A zombie has neither files nor memory: only those, and unreadable ones, cost a stat read. A process
        # whose main thread is a zombie while other threads run is alive, not a zombie.
        if watch.zombies and not fds and not maps and not tids:
            st_line = _stat_line(name)
            if st_line and st_line[0] == "Z":
                out.zombies.append((pid, st_line[1], st_line[2]))


def _other_tids(base: str, name: str) -> list[str]:
    try:
        return [tid for tid in os.listdir(base + "/task") if tid != name]
    except OSError:
        return []


def _scan_thread_fds(
    pid: int,
    base: str,
    tids: list[str],
    kcmp: t.Callable[[int, int, int, int, int], int],
    listdir: t.Callable[[str], list[str]],
    scan_fds: t.Callable[[int, str, list[str]], None],
    out: Scan,
    fds: list[str] | None,
) -> list[str] | None:
    """The file tables of the threads that do not share the main thread's (one each, read once); returns the fds
    seen, the main thread's or else a thread's, for the zombie test."""
    for task in _proctable.distinct_tasks(pid, tids, kcmp, _proctable.KCMP_FILES):
        fd_dir = f"{base}/task/{task}/fd"
        try:
            task_fds = listdir(fd_dir)
        except PermissionError:
            out.unreadable.append(pid)
            continue
        except OSError:
            continue  # the thread has exited
        scan_fds(pid, fd_dir, task_fds)
        fds = fds or task_fds
    return fds


def _match_maps(data: bytes, by_token: dict[bytes, int], watch: Watch, out: Scan, pid: int) -> None:
    for line in data.split(b"\n"):
        parts = line.split(None, 5)
        if len(parts) < 5:
            continue
        dev = by_token.get(parts[3])
        if dev is not None:
            try:
                key = (dev, int(parts[4]))
            except ValueError:
                continue
            if key in watch.keys:
                out.add(key, pid, "mmap")
                continue
        if watch.name_only and len(parts) == 6:
            path = parts[5].strip()
            if path.endswith(b" (deleted)"):
                continue
            base = path.rpartition(b"/")[2].decode("utf-8", "surrogateescape")
            if base in watch.name_only:
                # Overlayfs maps show the lower file's inode: the name is all there is to go by.
                holds = out.name_holds.setdefault(base, [])
                if not any(h.pid == pid for h in holds):
                    holds.append(Hold(pid, "mmap"))


def read_locks(keys: set[Key], path: str = "/proc/locks") -> dict[Key, list[Hold]]:
    """Locks (flock, POSIX, OFD, leases) held on ``keys``, with the holder pid (-1 or 0: not known here)."""
    out: dict[Key, list[Hold]] = {}
    if not keys:
        return out
    devs = {dev_token(dev): dev for dev in {k[0] for k in keys}}
    try:
        with open(path, encoding="ascii", errors="replace") as fh:
            lines = fh.readlines()
    except OSError:
        return out
    for line in lines:
        m = _LOCK_LINE.match(line)
        if not m:
            continue
        dev = devs.get(f"{m.group(3).lower()}:{m.group(4).lower()}")
        if dev is None:
            continue
        key = (dev, int(m.group(5)))
        if key in keys:
            out.setdefault(key, []).append(Hold(int(m.group(2)), "lock"))
    return out


def read_unix(pid: int | str) -> list[tuple[int, str]]:
    """Bound unix sockets of the network namespace of ``pid``: (socket inode, path). Abstract ones are left out."""
    out = []
    try:
        with open(f"/proc/{pid}/net/unix", encoding="utf-8", errors="surrogateescape") as fh:
            next(fh, None)
            for line in fh:
                parts = line.rstrip("\n").split(None, 7)
                if len(parts) == 8 and parts[7][:1] != "@":
                    out.append((int(parts[6]), parts[7]))
    except (OSError, ValueError):
        pass
    return out
