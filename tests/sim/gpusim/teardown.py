"""CUDA teardown in the kernel: an exiting process stays in the driver until its contexts are freed.

What the H200 showed (docs/validation.md): a killed torch process is not gone when the signal
lands. The kernel's exit path closes the process's ``/dev/nvidia*`` files, and the driver tears
the GPU contexts down inside that close; the process (as a pidfd, ``waitpid`` or ``gpu_procs_kill``
sees it) is gone only once that is done, 150-300 ms later, after SIGTERM and SIGKILL alike, and
SIGKILL cannot shorten it (the task sits in state D). Its memory is back about when it is gone;
a forked child that holds the context takes as long to exit, the parent of such a child does not.

The simulation does it the same way, in the kernel, with FUSE: the driver daemon mounts a tiny
file system at ``$GPUSIM_STATE/teardown`` and each CUDA-like worker, once its contexts exist,
opens ``teardown/<id>[,<id>...]`` (its context ids) and never closes it. When the worker exits,
the kernel closes that file and sends FUSE_FLUSH, a request the kernel waits for
*uninterruptibly*: the exiting task sits in state D (``wchan`` ``request_wait_answer``), keeps
its pid, and its pidfd stays unreadable until the daemon answers. The daemon answers when the
driver would have freed those contexts (``release_delay_ms`` after the death, ``release_gap_ms``
apart on one GPU: the calibrated timing), plus ``teardown_hang_ms`` (0 by default; more models a
task stuck in the driver). A holder that is not the last one (the parent of a forked child) is
answered at once. Without /dev/fuse or the right to mount, there is no teardown file and workers
exit at once, as before.

Only the requests the kernel sends for this use are answered; everything else gets ENOSYS.
"""

from __future__ import annotations

import ctypes
import errno
import os
import re
import struct
import threading
import time
import typing as t
from pathlib import Path

# Opcodes (include/uapi/linux/fuse.h).
LOOKUP, FORGET, GETATTR, OPEN, RELEASE, FLUSH, INIT, INTERRUPT, BATCH_FORGET, DESTROY = 1, 2, 3, 14, 18, 25, 26, 36, 42, 38
NO_REPLY = (FORGET, BATCH_FORGET, INTERRUPT)
IN_HEADER = struct.Struct("IIQQIIIHH")  # len, opcode, unique, nodeid, uid, gid, pid, total_extlen, padding
OUT_HEADER = struct.Struct("IiQ")  # len, error, unique
ATTR = struct.Struct("QQQQQQIIIIIIIIII")  # ino size blocks atime mtime ctime *nsec(3) mode nlink uid gid rdev blksize flags
ENTRY_OUT = struct.Struct("QQQQII")  # nodeid generation entry_valid attr_valid entry_valid_nsec attr_valid_nsec
ATTR_OUT = struct.Struct("QII")  # attr_valid attr_valid_nsec dummy
OPEN_OUT = struct.Struct("QIi")  # fh open_flags backing_id
# major minor max_readahead flags max_background congestion_threshold max_write time_gran max_pages map_alignment flags2 max_stack_depth
INIT_OUT = struct.Struct("IIIIHHIIHHII24x")
FLUSH_IN = struct.Struct("QIIQ")  # fh unused padding lock_owner
FOPEN_DIRECT_IO = 1 << 0
MS_NOSUID, MS_NODEV, MNT_DETACH = 2, 4, 2
_NAME = re.compile(r"^\d+(,\d+)*$")


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def unmount(path: str | os.PathLike[str]) -> bool:
    """Lazily detach a teardown mount (True if something was unmounted)."""
    return _libc().umount2(os.fsencode(str(path)), MNT_DETACH) == 0


