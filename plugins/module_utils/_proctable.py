# Copyright (c) 2026, gpuops.clean_slate maintainers
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# Note: this module_util is PRIVATE to the collection; it may change without notice.

"""Read-only views of /proc: who holds the NVIDIA device files, process
ancestry, kernel threads, PID namespaces and container membership.

Raw /proc is read where psutil has no equivalent (device fds are not
"open files" to psutil, and its memory_maps() is slow), and for the cheap
per-process facts needed to protect processes before psutil is consulted.
Every reader tolerates processes vanishing mid-scan.
"""

from __future__ import annotations

import os
import re
import threading
import typing as t
from dataclasses import dataclass, field

#: Seconds a /proc read of a process in state D may take before it is abandoned. Reading the command line
#: or the maps of a process takes its memory-map lock, which a task stuck in the driver (a munmap of device
#: memory that never ends) can hold forever: ps hangs on such a process. Reads of processes in other states
#: are made directly; the check of the state and the read are not atomic, so this narrows the risk to a
#: process that entered D in between, it does not remove it.
D_STATE_READ_S = 1.0

PF_KTHREAD = 0x00200000
PF_EXITING = 0x00000004  #: include/linux/sched.h: the task is in do_exit()
# The kernel's initial PID namespace always has this inode (PROC_PID_INIT_INO).
INITIAL_PIDNS_INODE = 0xEFFFFFFC
_GPU_FILE = re.compile(r"^nvidia(\d+)$")
_LXC_CGROUP = re.compile(r"(?:^|/)lxc/(\d+)(?:/|$)|(?:^|/)lxc\.payload\.(\d+)(?:/|$)")


@dataclass
class Holding:
    """What one process holds of the NVIDIA device files."""

    gpu_fds: set[int] = field(default_factory=set)  # minors of /dev/nvidiaN held open
    gpu_maps: set[int] = field(default_factory=set)  # minors of /dev/nvidiaN mapped
    other_fds: set[str] = field(default_factory=set)  # nvidiactl, nvidia-uvm, nvidia-caps/...
    other_maps: set[str] = field(default_factory=set)

    @property
    def minors(self) -> set[int]:
        return self.gpu_fds | self.gpu_maps

    @property
    def has_mmaps(self) -> bool:
        """CUDA processes map the device files; NVML-only management clients only open them."""
        return bool(self.gpu_maps or self.other_maps)

    def describe(self, minors: set[int] | None = None) -> list[str]:
        """Short sentences for a candidate's ``reasons`` (``holds nvidia0-7 (fd+mmap)``), for ``minors`` or all."""
        runs: list[tuple[str, list[int]]] = []
        for minor in sorted(self.minors if minors is None else self.minors & minors):
            how = "+".join(x for x, on in (("fd", minor in self.gpu_fds), ("mmap", minor in self.gpu_maps)) if on)
            if runs and runs[-1][0] == how and runs[-1][1][-1] == minor - 1:
                runs[-1][1].append(minor)
            else:
                runs.append((how, [minor]))
        out = [f"holds nvidia{run[0]}{f'-{run[-1]}' if len(run) > 1 else ''} ({how})" for how, run in runs]
        others = sorted(self.other_fds | self.other_maps)
        if others and not self.minors:
            out.append("holds " + ", ".join(others))
        return out


def attribute(holding: Holding, nvml_minors: set[int] | None) -> set[int]:
    """The GPUs (device minors) a holder actually uses.

    Holding a GPU's device file does not mean using that GPU: the CUDA driver
    opens the file of every visible GPU when it starts, whichever device the
    program then uses (seen on an H200 pair). So NVML's word wins for a
    process it lists; for one it does not list (a forked child), the files it
    maps count, and only a holder with no maps at all is judged by its open files.
    """
    if nvml_minors:
        return set(nvml_minors)
    if holding.gpu_maps:
        return set(holding.gpu_maps)
    return set(holding.gpu_fds)


def pids() -> list[int]:
    """Every process visible in this /proc (thread-group leaders)."""
    return sorted(int(name) for name in os.listdir("/proc") if name.isdigit())


def pid_max() -> int:
    """The largest pid the kernel hands out."""
    try:
        with open("/proc/sys/kernel/pid_max", encoding="ascii") as fh:
            return int(fh.read().strip())
    except (OSError, ValueError):
        return 4194304


