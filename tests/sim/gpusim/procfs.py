"""/proc and PID-namespace helpers shared by the daemon, Node and Sandbox.

Only the standard library is used, so the daemon and the CLI run on any
Python 3.9+ without the venv.
"""

from __future__ import annotations

import fcntl
import os
import select
import signal
import struct
from collections.abc import Iterable
from pathlib import Path

NS_GET_PARENT = 0xB702  #: ioctl on a namespace fd: fd of the parent PID namespace
INIT_PID_NS_INO = 0xEFFFFFFC  #: PROC_PID_INIT_INO: the initial PID namespace

#: struct flock on Linux/x86-64 and aarch64: short l_type, l_whence; off_t l_start, l_len; pid_t l_pid.
FLOCK = "hhqqi4x"


def pidns_inode(pid: int | str = "self") -> int:
    """Inode of the PID namespace `pid` lives in (what identifies the namespace)."""
    return os.stat(f"/proc/{pid}/ns/pid").st_ino


def in_private_pidns() -> bool:
    return pidns_inode() != INIT_PID_NS_INO


def nspid(pid: int) -> list[int]:
    """The NSpid line of /proc/PID/status: pid at each level, from this /proc's
    namespace inwards (one entry if the process lives in this namespace)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("NSpid:"):
                return [int(x) for x in line.split()[1:]]
    return [pid]


def pid_levels(pid: int) -> list[tuple[int, int]]:
    """[(pid-namespace inode, pid), ...] of `pid`, outermost (ours) first.

    NSpid gives the numbers; the namespaces come from /proc/PID/ns/pid and
    NS_GET_PARENT, walked up as many levels as NSpid has entries."""
    pids = nspid(pid)
    fd = os.open(f"/proc/{pid}/ns/pid", os.O_RDONLY | os.O_CLOEXEC)
    try:
        inodes = [os.fstat(fd).st_ino]
        for _unused in range(len(pids) - 1):
            parent = fcntl.ioctl(fd, NS_GET_PARENT)
            os.close(fd)
            fd = parent
            inodes.append(os.fstat(fd).st_ino)
    finally:
        os.close(fd)
    inodes.reverse()
    return list(zip(inodes, pids))


def children(pid: int) -> list[int]:
    """Direct children of `pid` (all its threads)."""
    out: list[int] = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                out += [int(x) for x in f.read().split()]
    except (FileNotFoundError, ProcessLookupError):
        pass
    return out


def all_pids() -> list[int]:
    return [int(d) for d in os.listdir("/proc") if d.isdigit()]


def state(pid: int) -> str | None:
    """One-letter process state (R, S, D, T, Z...), or None if gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            data = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return data.rsplit(")", 1)[1].split()[0]