class TeardownFS:
    """The FUSE side of the driver daemon (see the module docstring).

    ``on_exit(ctx_ids, closing_pid)`` is called when the last holder of a worker's teardown file
    closes it (the worker is exiting); it returns the CLOCK_MONOTONIC nanoseconds at which the
    driver will have freed those contexts, or None when it knows nothing of them.
    """

    def __init__(self, mountpoint: Path, on_exit: t.Callable[[list[int], int], int | None], hang_ms: t.Callable[[], int]) -> None:
        self.mountpoint = Path(mountpoint)
        self.on_exit = on_exit
        self.hang_ms = hang_ms
        self.fd = -1
        self.paused = False
        self._lock = threading.Lock()
        self._nodes: dict[int, str] = {}  # nodeid -> name ("3,4": the context ids)
        self._next = 2
        self._pending: dict[int, float] = {}  # unique -> when to answer (monotonic seconds)
        self._wake = threading.Condition(self._lock)

    # ------------------------------------------------------------------ life cycle
    def mount(self) -> bool:
        """Mount, or return False (no /dev/fuse, no privilege): the node then has no teardown."""
        self.mountpoint.mkdir(parents=True, exist_ok=True)
        try:
            self.fd = os.open("/dev/fuse", os.O_RDWR | os.O_CLOEXEC)
        except OSError:
            return False
        opts = f"fd={self.fd},rootmode=40000,user_id=0,group_id=0,allow_other".encode()
        if _libc().mount(b"gpusim", os.fsencode(str(self.mountpoint)), b"fuse.gpusim", MS_NOSUID | MS_NODEV, opts) != 0:
            os.close(self.fd)
            self.fd = -1
            return False
        threading.Thread(target=self._serve, name="teardown-fuse", daemon=True).start()
        threading.Thread(target=self._answer_due, name="teardown-timer", daemon=True).start()
        return True

    def unmount(self) -> None:
        if self.fd >= 0:
            unmount(self.mountpoint)

    def pause(self, paused: bool) -> None:
        """While paused (a sandbox or the node is being torn down) exits are answered at once."""
        with self._lock:
            self.paused = paused
            if paused:
                for unique in self._pending:
                    self._pending[unique] = 0.0
                self._wake.notify()

    # ------------------------------------------------------------------ protocol
    def _reply(self, unique: int, error: int = 0, body: bytes = b"") -> None:
        try:
            os.write(self.fd, OUT_HEADER.pack(OUT_HEADER.size + len(body), -error if error else 0, unique) + body)
        except OSError:
            pass  # the request was interrupted or the connection aborted

    def _attr(self, ino: int) -> bytes:
        mode = 0o40755 if ino == 1 else 0o100666
        now = int(time.time())
        return ATTR.pack(ino, 0, 0, now, now, now, 0, 0, 0, mode, 2 if ino == 1 else 1, 0, 0, 0, 4096, 0)

    def _serve(self) -> None:
        while True:
            try:
                buf = os.read(self.fd, (1 << 20) + 4096)
            except InterruptedError:
                continue
            except OSError as exc:
                if exc.errno in (errno.ENOENT, errno.EINTR, errno.EAGAIN):
                    continue  # ENOENT: the request was interrupted before we read it
                return  # ENODEV: unmounted
            length, opcode, unique, nodeid, _uid, _gid, pid, _ext, _pad = IN_HEADER.unpack_from(buf)
            body = buf[IN_HEADER.size : length]
            try:
                self._dispatch(opcode, unique, nodeid, pid, body)
            except Exception:
                if opcode not in NO_REPLY:
                    self._reply(unique, errno.EIO)

    def _dispatch(self, opcode: int, unique: int, nodeid: int, pid: int, body: bytes) -> None:
        if opcode == INIT:
            # Protocol 7.31 is enough for this and every kernel since 5.x speaks it.
            self._reply(unique, 0, INIT_OUT.pack(7, 31, 0, 0, 16, 12, 4096, 1, 32, 0, 0, 0))
        elif opcode == LOOKUP:
            name = body.split(b"\0", 1)[0].decode(errors="replace")
            if nodeid != 1 or not _NAME.match(name):
                self._reply(unique, errno.ENOENT)
                return
            with self._lock:
                ino = self._next
                self._next += 1
                self._nodes[ino] = name
            # entry_valid 0: every open looks the name up again, so each worker gets its own inode.
            self._reply(unique, 0, ENTRY_OUT.pack(ino, 0, 0, 0, 0, 0) + self._attr(ino))
        elif opcode == GETATTR:
            if nodeid != 1 and nodeid not in self._nodes:
                self._reply(unique, errno.ENOENT)
                return
            self._reply(unique, 0, ATTR_OUT.pack(0, 0, 0) + self._attr(nodeid))
        elif opcode == OPEN:
            self._reply(unique, 0, OPEN_OUT.pack(nodeid, FOPEN_DIRECT_IO, 0))
        elif opcode == FLUSH:
            self._flush(unique, nodeid, pid)
        elif opcode == RELEASE:
            with self._lock:
                self._nodes.pop(nodeid, None)
            self._reply(unique)
        elif opcode in NO_REPLY:
            return
        else:
            self._reply(unique, errno.ENOSYS)

    # ------------------------------------------------------------------ the exit path
    def _flush(self, unique: int, nodeid: int, pid: int) -> None:
        name = self._nodes.get(nodeid)
        if name is None or self._other_holders(nodeid, pid):
            self._reply(unique)  # not the last holder: its exit frees nothing
            return
        release_ns = self.on_exit([int(x) for x in name.split(",")], pid)
        if release_ns is None:
            self._reply(unique)
            return
        due = release_ns / 1e9 + self.hang_ms() / 1000.0
        with self._lock:
            self._pending[unique] = 0.0 if self.paused else due
            self._wake.notify()

    def _answer_due(self) -> None:
        while True:
            with self._lock:
                now = time.monotonic()
                due = [u for u, when in self._pending.items() if when <= now]
                for u in due:
                    del self._pending[u]
                if not due:
                    nxt = min(self._pending.values(), default=None)
                    self._wake.wait(None if nxt is None else max(0.0, nxt - now))
                    continue
            for u in due:
                self._reply(u)

    def _other_holders(self, nodeid: int, closing: int) -> bool:
        """Does any process but the closing one still hold this teardown file (a forked child)?

        Nothing here may touch the mount itself (a stat would send this very server a request
        and deadlock it): the fd links name the file, and fdinfo carries its inode."""
        tgid = _tgid(closing)
        suffix = f"/teardown/{self._nodes.get(nodeid)}"
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) in (closing, tgid):
                continue
            try:
                fds = os.listdir(f"/proc/{entry}/fd")
            except OSError:
                continue
            for fd in fds:
                try:
                    if not os.readlink(f"/proc/{entry}/fd/{fd}").endswith(suffix):
                        continue
                    with open(f"/proc/{entry}/fdinfo/{fd}", encoding="ascii", errors="replace") as fh:
                        ino = next((int(line.split()[1]) for line in fh if line.startswith("ino:")), None)
                except (OSError, ValueError):
                    continue
                if ino in (None, nodeid):
                    return True
        return False


def _tgid(tid: int) -> int:
    try:
        with open(f"/proc/{tid}/status", encoding="ascii", errors="replace") as fh:
            for line in fh:
                if line.startswith("Tgid:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return tid