def read_stat(pid: int) -> dict[str, t.Any] | None:
    """comm, state, ppid, pgid, flags and start time (clock ticks) from /proc/PID/stat."""
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8", errors="backslashreplace") as fh:
            raw = fh.read()
    except OSError:
        return None
    # comm may contain spaces and parentheses: split on the last ')'.
    head, _sep, rest = raw.rpartition(")")
    fields = rest.split()
    if len(fields) < 20:
        return None
    return {
        "comm": head.partition("(")[2],
        "state": fields[0],
        "ppid": int(fields[1]),
        "pgid": int(fields[2]),
        "sid": int(fields[3]),
        "flags": int(fields[6]),
        "threads": int(fields[17]),
        "starttime": int(fields[19]),
    }


def live_threads(pid: int) -> bool:
    """Whether a thread of the process other than its main one lives on: not a zombie, not in the kernel's exit path
    (PF_EXITING), no SIGKILL pending. Then the process lives after its main thread exited (whose stat reads Z and
    PF_EXITING, as in a teardown); in a teardown every other thread is exiting, or has SIGKILL pending while it is
    stuck in the kernel (in the driver)."""
    try:
        tids = [tid for tid in os.listdir(f"/proc/{pid}/task") if tid != str(pid)]
    except OSError:
        return False
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat", encoding="utf-8", errors="backslashreplace") as fh:
                fields = fh.read().rpartition(")")[2].split()
            with open(f"/proc/{pid}/task/{tid}/status", encoding="utf-8", errors="backslashreplace") as fh:
                pending = [int(line.split()[1], 16) for line in fh if line.startswith(("SigPnd:", "ShdPnd:"))]
        except (OSError, ValueError, IndexError):
            continue
        if len(fields) > 6 and fields[0] not in ("Z", "X") and not int(fields[6]) & PF_EXITING and not any(m & _SIGKILL_BIT for m in pending):
            return True
    return False


_SIGKILL_BIT = 1 << 8  #: SIGKILL (9) in /proc/PID/status's SigPnd and ShdPnd masks


def exited(state: str | None, threads: int) -> bool:
    """Whether a process has exited: a zombie (Z, X) with no thread left. A process whose main thread has exited while
    other threads live also reads Z, but it is alive: it holds its memory, its files and its GPUs."""
    return state in ("Z", "X") and threads <= 1


def read_guarded(path: str, state: str | None, limit: float = D_STATE_READ_S) -> bytes:
    """Read a /proc file of a process in ``state``; for state D in a thread given ``limit`` seconds.

    A read that does not come back in time is left behind (its thread blocks in the kernel; the wait
    is killable, so it ends with the module) and raises :class:`TimeoutError` (an ``OSError``).
    """
    if state != "D":
        with open(path, "rb") as fh:
            return fh.read()
    box: dict[str, t.Any] = {}

    def read() -> None:
        try:
            with open(path, "rb") as fh:
                box["data"] = fh.read()
        except OSError as exc:
            box["error"] = exc

    worker = threading.Thread(target=read, name=f"read {path}", daemon=True)
    worker.start()
    worker.join(limit)
    if worker.is_alive():
        raise TimeoutError(f"{path}: no answer within {limit} s (the process is in state D)")
    if "error" in box:
        raise box["error"]
    return t.cast(bytes, box["data"])


def read_command(pid: int, state: str | None = None) -> tuple[bytes, str | None, int | None] | None:
    """The raw command line, the executable and the owner's uid of ``pid``; None if it is gone.

    For a process in state D (``state``) the command line is read under :data:`D_STATE_READ_S`; one that
    does not come in time reads as empty, so the process is still listed (by comm and executable).
    """
    try:
        try:
            cmdline = read_guarded(f"/proc/{pid}/cmdline", state)
        except TimeoutError:
            cmdline = b""
        uid: int | None = os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return None
    try:
        exe: str | None = os.readlink(f"/proc/{pid}/exe")
    except OSError:
        exe = None  # kernel threads and other users' processes do not show it
    return cmdline, exe, uid


def identity(pid: int) -> tuple[int, str, bytes, str | None, int | None] | None:
    """What names one process over time: start time, comm, cmdline, executable and owner.

    The start time alone has a 10 ms resolution, so a pid recycled within the
    same tick would pass for the old process; the rest tells an unrelated
    newcomer apart. The parent is left out on purpose: it changes when a
    process is re-parented, which says nothing about its identity.
    """
    st = read_stat(pid)
    command = read_command(pid, st["state"] if st else None)
    if st is None or command is None:
        return None
    cmdline, exe, uid = command
    return (st["starttime"], st["comm"], cmdline, exe, uid)


def _has_cap_kill() -> bool:
    """Whether this process may signal any process (CAP_KILL in its effective set)."""
    try:
        with open("/proc/self/status", encoding="ascii", errors="replace") as fh:
            for line in fh:
                if line.startswith("CapEff:"):
                    return bool(int(line.split()[1], 16) & (1 << 5))  # CAP_KILL
    except (OSError, ValueError, IndexError):
        pass
    return os.geteuid() == 0