def ppid(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def ancestors(pid: int) -> set[int]:
    """`pid` and every ancestor up to the namespace's init."""
    out = set()
    while pid > 0 and pid not in out:
        out.add(pid)
        try:
            pid = ppid(pid)
        except (FileNotFoundError, ProcessLookupError, ValueError):
            break
    return out


def find_in_namespace(ns_inode: int, ns_pid: int, candidates: Iterable[int] | None = None) -> int | None:
    """Our pid for the process that is `ns_pid` inside namespace `ns_inode`."""
    for pid in candidates if candidates is not None else all_pids():
        try:
            levels = nspid(pid)
            if len(levels) > 1 and levels[-1] == ns_pid and pidns_inode(pid) == ns_inode:
                return pid
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
    return None


def holders(files: Iterable[str | os.PathLike[str]]) -> set[int]:
    """Processes with an fd open on, or a mapping of, one of ``files``, matched by device and inode.

    Never by path: seen from the machine's initial PID namespace (the host gate), a process of
    another checkout's test run shows its own node's files under names such as ``/dev/nvidia0``
    (published in its mount namespace) or ``/tmp/.../dev/nvidia0``, and a path match found them
    and the node's cleanup SIGKILLed them: a `make test` beside another one lost its workers.
    Only names that look like device files (``nvidia*``) are stat'ed, so a hung file system of
    someone else's is never touched.
    """
    keys: set[tuple[int, int]] = set()
    names: set[str] = set()
    for f in files:
        try:
            st = os.stat(f)
        except OSError:
            continue
        keys.add((st.st_dev, st.st_ino))
        names.add(os.path.basename(f))
    found: set[int] = set()
    if not keys:
        return found
    for pid in all_pids():
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                try:
                    if os.path.basename(os.readlink(f"/proc/{pid}/fd/{fd}")) not in names:
                        continue
                    st = os.stat(f"/proc/{pid}/fd/{fd}")
                except OSError:
                    continue
                if (st.st_dev, st.st_ino) in keys:
                    found.add(pid)
                    break
            if pid in found:
                continue
            with open(f"/proc/{pid}/maps") as fh:
                for line in fh:
                    parts = line.split(None, 5)
                    if len(parts) < 6 or os.path.basename(parts[5].rstrip("\n")) not in names:
                        continue
                    major, minor = (int(x, 16) for x in parts[3].split(":"))
                    if (os.makedev(major, minor), int(parts[4])) in keys:
                        found.add(pid)
                        break
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
    return found


# ------------------------------------------------------------------ pidfds
class PidHandle:
    """A pidfd: signals and liveness checks that cannot hit a recycled pid."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.fd: int | None = None
        try:
            self.fd = os.pidfd_open(pid)
        except ProcessLookupError:
            self.fd = None

    def alive(self) -> bool:
        """True until the process exits (a zombie counts as exited)."""
        if self.fd is None:
            return False
        r, _unused, _unused = select.select([self.fd], [], [], 0)
        return not r

    def signal(self, sig: int) -> bool:
        if self.fd is None:
            return False
        try:
            signal.pidfd_send_signal(self.fd, sig)
            return True
        except ProcessLookupError:
            return False

    def wait_exit(self, timeout: float) -> bool:
        """Wait until the process has exited (not necessarily reaped)."""
        if self.fd is None:
            return True
        r, _unused, _unused = select.select([self.fd], [], [], max(0.0, timeout))
        return bool(r)

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


# ------------------------------------------------------------------ OFD locks
def device_fds(pid: int) -> set[str]:
    """Names of the gpusim (or NVIDIA) device files ``pid`` holds open, e.g. {"nvidia3", "nvidiactl"}."""
    out = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if "/dev/nvidia" in target:
            out.add(os.path.basename(target))
    return out


def device_map_lines(pid: int) -> list[str]:
    """The lines of /proc/PID/maps that map a gpusim (or NVIDIA) device file."""
    with open(f"/proc/{pid}/maps") as f:
        return [line for line in f if "/dev/nvidia" in line]


def ofd_lock_held(fd: int, offset: int) -> bool:
    """Is byte `offset` locked by some other open file description?"""
    arg = struct.pack(FLOCK, fcntl.F_WRLCK, os.SEEK_SET, offset, 1, 0)
    res = fcntl.fcntl(fd, fcntl.F_OFD_GETLK, arg)
    l_type: int = struct.unpack(FLOCK, res)[0]
    return l_type != fcntl.F_UNLCK


def ofd_lock(fd: int, offset: int, kind: int, wait: bool) -> None:
    """Take (or, with F_UNLCK, drop) an OFD lock on one byte."""
    arg = struct.pack(FLOCK, kind, os.SEEK_SET, offset, 1, 0)
    fcntl.fcntl(fd, fcntl.F_OFD_SETLKW if wait else fcntl.F_OFD_SETLK, arg)


def daemon_running(state_dir: Path) -> bool:
    """The driver daemon write-locks byte 0 of driver.lock while it runs; a lock
    reads the same from every PID namespace, unlike a pid file."""
    try:
        fd = os.open(Path(state_dir) / "driver.lock", os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    try:
        return ofd_lock_held(fd, 0)
    finally:
        os.close(fd)
