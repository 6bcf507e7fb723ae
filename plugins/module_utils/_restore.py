# Copyright (c) 2026, gpuops.clean_slate maintainers
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# Note: this module_util is PRIVATE to the collection; it may change without notice.

"""Put back what the last job changed on the GPUs: the compute mode and the MPS daemon (the
``gpu_mode_restore`` module's logic).

A job left in ``EXCLUSIVE_PROCESS`` compute mode, or with an MPS control daemon
running, makes the next one fail with "CUDA-capable device(s) is/are busy or
unavailable" although the memory is free (NVIDIA/k8s-device-plugin#1118). Only
what the user declares is restored; nothing else is touched, and never a GPU
reset, clocks or power.

Guarded: everything is read and judged before anything is changed. A GPU whose
compute mode must change while a process other than the MPS daemon's own is
listed on it is refused (``busy``): the job is still there. The MPS daemon is
found by its executable's name, pinned with a pidfd (never a pid that changed
hands), sent SIGTERM and waited for; a process the module must never signal
(PID 1, its own ancestors) is never a target.
"""

from __future__ import annotations

import os
import time
import typing as t

from ansible_collections.gpuops.clean_slate.plugins.module_utils import _checks, _health, _nvml, _probe, _proctable, _reasons, _signals
from ansible_collections.gpuops.clean_slate.plugins.module_utils._errors import CleanSlateError
from ansible_collections.gpuops.clean_slate.plugins.module_utils._nvml import NvmlError, NvmlSession

try:
    import pynvml
except ImportError:  # pragma: no cover - depends on the target host
    pynvml = None

#: The compute modes a user may declare (EXCLUSIVE_THREAD was removed from the driver with CUDA 8).
MODES = {"default": 0, "prohibited": 2, "exclusive_process": 3}
MPS_STATES = ("stopped",)


def argument_spec() -> dict[str, dict[str, t.Any]]:
    """The options of gpu_mode_restore (and of the umbrella's restore phase): one source for both."""
    return {
        "gpus": {"type": "list", "elements": "raw", "default": []},
        "compute_mode": {"type": "str", "choices": list(MODES)},
        "mps": {"type": "str", "choices": list(MPS_STATES)},
        "mps_timeout": {"type": "float", "default": 10},
        "probe_timeout": {"type": "float", "default": 10},
    }


def validate(params: t.Mapping[str, t.Any]) -> list[int | str]:
    """Refuse bad input before anything is read or changed; returns the GPU selectors."""
    if params["compute_mode"] is None and params["mps"] is None:
        raise CleanSlateError(
            "compute_mode: nothing to restore: declare compute_mode (default, exclusive_process or prohibited) and/or mps (stopped).",
            reason=_reasons.BAD_ARGUMENTS,
            option="compute_mode",
        )
    if params["compute_mode"] is not None and params["compute_mode"] not in MODES:
        raise CleanSlateError(
            f"compute_mode must be one of {', '.join(MODES)}, got {params['compute_mode']!r}.", reason=_reasons.BAD_ARGUMENTS, option="compute_mode"
        )
    if params["mps"] is not None and params["mps"] not in MPS_STATES:
        raise CleanSlateError(f"mps must be stopped, got {params['mps']!r}.", reason=_reasons.BAD_ARGUMENTS, option="mps")
    _checks.number("mps_timeout", params["mps_timeout"], 0, _checks.MAX_SECONDS, unit="seconds")
    _checks.number("probe_timeout", params["probe_timeout"], 0.1, 3600, unit="seconds")
    return _nvml.parse_gpu_selectors(params["gpus"])


def mps_daemons() -> list[int]:
    """PIDs of the MPS control daemons and servers here, never PID 1 nor this module's ancestors."""
    found = _health.find_processes(_health.MPS_NAMES)
    spared = set(_proctable.ancestors(os.getpid())) | {1, os.getpid()}
    return sorted(pid for name in _health.MPS_NAMES for pid in found[name] if pid not in spared)


def compute_mode(_session: NvmlSession, gpu: _nvml.Gpu) -> str:
    """The GPU's compute mode by name (run in the prober's helper: a hung driver cannot hang the module)."""
    try:
        return _health.COMPUTE_MODES.get(int(pynvml.nvmlDeviceGetComputeMode(gpu.handle)), "unknown")
    except pynvml.NVMLError as exc:
        raise NvmlError(getattr(exc, "value", -1), "nvmlDeviceGetComputeMode", gpu=gpu.index) from None


def set_compute_mode(_session: NvmlSession, gpu: _nvml.Gpu, mode: int) -> str | None:
    """Set the GPU's compute mode; None, or what NVML said (run in the prober's helper)."""
    try:
        pynvml.nvmlDeviceSetComputeMode(gpu.handle, mode)
    except pynvml.NVMLError as exc:
        return NvmlError(getattr(exc, "value", -1), "nvmlDeviceSetComputeMode", gpu=gpu.index).msg
    return None


