# Copyright (c) 2026, gpuops.clean_slate maintainers
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# Note: this module_util is PRIVATE to the collection; it may change without notice.

"""A CUDA start on every selected GPU, a moment before the verdict: the startability probe.

NVML can read a GPU that CUDA cannot use: a container without ``/dev/nvidia-uvm``, Exclusive_Process mode with a
context held elsewhere, an uncorrectable ECC error not yet reset, the NVLink fabric not up, less memory allocatable
than NVML reads free, a GPU wedged in UVM, no ``libcuda.so.1``. So the verification makes the start a server makes,
through ``libcuda.so.1`` directly: ``cuInit``, the primary context, an allocation of ``fraction`` of the GPU's
memory (what a server asks for), a memset, a synchronize, the free and the release, timing each step.

The start itself is :mod:`._cuda_program`, one self-contained text: here, each GPU's start runs in a helper forked
from the module (which never loads CUDA: it is not fork-safe), with ``CUDA_VISIBLE_DEVICES`` set to that GPU's UUID,
so that the GPUs are probed in parallel and a GPU that hangs holds up only its own helper, killed at its deadline
(``cuda_hung``, named by the call it was in); in container scope the same text runs inside the container
(:mod:`._inside`). This file names what the answers mean: each failure's reason, its CUDA error and a sentence that
says what to do. The caller then reads NVML again until the helpers' processes and memory are gone, so the probe is
never the next start's residue (:mod:`._verify`).
"""

from __future__ import annotations

import time
import typing as t

from ansible_collections.gpuops.clean_slate.plugins.module_utils import _cuda_program, _findings, _health, _reasons

#: cuda.h's CUresult names of the codes a start meets.
ERROR_NAMES = {
    0: "CUDA_SUCCESS",
    1: "CUDA_ERROR_INVALID_VALUE",
    2: "CUDA_ERROR_OUT_OF_MEMORY",
    3: "CUDA_ERROR_NOT_INITIALIZED",
    34: "CUDA_ERROR_STUB_LIBRARY",
    35: "CUDA_ERROR_INSUFFICIENT_DRIVER",
    46: "CUDA_ERROR_DEVICE_UNAVAILABLE",
    100: "CUDA_ERROR_NO_DEVICE",
    101: "CUDA_ERROR_INVALID_DEVICE",
    201: "CUDA_ERROR_INVALID_CONTEXT",
    214: "CUDA_ERROR_ECC_UNCORRECTABLE",
    217: "CUDA_ERROR_PEER_ACCESS_UNSUPPORTED",
    304: "CUDA_ERROR_OPERATING_SYSTEM",
    400: "CUDA_ERROR_INVALID_HANDLE",
    600: "CUDA_ERROR_NOT_READY",
    700: "CUDA_ERROR_ILLEGAL_ADDRESS",
    704: "CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED",
    705: "CUDA_ERROR_PEER_ACCESS_NOT_ENABLED",
    802: "CUDA_ERROR_SYSTEM_NOT_READY",
    803: "CUDA_ERROR_SYSTEM_DRIVER_MISMATCH",
    804: "CUDA_ERROR_COMPAT_NOT_SUPPORTED_ON_DEVICE",
    999: "CUDA_ERROR_UNKNOWN",
}
_CODE_REASONS = {
    2: _reasons.CUDA_OOM,
    46: _reasons.CUDA_BUSY,
    214: _reasons.ECC_UNCORRECTABLE,
    802: _reasons.FABRIC_NOT_READY,
}
#: Where each failed start puts the GPU on the health verdict's scale (``_health.VERDICTS``), from the one table of
#: findings (a missing device file or nvidia-uvm is the configuration's fault, fix_config; a start that hangs, reboot).
#: A start that could not be made (``cuda_unproven``) says nothing of the GPU's health: the GPU is not clean, and its
#: health is what was read.
VERDICTS = {reason: _findings.FINDINGS[reason].verdict for reason in _reasons.STARTABILITY if reason != _reasons.CUDA_UNPROVEN}
#: Variables DCGM flags as breaking CUDA starts; the probe's helper runs without them (:data:`._cuda_program.BAD_ENV`).
BAD_ENV = _cuda_program.BAD_ENV
#: How long a killed helper may take to be reaped (:data:`._cuda_program.REAP_WAIT_S`).
REAP_WAIT_S = _cuda_program.REAP_WAIT_S
#: A bare primary context on an H200 (docs/results/cuda-facts-h200x1-2026-12-02.json: free = total - 527 MiB).
CONTEXT_MIB = 527


class Target(t.NamedTuple):
    """One GPU to start CUDA on: its NVML index and UUID, and whether to stop after the context (no allocation)."""

    gpu: int
    uuid: str
    context_only: bool = False


# ---------------------------------------------------------------------- the module's side
def probe(
    targets: t.Sequence[Target], fraction: float, timeout: float, clock: t.Callable[[], float] = time.monotonic
) -> tuple[dict[int, dict[str, t.Any]], list[int]]:
    """Start CUDA on every target at once, each in a helper forked from this process under ``timeout`` seconds
    (:func:`._cuda_program.probe`): each GPU's raw answer, and the helpers that did not die of SIGKILL in time."""
    return _cuda_program.probe(targets, fraction, timeout, clock)


