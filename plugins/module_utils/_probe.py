# Copyright (c) 2026, gpuops.clean_slate maintainers
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# Note: this module_util is PRIVATE to the collection; it may change without notice.

"""NVML calls that cannot hang the run: every one runs in a helper process, under a deadline.

A hung driver does not fail a call, it never returns it: the calling thread sits in an ioctl,
and no Python code can stop or abandon it (a thread cannot be killed; a timer or signal handler
never runs while the thread is in C). A process can be killed. So the modules make no NVML call
themselves: a :class:`Prober` forks one helper process that opens the NVML session and answers
requests over a pipe, and it announces every call before it makes it (the GPU, then each entry
point's name, through a wrapper around pynvml's function lookup). When a call has not come back
by its deadline the module knows which GPU and which call hung, kills the helper (SIGKILL: the
driver's waits are killable), reaps it, marks that GPU hung (:class:`DriverHung`, reason
``driver_hung``) and starts a fresh helper for the other GPUs, which never touches the hung one
again. All within one overall end, so a module returns within its own timeout plus a little.

Any per-GPU reading runs under the same deadline: :meth:`Prober.each` takes a plain module-level
function ``fn(session, gpu, *args)`` (``session`` an :class:`~._nvml.NvmlSession` opened in the
helper, ``gpu`` an :class:`~._nvml.Gpu` with its handle) and returns what it returns, pickled:
plain data (device handles come back as ``None``). Work that is not an NVML call but can block
as well (a ``/proc`` read of a process stuck in the driver) is announced with :func:`announce`.

The helper never outlives the module: it is in the module's process group (Ansible's async
wrapper kills that group), it asks the kernel for SIGKILL when its parent dies
(``PR_SET_PDEATHSIG``), and :meth:`Prober.close` kills and reaps it.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import pickle
import select
import signal
import struct
import time
import typing as t
from dataclasses import dataclass

from ansible_collections.gpuops.clean_slate.plugins.module_utils import _cuda_program, _nvml, _reasons
from ansible_collections.gpuops.clean_slate.plugins.module_utils._errors import CleanSlateError

ADVICE = (
    "The driver did not answer, and a call stuck in it will not come back: reboot the node (or follow the node's documented"
    " recovery: stop every user of the GPU, then nvidia-smi -r -i <index> where the driver still allows it). Check dmesg for"
    " Xid errors and hung-task reports first."
)

# How long a killed helper may take to be reaped. A process stuck in an uninterruptible wait of the
# driver dies only when the driver lets it; the module does not wait for that (it says so instead).
REAP_WAIT_S = 0.5

_HEADER = struct.Struct("!cI")
_ANSWER = b"R"  # payload: a pickled (ok, value)

# Where the helper is, written before every call into a page both processes map (MAP_SHARED): a
# sequence number, the number of calls, the GPU (-1: the system) and the call's name. A memory write costs the helper about
# a microsecond and wakes nobody; the module looks at the page only while it waits (every
# _WATCH_S at most), so the healthy path pays no pipe message or context switch per call.
_SLOT = struct.Struct("!QQiH")
_NAME_MAX = 200
_WATCH_S = 0.05


class _Board:
    """The shared page: the helper writes where it is, the module reads it."""

    def __init__(self) -> None:
        self.page = mmap.mmap(-1, mmap.PAGESIZE)
        self.seq = 0
        self.calls = 0

    def write(self, gpu: int | None, name: str | None) -> None:
        raw = (name or "").encode("utf-8", "replace")[:_NAME_MAX]
        self.seq += 1
        self.calls += 1 if name else 0
        # The name first, the header (with the new sequence number) last; the reader checks the number twice.
        self.page[_SLOT.size : _SLOT.size + len(raw)] = raw
        self.page[: _SLOT.size] = _SLOT.pack(self.seq, self.calls, -1 if gpu is None else gpu, len(raw))

    def read(self) -> tuple[int, int, int | None, str | None]:
        while True:
            seq, calls, gpu, size = _SLOT.unpack_from(self.page)
            name = bytes(self.page[_SLOT.size : _SLOT.size + size]).decode("utf-8", "replace")
            if _SLOT.unpack_from(self.page)[0] == seq:
                return seq, calls, (None if gpu < 0 else gpu), (name or None)

    def close(self) -> None:
        self.page.close()


_board: _Board | None = None  # the helper's, set in the helper process only
_gpu_now: int | None = None


def announce(name: str) -> None:
    """Say, in the helper, that a call that may block starts now (a no-op outside the helper)."""
    if _board is not None:
        _board.write(_gpu_now, name)


def _on_gpu(index: int | None) -> None:
    global _gpu_now  # pylint: disable=global-statement
    _gpu_now = index
    if _board is not None:
        _board.write(index, None)


class DriverHung(_nvml.NvmlError):
    """An NVML call that did not return within its deadline: the GPU (or the driver) is hung."""

    def __init__(self, call: str, gpu: int | None, waited_s: float) -> None:  # pylint: disable=super-init-not-called
        where = f"GPU {gpu}: " if gpu is not None else ""
        msg = f"{where}{call} did not return within {waited_s:.1f} s; the helper process making it was killed. {ADVICE}"
        # NvmlError's constructor wants an NVML return code; a hang has none.
        CleanSlateError.__init__(self, msg, reason=_reasons.DRIVER_HUNG, call=call, waited_s=round(waited_s, 3))  # pylint: disable=non-parent-init-called
        self.code = -1
        self.gpu = gpu
        self.call = call
        self.waited_s = waited_s


class Late(CleanSlateError):
    """A GPU that was not read because the overall end had passed (not hung: not asked)."""

    def __init__(self, gpu: int) -> None:
        super().__init__(
            f"GPU {gpu} was not read: the time for NVML calls ran out (the module's timeout, spent in part waiting on calls that hung).",
            reason=_reasons.TIMEOUT,
        )
        self.gpu = gpu


@dataclass
class Answer:
    """What one GPU's call gave: a value, or an error (hung, late, or what the function raised)."""

    value: t.Any = None
    error: BaseException | None = None

    @property
    def hung(self) -> bool:
        return isinstance(self.error, DriverHung)