def answers(replies: list[_probe.Answer]) -> list[t.Any]:
    """The values of ``replies``; the first error (an NVML failure, a hung driver) is raised."""
    for reply in replies:
        if reply.error is not None:
            raise reply.error
    return [reply.value for reply in replies]


def stop_mps(pids: list[int], timeout: float) -> tuple[list[int], list[int]]:
    """SIGTERM each MPS process (pinned by pidfd) and wait up to ``timeout``: (ended, survivors)."""
    victims = [_signals.pin(pid, _proctable.identity(pid)) for pid in pids]
    start = time.monotonic()
    for v in victims:
        if not v.done and not _signals.send(v, "TERM"):
            v.outcome = "vanished"
    _signals.wait_exit(victims, start + timeout, start, "terminated", time.monotonic)
    for v in victims:
        _signals.close(v)
    return [v.pid for v in victims if v.done], [v.pid for v in victims if not v.done]


def run(module: t.Any) -> dict[str, t.Any]:
    """The gpu_mode_restore module: read, judge, then (outside check mode) restore what was declared."""
    p = module.params
    selectors = validate(p)
    want_mode, want_mps = p["compute_mode"], p["mps"]
    # Every NVML call runs in the prober's helper process, under probe_timeout (a hung driver fails the
    # module with driver_hung instead of hanging it).
    with _probe.Prober(p["probe_timeout"]) as prober:
        every = prober.start()
        selected = _nvml.select_gpus(every, selectors)
        for gpu in selected:
            if gpu.error is not None:
                raise gpu.error
        before = dict(zip((g.index for g in selected), answers(prober.each(compute_mode, selected))))
        mps_before = mps_daemons() if want_mps else []
        to_change = [g for g in selected if want_mode is not None and before[g.index] != want_mode]
        # Guard: a GPU still in use is not changed under its job (MPS's own server goes with the daemon).
        busy = {}
        for g, procs in zip(to_change, answers(prober.each(NvmlSession.processes, to_change))):
            others = [proc.pid for proc in procs if proc.pid not in mps_before]
            if others:
                busy[g.index] = others
        if busy:
            which = "; ".join(f"GPU {i}: PID(s) {', '.join(map(str, pids))}" for i, pids in sorted(busy.items()))
            raise CleanSlateError(
                f"compute mode not changed: processes still use the GPU ({which}). End them first (gpuops.clean_slate.gpu_procs_kill); nothing was changed.",
                reason=_reasons.BUSY,
                busy={str(i): pids for i, pids in busy.items()},
            )
        ended: list[int] = []
        survivors: list[int] = []
        failed: dict[int, str] = {}
        if not module.check_mode:
            if want_mps and mps_before:
                ended, survivors = stop_mps(mps_before, p["mps_timeout"])
            if to_change:
                for g, problem in zip(to_change, answers(prober.each(set_compute_mode, to_change, MODES[want_mode]))):
                    if problem:
                        failed[g.index] = problem
            after = dict(zip((g.index for g in selected), answers(prober.each(compute_mode, selected))))
            mps_after = mps_daemons() if want_mps else []
        else:
            after = {g.index: (want_mode if g in to_change else before[g.index]) for g in selected}
            mps_after = []
    changed = bool(to_change) or bool(mps_before)
    gpus = [
        {"index": g.index, "uuid": g.uuid, "compute_mode_before": before[g.index], "compute_mode_after": after[g.index], "changed": g in to_change}
        for g in selected
    ]
    result: dict[str, t.Any] = {
        "changed": changed,
        "gpus": gpus,
        "mps": {"before": mps_before, "after": mps_after, "ended": ended},
        "diff": {
            "before": {"compute_mode": {str(i): m for i, m in before.items()}, "mps_daemon": mps_before},
            "after": {"compute_mode": {str(i): m for i, m in after.items()}, "mps_daemon": mps_after},
        },
    }
    problems = [f"GPU {i}: {text}" for i, text in sorted(failed.items())]
    if survivors or mps_after:
        problems.append(
            f"the MPS daemon PID(s) {', '.join(map(str, sorted(set(survivors) | set(mps_after))))} still run {p['mps_timeout']} s after SIGTERM;"
            " stop it with echo quit | nvidia-cuda-mps-control (as the user that started it), or reboot."
        )
    if want_mode is not None and not module.check_mode:
        wrong = [i for i, m in after.items() if m != want_mode and i not in failed]
        problems += [f"GPU {i}: compute mode reads {after[i]} after it was set to {want_mode}." for i in wrong]
    if problems:
        raise CleanSlateError("restore incomplete: " + " ".join(problems), reason=_reasons.RESTORE_FAILED, **{k: v for k, v in result.items() if k != "diff"})
    verb = "would restore" if module.check_mode else "restored"
    parts = []
    if to_change:
        parts.append(f"compute mode {want_mode} on GPU {', '.join(str(g.index) for g in to_change)}")
    if mps_before:
        parts.append(f"MPS stopped (PID(s) {', '.join(map(str, mps_before))})")
    result["msg"] = f"{verb} {' and '.join(parts)}" if parts else "nothing to restore: every declared value already holds"
    return result