def probe_all(
    targets: t.Sequence[Target],
    fraction: float,
    timeout: float,
    peers: dict[str, t.Any] | None = None,
    on_step: t.Callable[[int, str], None] | None = None,
    early: _cuda_program.Helpers | None = None,
) -> tuple[dict[int, dict[str, t.Any]], dict[str, t.Any] | None, list[int]]:
    """:func:`probe`, and with ``peers`` the peer check of those GPUs beside it, by the helpers forked ``early`` where they
    cover it (:func:`._cuda_program.probe_all`)."""
    return _cuda_program.probe_all(targets, fraction, timeout, peers, on_step=on_step, early=early)


# ---------------------------------------------------------------------- judging an answer
def error_name(code: int | None) -> str:
    return ERROR_NAMES.get(code or 0, f"CUresult {code}")


def judge(
    raw: dict[str, t.Any],
    gpu: int,
    fraction: float,
    timeout: float,
    devices: dict[str, t.Any],
    compute_mode: str | None,
    nvml_free_mib: int | None,
    context_only: bool = False,
) -> dict[str, t.Any]:
    """The ``startable`` record of one GPU from its helper's raw answer: ``ok``, ``reason`` (a diagnosis of
    ``_reasons.STARTABILITY``, None when it started), ``code``, ``error`` (the CUresult's name), ``step``, ``detail``
    (a sentence: what happened and what to do) and the measurements.

    ``devices`` is what :func:`._software.device_nodes` found (``uvm`` and ``gpus`` by index, each with ``ok`` and ``why``).
    """
    code = raw.get("code")
    record: dict[str, t.Any] = {
        "ok": bool(raw.get("ok")),
        "reason": None,
        "code": code,
        "error": error_name(code) if code else None,
        "step": raw.get("step") or raw.get("hung") or raw.get("died") or raw.get("abandoned"),
        "detail": "a CUDA context" + ("" if context_only else f", {raw.get('allocated_mib', 0)} MiB allocated, set and freed") + ", released",
        "context_only": context_only,
        "elapsed_s": raw.get("elapsed_s"),
        "steps": raw.get("steps", {}),
        "cuda_total_mib": raw.get("cuda_total_mib"),
        "cuda_free_mib": raw.get("cuda_free_mib"),
        "allocated_mib": raw.get("allocated_mib"),
        "pid": raw.get("pid"),
    }
    if record["ok"]:
        return record
    reason, facts = _why(raw, gpu, fraction, timeout, devices, compute_mode, nvml_free_mib)
    # What happened, then what fixes it (the table's word, said once per finding in a message).
    record.update(reason=reason, facts=facts, detail=f"{facts} {_findings.FINDINGS[reason].fix}")
    return record