@dataclass
class Stats:
    """What the prober did, for benchmarks and notes."""

    helpers: int = 0  # helper processes started
    calls: int = 0  # NVML calls announced
    requests: int = 0  # round trips


class _Announced:
    """A C function pointer from pynvml that announces its name before each call.

    pynvml sets ``restype``/``argtypes`` on what it looked up, so those go to the real pointer.
    """

    __slots__ = ("_fn", "_name")

    def __init__(self, name: str, fn: t.Any) -> None:
        object.__setattr__(self, "_name", name)
        object.__setattr__(self, "_fn", fn)

    def __call__(self, *args: t.Any) -> t.Any:
        announce(self._name)
        return self._fn(*args)

    def __getattr__(self, attr: str) -> t.Any:
        return getattr(self._fn, attr)

    def __setattr__(self, attr: str, value: t.Any) -> None:
        setattr(self._fn, attr, value)


def _none() -> None:
    return None


class _Pickler(pickle.Pickler):
    # Device handles (ctypes pointers) mean nothing in another process: they travel as None.
    def reducer_override(self, obj: t.Any) -> t.Any:
        if isinstance(obj, (ctypes._Pointer, ctypes.c_void_p)):  # pylint: disable=protected-access
            return _none, ()
        return NotImplemented


def _dumps(obj: t.Any) -> bytes:
    import io

    buf = io.BytesIO()
    _Pickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return buf.getvalue()


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _send(fd: int, kind: bytes, payload: bytes) -> None:
    _write_all(fd, _HEADER.pack(kind, len(payload)) + payload)


def _read_exact(fd: int, n: int) -> bytes | None:
    chunks = []
    while n:
        chunk = os.read(fd, n)
        if not chunk:
            return None
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