def may_signal(pid: int) -> bool:
    """Whether the kernel would let this process signal ``pid`` (kill(2): CAP_KILL, or our real
    or effective uid equal to its real or saved uid). A module run without become as an ordinary
    user sees other users' GPU processes through NVML but may not end them."""
    if os.geteuid() == 0 or _has_cap_kill():
        return True
    try:
        with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as fh:
            uids = next((line.split()[1:] for line in fh if line.startswith("Uid:")), None)
    except OSError:
        return True  # gone: nothing to refuse; the signal path reports it vanished
    if not uids or len(uids) < 3:
        return True
    target = {int(uids[0]), int(uids[2])}
    return bool(target & {os.getuid(), os.geteuid()})


def is_kernel_thread(pid: int) -> bool:
    """True for kernel threads (PF_KTHREAD), which must never be signalled.

    Only the flag is trusted: in a child PID namespace pid 2 is an ordinary process.
    """
    st = read_stat(pid)
    return bool(st and st["flags"] & PF_KTHREAD)


def ancestors(pid: int) -> list[int]:
    """The chain of parents of ``pid`` up to (and including) the namespace's init."""
    chain: list[int] = []
    seen = {pid}
    current = pid
    while True:
        st = read_stat(current)
        if not st or st["ppid"] <= 0 or st["ppid"] in seen:
            return chain
        current = st["ppid"]
        seen.add(current)
        chain.append(current)


def pidns_inode(pid: int | str = "self") -> int | None:
    """Inode of the PID namespace ``pid`` lives in (None when not readable)."""
    try:
        return os.stat(f"/proc/{pid}/ns/pid").st_ino
    except OSError:
        return None


def in_initial_pidns() -> bool:
    """Whether this process runs in the host's initial PID namespace (not in a container)."""
    return pidns_inode("self") == INITIAL_PIDNS_INODE


def nspids(pid: int) -> list[int]:
    """The NSpid line of /proc/PID/status: the pid at each namespace level, outermost first."""
    try:
        with open(f"/proc/{pid}/status", encoding="utf-8", errors="replace") as fh:
            for line in fh:
                if line.startswith("NSpid:"):
                    return [int(x) for x in line.split()[1:]]
    except OSError:
        pass
    return [pid]


def container_of(pid: int) -> int | None:
    """The Proxmox/LXC container id from the cgroup path (``/lxc/<vmid>/``), if any."""
    try:
        with open(f"/proc/{pid}/cgroup", encoding="utf-8", errors="replace") as fh:
            for line in fh:
                path = line.rstrip("\n").split(":", 2)[-1]
                m = _LXC_CGROUP.search(path)
                if m:
                    return int(m.group(1) or m.group(2))
    except OSError:
        pass
    return None


def wchan(pid: int) -> str | None:
    """The kernel function a sleeping process waits in (useful for D-state diagnoses)."""
    try:
        with open(f"/proc/{pid}/wchan", encoding="utf-8", errors="replace") as fh:
            value = fh.read().strip()
    except OSError:
        return None
    return value if value and value != "0" else None


