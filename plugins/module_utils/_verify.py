# Copyright (c) 2026, gpuops.clean_slate maintainers
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# Note: this module_util is PRIVATE to the collection; it may change without notice.

"""Verify that GPUs are clean: poll NVML in-process until every selected GPU
is clean or a deadline passes, then explain each GPU that is not.

Polling is in-process because one NVML query costs well under a millisecond
per GPU while spawning nvidia-smi costs ~22 ms, and because GPU memory comes
back 60-110 ms after a process dies: a clean node answers in milliseconds and
a node that was just cleaned answers as soon as the driver has freed it.

It is also the gpu_mem_verify module's logic (:func:`run`): its options,
the verdict (dirty GPUs, ``expected_count``) and the result.
"""

from __future__ import annotations

import contextlib
import datetime
import importlib.util
import os
import platform
import sys
import time
import typing as t
from dataclasses import dataclass, field

from ansible_collections.gpuops.clean_slate.plugins.module_utils import (
    _checks,
    _cuda,
    _cuda_program,
    _findings,
    _health,
    _nvml,
    _peers,
    _probe,
    _procs,
    _proctable,
    _protection,
    _reasons,
    _reset,
    _software,
)
from ansible_collections.gpuops.clean_slate.plugins.module_utils._errors import CleanSlateError
from ansible_collections.gpuops.clean_slate.plugins.module_utils._nvml import (
    Gpu,
    GpuProcess,
    Memory,
    NvmlError,
    NvmlSession,
    recovery_action_name,
)

# Diagnoses that waiting cannot change: stop polling early when only these remain.
TERMINAL = frozenset({_reasons.GPU_LOST, _reasons.UNSUPPORTED, _reasons.NEEDS_RESET, _reasons.DRIVER_HUNG})

# NVML failures of one GPU that waiting cannot change, and the diagnosis each one is.
_TERMINAL_ERRORS = {
    _reasons.GPU_LOST: _reasons.GPU_LOST,
    _reasons.NOT_SUPPORTED: _reasons.UNSUPPORTED,
    _reasons.NEEDS_RESET: _reasons.NEEDS_RESET,
    _reasons.DRIVER_HUNG: _reasons.DRIVER_HUNG,
}

#: A GPU whose used memory went down this recently is still in a teardown that makes progress (``progress_timeout``).
PROGRESS_WINDOW_S = 10.0
# Seconds the NVML work may go on after the verification's own timeout: the last poll and the
# naming of holders. The module returns within max(timeout, probe_timeout) plus this plus its own
# bookkeeping, even when calls hang.
NVML_GRACE_S = 0.5

# Device memory a live context costs beyond what NVML charges its process (9 MiB for a torch
# process on an H200: 518 MiB listed, 527 MiB used device-wide), with room to spare. A GPU whose
# listed processes explain its memory up to this much each is not held by anyone unlisted; a real
# leftover context (>= 518 MiB) is far above it.
CONTEXT_OVERHEAD_ALLOWANCE_MIB = 32

#: What fixes each diagnosis: the one table of findings (a GPU's detail says what happened, then this).
ADVICE = {
    diagnosis: _findings.FINDINGS[diagnosis].fix
    for diagnosis in (
        _reasons.BUSY,
        _reasons.HELD_OUTSIDE_NAMESPACE,
        _reasons.ORPHANED_CONTEXT,
        _reasons.HELD_BY_PROTECTED,
        _reasons.GPU_LOST,
        _reasons.NEEDS_RESET,
        _reasons.UNSUPPORTED,
        _reasons.UNRESPONSIVE,
        _reasons.DRIVER_HUNG,
    )
}


@dataclass
class Reading:
    """One poll of one GPU."""

    gpu: Gpu
    memory: Memory | None = None
    processes: list[GpuProcess] = field(default_factory=list)
    recovery_action: int | None = None
    error: NvmlError | None = None
    estimated_reserved_mib: int | None = None

    @property
    def used_mib(self) -> int | None:
        if self.memory is None:
            return None
        if self.memory.api == "v1":
            return max(0, self.memory.used_mib - (self.estimated_reserved_mib or 0))
        return self.memory.used_mib

    @property
    def reserved_mib(self) -> int | None:
        if self.memory is None:
            return None
        return self.memory.reserved_mib if self.memory.api == "v2" else self.estimated_reserved_mib


def read_gpu(session: NvmlSession, gpu: Gpu) -> Reading:
    """Memory, processes and recovery action of one GPU; NVML errors are kept, not raised."""
    reading = Reading(gpu=gpu)
    if gpu.error is not None:
        reading.error = gpu.error
        return reading
    try:
        reading.memory = session.memory(gpu)
        reading.processes = session.processes(gpu)
        reading.recovery_action = session.recovery_action(gpu)
    except NvmlError as exc:
        reading.error = exc
    return reading


def read_all(session: t.Any, gpus: list[Gpu]) -> list[Reading]:
    """One reading per GPU: through the helper process of a :class:`~._probe.Prober` (a GPU whose call
    hangs reads as its :class:`~._probe.DriverHung` error), or in-process from any session-like object."""
    if not isinstance(session, _probe.Prober):
        return [read_gpu(session, g) for g in gpus]
    readings = []
    for gpu, answer in zip(gpus, session.each(read_gpu, gpus)):
        if answer.error is None:
            reading = answer.value
            reading.gpu = gpu  # the module's own record (the helper's copy has no handle)
        else:
            reading = Reading(gpu=gpu, error=t.cast(NvmlError, answer.error))
        readings.append(reading)
    return readings


def read_health(_session: t.Any, gpu: Gpu) -> dict[str, t.Any]:
    """The health readings of one GPU (:func:`._health.read_gpu`), in the shape :meth:`._probe.Prober.each` calls."""
    return _health.read_gpu(gpu.handle)


def read_health_all(session: t.Any, gpus: list[Gpu]) -> tuple[list[dict[str, t.Any] | None], dict[int, CleanSlateError]]:
    """Each GPU's health readings (None for a GPU that has an error, or whose reading failed), under the
    prober's deadline when ``session`` is a Prober, and the GPUs whose reading hung (index -> DriverHung)."""
    readable = [g for g in gpus if g.error is None]
    hung: dict[int, CleanSlateError] = {}
    if isinstance(session, _probe.Prober):
        got = {}
        for g, answer in zip(readable, session.each(read_health, readable)):
            got[g.index] = answer.value if answer.error is None else None
            if isinstance(answer.error, _probe.DriverHung):
                hung[g.index] = answer.error
    else:
        got = {g.index: read_health(session, g) for g in readable}
    return [got.get(g.index) for g in gpus], hung


def processes_by_gpu(session: t.Any, gpus: list[Gpu]) -> dict[int, list[GpuProcess]]:
    """NVML's process list of each GPU that answers (in the helper when ``session`` is a Prober)."""
    out: dict[int, list[GpuProcess]] = {}
    if isinstance(session, _probe.Prober):
        for gpu, answer in zip(gpus, session.each(_nvml.NvmlSession.processes, gpus)):
            if answer.error is None:
                out[gpu.index] = answer.value
        return out
    for gpu in gpus:
        try:
            out[gpu.index] = session.processes(gpu)
        except NvmlError:
            continue
    return out


def estimate_v1_reserved(readings: list[Reading]) -> None:
    """On drivers without memory info v2, estimate what each idle GPU reserves.

    v1 ``used`` includes driver-reserved memory. The estimate is the smallest
    (v1 used - memory of the listed processes) among GPUs of the same model,
    so a GPU holding orphaned memory does not hide it as "reserved" while an
    idle sibling exists.
    """
    by_model: dict[str | None, list[int]] = {}
    for r in readings:
        if r.memory is not None and r.memory.api == "v1":
            listed = sum(p.used_mib or 0 for p in r.processes)
            by_model.setdefault(r.gpu.name, []).append(max(0, r.memory.used_mib - listed))
    for r in readings:
        if r.memory is not None and r.memory.api == "v1":
            r.estimated_reserved_mib = min(by_model[r.gpu.name])


