"""The simulated kernel driver: ``python -m gpusim.driver --state DIR``.

It plays the part of nvidia.ko's resource manager for one node:

* it hands out GPU contexts over a unix socket (``driver.sock``), refusing
  those that would not fit (cudaMalloc OOM) or that target a lost GPU;
* it learns the owner from SO_PEERCRED (the kernel translates the pid into the
  daemon's PID namespace) and records the owner's pid at every namespace
  level, so the library can answer in the caller's namespace;
* for each context a thread blocks in F_OFD_SETLKW for a write lock on the
  context's byte, through a hard link of the device file kept outside dev/
  (``driver/nvidia<minor>``), so the daemon never shows up as a holder of
  ``dev/nvidia*``. The lock is granted when the last open file description
  holding the owner's read lock is closed: every holder is gone (parent,
  forked children, zombies excluded: exit closes files). The thread then
  stamps dead_ns and computes when the teardown completes:
  ``release_ns = max(dead_ns + delay, last release on this GPU + gap)``,
  which serialises simultaneous deaths about one per ``gap`` like the real
  driver, writes it into the record and deletes the record afterwards.

The simulated libcuda (``tests/sim/nvml/cuda.c``) speaks the same protocol and four more requests:
``alloc <id> <mib>`` and ``free <id> <mib>`` grow and shrink a context (refused with OOM when it would
not fit), ``release <id>`` frees a context now, inside the caller's cuDevicePrimaryCtxRelease (answered
``ok <ms>``: how long the call takes), and ``meminfo <gpu>`` answers ``ok <free MiB> <total MiB>`` as
cuMemGetInfo sees them. A context is refused with BUSY when its GPU's compute mode is exclusive_process and
another process holds a context there, or prohibited; with NOTREADY when the NVLink fabric is not up; with ECC
after an uncontained ECC error (``ecc_uncontained``); memory the ``hidden`` fault names is never handed out.

The daemon must run in the PID namespace of whoever starts the node (tests
run workloads in child namespaces, where it is as invisible as a kernel).
While it runs it holds an OFD write lock on byte 0 of ``driver.lock``.

With ``--teardown`` it also serves ``teardown/`` over FUSE (gpusim.teardown): an exiting
worker then stays in the kernel, in state D, until the driver has freed its contexts, as a
torch process does on the real driver.
"""

from __future__ import annotations

import argparse
import fcntl
import os
import select
import signal
import socket
import struct
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from .description import Description
from .procfs import ofd_lock, pid_levels, pidns_inode
from .state import Context, read_records, remove_record, write_record
from .teardown import TeardownFS

KINDS = ("compute", "graphics", "mps")

MIB = 1 << 20
#: How often a gradual teardown (``release_gradual``) lowers a dying context's memory.
GRADUAL_STEP_NS = 250_000_000


@dataclass
class _Slot:
    """In-memory view of a context, for capacity checks and release ordering."""

    gpu: int
    mib: int
    release_ns: int | None = None


