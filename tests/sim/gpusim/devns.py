"""A private /dev for this process, so a simulated node can own the names /dev/nvidia*.

Code under test defaults to ``/dev`` (``device_dir``), and a real host's NVIDIA device files live
there. A test may make the simulated node's files appear at ``/dev/nvidia*`` only where nothing
else can see them: :func:`private_dev` moves the calling process into a new mount namespace
(``unshare(CLONE_NEWNS)``, every mount private, so nothing propagates back), mounts a tmpfs on
``/dev`` there and fills it with what programs expect (null, zero, full, random, urandom, tty,
ptmx, pts, shm, the fd links). The machine's /dev is not touched, other processes never see the
tmpfs, and it disappears with the last process of the namespace. Children inherit it, so
everything a test starts afterwards (Ansible, workers) uses it. Then
``Node.publish_devices("/dev")`` bind-mounts the node's device files into it. Needs root.
"""

from __future__ import annotations

import ctypes
import os
import stat

CLONE_NEWNS = 0x00020000
MS_NOSUID, MS_BIND, MS_REC, MS_PRIVATE = 2, 4096, 16384, 1 << 18
#: The character devices every program may open, as a stock /dev has them (name: major, minor, mode).
BASIC = {"null": (1, 3, 0o666), "zero": (1, 5, 0o666), "full": (1, 7, 0o666), "random": (1, 8, 0o666), "urandom": (1, 9, 0o666), "tty": (5, 0, 0o666)}
#: The FUSE device, for the simulated driver's teardown mount (root only, as on this machine).
FUSE = ("fuse", (10, 229, 0o600))


def _mount(src: str | None, dst: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    enc = [None if v is None else os.fsencode(v) for v in (src, dst, fstype, data)]
    if libc.mount(enc[0], enc[1], enc[2], flags, enc[3]) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {src} on {dst}: {os.strerror(err)}")


def private_dev() -> None:
    """Give the calling process (and its future children) a mount namespace with a /dev of its own."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(CLONE_NEWNS) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"unshare(CLONE_NEWNS): {os.strerror(err)}")
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    _mount("gpusim-dev", "/dev", "tmpfs", MS_NOSUID, "mode=0755")
    for name, (major, minor, mode) in [*BASIC.items(), FUSE]:
        if name == "fuse" and not os.path.exists("/sys/module/fuse") and not _in_proc_devices("misc"):
            continue
        os.mknod(f"/dev/{name}", stat.S_IFCHR | mode, os.makedev(major, minor))
        os.chmod(f"/dev/{name}", mode)
    os.mkdir("/dev/pts")
    os.mkdir("/dev/shm")
    os.chmod("/dev/shm", 0o1777)
    _mount("gpusim-shm", "/dev/shm", "tmpfs", MS_NOSUID, "mode=1777")
    try:
        _mount("devpts", "/dev/pts", "devpts", MS_NOSUID, "newinstance,ptmxmode=0666,mode=0620")
        os.symlink("pts/ptmx", "/dev/ptmx")
    except OSError:
        pass  # no pseudo-terminals: nothing here needs one
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"), ("stderr", "/proc/self/fd/2")):
        os.symlink(target, f"/dev/{name}")


def _in_proc_devices(name: str) -> bool:
    try:
        with open("/proc/devices", encoding="ascii") as fh:
            return any(line.split()[1:2] == [name] for line in fh)
    except OSError:
        return False


def dev_is_private() -> bool:
    """Is /dev a tmpfs made by private_dev() (never the machine's devtmpfs)?"""
    last: list[str] = []
    with open("/proc/self/mounts", encoding="utf-8") as fh:
        for line in fh:
            parts = line.split()
            if len(parts) >= 3 and parts[1] == "/dev":
                last = parts  # the last mount on /dev is the one in effect
    return bool(last) and last[0] == "gpusim-dev" and last[2] == "tmpfs"