# ---------------------------------------------------------------------- the helper process
def _helper(requests: int, answers: int, parent: int, skip: t.Mapping[int, CleanSlateError], opener: t.Callable[[], t.Any], board: _Board) -> None:
    """The helper's life: open the session, report the GPUs, answer requests until the pipe closes."""
    global _board  # pylint: disable=global-statement
    # Dies with the module, and nothing it does may reach the module's stdout (its JSON result) or keep it open.
    if not _cuda_program.detach(parent):  # the parent died before the request took effect
        return
    _board = board
    if _nvml.HAS_PYNVML:
        lookup = _nvml.pynvml._nvmlGetFunctionPointer  # pylint: disable=protected-access
        _nvml.pynvml._nvmlGetFunctionPointer = lambda name: _Announced(name, lookup(name))  # pylint: disable=protected-access

    def reply(ok: bool, value: t.Any) -> None:
        try:
            payload = _dumps((ok, value))
        except Exception as exc:  # noqa: BLE001  # pylint: disable=broad-exception-caught
            payload = _dumps((False, CleanSlateError(f"the NVML helper could not send its answer: {exc!r}", reason=_reasons.INTERNAL_ERROR)))
        _send(answers, _ANSWER, payload)

    _on_gpu(None)
    announce("nvmlInit")
    try:
        session = opener()
        session.open()
        gpus = session.gpus(skip=skip, on_gpu=_on_gpu)
    except Exception as exc:  # noqa: BLE001  # pylint: disable=broad-exception-caught
        reply(False, exc)
        return
    by_index = {g.index: g for g in gpus}
    reply(True, gpus)
    while True:
        head = _read_exact(requests, _HEADER.size)
        if head is None:
            break
        _kind, size = _HEADER.unpack(head)
        body = _read_exact(requests, size)
        if body is None:
            break
        fn, indices, args = pickle.loads(body)
        for index in indices:
            _on_gpu(index)
            try:
                value = fn(session, *args) if index is None else fn(session, by_index[index], *args)
            except Exception as exc:  # noqa: BLE001  # pylint: disable=broad-exception-caught
                reply(False, exc)
            else:
                reply(True, value)
    session.close()


def _exit_waiter(pid: int) -> int | None:
    """A pidfd of ``pid`` (Linux 5.3+, Python 3.9+): readable once it exits. None where there is none."""
    opener = getattr(os, "pidfd_open", None)
    if opener is None:
        return None
    try:
        return int(opener(pid))
    except OSError:
        return None