def progress(pid: int) -> tuple[str, str | None, int, int] | None:
    """What moves while a dying process's teardown makes progress: its state, its wait channel, its CPU time (utime +
    stime, clock ticks: a teardown inside the driver runs in the kernel) and its thread count; None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8", errors="backslashreplace") as fh:
            rest = fh.read().rpartition(")")[2].split()
        return (rest[0], wchan(pid), int(rest[11]) + int(rest[12]), int(rest[17]))
    except (OSError, IndexError, ValueError):
        return None


def _classify(path: str, dev_dir: str) -> tuple[str, int | str] | None:
    if not path.startswith(dev_dir):
        return None
    rel = path[len(dev_dir) :]
    if rel.endswith(" (deleted)"):
        rel = rel[: -len(" (deleted)")]
    if not rel.startswith("nvidia"):
        return None
    m = _GPU_FILE.match(rel)
    if m:
        return ("gpu", int(m.group(1)))
    return ("other", rel)


def distinct_tasks(pid: int, tids: list[str], kcmp: t.Callable[[int, int, int, int, int], int], what: int) -> list[str]:
    """The threads whose ``what`` (file table or fs) is none of the main thread's or another listed one's."""
    out: list[str] = []
    others: list[int] = []
    for tid in tids:
        task = int(tid)
        # kcmp(2) answers 0 for the same table, more for another, -1 when it cannot tell (then: read it).
        answer = kcmp(pid, task, what, 0, 0)
        if answer == 0 or (answer > 0 and others and any(kcmp(o, task, what, 0, 0) == 0 for o in others)):
            continue
        if answer > 0:
            others.append(task)
        out.append(tid)
    return out


KCMP_FILES = 2  # linux/kcmp.h: KCMP_FILES, the file descriptor table
KCMP_FS = 3  # KCMP_FS: the working directory and root
# kcmp(2)'s number on each architecture CPython runs on here (asm/unistd.h).
_SYS_KCMP = {"x86_64": 312, "aarch64": 272, "ppc64le": 354, "ppc64": 354, "s390x": 343, "riscv64": 272, "i686": 349, "armv7l": 378}


def kcmp() -> t.Callable[[int, int, int, int, int], int]:
    """kcmp(2): ``kcmp(a, b, what, 0, 0)`` is 0 when tasks ``a`` and ``b`` share a file table (``KCMP_FILES``) or a
    working directory and root (``KCMP_FS``), more when not, -1 when it cannot tell (no kcmp here, or not
    permitted), and then every thread is read as if it had its own: the safe side. The libc call itself, with no
    Python function around it: a host with thousands of threads makes it thousands of times."""
    import ctypes
    import functools
    import platform

    number = _SYS_KCMP.get(platform.machine())
    try:
        syscall = ctypes.CDLL(None, use_errno=True).syscall
    except (OSError, AttributeError):
        number = None
    if number is None:
        return lambda _a, _b, _what, _i, _j: -1
    syscall.restype = ctypes.c_long
    syscall.argtypes = [ctypes.c_long, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong]
    return t.cast(t.Callable[[int, int, int, int, int], int], functools.partial(syscall, number))


def scan_device_holders(dev_dir: str = "/dev", only: t.Iterable[int] | None = None) -> tuple[dict[int, Holding], list[int]]:
    """Find holders of ``<dev_dir>/nvidia*`` through /proc/*/fd and /proc/*/maps, every thread included.

    A thread with a file table of its own (``unshare(CLONE_FILES)``) is read too (kcmp(2) tells which threads share the
    main thread's), and a process whose main thread has exited while its threads live is read through a thread (its
    own fd and maps are empty then). Returns the holders by pid and the pids whose fds could not be read
    (permission), so callers can say what they could not see.
    """
    prefix = os.path.realpath(dev_dir).rstrip("/") + "/"
    holders: dict[int, Holding] = {}
    unreadable: list[int] = []
    compare = kcmp()

    def read_fds(pid: int, fd_dir: str, holding: Holding) -> None:
        for fd in os.listdir(fd_dir):
            try:
                target = os.readlink(f"{fd_dir}/{fd}")
            except OSError:
                continue
            kind = _classify(target, prefix)
            if kind is None:
                continue
            if kind[0] == "gpu":
                holding.gpu_fds.add(t.cast(int, kind[1]))
            else:
                holding.other_fds.add(t.cast(str, kind[1]))

    for pid in only if only is not None else pids():
        holding = Holding()
        try:
            read_fds(pid, f"/proc/{pid}/fd", holding)
        except PermissionError:
            unreadable.append(pid)
        except OSError:
            continue
        try:
            tids = [tid for tid in os.listdir(f"/proc/{pid}/task") if tid != str(pid)]
        except OSError:
            tids = []
        for tid in distinct_tasks(pid, tids, compare, KCMP_FILES) if tids else []:
            try:
                read_fds(pid, f"/proc/{pid}/task/{tid}/fd", holding)
            except OSError:
                continue  # the thread has exited, or cannot be read (its process is already on record)
        # Only a process with a device file open can be stuck in the driver: its maps are read under a
        # deadline when it is in state D (read_guarded); the others' are read directly.
        st = read_stat(pid) if holding.gpu_fds or holding.other_fds else None
        data = b""
        for path in [f"/proc/{pid}/maps"] + [f"/proc/{pid}/task/{tid}/maps" for tid in tids[:1]]:
            # A main thread that has exited has no memory map any more; its threads share one.
            try:
                data = read_guarded(path, st["state"] if st else None)
            except OSError:
                data = b""
            if data:
                break
        # A cheap substring test first: maps files of big processes are long.
        if b"nvidia" in data:
            for line in data.decode("utf-8", "replace").splitlines():
                if "nvidia" not in line:
                    continue
                parts = line.split(None, 5)
                if len(parts) < 6:
                    continue
                kind = _classify(parts[5].strip(), prefix)
                if kind is None:
                    continue
                if kind[0] == "gpu":
                    holding.gpu_maps.add(t.cast(int, kind[1]))
                else:
                    holding.other_maps.add(t.cast(str, kind[1]))
        if holding.gpu_fds or holding.gpu_maps or holding.other_fds or holding.other_maps:
            holders[pid] = holding
    return holders, unreadable