class Driver:
    """One node's driver daemon."""

    def __init__(self, state_dir: Path) -> None:
        self.state = Path(state_dir)
        self.mutex = threading.Lock()
        self.slots: dict[int, _Slot] = {}
        self.last_release: dict[int, int] = {}  # gpu -> release_ns of the latest teardown
        self.next_id = 1
        self._desc: Description | None = None
        self._desc_key: tuple[int, int, int] | None = None
        self.own_ns = pidns_inode()
        self.contexts: dict[int, Context] = {}  # live and releasing contexts, by id
        self.teardown: TeardownFS | None = None

    # ---------------------------------------------------------- description
    def desc(self) -> Description:
        """node.conf, re-read when it was replaced (faults change at runtime)."""
        st = os.stat(self.state / "node.conf")
        key = (st.st_ino, st.st_mtime_ns, st.st_size)
        if key != self._desc_key or self._desc is None:
            self._desc = Description.read(self.state)
            self._desc_key = key
        return self._desc

    # ---------------------------------------------------------- start-up
    def lock_instance(self) -> int:
        fd = os.open(self.state / "driver.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            ofd_lock(fd, 0, fcntl.F_WRLCK, wait=False)
        except OSError:
            raise SystemExit(f"gpusim driver: another daemon already runs for {self.state}") from None
        return fd

    def adopt(self) -> None:
        """Take over the records of a previous daemon (a restart keeps contexts)."""
        now = time.monotonic_ns()
        for ctx in read_records(self.state):
            self.next_id = max(self.next_id, ctx.id + 1)
            if ctx.release_ns is not None:
                if ctx.release_ns <= now:
                    remove_record(self.state, ctx.id)
                    continue
                self.slots[ctx.id] = _Slot(ctx.gpu, ctx.mib, ctx.release_ns)
                self.contexts[ctx.id] = ctx
                self.last_release[ctx.gpu] = max(self.last_release.get(ctx.gpu, 0), ctx.release_ns)
                threading.Thread(target=self._expire, args=(ctx,), daemon=True).start()
            else:
                self.slots[ctx.id] = _Slot(ctx.gpu, ctx.mib)
                self.contexts[ctx.id] = ctx
                threading.Thread(target=self._watch, args=(ctx,), daemon=True).start()

    # ---------------------------------------------------------- registration
    def _used_mib(self, gpu: int, overhead: int = 0) -> int:
        return sum(s.mib + overhead for s in self.slots.values() if s.gpu == gpu)

    def _free_mib(self, desc: Description, gpu: int) -> int:
        """What the driver can still hand out on ``gpu`` (mutex held): NVML's free less the hidden fault."""
        now = time.monotonic_ns()
        for cid in [c for c, s in self.slots.items() if s.release_ns is not None and s.release_ns <= now]:
            del self.slots[cid]
        spec = desc.gpus[gpu]
        taken = desc.faults.orphan.get(gpu, 0) + desc.faults.hidden.get(gpu, 0) + self._used_mib(gpu, desc.context_overhead_mib)
        return spec.total_mib - spec.reserved_mib - taken

    def _compute_mode(self, gpu: int) -> int:
        try:
            return int((self.state / f"compute_mode.{gpu}").read_text().strip() or 0)
        except (OSError, ValueError):
            return 0

    def _refusal(self, desc: Description, gpu: int, pid: int) -> str | None:
        """Why the driver refuses a new context on ``gpu`` for ``pid``, as an error line; None when it does not."""
        spec = desc.gpus[gpu]
        if "fabric" in spec.feature_list() and (spec.fabric_state in (1, 2) or spec.fabric_status != 0):
            return f"error NOTREADY the NVLink fabric of GPU {gpu} is not up (state {spec.fabric_state}): system not yet initialized"
        if spec.ecc_uncontained:
            return f"error ECC GPU {gpu} met an uncontained uncorrectable ECC error and needs a reset"
        mode = self._compute_mode(gpu)
        if mode == 2:
            return f"error BUSY GPU {gpu} is in prohibited compute mode"
        if mode == 3:
            with self.mutex:
                others = [c.pid for c in self.contexts.values() if c.gpu == gpu and c.release_ns is None and c.pid != pid]
            if others:
                return f"error BUSY GPU {gpu} is in exclusive_process compute mode and process {others[0]} holds a context on it"
        return None

    def _reserve(self, gpu: int, mib: int, pid: int = 0) -> tuple[int, int] | str:
        """Allocate a context id, or return an error line."""
        desc = self.desc()
        if not 0 <= gpu < len(desc.gpus):
            return f"error BADGPU no GPU {gpu} (the node has {len(desc.gpus)})"
        if gpu in desc.faults.lost:
            return f"error LOST GPU {gpu} has fallen off the bus"
        refused = self._refusal(desc, gpu, pid)
        if refused:
            return refused
        spec = desc.gpus[gpu]
        with self.mutex:
            free = self._free_mib(desc, gpu) - desc.context_overhead_mib
            if mib > free:
                return f"error OOM out of memory: {mib} MiB requested, {max(free, 0)} MiB free on GPU {gpu}"
            cid = self.next_id
            self.next_id += 1
            self.slots[cid] = _Slot(gpu, mib)
        return cid, spec.minor

    def handle(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(10)
            f = conn.makefile("rwb", buffering=0)
            try:
                line = f.readline().decode().split()
                if line[:1] == ["ping"]:
                    f.write(b"pong\n")
                    return
                if line[:1] in (["alloc"], ["free"], ["release"], ["meminfo"]):
                    f.write(self._cuda(line).encode() + b"\n")
                    return
                if line[:1] == ["teardown"] and len(line) == 2 and line[1] in ("pause", "resume"):
                    # Tear-down of a sandbox or the node: exits are answered at once meanwhile.
                    if self.teardown is not None:
                        self.teardown.pause(line[1] == "pause")
                    f.write(b"ok\n")
                    return
                if len(line) not in (3, 4) or line[0] != "register" or (len(line) == 4 and line[3] not in KINDS):
                    f.write(b"error PROTOCOL expected: register <gpu> <mib> [compute|graphics|mps]\n")
                    return
                gpu, mib = int(line[1]), int(line[2])
                kind = line[3] if len(line) == 4 else "compute"
            except (ValueError, OSError):
                return
            pid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[0]
            reserved = self._reserve(gpu, mib, pid)
            if isinstance(reserved, str):
                f.write(reserved.encode() + b"\n")
                return
            cid, minor = reserved
            try:
                f.write(f"lock {cid} {minor}\n".encode())
                if f.readline().strip() != b"locked":
                    raise OSError("client went away")
            except OSError:
                with self.mutex:
                    self.slots.pop(cid, None)
                return
            try:
                levels = pid_levels(pid)
            except OSError:
                levels = []
            if not levels or levels[0][0] != self.own_ns:
                levels = [(self.own_ns, pid)]  # exited already, or /proc is not our namespace's
            ctx = Context(id=cid, gpu=gpu, minor=minor, mib=mib, lock=cid, pid=pid, levels=levels, created_ns=time.monotonic_ns(), kind=kind)
            with self.mutex:
                self.contexts[cid] = ctx
            write_record(self.state, ctx)
            threading.Thread(target=self._watch, args=(ctx,), daemon=True).start()
            try:
                f.write(f"ok {cid}\n".encode())
            except OSError:
                pass  # the context exists regardless; the watcher handles its end

    # ---------------------------------------------------------- the CUDA library's requests
    def _cuda(self, line: list[str]) -> str:
        """``alloc|free <id> <mib>``, ``release <id>``, ``meminfo <gpu>``: one answer line."""
        try:
            args = [int(x) for x in line[1:]]
        except ValueError:
            return "error PROTOCOL numbers expected"
        desc = self.desc()
        if line[0] == "meminfo":
            if len(args) != 1 or not 0 <= args[0] < len(desc.gpus):
                return "error BADGPU no such GPU"
            spec = desc.gpus[args[0]]
            with self.mutex:
                free = self._free_mib(desc, args[0])
            return f"ok {max(free, 0)} {spec.total_mib - spec.reserved_mib}"
        if len(args) != (1 if line[0] == "release" else 2):
            return "error PROTOCOL expected: alloc|free <id> <mib>, release <id>"
        with self.mutex:
            ctx = self.contexts.get(args[0])
            if ctx is None or ctx.release_ns is not None:
                return f"error INVALID no live context {args[0]}"
            if line[0] == "alloc":
                free = self._free_mib(desc, ctx.gpu)
                if args[1] > free:
                    return f"error OOM out of memory: {args[1]} MiB requested, {max(free, 0)} MiB free on GPU {ctx.gpu}"
                ctx.mib += args[1]
            elif line[0] == "free":
                ctx.mib = max(0, ctx.mib - args[1])
            else:
                # A release tears the context down inside the call: its memory is back when the call returns.
                now = time.monotonic_ns()
                wait = desc.cuda_release_ms * 1_000_000
                ctx.dead_ns, ctx.release_ns = now, now + wait
                self.last_release[ctx.gpu] = max(self.last_release.get(ctx.gpu, 0), ctx.release_ns)
            slot = self.slots.get(ctx.id)
            if slot:
                slot.mib, slot.release_ns = ctx.mib, ctx.release_ns
        write_record(self.state, ctx)
        return f"ok {desc.cuda_release_ms}" if line[0] == "release" else "ok"

    # ---------------------------------------------------------- teardown
    def _timing(self, mib: int) -> tuple[int, int]:
        """(teardown delay, serialisation gap) in ns for a context of ``mib``: release_delay_ms, plus
        release_us_per_gib for each GiB it held."""
        try:
            desc = self.desc()
            return desc.release_delay_ms * 1_000_000 + desc.release_us_per_gib * 1000 * mib // 1024, desc.release_gap_ms * 1_000_000
        except OSError:
            return 185_000_000, 60_000_000

    def _schedule(self, ctx: Context, dead: int) -> bool:
        """Stamp the context dead at ``dead`` and compute its release (mutex held).
        False if it already had one (the exit path got there first)."""
        if ctx.release_ns is not None:
            return False
        delay, gap = self._timing(ctx.mib)
        release = max(dead + delay, self.last_release.get(ctx.gpu, 0) + gap)
        self.last_release[ctx.gpu] = release
        slot = self.slots.get(ctx.id)
        if slot:
            slot.release_ns = release
        ctx.dead_ns, ctx.release_ns = dead, release
        return True

    def on_exit(self, ids: list[int], _pid: int) -> int | None:
        """The last holder of these contexts is exiting (teardown file closed): free them now
        and say when that is done, which is when the exiting process may go."""
        now = time.monotonic_ns()
        releases = []
        with self.mutex:
            for cid in ids:
                ctx = self.contexts.get(cid)
                if ctx is None:
                    continue
                if self._schedule(ctx, now):
                    try:
                        write_record(self.state, ctx)
                    except OSError:
                        pass
                    self._gradual(ctx)
                if ctx.release_ns is not None:
                    releases.append(ctx.release_ns)
        return max(releases) if releases else None

    def _watch(self, ctx: Context) -> None:
        """Block until every holder of the context is gone, then schedule its release."""
        fd = os.open(self.state / "driver" / f"nvidia{ctx.minor}", os.O_RDWR | os.O_CLOEXEC)
        try:
            ofd_lock(fd, ctx.lock, fcntl.F_WRLCK, wait=True)
            dead = time.monotonic_ns()
            ofd_lock(fd, ctx.lock, fcntl.F_UNLCK, wait=False)
        finally:
            os.close(fd)
        with self.mutex:
            fresh = self._schedule(ctx, dead)
        if fresh:
            try:
                write_record(self.state, ctx)
            except OSError:
                return  # state dir removed: the node is gone
            self._gradual(ctx)
        self._expire(ctx)

    def _step_down(self, ctx: Context) -> None:
        """With ``release_gradual``: lower a dying context's memory step by step from its death to its release, rewriting
        its record (the library reads it on every call), as a long teardown frees what it can as it goes."""
        assert ctx.release_ns is not None and ctx.dead_ns is not None
        whole, span = ctx.mib, max(1, ctx.release_ns - ctx.dead_ns)
        while ctx.release_ns - time.monotonic_ns() > GRADUAL_STEP_NS:
            time.sleep(GRADUAL_STEP_NS / 1e9)
            with self.mutex:
                ctx.mib = max(0, whole * (ctx.release_ns - time.monotonic_ns()) // span)
            try:
                write_record(self.state, ctx)
            except OSError:
                return  # state dir removed: the node is gone

    def _gradual(self, ctx: Context) -> None:
        """Start :meth:`_step_down` for a context just stamped dead, when the node asks for gradual teardowns."""
        try:
            gradual = bool(self.desc().release_gradual)
        except OSError:
            gradual = False
        if gradual:
            threading.Thread(target=self._step_down, args=(ctx,), daemon=True).start()

    def _expire(self, ctx: Context) -> None:
        """Delete the record once the release time has passed (the library
        already ignores it from release_ns on; deleting just tidies up)."""
        assert ctx.release_ns is not None
        delay = (ctx.release_ns - time.monotonic_ns()) / 1e9
        if delay > 0:
            time.sleep(delay)
        remove_record(self.state, ctx.id)
        with self.mutex:
            self.slots.pop(ctx.id, None)
            self.contexts.pop(ctx.id, None)

    # ---------------------------------------------------------- main loop
    def serve(self, ready_fd: int | None, watch_parent: bool, teardown: bool = False) -> None:
        self._lock_fd = self.lock_instance()  # open (hence locked) until we exit
        (self.state / "driver.pid").write_text(f"{os.getpid()}\n")
        self.adopt()
        if teardown:
            fs = TeardownFS(self.state / "teardown", self.on_exit, lambda: self.desc().teardown_hang_ms)
            if fs.mount():
                self.teardown = fs
            else:
                print("gpusim driver: no FUSE here (/dev/fuse or the right to mount is missing): exits are instant", file=sys.stderr, flush=True)
        path = self.state / "driver.sock"
        if len(os.fsencode(path)) >= 108:
            raise SystemExit(f"gpusim driver: socket path too long: {path}")
        try:
            path.unlink()
        except FileNotFoundError:
            pass
        srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        srv.bind(str(path))
        os.chmod(path, 0o666)
        srv.listen(128)

        def stop(_sig: int, _frame: object) -> None:
            if self.teardown is not None:
                # Detach the mount; exiting closes /dev/fuse, which aborts any teardown still waiting.
                self.teardown.unmount()
            for p in (path, self.state / "driver.pid"):
                try:
                    p.unlink()
                except FileNotFoundError:
                    pass
            os._exit(0)

        signal.signal(signal.SIGTERM, stop)
        signal.signal(signal.SIGINT, stop)
        if watch_parent:
            threading.Thread(target=self._watch_parent, args=(os.getppid(),), daemon=True).start()
        if ready_fd is not None:
            os.write(ready_fd, b"ready\n")
            os.close(ready_fd)
        while True:
            try:
                conn, _unused = srv.accept()
            except InterruptedError:
                continue
            threading.Thread(target=self.handle, args=(conn,), daemon=True).start()

    def _watch_parent(self, parent: int) -> None:
        """Exit with the process that started us (Node.start without detach),
        so a killed test run leaves no daemon behind."""
        try:
            fd = os.pidfd_open(parent)
        except ProcessLookupError:
            os.kill(os.getpid(), signal.SIGTERM)
            return
        select.select([fd], [], [])
        os.kill(os.getpid(), signal.SIGTERM)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="gpusim.driver", description="simulated NVIDIA kernel driver daemon")
    ap.add_argument("--state", required=True, type=Path)
    ap.add_argument("--ready-fd", type=int, help="write 'ready' here once serving")
    ap.add_argument("--watch-parent", action="store_true", help="exit when the parent process exits")
    ap.add_argument("--teardown", action="store_true", help="serve teardown/ over FUSE: exiting workers wait for their contexts to be freed")
    args = ap.parse_args(argv)
    Driver(args.state.resolve()).serve(args.ready_fd, args.watch_parent, args.teardown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