# ---------------------------------------------------------------------- the module's side
class Prober:
    """The NVML session of a module, in a helper process, with a deadline on every call.

    :param probe_timeout: seconds one call may take before its GPU is declared hung.
    :param end: a ``clock()`` time after which no call is waited for (the module's own bound), or None.
    :param opener: makes the session in the helper (tests hand in their own).
    """

    def __init__(
        self,
        probe_timeout: float,
        end: float | None = None,
        clock: t.Callable[[], float] = time.monotonic,
        opener: t.Callable[[], t.Any] = _nvml.NvmlSession,
    ) -> None:
        self.probe_timeout = probe_timeout
        self.end = end
        self.clock = clock
        self.opener = opener
        self.every: list[_nvml.Gpu] = []
        self.hung: dict[int, DriverHung] = {}  # GPU index -> how it hung
        self.system_hung: DriverHung | None = None  # the driver as a whole (nvmlInit, a system call)
        self.left_behind: list[int] = []  # helpers that did not die of SIGKILL in time (stuck in the driver)
        self.stats = Stats()
        self._pid: int | None = None
        self._requests = -1
        self._answers = -1
        self._buffer = b""
        self._board: _Board | None = None
        self._seen = 0
        self._calls = 0

    def __enter__(self) -> Prober:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ life of the helper
    def start(self) -> list[_nvml.Gpu]:
        """Start the helper: NVML opened, every GPU's identity read. Raises what NVML raised, or :class:`DriverHung`."""
        if self._pid is None:
            self._spawn()
        return self.every

    def _spawn(self) -> None:
        """Start a helper; a GPU whose identity calls hang is marked and skipped by the next one."""
        while True:
            try:
                self._spawn_once()
                return
            except DriverHung as exc:
                if exc.gpu is None:
                    self.system_hung = exc
                    raise
                self.hung[exc.gpu] = exc

    def _spawn_once(self) -> None:
        if self.system_hung is not None:
            raise self.system_hung
        if not _nvml.HAS_PYNVML and self.opener is _nvml.NvmlSession:
            _nvml.NvmlSession().open()  # raises the missing-library error here, without a helper
        req_r, req_w = os.pipe()
        ans_r, ans_w = os.pipe()
        parent = os.getpid()
        skip = dict(self.hung)
        board = self._board = _Board()
        self._seen = self._calls = 0
        pid = os.fork()
        if pid == 0:  # pragma: no cover - runs in the helper (its coverage is not collected)
            try:
                os.close(req_w)
                os.close(ans_r)
                _helper(req_r, ans_w, parent, skip, self.opener, board)
            finally:
                os._exit(0)
        os.close(req_r)
        os.close(ans_w)
        self._pid, self._requests, self._answers, self._buffer = pid, req_w, ans_r, b""
        self.stats.helpers += 1
        try:
            ok, value = self._answer(_Waiting(self.clock(), None))
        except _HelperDied as exc:
            raise CleanSlateError(f"the NVML helper process died while opening NVML ({exc}).", reason=_reasons.NVML_ERROR) from None
        if not ok:
            self._stop()
            raise value
        known = {g.index: g for g in self.every}
        fresh: list[_nvml.Gpu] = value
        for position, gpu in enumerate(fresh):
            if gpu.index in self.hung and gpu.index in known:
                # The hung GPU is not asked again: keep the identity read before it hung.
                old = known[gpu.index]
                old.error = self.hung[gpu.index]
                fresh[position] = old
        self.every = fresh

    def _stop(self) -> None:
        """Kill and reap the helper (closing its pipes first: a healthy helper would exit by itself)."""
        pid, self._pid = self._pid, None
        for fd in (self._requests, self._answers):
            if fd >= 0:
                os.close(fd)
        self._requests = self._answers = -1
        if self._board is not None:
            self._board.close()
            self._board = None
        if pid is None:
            return
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        deadline = time.monotonic() + REAP_WAIT_S
        waiter = _exit_waiter(pid)
        try:
            while True:
                try:
                    done, _status = os.waitpid(pid, os.WNOHANG)
                except ChildProcessError:
                    return
                if done:
                    return
                left = deadline - time.monotonic()
                if left <= 0:
                    # Stuck in the driver (state D): it dies when the driver lets it, and init reaps it then.
                    self.left_behind.append(pid)
                    return
                if waiter is not None:
                    select.select([waiter], [], [], left)  # readable once it has exited
                else:
                    time.sleep(min(left, 0.001))
        finally:
            if waiter is not None:
                os.close(waiter)

    def close(self) -> None:
        """End the helper; idempotent."""
        self._stop()

    # ------------------------------------------------------------------ requests
    def call(self, fn: t.Callable[..., t.Any], *args: t.Any) -> t.Any:
        """``fn(session, *args)`` for the system as a whole; raises what it raised, or :class:`DriverHung`."""
        answer = self._run(fn, [None], args)[0]
        if answer.error is not None:
            raise answer.error
        return answer.value

    def each(self, fn: t.Callable[..., t.Any], gpus: t.Sequence[_nvml.Gpu], *args: t.Any) -> list[Answer]:
        """``fn(session, gpu, *args)`` for every GPU, in order; a GPU that hangs (now or before) answers :class:`DriverHung`."""
        return self._run(fn, [g.index for g in gpus], args)

    def _run(self, fn: t.Callable[..., t.Any], indices: list[int | None], args: tuple[t.Any, ...]) -> list[Answer]:
        answers: dict[int | None, Answer] = {}
        todo = list(indices)
        while todo:
            for index in list(todo):
                if index is not None and index in self.hung:
                    answers[index] = Answer(error=self.hung[index])
                    todo.remove(index)
                elif self.system_hung is not None:
                    answers[index] = Answer(error=self.system_hung)
                    todo.remove(index)
            if not todo:
                break
            if self.end is not None and self.clock() >= self.end:
                for index in todo:
                    answers[index] = Answer(error=Late(-1 if index is None else index))
                break
            if self._pid is None:
                try:
                    self._spawn()
                except DriverHung:
                    continue  # system_hung is set: the loop answers the rest with it
            self.stats.requests += 1
            _send(self._requests, b"Q", pickle.dumps((fn, todo, args), protocol=pickle.HIGHEST_PROTOCOL))
            state = _Waiting(self.clock(), todo[0])
            while todo:
                try:
                    ok, value = self._answer(state)
                except DriverHung as exc:
                    if state.gpu is None:
                        self.system_hung = exc
                    else:
                        self.hung[state.gpu] = exc
                    break  # the helper is gone: a fresh one takes the rest
                except _OutOfTime:
                    for index in todo:
                        answers[index] = Answer(error=Late(-1 if index is None else index))
                    todo = []
                    break
                except _HelperDied as exc:
                    failed = todo.pop(0) if todo else None
                    answers[failed] = Answer(
                        error=CleanSlateError(f"the NVML helper process died during {state.call or 'a call'} ({exc}).", reason=_reasons.NVML_ERROR)
                    )
                    break
                done = todo.pop(0)
                answers[done] = Answer(value=value) if ok else Answer(error=value)
                state.gpu = todo[0] if todo else None
        return [answers[i] for i in indices]

    def _answer(self, state: _Waiting) -> tuple[bool, t.Any]:
        """Wait for the next answer; raise :class:`DriverHung` when the current call's deadline passes."""
        _kind, payload = self._frame(state)
        state.since = self.clock()  # the helper moved on: the next call's time starts now
        self._look(state)
        return t.cast(t.Tuple[bool, t.Any], pickle.loads(payload))

    def _look(self, state: _Waiting) -> bool:
        """Read the shared page: where the helper is now. True when it moved on since the last look."""
        if self._board is None:
            return False
        seq, calls, gpu, call = self._board.read()
        if seq == self._seen:
            return False
        self.stats.calls += calls - self._calls
        self._seen, self._calls = seq, calls
        state.gpu, state.call, state.since = gpu, call or state.call, self.clock()
        return True

    def _frame(self, state: _Waiting) -> tuple[bytes, bytes]:
        while True:
            if len(self._buffer) >= _HEADER.size:
                kind, size = _HEADER.unpack_from(self._buffer)
                if len(self._buffer) >= _HEADER.size + size:
                    payload = self._buffer[_HEADER.size : _HEADER.size + size]
                    self._buffer = self._buffer[_HEADER.size + size :]
                    return kind, payload
            deadline = state.since + self.probe_timeout
            if self.end is not None:
                deadline = min(deadline, max(self.end, state.since))
            wait = min(deadline - self.clock(), _WATCH_S)
            ready = select.select([self._answers], [], [], max(0.0, wait))[0]
            if not ready:
                if self._look(state) or self.clock() < deadline:
                    continue  # the helper moved on (a new call started), or this one still has time
                waited = self.clock() - state.since
                self._stop()
                if waited < self.probe_timeout:
                    # Cut short by the overall end, not by its own deadline: not proven hung, just not read.
                    raise _OutOfTime()
                raise DriverHung(state.call or "nvmlInit", state.gpu, waited)
            chunk = os.read(self._answers, 65536)
            if not chunk:
                pid = self._pid
                self._stop()
                raise _HelperDied(f"helper {pid} exited")
            self._buffer += chunk


@dataclass
class _Waiting:
    """Where the helper is: since when, on which GPU (None: the system), in which call."""

    since: float
    gpu: int | None
    call: str | None = None


class _OutOfTime(Exception):
    """The overall end came before the current call had had its probe_timeout."""


class _HelperDied(Exception):
    """The helper's pipe closed before it answered (it crashed)."""