def _why(
    raw: dict[str, t.Any], gpu: int, fraction: float, timeout: float, devices: dict[str, t.Any], compute_mode: str | None, nvml_free_mib: int | None
) -> tuple[str, str]:
    """(reason, what happened) of a failed start; what fixes it is the reason's row of ``_findings.FINDINGS``."""
    code, step = raw.get("code"), raw.get("step")
    said = f"CUDA error {code} ({error_name(code)}{': ' + raw['text'] if raw.get('text') else ''}) in {step}"
    uvm = devices.get("uvm") or {"ok": True}
    ctl = devices.get("ctl") or {"ok": True}
    node = (devices.get("gpus") or {}).get(gpu) or {"ok": True}
    if "unproven" in raw:
        return _reasons.CUDA_UNPROVEN, (
            f"{raw['unproven']} NVML reads the GPU clean, but a server may still fail to start there (a device file not passed"
            " through, nvidia-uvm missing): it is not proven startable."
        )
    if "dlopen_error" in raw:
        return _reasons.NO_LIBCUDA, f"libcuda.so.1 cannot be loaded ({raw['dlopen_error']}): NVML works, but no CUDA program can start."
    if "hung" in raw or "died" in raw or "abandoned" in raw:
        where = raw.get("hung") or raw.get("died") or raw.get("abandoned")
        if "died" in raw:
            return _reasons.CUDA_ERROR, f"the CUDA probe's helper died in {where} before it answered."
        if "abandoned" in raw:
            return _reasons.CUDA_ERROR, f"the CUDA probe's helper was killed in {where}: the run that asked for it went away. Run again."
        return _reasons.CUDA_HUNG, (
            f"the CUDA start did not finish within {timeout:g} s (cuda_probe_timeout): it was stuck in {where}, and its helper"
            " process was killed. A GPU that hangs a CUDA start is wedged in the driver (often in UVM)."
        )
    # The device files first: a node that is absent, another device's or refused is the configuration's fault whatever
    # error code CUDA gives for it (999 from cuInit for a wrong nvidia-uvm, 100 for a missing nvidiactl).
    if not uvm["ok"]:
        major = devices.get("uvm_major")
        number = f" (nvidia-uvm's major is {major} on this kernel, from /proc/devices: dynamic, not the GPUs' 195)" if major else ""
        return _reasons.UVM_MISSING, f"{said}: {uvm['why']}{number}. NVML works without nvidia-uvm; every CUDA start needs it."
    if not ctl["ok"]:
        return _reasons.DEVICE_MISSING, f"{said}: {ctl['why']}. No CUDA program can start without the control device."
    if not node["ok"] and code in (100, 101, 999, None):
        return _reasons.DEVICE_MISSING, f"{said}: {node['why']}. CUDA cannot use this GPU here."
    if code == 999 and step == "cuInit":
        # cuInit fails with CUDA_ERROR_UNKNOWN where the driver's unified-memory part cannot be used (on an H100 with a
        # node of /dev/null's numbers as /dev/nvidia-uvm): a GPU reset does not touch it.
        if devices.get("uvm_loaded") is False:
            why = "the nvidia-uvm module is not loaded on this kernel (/proc/devices lists no nvidia-uvm)"
        elif devices.get("numbers_checked"):
            why = "/dev/nvidia-uvm is present, is the nvidia-uvm device and opens, so the unified-memory driver itself refused"
        else:
            why = (
                "/dev/nvidia-uvm is present and opens, but its numbers cannot be checked here (/proc/devices lists no NVIDIA driver): it may be"
                " another device's node, or the module may not be loaded"
            )
        return _reasons.UVM_MISSING, f"{said}, while NVML reads the GPU: the unified-memory driver could not be used: {why}."
    if "mismatch" in raw:
        return _reasons.CUDA_ERROR, f"CUDA_VISIBLE_DEVICES named {raw['mismatch']}'s GPU but CUDA opened another: the UUIDs NVML and CUDA report differ."
    reason = _CODE_REASONS.get(code or 0, _reasons.CUDA_ERROR)
    if reason == _reasons.CUDA_BUSY:
        holder = "another process holds a context on it" + (
            " (one this namespace cannot see when NVML lists none)" if compute_mode == "exclusive_process" else ""
        )
        return reason, f"{said}: the GPU's compute mode is {compute_mode or 'not default'} and {holder}."
    if reason == _reasons.CUDA_OOM:
        asked = int((raw.get("cuda_total_mib") or 0) * fraction)
        free = raw.get("cuda_free_mib")
        nvml = f" where NVML reads {nvml_free_mib} MiB free" if nvml_free_mib is not None else ""
        return reason, (
            f"{said}, asking for {asked} MiB ({fraction:.0%} of {raw.get('cuda_total_mib')} MiB, what a server asks for): CUDA"
            f" reports {free} MiB free{nvml}. A server asking for this share would not start (lower cuda_probe_memory_fraction only if"
            " your servers ask for less)."
        )
    if reason == _reasons.ECC_UNCORRECTABLE:
        return reason, f"{said}: an uncorrectable ECC error this GPU has not been reset from."
    if reason == _reasons.FABRIC_NOT_READY:
        return reason, f"{said}: the NVLink fabric is not up, so CUDA says 'system not yet initialized' while nvidia-smi works."
    library = {
        34: "libcuda.so.1 is CUDA's stub library, not the driver's",
        35: "libcuda.so.1 is older than the kernel module (a container's libraries older than the node's driver)",
        803: (
            "libcuda.so.1 and the kernel module are of different versions (a driver upgraded whose new kernel module is not loaded yet, or a"
            " container's libraries not the node's driver version)"
        ),
    }
    if code in library:
        # The user-space driver does not match the kernel module: its installation, not the GPU, is at fault.
        return _reasons.NO_LIBCUDA, f"{said}: {library[code]}."
    what = {100: "CUDA sees no device (check the device files and CUDA_VISIBLE_DEVICES)"}
    return _reasons.CUDA_ERROR, f"{said}" + (f": {what[code]}." if code in what else ".")


def finding(record: dict[str, t.Any]) -> _health.Found | None:
    """``(name, verdict, sentence)`` of a failed start for the GPU's health, None for one that worked, did not run or could
    not be made."""
    if not record or record.get("ok") is not False or record.get("reason") not in VERDICTS:
        return None
    return record["reason"], VERDICTS[record["reason"]], f"a CUDA start failed ({record.get('facts') or record['detail']})"


def modes(session: t.Any, gpu: t.Any) -> dict[str, t.Any]:
    """Compute mode and MIG mode of one GPU (NVML, in the prober's helper): which probe it gets."""
    import pynvml  # pylint: disable=import-outside-toplevel

    out: dict[str, t.Any] = {"compute_mode": None, "mig": None}
    del session
    try:
        mode = int(pynvml.nvmlDeviceGetComputeMode(gpu.handle))
        out["compute_mode"] = _health.COMPUTE_MODES.get(mode, f"unknown_{mode}")
    except pynvml.NVMLError:
        pass
    try:
        out["mig"] = bool(pynvml.nvmlDeviceGetMigMode(gpu.handle)[0])
    except pynvml.NVMLError:
        pass
    return out
