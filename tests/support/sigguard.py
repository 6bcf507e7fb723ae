"""A kernel-enforced guard on every signal a command and its descendants send.

Used by the host gate (tests/host), where Ansible and the modules run in the machine's initial PID
namespace: there, a bug in the modules' protection could reach any process of the machine. The
guard makes that impossible, independently of the code under test:

* the command is started with a seccomp filter (inherited by every process it forks or execs)
  that stops each signal-sending system call - ``kill``, ``tkill``, ``tgkill``,
  ``rt_sigqueueinfo``, ``rt_tgsigqueueinfo``, ``pidfd_send_signal`` - *before* it takes effect
  and hands it to this process (``SECCOMP_RET_USER_NOTIF``); ``ptrace`` and the ``fcntl``
  commands that arm SIGIO for another process (F_SETOWN, F_SETOWN_EX) fail with EPERM outright;
  system calls of another architecture (x32 or 32-bit) kill the caller;
* the guard lets a signal through only when it goes to one of the victims the test created, or to
  a process of the command's own tree (Ansible's workers and the module itself), or when it is
  signal 0 (an existence check, which delivers nothing); anything else fails with EPERM and is
  recorded as a violation;
* for ``pidfd_send_signal`` the target is the process the pidfd refers to, read from the caller's
  ``/proc/PID/fdinfo`` (a file descriptor that is not a pidfd is refused); the victims are
  children of the test that it does not reap while the command runs, so their pids cannot be
  reused meanwhile.

If the guard cannot be installed (not x86_64, no seccomp user notification, not root) the gate
fails rather than run unguarded. Every decision is logged (:attr:`SignalGuard.log`), which also
lets tests assert the exact signals a module sent, in order.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import select
import signal
import socket
import struct
import subprocess
import threading
import typing as t
from dataclasses import dataclass

# x86_64 system call numbers (arch/x86/entry/syscalls/syscall_64.tbl).
NR = {"kill": 62, "tkill": 200, "tgkill": 234, "rt_sigqueueinfo": 129, "rt_tgsigqueueinfo": 297, "pidfd_send_signal": 424}
NR_PTRACE, NR_FCNTL, NR_SECCOMP = 101, 72, 317
F_SETOWN, F_SETOWN_EX = 8, 15
AUDIT_ARCH_X86_64 = 0xC000003E
X32_SYSCALL_BIT = 0x40000000
SECCOMP_SET_MODE_FILTER, SECCOMP_FILTER_FLAG_NEW_LISTENER = 1, 1 << 3
SECCOMP_RET_KILL_PROCESS, SECCOMP_RET_ERRNO, SECCOMP_RET_USER_NOTIF, SECCOMP_RET_ALLOW = 0x80000000, 0x00050000, 0x7FC00000, 0x7FFF0000
SECCOMP_USER_NOTIF_FLAG_CONTINUE = 1
NOTIF = struct.Struct("=QIIiIQ6Q")  # id, pid, flags, data.nr, data.arch, data.instruction_pointer, data.args[6]
RESP = struct.Struct("=QqiI")  # id, val, error, flags
IOCTL_NOTIF_RECV, IOCTL_NOTIF_SEND, IOCTL_NOTIF_ID_VALID = 0xC0502100, 0xC0182101, 0x40082102
# BPF (linux/filter.h): ld word at an absolute offset of seccomp_data, jumps, return.
LD_ABS, JEQ, JGE, RET = 0x20, 0x15, 0x35, 0x06
OFF_NR, OFF_ARCH = 0, 4
OFF_ARG1_LO = 16 + 8 * 1

# Which argument holds the signal number, and how the target is named.
SIG_ARG = {"kill": 1, "tkill": 1, "tgkill": 2, "rt_sigqueueinfo": 1, "rt_tgsigqueueinfo": 2, "pidfd_send_signal": 1}


def _filter() -> bytes:
    """The BPF program, as struct sock_filter entries (code, jt, jf, k)."""
    ins: list[tuple[int, int, int, int]] = []
    notify = list(NR.values())
    # 0: arch check
    ins.append((LD_ABS, 0, 0, OFF_ARCH))
    ins.append((JEQ, 1, 0, AUDIT_ARCH_X86_64))
    ins.append((RET, 0, 0, SECCOMP_RET_KILL_PROCESS))
    ins.append((LD_ABS, 0, 0, OFF_NR))
    ins.append((JGE, 0, 1, X32_SYSCALL_BIT))
    ins.append((RET, 0, 0, SECCOMP_RET_KILL_PROCESS))
    # the signal calls: to the guard
    first = len(ins)
    notify_at = first + len(notify) + 8  # index of the final RET USER_NOTIF (see the layout below)
    for i, nr in enumerate(notify):
        ins.append((JEQ, notify_at - (first + i) - 1, 0, nr))
    # ptrace: EPERM
    ins.append((JEQ, 0, 1, NR_PTRACE))
    ins.append((RET, 0, 0, SECCOMP_RET_ERRNO | errno.EPERM))
    # fcntl(fd, F_SETOWN/F_SETOWN_EX, ...): EPERM; other fcntl commands pass
    ins.append((JEQ, 0, 3, NR_FCNTL))
    ins.append((LD_ABS, 0, 0, OFF_ARG1_LO))
    ins.append((JEQ, 2, 0, F_SETOWN))
    ins.append((JEQ, 1, 0, F_SETOWN_EX))
    ins.append((RET, 0, 0, SECCOMP_RET_ALLOW))
    # the remaining two: F_SETOWN* -> EPERM, signal calls -> notify
    ins.append((RET, 0, 0, SECCOMP_RET_ERRNO | errno.EPERM))
    ins.append((RET, 0, 0, SECCOMP_RET_USER_NOTIF))
    assert len(ins) == notify_at + 1, "the jump offsets no longer match the layout"
    return b"".join(struct.pack("=HBBI", *i) for i in ins)


@dataclass
class Decision:
    """One signal system call the guard saw."""

    call: str
    caller: int
    target: int | None
    signal: int
    allowed: bool
    why: str


class GuardError(RuntimeError):
    """The guard could not be installed: the gate must not run unguarded."""


class SignalGuard:
    """Run commands under the guard; ``victims`` may be signalled, nothing else outside the command's tree."""

    def __init__(self, victims: t.Iterable[int] = ()) -> None:
        if platform.machine() != "x86_64":
            raise GuardError(f"the signal guard knows x86_64 system calls only, not {platform.machine()}")
        if os.geteuid() != 0:
            raise GuardError("the signal guard installs a seccomp filter without no_new_privs: it needs root")
        self.victims: set[int] = set(victims)
        self.log: list[Decision] = []
        self._lock = threading.Lock()

    @property
    def violations(self) -> list[Decision]:
        return [d for d in self.log if not d.allowed]

    def sent_to(self, pid: int) -> list[str]:
        """Signal names delivered to ``pid`` through the guard, in order (signal 0 left out)."""
        return [signal.Signals(d.signal).name.removeprefix("SIG") for d in self.log if d.allowed and d.target == pid and d.signal]

    # ------------------------------------------------------------------ running a command
    def run(
        self,
        argv: list[str],
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        timeout: float | None = None,
        input: str | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """Like subprocess.run(argv, capture_output=True, text=True), with the filter installed in
        the child before exec (so the command and everything it starts is guarded)."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        prog = _filter()

        def install() -> None:  # runs in the child between fork and exec
            libc = ctypes.CDLL(None, use_errno=True)
            buf = ctypes.create_string_buffer(prog)
            fprog = struct.pack("=HxxxxxxQ", len(prog) // 8, ctypes.addressof(buf))
            fbuf = ctypes.create_string_buffer(fprog)
            fd = libc.syscall(NR_SECCOMP, SECCOMP_SET_MODE_FILTER, SECCOMP_FILTER_FLAG_NEW_LISTENER, fbuf)
            if fd < 0:
                os._exit(125)
            socket.send_fds(theirs, [b"l"], [fd])
            os.close(fd)
            theirs.close()

        stop = threading.Event()
        started = threading.Event()
        state: dict[str, t.Any] = {}

        def serve() -> None:
            try:
                _msg, fds, _flags, _addr = socket.recv_fds(ours, 1, 1)
            except OSError as exc:
                state["error"] = exc
                started.set()
                return
            if not fds:
                state["error"] = GuardError("the child sent no seccomp listener")
                started.set()
                return
            state["listener"] = fds[0]
            started.set()
            self._serve(fds[0], state["root"], stop)

        thread = threading.Thread(target=serve, name="sigguard", daemon=True)
        proc = subprocess.Popen(
            argv,
            preexec_fn=install,
            pass_fds=(theirs.fileno(),),
            env=env,
            cwd=cwd,
            text=True,
            stdin=subprocess.PIPE if input is not None else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        state["root"] = proc.pid
        thread.start()
        theirs.close()
        if not started.wait(30) or "error" in state:
            proc.kill()
            proc.wait()
            raise GuardError(f"the seccomp guard did not start: {state.get('error')}")
        try:
            out, err = proc.communicate(input, timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
            raise
        finally:
            stop.set()
            thread.join(10)
            ours.close()
        return subprocess.CompletedProcess(argv, proc.returncode, out, err)

    # ------------------------------------------------------------------ the supervisor
    def _serve(self, listener: int, root: int, stop: threading.Event) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        poller = select.poll()
        poller.register(listener, select.POLLIN)
        try:
            while not stop.is_set():
                events = poller.poll(100)
                if not events:
                    continue
                if any(ev & (select.POLLHUP | select.POLLERR) for _fd, ev in events) and not any(ev & select.POLLIN for _fd, ev in events):
                    return  # every guarded process is gone
                buf = ctypes.create_string_buffer(NOTIF.size)
                if libc.ioctl(listener, IOCTL_NOTIF_RECV, buf) != 0:
                    if ctypes.get_errno() in (errno.ENOENT, errno.EINTR):
                        continue  # the caller died meanwhile
                    return
                nid, caller, _flags, nr, _arch, _ip, *args = NOTIF.unpack(buf.raw)
                decision = self._decide(caller, nr, args, root)
                # The caller may have died and its pid been reused while we read /proc: only
                # answer for a notification the kernel still considers valid.
                idbuf = ctypes.c_uint64(nid)
                if libc.ioctl(listener, IOCTL_NOTIF_ID_VALID, ctypes.byref(idbuf)) != 0:
                    continue
                with self._lock:
                    self.log.append(decision)
                # Allowed: the kernel carries the call out as the caller made it. Else: EPERM.
                resp = RESP.pack(nid, 0, 0, SECCOMP_USER_NOTIF_FLAG_CONTINUE) if decision.allowed else RESP.pack(nid, 0, -errno.EPERM, 0)
                libc.ioctl(listener, IOCTL_NOTIF_SEND, ctypes.create_string_buffer(resp))
        finally:
            os.close(listener)

    def _decide(self, caller: int, nr: int, args: list[int], root: int) -> Decision:
        call = next(name for name, n in NR.items() if n == nr)
        sig = args[SIG_ARG[call]] & 0xFFFFFFFF
        if call == "pidfd_send_signal":
            target = _pidfd_target(caller, args[0] & 0xFFFFFFFF)
        elif call in ("kill", "tgkill", "rt_sigqueueinfo", "rt_tgsigqueueinfo"):
            target = ctypes.c_int32(args[0] & 0xFFFFFFFF).value
        else:  # tkill(tid)
            target = _tgid(ctypes.c_int32(args[0] & 0xFFFFFFFF).value)
        if sig == 0:
            return Decision(call, caller, target, 0, True, "signal 0 delivers nothing")
        if target is None:
            return Decision(call, caller, None, sig, False, "the file descriptor is not a pidfd")
        if call == "kill" and target <= 0:
            group = _pgid(caller) if target == 0 else -target
            if target == -1:
                return Decision(call, caller, target, sig, False, "kill(-1) would reach every process")
            members = _group_members(group)
            ok = bool(members) and all(m in self.victims or _descends_from(m, root) for m in members)
            return Decision(call, caller, target, sig, ok, f"process group {group}: " + ("ours" if ok else "holds processes that are not ours"))
        if target in self.victims:
            return Decision(call, caller, target, sig, True, "a victim the test created")
        if _descends_from(target, root):
            return Decision(call, caller, target, sig, True, "inside the guarded command's own tree")
        return Decision(call, caller, target, sig, False, "neither a victim nor part of the guarded command")


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            return fh.read()
    except OSError:
        return None


def _pidfd_target(caller: int, fd: int) -> int | None:
    text = _read(f"/proc/{caller}/fdinfo/{fd}")
    for line in (text or "").splitlines():
        if line.startswith("Pid:"):
            pid = int(line.split()[1])
            return pid if pid > 0 else None
    return None


def _stat(pid: int) -> list[str] | None:
    text = _read(f"/proc/{pid}/stat")
    return text.rpartition(")")[2].split() if text else None


def _tgid(tid: int) -> int:
    for line in (_read(f"/proc/{tid}/status") or "").splitlines():
        if line.startswith("Tgid:"):
            return int(line.split()[1])
    return tid


def _pgid(pid: int) -> int:
    st = _stat(pid)
    return int(st[2]) if st else -1


def _group_members(pgid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            st = _stat(int(entry))
            if st and int(st[2]) == pgid:
                out.append(int(entry))
    return out


def _descends_from(pid: int, root: int) -> bool:
    seen = set()
    while pid > 1 and pid not in seen:
        if pid == root:
            return True
        seen.add(pid)
        st = _stat(pid)
        if not st:
            return False
        pid = int(st[1])
    return False