@dataclass
class Criteria:
    """What "clean" means."""

    max_used_mib: int = 64
    require_no_processes: bool = True


def quick_judge(reading: Reading, criteria: Criteria) -> tuple[bool, str | None]:
    """(clean, terminal diagnosis or None) from one reading, without scanning /proc."""
    if reading.error is not None:
        # What waiting cannot change ends the polling early; anything else (a timeout) may pass.
        return False, _TERMINAL_ERRORS.get(reading.error.reason)
    used = reading.used_mib
    if used is None or used > criteria.max_used_mib:
        return False, None
    if criteria.require_no_processes and reading.processes:
        return False, None
    if reading.recovery_action not in (None, 0):
        return False, _reasons.NEEDS_RESET
    return True, None


def _comm(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/comm", encoding="utf-8", errors="backslashreplace") as fh:
            return fh.read().strip()
    except OSError:
        return None


def protected_daemons(pids: t.Iterable[int], protect: t.Sequence[str] | None = None) -> dict[int, str]:
    """Those of ``pids`` that gpu_procs_kill protects as daemons (by executable), with the entry they match."""
    entries = list(protect) if protect is not None else _protection.protect_list([], [])
    out = {}
    for pid in pids:
        facts = _procs.read_facts(pid)
        name = _protection.protected_name(facts, entries) if facts is not None else None
        if name:
            out[pid] = name
    return out


def diagnose(
    reading: Reading,
    criteria: Criteria,
    holders: dict[int, _proctable.Holding],
    own: set[int],
    nvml_minors: dict[int, set[int]] | None = None,
    protect: t.Sequence[str] | None = None,
) -> tuple[str, str, list[int]]:
    """(diagnosis, sentence, pids holding it) for a GPU, using a /proc holder scan.

    ``nvml_minors`` says on which GPUs (device minors) NVML lists each pid, so that a
    process holding every device file is blamed only for the GPUs it uses. A GPU held
    only by daemons gpu_procs_kill protects (``protect``, the default list when None)
    is ``held_by_protected``: killing will never free it.
    """
    clean, terminal = quick_judge(reading, criteria)
    gpu = reading.gpu
    if clean:
        return _reasons.CLEAN, "clean", []
    if terminal == _reasons.DRIVER_HUNG:
        return terminal, t.cast(NvmlError, reading.error).msg, []
    if terminal in (_reasons.GPU_LOST, _reasons.UNSUPPORTED):
        return terminal, t.cast(NvmlError, reading.error).msg if reading.error else ADVICE[terminal], []
    if reading.error is not None:
        if reading.error.reason == _reasons.TIMEOUT:
            return _reasons.UNRESPONSIVE, f"{reading.error.msg} {ADVICE[_reasons.UNRESPONSIVE]}", []
        return _reasons.UNSUPPORTED, reading.error.msg, []
    used = reading.used_mib or 0
    listed_on = nvml_minors or {}
    visible_listed = sorted(p.pid for p in reading.processes if os.path.exists(f"/proc/{p.pid}") and p.pid not in own)
    invisible_listed = sorted(p.pid for p in reading.processes if not os.path.exists(f"/proc/{p.pid}"))
    listed_here = [p for p in reading.processes if p.pid in visible_listed]
    explained = sum(p.used_mib or 0 for p in listed_here)
    # A holder NVML does not list (the CUDA driver maps every GPU's file) is blamed only for memory
    # that no visible listed process accounts for: NVML lists a pid that is not here (a forked
    # child's dead parent), or more is used than the listed processes were charged plus the driver's
    # own share of each context. Where NVML cannot say what a process uses (MIG), only the first counts.
    charged = all(p.used_mib is not None for p in listed_here)
    allowance = criteria.max_used_mib + CONTEXT_OVERHEAD_ALLOWANCE_MIB * len(listed_here)
    unexplained = bool(invisible_listed) or (charged and (reading.used_mib or 0) > explained + allowance)
    compute_holders = sorted(
        pid
        for pid, h in holders.items()
        if pid not in own
        and gpu.minor is not None
        and h.has_mmaps
        and gpu.minor in _proctable.attribute(h, listed_on.get(pid)) & h.minors
        and (pid in listed_on or unexplained)
    )
    holding = sorted(set(compute_holders) | set(visible_listed))
    if holding:
        names = ", ".join(f"{pid} ({_comm(pid) or '?'})" for pid in holding)
        extra = ""
        if invisible_listed:
            extra = (
                f" NVML also lists PID(s) {', '.join(map(str, invisible_listed))} that do not exist here"
                " (a dead parent whose forked child holds the memory, or another namespace)."
            )
        daemons = protected_daemons(holding, protect)
        if len(daemons) == len(holding):
            what = ", ".join(f"{pid} ({name})" for pid, name in daemons.items())
            return _reasons.HELD_BY_PROTECTED, f"{used} MiB used, held by protected daemon PID(s) {what}.{extra} {ADVICE[_reasons.HELD_BY_PROTECTED]}", holding
        if daemons:
            extra += f" PID(s) {', '.join(map(str, daemons))} are protected daemons, which gpu_procs_kill will not end."
        return _reasons.BUSY, f"{used} MiB used, held by PID(s) {names}.{extra} {ADVICE[_reasons.BUSY]}", holding
    if used > criteria.max_used_mib or reading.processes:
        # Inside a container, host-held memory and an orphaned context look alike; the driver's
        # recovery action tells them apart when it asks for a reset.
        flagged = reading.recovery_action not in (None, 0)
        if invisible_listed or (not flagged and not _proctable.in_initial_pidns()):
            listed = f" NVML lists PID(s) {', '.join(map(str, invisible_listed))}, not visible here." if invisible_listed else ""
            return (
                _reasons.HELD_OUTSIDE_NAMESPACE,
                f"{used} MiB used and no process in this PID namespace holds it.{listed} {ADVICE[_reasons.HELD_OUTSIDE_NAMESPACE]}",
                [],
            )
        action = recovery_action_name(reading.recovery_action)
        hint = f" The driver's recovery action is {action}." if action and action != "none" else ""
        return _reasons.ORPHANED_CONTEXT, f"{used} MiB used with no process holding it.{hint} {ADVICE[_reasons.ORPHANED_CONTEXT]}", []
    action = recovery_action_name(reading.recovery_action)
    return _reasons.NEEDS_RESET, f"memory is free but the driver's recovery action is {action}. {ADVICE[_reasons.NEEDS_RESET]}", []


def gpu_report(reading: Reading, diagnosis: str, detail: str, clean: bool) -> dict[str, t.Any]:
    """The per-GPU record the module returns."""
    gpu = reading.gpu
    mem = reading.memory
    return {
        "index": gpu.index,
        "uuid": gpu.uuid,
        "name": gpu.name,
        "pci_bus_id": gpu.pci_bus_id,
        "minor": gpu.minor,
        "total_mib": mem.total_mib if mem else None,
        "used_mib": reading.used_mib,
        "reserved_mib": reading.reserved_mib,
        "memory_api": mem.api if mem else None,
        "processes": [
            {"pid": p.pid, "name": _comm(p.pid), "used_mib": p.used_mib, "visible": os.path.exists(f"/proc/{p.pid}"), "types": p.kinds}
            for p in reading.processes
        ],
        "recovery_action": recovery_action_name(reading.recovery_action),
        _reasons.CLEAN: clean,
        "diagnosis": diagnosis,
        "detail": detail,
    }


@dataclass
class Outcome:
    """Result of :func:`poll_until_clean`."""

    gpus: list[dict[str, t.Any]]
    elapsed_s: float
    time_to_clean_s: float | None
    polls: int
    notes: list[str]
    unreadable: int = 0  # processes whose file descriptors could not be read while naming holders
    health: list[dict[str, t.Any] | None] = field(default_factory=list)  # NVML health readings per GPU (None: not read)

    @property
    def clean_count(self) -> int:
        return sum(1 for g in self.gpus if g["clean"])


def poll_until_clean(
    session: NvmlSession | _probe.Prober,
    gpus: list[Gpu],
    criteria: Criteria,
    timeout: float,
    interval: float,
    device_dir: str = "/dev",
    every_gpu: list[Gpu] | None = None,
    clock: t.Callable[[], float] = time.monotonic,
    sleep: t.Callable[[float], None] = time.sleep,
    health: bool = False,
    helpers: t.Collection[int] = (),
    progress_timeout: float = 0.0,
    progress_window: float = PROGRESS_WINDOW_S,
) -> Outcome:
    """Poll until every GPU in ``gpus`` is clean or ``timeout`` seconds pass; with ``health``, then
    take each GPU's health readings once (they do not change while memory is released). ``helpers``: processes of this
    module that may hold the device files (the CUDA starts' helpers, forked early), never a GPU's holders.

    Past ``timeout``, a GPU whose used memory went down within the last ``progress_window`` seconds is still in a
    teardown that makes progress (GB300 teardowns take more than 30 s): the polling goes on while that holds, up to
    ``progress_timeout`` seconds from the start (0: never past ``timeout``)."""
    start = clock()
    deadline = start + timeout
    cap = start + max(timeout, progress_timeout)
    polls = 0
    time_to_clean: float | None = None
    lowest: dict[int, int] = {}  # GPU index -> its lowest used MiB so far
    moved: float | None = None  # when a GPU's used memory last went down
    while True:
        polls += 1
        readings = read_all(session, gpus)
        estimate_v1_reserved(readings)
        judged = [quick_judge(r, criteria) for r in readings]
        now = clock()
        for r in readings:
            used = r.used_mib
            if used is not None:
                if r.gpu.index in lowest and used < lowest[r.gpu.index]:
                    moved = now
                lowest[r.gpu.index] = min(used, lowest.get(r.gpu.index, used))
        if all(clean for clean, _terminal in judged):
            time_to_clean = now - start
            break
        limit = max(deadline, min(cap, moved + progress_window)) if moved is not None else deadline
        if limit > deadline and isinstance(session, _probe.Prober) and session.end is not None:
            # A teardown that progresses earns its NVML work the time too; a hung driver is still capped at the
            # timeout (the prober's end stays there while nothing moves).
            session.end = max(session.end, time.monotonic() + (limit - now) + NVML_GRACE_S)
        if all(clean or terminal in TERMINAL for clean, terminal in judged) or now >= limit:
            break
        sleep(max(0.0, min(interval, limit - now)))
    notes = []
    if any(r.memory is not None and r.memory.api == "v1" for r in readings):
        notes.append(
            "The driver lacks nvmlDeviceGetMemoryInfo_v2: used_mib is v1 used minus an estimate of the reserved memory"
            " (the smallest unexplained use among GPUs of the same model)."
        )
    holders: dict[int, _proctable.Holding] = {}
    unreadable = 0
    own = {os.getpid(), *helpers}
    nvml_minors: dict[int, set[int]] = {}
    if not all(clean for clean, _terminal in judged):
        # Only a dirty node pays for the /proc scan that names the real holders.
        holders, unreadable_pids = _proctable.scan_device_holders(device_dir)
        unreadable = len(unreadable_pids)
        if unreadable:
            notes.append(f"{unreadable} process(es) could not be inspected (permission); run with become: true for a complete diagnosis.")
        listable = [g for g in every_gpu or gpus if g.error is None and g.minor is not None]
        minors = {g.index: g.minor for g in listable}
        for index, procs in processes_by_gpu(session, listable).items():
            for proc in procs:
                nvml_minors.setdefault(proc.pid, set()).add(t.cast(int, minors[index]))
    reports = []
    for reading, (clean, _terminal) in zip(readings, judged):
        diagnosis, detail, _pids = diagnose(reading, criteria, holders, own, nvml_minors)
        reports.append(gpu_report(reading, diagnosis, detail, clean))
    # Once, after the polling (they do not change while memory is released); a GPU whose identity could not
    # be read, or whose driver hung, has no readings: they stay unknown.
    health_readings: list[dict[str, t.Any] | None] = [None] * len(readings)
    if health:
        health_readings, hung = read_health_all(session, [r.gpu for r in readings])
        for report in reports:
            if report["index"] in hung:
                # A health query that hung is a hung driver like any other call: the GPU is not usable.
                report.update(clean=False, diagnosis=_reasons.DRIVER_HUNG, detail=hung[report["index"]].msg)
    # Measured after the /proc scan and the diagnoses: they are part of what the verification cost.
    elapsed = clock() - start
    return Outcome(gpus=reports, elapsed_s=elapsed, time_to_clean_s=time_to_clean, polls=polls, notes=notes, unreadable=unreadable, health=health_readings)


def _facts(g: t.Mapping[str, t.Any]) -> str:
    """What happened to a dirty GPU, without the fix its ``detail`` ends with (the message says each fix once)."""
    detail = str(g["detail"])
    start = g.get("startable") or {}
    if start.get("reason") == g["diagnosis"] and start.get("facts") and detail == start.get("detail"):
        return str(start["facts"])
    entry = _findings.FINDINGS.get(g["diagnosis"])
    if entry and detail.endswith(entry.fix):
        return detail[: -len(entry.fix)].rstrip()
    return detail


def failure_lines(outcome: Outcome, expected_total: int) -> list[str]:
    """The dirty GPUs in a few lines, whatever their number: a line per distinct diagnosis and sentence (GPUs whose
    sentence is the same but for their own number share one, ``GPUs 0-7: uvm_missing: ...``), and each diagnosis's fix
    said once, on its first line. Each GPU's ``detail`` in the result keeps its own whole sentence."""
    dirty = [g for g in outcome.gpus if not g["clean"]]
    groups: dict[tuple[str, str], list[t.Mapping[str, t.Any]]] = {}
    for g in dirty:
        groups.setdefault((g["diagnosis"], _health.shape(_facts(g))), []).append(g)
    out = [f"{len(dirty)} of {expected_total} GPU(s) not clean after {outcome.elapsed_s:.1f} s."]
    fixed: set[str] = set()
    for (diagnosis, _shape), members in groups.items():
        facts = _facts(members[0])
        if len(members) > 1:
            facts = _health.for_several(facts)
        entry = _findings.FINDINGS.get(diagnosis)
        fix = f" Fix: {entry.fix}" if entry and diagnosis not in fixed else ""
        fixed.add(diagnosis)
        # One GPU is named with its UUID as well (the index alone can differ between a container and its node).
        who = f"GPU {members[0]['index']} ({members[0].get('uuid') or 'uuid unknown'})" if len(members) == 1 else _health.gpu_list(g["index"] for g in members)
        out.append(f"{who}: {diagnosis}: {facts.rstrip('.')}.{fix}")
    return out


def failure_message(outcome: Outcome, expected_total: int) -> str:
    """:func:`failure_lines` as one message."""
    return " ".join(failure_lines(outcome, expected_total))


# ---------------------------------------------------------------------- the gpu_mem_verify module
def validate(params: t.Mapping[str, t.Any]) -> list[int | str]:
    """Reject bad input before touching the GPUs; returns the parsed GPU selectors."""
    if params.get("fail_on") is not None and params["fail_on"] not in _health.FAIL_ON_CHOICES:
        raise CleanSlateError(
            f"fail_on must be one of {', '.join(_health.FAIL_ON_CHOICES)}, got {params['fail_on']!r}.", reason=_reasons.BAD_ARGUMENTS, option="fail_on"
        )
    if _health.parse_since(params.get("since"), 0.0) is None:
        raise CleanSlateError(
            f"since must be epoch seconds (1796112000) or an ISO 8601 time (2026-12-01T08:00:00Z), got {params['since']!r}.",
            reason=_reasons.BAD_ARGUMENTS,
            option="since",
        )
    _checks.number("timeout", params["timeout"], 0, _checks.MAX_SECONDS, unit="seconds")
    _checks.number("progress_timeout", params.get("progress_timeout"), 0, _checks.MAX_SECONDS, unit="seconds")
    _checks.number("progress_window", params.get("progress_window"), 0, _checks.MAX_SECONDS, low_open=True, unit="seconds")
    _checks.number("interval", params["interval"], 0.001, 60, unit="seconds")
    _checks.number("probe_timeout", params["probe_timeout"], 0.1, 3600, unit="seconds")
    _checks.number("max_used_mib", params["max_used_mib"], 0, 1048576, unit="MiB")
    _checks.number("cuda_probe_memory_fraction", params.get("cuda_probe_memory_fraction", 0.9), 0, 0.99)
    _checks.number("cuda_probe_timeout", params.get("cuda_probe_timeout", 10), 0.1, 3600, unit="seconds")
    _checks.number("expected_count", params["expected_count"], 0, 1024)
    # Ready together (issue 39): what a copy moves (the simulated driver backs a buffer of up to 1 GiB), the share of a
    # link's rate below which a pair is slow (0: never), the link error counts tolerated, the room the next start needs.
    _checks.number("peers_copy_mib", params.get("peers_copy_mib", 2), 1, 1024, unit="MiB")
    _checks.number("peers_min_bandwidth", params.get("peers_min_bandwidth", 0.25), 0, 1)
    _checks.number("nvlink_error_threshold", params.get("nvlink_error_threshold", 0), 0, 1 << 40)
    _checks.number("shm_min_mib", params.get("shm_min_mib", 1024), 0, 1 << 30, unit="MiB")
    if params.get("peers_cache", "report") not in _peers.P2P_CACHE_CHOICES:
        raise CleanSlateError(
            f"peers_cache must be one of {', '.join(_peers.P2P_CACHE_CHOICES)}, got {params['peers_cache']!r}.",
            reason=_reasons.BAD_ARGUMENTS,
            option="peers_cache",
        )
    for path in params.get("peers_cache_dirs") or []:
        if not str(path).startswith("/") or ".." in str(path).split("/") or "\0" in str(path):
            raise CleanSlateError(
                f"peers_cache_dirs: {path!r} is not an absolute directory (globs allowed, '..' not).", reason=_reasons.BAD_ARGUMENTS, option="peers_cache_dirs"
            )
    _checks.existing_dir("device_dir", params["device_dir"])
    containers = params.get("containers") or []
    for vmid in containers:
        _checks.vmid("containers", vmid)
    if len(containers) > 1:
        raise CleanSlateError(
            f"containers: the GPUs are proven startable inside one container at a time, got {len(containers)} ({', '.join(map(str, containers))}):"
            " verify each container in a run of its own.",
            reason=_reasons.BAD_ARGUMENTS,
            option="containers",
        )
    _checks.executable("pct_path", params.get("pct_path"))
    return _nvml.parse_gpu_selectors(params["gpus"])


def python_facts() -> dict[str, t.Any]:
    """The target interpreter and which of the collection's Python dependencies it lacks (by package name)."""
    wanted = (("pynvml", "nvidia-ml-py"), ("psutil", "psutil"), ("jmespath", "jmespath"))
    missing = [package for module_name, package in wanted if importlib.util.find_spec(module_name) is None]
    return {"executable": sys.executable, "version": platform.python_version(), "missing": missing}


def failure_details(reason: str) -> dict[str, t.Any]:
    """What every failure of gpu_mem_verify carries: not clean, no GPU read, the interpreter, and the deprecated alias."""
    return {"clean": False, "gpus": [], "python": python_facts(), "diagnosis": reason}


def reset_wanted(outcome: Outcome, health: t.Mapping[str, t.Any] | None) -> dict[int, list[str]]:
    """The GPUs whose fix is a reset, each with the findings that ask for it: a dirty GPU whose diagnosis is fixed by a
    reset (an orphaned context, a failed start such as cuda_oom), a GPU with a health finding at ``reset_gpu``. None when
    the host's verdict is worse (a reboot or a drain comes first) or nothing asks."""
    if health is not None and _health.rank(health["verdict"]) > _health.rank(_health.RESET_GPU):
        return {}
    out: dict[int, list[str]] = {}
    for g in outcome.gpus:
        entry = _findings.FINDINGS.get(g["diagnosis"])
        if not g["clean"] and entry is not None and entry.verdict == _health.RESET_GPU:
            out.setdefault(g["index"], []).append(g["diagnosis"])
        for f in (g.get("health") or {}).get("findings") or []:
            if f["verdict"] == _health.RESET_GPU and f["name"] not in out.get(g["index"], []):
                out.setdefault(g["index"], []).append(f["name"])
    return out


def start(prober: _probe.Prober, device_dir: str) -> list[Gpu]:
    """NVML opened and every GPU read (:meth:`._probe.Prober.start`). When NVML cannot open because nvidiactl is absent,
    another device's or refused here (a container's passthrough: nvmlInit answers NVML_ERROR_OPERATING_SYSTEM for
    /dev/null's numbers on an H100, a driver-not-loaded for none), the failure is that configuration fault,
    ``device_missing``, with the node's facts and its fix, never a driver to reload or a node to reboot."""
    try:
        return prober.start()
    except CleanSlateError as exc:
        # No library, or one of another version, or a hung driver: the driver's own state, whatever the files say.
        if exc.reason not in _reasons.NVML or exc.reason in (_reasons.DRIVER_HUNG, _reasons.LIBRARY_NOT_FOUND, _reasons.DRIVER_LIBRARY_MISMATCH):
            raise
        majors = _cuda_program.char_majors()
        ctl = _cuda_program.node(os.path.join(device_dir, "nvidiactl"), (_cuda_program.CTL, _cuda_program.CTL_MINOR), majors)
        # An absent node is the configuration's fault only where the kernel has the driver loaded (/proc/devices lists
        # it): on a node without the driver it is the driver that is missing.
        loaded = _cuda_program.driver_major(_cuda_program.FRONTEND, majors) is not None
        if ctl["ok"] or not os.path.isdir(device_dir) or (ctl["fault"] == "absent" and not loaded):
            raise
        raise CleanSlateError(
            f"{exc.msg.rstrip('.')}: {ctl['why']}. {_findings.FINDINGS[_reasons.DEVICE_MISSING].fix}",
            reason=_reasons.DEVICE_MISSING,
            **{**exc.details, "nvml_reason": exc.reason, "device": ctl},
        ) from None


def healthy_count(every_gpu: list[Gpu]) -> int:
    """The GPUs NVML lists that did not fall off the bus (a lost GPU still counts in the driver's total)."""
    return sum(1 for g in every_gpu if g.error is None or g.error.reason != _reasons.GPU_LOST)


def gpu_files(device_dir: str) -> list[int]:
    """The minors of the GPU device files (``nvidia<N>``) in ``device_dir``."""
    try:
        return sorted(int(n[6:]) for n in os.listdir(device_dir) if n.startswith("nvidia") and n[6:].isdigit())
    except OSError:
        return []


def device_shortfall(device_dir: str, every_gpu: list[Gpu]) -> list[dict[str, t.Any]]:
    """When NVML sees fewer GPUs than expected: what the device files here say, as findings (``device_missing``,
    fix_config): each ``nvidia<N>`` file and ``nvidiactl`` that is another device's, a regular file or refused (with the
    real driver, NVML does not list a GPU whose node is masked), and how many GPU files there are at all."""
    majors = _cuda_program.char_majors()
    listed = {g.minor for g in every_gpu if g.minor is not None}
    names = [f"nvidia{m}" for m in gpu_files(device_dir)]
    out: list[dict[str, t.Any]] = []
    for name in names:
        n = _cuda_program.node(os.path.join(device_dir, name), (_cuda_program.FRONTEND, int(name[6:])), majors)
        if not n["ok"]:
            out.append({"name": _reasons.DEVICE_MISSING, "verdict": _findings.FINDINGS[_reasons.DEVICE_MISSING].verdict, "gpu": None, "text": n["why"]})
        elif int(name[6:]) not in listed:
            out.append(
                {
                    "name": _reasons.DEVICE_MISSING,
                    "verdict": _findings.FINDINGS[_reasons.DEVICE_MISSING].verdict,
                    "gpu": None,
                    "text": f"{os.path.join(device_dir, name)} is present and opens, but NVML lists no GPU of minor {name[6:]}: the node may be another"
                    " device's (its numbers cannot be held to /proc/devices here) or its GPU is not this node's",
                }
                if not _cuda_program.driver_major(_cuda_program.FRONTEND, majors)
                else {
                    "name": "gpus_not_listed",
                    "verdict": _findings.FINDINGS["gpus_not_listed"].verdict,
                    "gpu": None,
                    "text": f"{os.path.join(device_dir, name)} is the GPU device of minor {name[6:]}, but NVML does not list that GPU",
                }
            )
    ctl = _cuda_program.node(os.path.join(device_dir, "nvidiactl"), (_cuda_program.CTL, _cuda_program.CTL_MINOR), majors)
    if not ctl["ok"]:
        out.append({"name": _reasons.DEVICE_MISSING, "verdict": _findings.FINDINGS[_reasons.DEVICE_MISSING].verdict, "gpu": None, "text": ctl["why"]})
    if not out:
        shown = ", ".join(names) if names else "none"
        out.append(
            {
                "name": "gpus_not_listed",
                "verdict": _findings.FINDINGS["gpus_not_listed"].verdict,
                "gpu": None,
                "text": f"the GPU device files here ({device_dir}: {shown}) are all usable: a GPU NVML does not list at all has fallen off the bus,"
                " was disabled, or is not given to this host",
            }
        )
    return out


def verdict(
    outcome: Outcome,
    every_gpu: list[Gpu],
    selected: int,
    expected_count: int | None,
    shortfall: t.Sequence[t.Mapping[str, t.Any]] = (),
    elapsed: float | None = None,
) -> tuple[str | None, list[str]]:
    """(failure reason or None, the message's lines) of a verification: dirty selected GPUs, then too few healthy ones,
    with what the device files say of the missing ones (``shortfall``, :func:`device_shortfall`).

    A GPU that fell off the bus still counts in the driver's total but not as healthy, so
    ``expected_count`` catches a node that lost one (NVML lists it with an error).
    """
    problems: list[str] = []
    reason = None
    healthy = healthy_count(every_gpu)
    seconds = outcome.elapsed_s if elapsed is None else elapsed
    if expected_count is not None and healthy < expected_count:
        lost = [str(g.index) for g in every_gpu if g.error is not None and g.error.reason == _reasons.GPU_LOST]
        lost_text = f" (lost: GPU {', '.join(lost)})" if lost else ""
        why = "; ".join(str(f["text"]) for f in shortfall)
        problems.append(f"expected {expected_count} GPUs, found {healthy} healthy of {len(every_gpu)}{lost_text}" + (f": {why}." if why else "."))
        reason = _reasons.MISSING_GPUS
    if outcome.clean_count < selected:
        problems += failure_lines(outcome, selected)
        reason = _reasons.NOT_CLEAN
    if problems:
        return reason, problems
    if not selected:
        # Not "0/0 GPUs clean": read at a glance, that is a green line for a node whose GPUs NVML does not see (on an
        # H100 a GPU's device file masked by another device's made NVML list none, the health finding saying why).
        return None, [f"no GPU to verify: NVML lists none ({seconds:.2f} s)"]
    return None, [f"{outcome.clean_count}/{selected} GPUs clean in {seconds:.2f} s"]


def argument_spec() -> dict[str, dict[str, t.Any]]:
    """The options of gpu_mem_verify (and of the umbrella's preflight and verify phases): one source for both."""
    return {
        "gpus": {"type": "list", "elements": "raw", "default": []},
        "expected_count": {"type": "int"},
        "max_used_mib": {"type": "int", "default": 64},
        "require_no_processes": {"type": "bool", "default": True},
        "timeout": {"type": "float", "default": 30},
        "progress_timeout": {"type": "float", "default": 120},
        "progress_window": {"type": "float", "default": 10},
        "interval": {"type": "float", "default": 0.1},
        "probe_timeout": {"type": "float", "default": 10},
        "fail_on_dirty": {"type": "bool", "default": True},
        "device_dir": {"type": "path", "default": "/dev"},
        "health": {"type": "bool", "default": True},
        "fail_on": {"type": "str", "default": "fix_config", "choices": ["ok", "restart_app", "fix_config", "reset_gpu", "reboot", "drain", "never"]},
        "since": {"type": "raw"},
        "kernel_log": {"type": "path", "default": "/dev/kmsg"},
        "cuda_probe": {"type": "bool", "default": True},
        "cuda_probe_memory_fraction": {"type": "float", "default": 0.9},
        "cuda_probe_timeout": {"type": "float", "default": 10},
        "peers": {"type": "bool", "default": True},
        "peers_required": {"type": "bool", "default": False},
        "peers_copy_mib": {"type": "int", "default": 2},
        "peers_min_bandwidth": {"type": "float", "default": 0.25},
        "links": {"type": "bool", "default": True},
        "nvlink_error_threshold": {"type": "int", "default": 0},
        "shm_min_mib": {"type": "int", "default": 1024},
        "peers_cache": {"type": "str", "default": "report", "choices": list(_peers.P2P_CACHE_CHOICES)},
        "peers_cache_dirs": {"type": "list", "elements": "str", "default": list(_peers.P2P_CACHE_DIRS)},
    }


def judge_health(
    outcome: Outcome,
    every_gpu: list[Gpu],
    since: float,
    kernel_log: str,
    fail_on: str,
    run: _health.Run | None = None,
    software: list[dict[str, t.Any]] | None = None,
) -> dict[str, t.Any]:
    """Attach each GPU's ``health`` to its report (Xid events by PCI address; a failed CUDA start) and return the
    host's (with the software checks' ``software`` findings)."""
    started = time.monotonic()
    source, events, log = _health.read_xids(since, kernel_log, run)
    buses = {_health.bus_key(g.pci_bus_id) for g in every_gpu if g.pci_bus_id}
    per_gpu = []
    for report, readings in zip(outcome.gpus, outcome.health):
        readings = dict(readings) if readings is not None else dict.fromkeys(_health.READING_KEYS)
        key = _health.bus_key(report["pci_bus_id"])
        mine = [e for e in events if key is not None and e["bus"] == key]
        readings["xid"] = [{k: v for k, v in e.items() if k != "bus"} for e in mine] if source != "unreadable" else None
        started_cuda = _cuda.finding(report.get("startable") or {})
        report["health"] = _health.judge_gpu(readings, report["diagnosis"], [started_cuda] if started_cuda else [])
        per_gpu.append((report["index"], report["health"]))
    stray = [e for e in events if e["bus"] not in buses]
    host = _health.host_findings(_health.fabric_present(r for r in outcome.health if r))
    host["kernel_log"] = source
    host["kernel_log_read"] = log
    verdict = _health.judge_host(per_gpu, host, fail_on, stray, software or [])
    unread = _health.unread_note(log, since, kernel_log) if source == "kmsg" else None
    if unread:
        outcome.notes.append(unread)
    if source == "unreadable":
        outcome.notes.append(
            f"The kernel log cannot be read ({kernel_log}, journalctl -k): Xid errors are not part of the health verdict; run with become: true."
        )
    verdict["since"] = round(since, 3)
    verdict["elapsed_s"] = round(time.monotonic() - started, 4)
    return verdict


#: Container scope: ``(vmid, request, timeout) -> answer``, the startability program (``_cuda_program.main``) run inside
#: the container under a deadline of its own; the answer is ``ok`` with ``devices``, ``raw``, ``left_behind`` and
#: ``python``, or not ``ok`` with ``why`` (a sentence); either way ``ended`` and ``left``, the host pids of the run found
#: still there once pct returned, SIGKILLed, and those that did not go. The modules hand it in (``_inside.runner``): this
#: file does not sit on pct.
InContainer = t.Callable[[int, t.Dict[str, t.Any], float], t.Dict[str, t.Any]]

# How long the verification waits, after the CUDA probes, for NVML to read their processes and memory gone (on the
# H200 it read the GPU idle as soon as a probe had released its context; a killed one is torn down in ~0.2 s).
CUDA_SETTLE_S = 2.0
#: Why a GPU gets no CUDA start (``gpus[].startable.skipped``).
_NOT_READ = "not probed: NVML could not read it"
_MIG = "not probed: MIG mode is on, and CUDA runs on its instances, which this probe does not start"
_IN_USE = "not probed: NVML reads it in use, and the probe never takes memory on a GPU in use (only a context on one in exclusive_process or prohibited mode)"
_CHECK_MODE = "not probed in check mode: a CUDA start takes a context and memory on the GPU for a moment"
_HUNG = (
    "not probed: an NVML call on GPU {gpus} did not return (driver_hung), and a CUDA start on a node whose driver hangs can"
    " stick in the driver where no kill reaches it (state D); the node needs the reboot that finding names first"
)


def gpu_modes(prober: _probe.Prober, gpus: list[Gpu]) -> dict[int, dict[str, t.Any]]:
    """Compute mode and MIG mode of each GPU that answers (in the prober's helper)."""
    readable = [g for g in gpus if g.error is None]
    return {g.index: a.value for g, a in zip(readable, prober.each(_cuda.modes, readable)) if a.error is None}


def probe_targets(outcome: Outcome, selected: list[Gpu], modes: dict[int, dict[str, t.Any]], check_mode: bool) -> list[_cuda.Target]:
    """The GPUs to start CUDA on: every selected GPU NVML reads clean, and a context only on a busy one in
    exclusive_process or prohibited mode; each of the others gets ``startable`` saying why it is not probed."""
    reports = {r["index"]: r for r in outcome.gpus}
    # One GPU hung in the driver: no CUDA start anywhere on the node. Its helpers would share that driver, and a helper
    # stuck in it outlives its deadline's SIGKILL, left behind; the verdict is red (reboot) whatever the others say.
    hung = sorted(r["index"] for r in outcome.gpus if r["diagnosis"] == _reasons.DRIVER_HUNG)
    targets: list[_cuda.Target] = []
    for gpu in selected:
        report, mode = reports[gpu.index], modes.get(gpu.index, {})
        why = None
        if check_mode:
            why = _CHECK_MODE
        elif hung:
            why = _HUNG.format(gpus=", ".join(map(str, hung)))
        elif gpu.error is not None or report["diagnosis"] in TERMINAL or report["diagnosis"] == _reasons.UNRESPONSIVE:
            why = _NOT_READ
        elif mode.get("mig"):
            why = _MIG
        elif report["clean"]:
            targets.append(_cuda.Target(gpu.index, t.cast(str, gpu.uuid)))
        elif mode.get("compute_mode") in ("exclusive_process", "prohibited"):
            targets.append(_cuda.Target(gpu.index, t.cast(str, gpu.uuid), context_only=True))
        else:
            why = _IN_USE
        if why:
            report["startable"] = {"ok": None, "skipped": why}
    return targets


def not_clean(run: StartRun) -> list[int]:
    """The selected GPUs NVML reads not clean (the peer check waits for every one to read clean)."""
    selected = {g.index for g in run.selected}
    return [r["index"] for r in run.outcome.gpus if r["index"] in selected and not r["clean"]]


@dataclass
class StartRun:
    """What the CUDA starts of one verification are judged against: the NVML prober, the run's outcome (its GPU reports),
    the selected GPUs and their modes, the verdict's criteria, the module's parameters and check mode."""

    prober: _probe.Prober
    outcome: Outcome
    selected: list[Gpu]
    modes: dict[int, dict[str, t.Any]]
    criteria: Criteria
    params: t.Mapping[str, t.Any]
    check_mode: bool
    #: Ready together (issue 39): what the GPUs are checked for together, and what was found.
    together: _peers.Check | None = None
    #: The CUDA starts' helpers, forked before the GPUs were read clean (``early_helpers``), or None.
    early: _cuda_program.Helpers | None = None


def startability(run: StartRun, look: t.Callable[[], dict[str, t.Any]]) -> tuple[dict[str, t.Any], dict[str, t.Any]]:
    """Start CUDA on every selected GPU NVML reads clean (a context only on a busy one in exclusive_process or
    prohibited mode), all at once, each in a helper forked from the module (``_cuda.probe``); then read NVML until the
    helpers' processes and memory are gone. Each GPU's report gets ``startable``; a clean GPU whose start failed becomes
    not clean, diagnosed with the start's reason. Returns the device files (``look``, called after the starts: run as
    root, the driver's own nvidia-modprobe makes a missing node at the start, as a server's start would; what is still
    wrong then is the fault) and the run's summary (``cuda_probe`` in the result)."""
    began = time.monotonic()
    params = run.params
    targets = probe_targets(run.outcome, run.selected, run.modes, run.check_mode)
    together = run.together
    peers = together.request(targets, run.modes, {g.index: str(g.uuid) for g in run.selected}, not_clean(run)) if together else None
    on_step = together.on_step(run.prober, {g.index: g for g in run.selected}) if together else None
    raw: dict[int, dict[str, t.Any]] = {}
    left_behind: list[int] = []
    if targets:
        raw, peers_raw, left_behind = _cuda.probe_all(targets, params["cuda_probe_memory_fraction"], params["cuda_probe_timeout"], peers, on_step, run.early)
        if together:
            together.raw = peers_raw
    elif run.early is not None:
        # No start after all (every GPU busy, or a hung driver): the helpers forked early are ended now, and one that
        # a driver holds past its SIGKILL is reported like any helper of a start, not dropped when the run ends.
        left_behind = run.early.close()
    devices = look()
    return devices, judge_starts(run, devices, targets, raw, left_behind, began)


def startability_inside(
    run: StartRun, wanted: list[tuple[int, int | None, bool]], in_container: InContainer
) -> tuple[dict[str, t.Any], dict[str, t.Any] | None]:
    """Container scope: the device files and (with ``cuda_probe``) the CUDA starts of :func:`startability`, made inside the
    container where the next server starts, in one run of the startability program there (``in_container``); NVML is
    read here before and after, and a GPU is settled when no process NVML did not list before the starts is on it.

    Returns the container's device files (``_software.device_nodes``'s shape, with ``container``; with ``unchecked``, a
    sentence, when the program gave no answer) and the summary (None without ``cuda_probe``). When the program cannot run
    there (no python3, pct failed, its deadline), every GPU that was to be probed is ``cuda_unproven``, not clean.
    """
    began = time.monotonic()
    params, outcome, selected = run.params, run.outcome, run.selected
    vmid = params["containers"][0]
    targets = probe_targets(outcome, selected, run.modes, run.check_mode) if params.get("cuda_probe") else []
    probed = [g for g in selected if g.index in {x.gpu for x in targets}]
    before = {index: {p.pid for p in procs} for index, procs in processes_by_gpu(run.prober, probed).items()}
    request = {
        "device_dir": params["device_dir"],
        "gpus": wanted,
        # In the container only its own GPUs' files are expected: the selected ones.
        "nvml_count": len(selected),
        "targets": [list(x) for x in targets],
        "fraction": params["cuda_probe_memory_fraction"],
        "timeout": params["cuda_probe_timeout"],
    }
    together = run.together
    if together:
        # The container's own GPUs are the selected ones: a cached answer's CUDA ordinals count those.
        request["peers"] = together.request(targets, run.modes, {g.index: str(g.uuid) for g in selected}, not_clean(run))
        request.update(together.next_start_request(selected))
    answer = in_container(vmid, request, params["cuda_probe_timeout"])
    if answer.get("left"):
        outcome.notes.append(
            f"Process(es) {', '.join(map(str, answer['left']))} of the CUDA probe's run in container {vmid} (host pids) were still there after"
            f" pct exec returned and did not die of SIGKILL within {_cuda.REAP_WAIT_S} s (stuck in the driver, state D); they end when the"
            " driver lets them."
        )
    if answer["ok"]:
        devices = {**answer["devices"], "container": vmid}
        raw, left_behind = answer["raw"], answer["left_behind"]
        if together:
            together.raw = answer.get("peers")
            together.next = {"shm": answer.get("shm"), "p2p_caches": answer.get("p2p_caches")}
    else:
        unproven = f"the CUDA start could not be made inside container {vmid}, where the next server starts: {answer['why']}."
        devices = {"dir": params["device_dir"], "container": vmid, "unchecked": unproven, "gpus": {}}
        raw, left_behind = {x.gpu: {"ok": False, "unproven": unproven, "steps": {}} for x in targets}, []
    if not params.get("cuda_probe"):
        return devices, None
    summary = judge_starts(run, devices, targets, raw, left_behind, began, before)
    summary["container"] = {k: answer.get(k) for k in ("vmid", "ok", "python", "elapsed_s", "rc", "ended", "left")}
    if not answer["ok"]:
        summary["container"]["why"] = answer["why"]
    return devices, summary


def judge_starts(
    run: StartRun,
    devices: dict[str, t.Any],
    targets: list[_cuda.Target],
    raw: dict[int, dict[str, t.Any]],
    left_behind: list[int],
    began: float,
    before: dict[int, set[int]] | None = None,
) -> dict[str, t.Any]:
    """Wait for NVML to read the starts gone (:func:`settle`), then judge each (``_cuda.judge``) into its GPU's report."""
    prober, outcome, selected, modes, criteria, params, check_mode = (
        run.prober,
        run.outcome,
        run.selected,
        run.modes,
        run.criteria,
        run.params,
        run.check_mode,
    )
    fraction, timeout = params["cuda_probe_memory_fraction"], params["cuda_probe_timeout"]
    reports = {r["index"]: r for r in outcome.gpus}
    probed_at = time.monotonic()
    helper = (run.together.raw or {}).get("pid") if run.together and before is None else None
    back = settle(prober, [g for g in selected if g.index in raw], raw, {i: reports[i]["clean"] for i in raw}, criteria, before, helper)
    for target in targets:
        report = reports[target.gpu]
        used, total, reserved = report.get("used_mib"), report.get("total_mib"), report.get("reserved_mib") or 0
        nvml_free = total - reserved - used if total is not None and used is not None else None
        record = _cuda.judge(
            raw[target.gpu], target.gpu, fraction, timeout, devices, modes.get(target.gpu, {}).get("compute_mode"), nvml_free, target.context_only
        )
        record["gone_after_s"] = back.get(target.gpu)
        if record["ok"] and back.get(target.gpu) is None:
            record.update(
                ok=False,
                reason=_reasons.CUDA_RESIDUE,
                detail=f"the CUDA start worked, but NVML still listed its helper (PID {record['pid']}) or its memory {CUDA_SETTLE_S:g} s after"
                " it ended: the next start would meet it. Check dmesg; a GPU reset or a reboot frees it.",
            )
        report["startable"] = record
        if report["clean"] and not record["ok"]:
            report.update(clean=False, diagnosis=record["reason"], detail=record["detail"])
    if left_behind:
        where = f" in container {params['containers'][0]}" if before is not None else ""
        outcome.notes.append(
            f"CUDA probe helper process(es) {', '.join(map(str, left_behind))}{where} did not die of SIGKILL within {_cuda.REAP_WAIT_S} s (stuck in"
            " the driver, state D); they end when the driver lets them."
        )
    if check_mode:
        outcome.notes.append("Check mode: no CUDA start was made (it takes a context and memory on the GPU for a moment).")
    return {
        "probed": len(targets),
        "started": sum(1 for i in raw if reports[i].get("startable", {}).get("ok")),
        "memory_fraction": fraction,
        "elapsed_s": round(time.monotonic() - began, 4),
        "probes_s": round(probed_at - began, 4),
        "gone_after_s": max((v for v in back.values() if v is not None), default=None),
        "left_behind": left_behind,
    }


def settle(
    prober: _probe.Prober,
    gpus: list[Gpu],
    raw: dict[int, dict[str, t.Any]],
    was_clean: dict[int, bool],
    criteria: Criteria,
    before: dict[int, set[int]] | None = None,
    peer_helper: int | None = None,
) -> dict[int, float | None]:
    """Read NVML until no probed GPU lists its probe's helper (nor the peer check's, ``peer_helper``) and each one that
    was clean is clean again; the seconds that took per GPU (None: still there after ``CUDA_SETTLE_S``).

    With ``before`` (the pids NVML listed on each GPU before the starts: container scope, where the helpers' pids are
    the container's own), a GPU still lists its probe's helper while it lists any pid it did not list before.
    """
    began = time.monotonic()
    # The NVML session's own end was the verification's: the probes came after it.
    prober.end = max(prober.end or 0.0, began + CUDA_SETTLE_S + prober.probe_timeout + NVML_GRACE_S)
    out: dict[int, float | None] = {g.index: None for g in gpus}
    todo = list(gpus)
    while todo:
        for reading in read_all(prober, todo):
            index = reading.gpu.index
            pids = {p.pid for p in reading.processes}
            listed = bool(pids - before.get(index, set())) if before is not None else bool({raw[index]["pid"], peer_helper} & pids)
            if reading.error is None and not listed and (not was_clean[index] or quick_judge(reading, criteria)[0]):
                out[index] = round(time.monotonic() - began, 4)
        todo = [g for g in todo if out[g.index] is None]
        if not todo or time.monotonic() - began >= CUDA_SETTLE_S:
            break
        time.sleep(0.01)
    return out


def software_checks(prober: _probe.Prober, outcome: Outcome, selected: list[Gpu], devices: dict[str, t.Any]) -> dict[str, t.Any]:
    """DCGM level 1's software checks (``_software``): the devices, persistence mode, the environment, the infoROM."""
    readable = [g for g in selected if g.error is None]
    inforom = {g.index: a.value if a.error is None else None for g, a in zip(readable, prober.each(_software.read_inforom, readable))}
    health = {r["index"]: h for r, h in zip(outcome.gpus, outcome.health) if h is not None}
    persistence = {index: h.get("persistence_mode") for index, h in health.items()}
    env = _software.environment()
    # As the result shows them: lists with the GPU's index (JSON has no integer keys).
    shown = {**devices, "gpus": [{"index": index, **n} for index, n in sorted(devices["gpus"].items())]}
    return {
        "devices": shown,
        "environment": env,
        "inforom": [{"index": index, "valid": valid} for index, valid in sorted(inforom.items())],
        "findings": _software.findings(devices, env, persistence, inforom),
    }


def early_helpers(params: t.Mapping[str, t.Any], gpus: t.Sequence[tuple[int, str]], check_mode: bool) -> _cuda_program.Helpers | None:
    """The CUDA starts' helpers (and the peer check's) forked now, before the GPUs are read clean, for ``gpus`` (``(index,
    uuid)``, those the verification selects): they spend the first tenth of a second of a start (``cuInit``) while the
    GPUs' holders are still being ended, and the starts then go on from there (:class:`._cuda_program.Helpers`). None
    where no start will be made here: check mode, no CUDA probe, container scope (the start is made inside the container)."""
    if check_mode or not params.get("cuda_probe") or params.get("containers") or not gpus:
        return None
    return _cuda_program.Helpers([list(g) for g in gpus], [list(g) for g in gpus] if params.get("peers", True) else None)


def run(module: t.Any, in_container: InContainer | None = None, early: _cuda_program.Helpers | None = None) -> dict[str, t.Any]:
    """The gpu_mem_verify module: read the GPUs until they are clean or the timeout passes, then judge.

    With ``containers`` (container scope, a container cleaned from its node), the device files are looked at and the
    CUDA start is made inside that container through ``in_container`` (:func:`startability_inside`); NVML is read here.

    Raises :class:`CleanSlateError` carrying the whole result when a GPU is not clean (or too few are
    healthy) and ``fail_on_dirty`` is set.
    """
    started = datetime.datetime.now()
    began = time.monotonic()
    p = module.params
    selectors = validate(p)
    since = t.cast(float, _health.parse_since(p.get("since"), started.timestamp()))
    files_problem = _nvml.device_files_problem(p["device_dir"])
    if files_problem:
        module.warn(f"The GPU device files cannot be used ({files_problem}): holders of a GPU that is not clean can be named only if NVML lists them.")
    # Every NVML call runs in a helper process under a deadline (_probe): a hung driver costs at most
    # probe_timeout per call, and all of it ends NVML_GRACE_S after the later of timeout and probe_timeout.
    end = time.monotonic() + max(p["timeout"], p["probe_timeout"]) + NVML_GRACE_S
    # Where the seconds go (tools/bench/cost.py): each step's, from the one before.
    timings: dict[str, float] = {}
    mark = [time.monotonic()]

    def lap(name: str) -> None:
        now = time.monotonic()
        timings[name] = round(now - mark[0], 4)
        mark[0] = now

    with contextlib.ExitStack() as stack:
        prober = stack.enter_context(_probe.Prober(p["probe_timeout"], end=end))
        every = start(prober, p["device_dir"])
        lap("nvml_start")
        selected = _nvml.select_gpus(every, selectors)
        if early is None:
            # Forked now, the starts' cuInit runs while NVML is polled (clean_slate_node forks them before its kill).
            early = early_helpers(p, [(g.index, str(g.uuid)) for g in selected if g.error is None and g.uuid], module.check_mode)
        if early is not None:
            stack.callback(early.close)
        criteria = Criteria(max_used_mib=p["max_used_mib"], require_no_processes=p["require_no_processes"])
        outcome = poll_until_clean(
            prober,
            selected,
            criteria,
            timeout=p["timeout"],
            interval=p["interval"],
            device_dir=p["device_dir"],
            every_gpu=every,
            health=p.get("health", False),
            helpers=early.pids if early is not None else (),
            progress_timeout=p.get("progress_timeout") or 0.0,
            progress_window=p.get("progress_window") or PROGRESS_WINDOW_S,
        )
        lap("poll")
        cuda_probe = software = together = None
        if p.get("cuda_probe") or p.get("health"):
            modes = gpu_modes(prober, selected)
            wanted = [(g.index, g.minor, bool(modes.get(g.index, {}).get("mig"))) for g in selected]
            # Ready together (issue 39): each GPU's links read first, the peer check made beside the starts.
            check = _peers.Check(p, module.check_mode, bool(p.get("containers")))
            check.read_links(prober, selected)
            starts = StartRun(prober, outcome, selected, modes, criteria, p, module.check_mode, check, early)
            if p.get("containers"):
                if in_container is None:
                    raise CleanSlateError("containers: this entry point has no way into a container.", reason=_reasons.INTERNAL_ERROR)
                devices, cuda_probe = startability_inside(starts, wanted, in_container)
            else:

                def look() -> dict[str, t.Any]:
                    return _software.device_nodes(p["device_dir"], wanted, len(every))

                if p.get("cuda_probe"):
                    devices, cuda_probe = startability(starts, look)
                else:
                    devices = look()
                check.look_here(every)
            lap("cuda")
            if p.get("health"):
                software = software_checks(prober, outcome, selected, devices)
                lap("software")
            together = check.judge({r["index"]: r.get("startable") or {} for r in outcome.gpus}, p["cuda_probe_timeout"])
            lap("together")
        try:
            driver = prober.call(NvmlSession.driver_version)
        except CleanSlateError:
            driver = None
    lap("nvml_end")
    if prober.left_behind:
        outcome.notes.append(
            f"NVML helper process(es) {', '.join(map(str, prober.left_behind))} did not die of SIGKILL within {_probe.REAP_WAIT_S} s (stuck in the"
            " driver, state D); they end when the driver lets them."
        )
    # Fewer GPUs than expected: what the device files say of the missing ones (with the real driver NVML does not list a
    # GPU whose node is masked), a finding of its own, so that the health verdict names the cause.
    # With the real driver a GPU whose node is another device's (or a regular file) is not listed at all, so a device file
    # here that NVML lists no GPU for is a finding too, expected count or not (NVML in a container lists only the GPUs
    # whose nodes work: docs/results/round4-facts-h100x1-2026-12-05.json).
    short = p["expected_count"] is not None and healthy_count(every) < p["expected_count"]
    files = gpu_files(p["device_dir"])
    unlisted = [m for m in files if m not in {g.minor for g in every}]
    shortfall = device_shortfall(p["device_dir"], every) if (short or unlisted) and not p.get("containers") else []
    found = (software["findings"] if software else []) + [f for f in shortfall if f["verdict"] != _findings.NONE]
    found += together["findings"] if together else []
    health = judge_health(outcome, every, since, p["kernel_log"], p["fail_on"], module.run_command, found) if p.get("health") else None
    lap("health")
    if outcome.unreadable:
        module.warn(
            f"{outcome.unreadable} process(es) could not be inspected for device files (permission): a holder among them is named only if NVML"
            " lists it; run with become: true."
        )
    resets = reset_wanted(outcome, health)
    reports = [{**r, "fabric": (h or {}).get("fabric")} for r, h in zip(outcome.gpus, outcome.health or [None] * len(outcome.gpus))]
    plan = _reset.plan(resets, reports, p["device_dir"], p.get("containers") or []) if resets and not module.check_mode else None
    lap("reset_plan")
    elapsed = time.monotonic() - began
    reason, lines = verdict(outcome, every, len(selected), p["expected_count"], shortfall, elapsed)
    if reason is None and together is not None and not together["ready"]:
        reason = _reasons.NOT_READY_TOGETHER
        lines.append(_peers.message(together))
    if health is not None and health["verdict"] != _health.OK:
        # The memory part said the failed CUDA starts already (each dirty GPU's diagnosis): the health part leaves them out.
        said = {g["diagnosis"] for g in outcome.gpus if not g["clean"]}
        fails = reason is None and _health.fails(health["verdict"], p["fail_on"])
        lines.append(f"Health: {health['verdict']}" + (f" (fail_on is {p['fail_on']})." if fails else "."))
        lines += _health.lines(health["findings"], said)
        advice = _health.advice(health["verdict"])
        lines.append(advice[:1].upper() + advice[1:])
        if fails:
            reason = _reasons.UNHEALTHY
    if plan:
        lines += _reset.lines(plan)
    msg = " ".join(lines)
    result = {
        "changed": False,
        "clean": reason is None,
        "msg": msg,
        "lines": lines,
        "gpus": outcome.gpus,
        "gpu_count": len(every),
        "clean_count": outcome.clean_count,
        # Everything the verdict waited for: the polling, the CUDA start and its settling, the health readings.
        "elapsed_s": round(elapsed, 4),
        "poll_s": round(outcome.elapsed_s, 4),
        "cuda_s": cuda_probe["elapsed_s"] if cuda_probe else None,
        "start": str(started),
        "end": str(datetime.datetime.now()),
        "time_to_clean_s": None if outcome.time_to_clean_s is None else round(outcome.time_to_clean_s, 4),
        "polls": outcome.polls,
        "driver_version": driver,
        "notes": outcome.notes,
        "python": python_facts(),
        "health": health,
        "reset_plan": plan,
        "timings": timings,
        "cuda_probe": cuda_probe,
        "software": software,
        "together": together,
    }
    if reason is not None and p["fail_on_dirty"]:
        details = {k: v for k, v in result.items() if k != "msg"}
        raise CleanSlateError(msg, reason=reason, **details)
    return result
