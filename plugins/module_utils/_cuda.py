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

from ansible_collections.gpuops.clean_slate.plugins.module_utils import _cuda_program, _health, _reasons

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
#: Where each failed start puts the GPU on the health verdict's scale (``_health.VERDICTS``). A start that could not be
#: made (``cuda_unproven``) says nothing of the GPU's health: the GPU is not clean, and its health is what was read.
VERDICTS = {
    _reasons.UVM_MISSING: _health.RESET_GPU,
    _reasons.DEVICE_MISSING: _health.RESET_GPU,
    _reasons.NO_LIBCUDA: _health.RESET_GPU,
    _reasons.CUDA_BUSY: _health.RESTART_APP,
    _reasons.CUDA_OOM: _health.RESET_GPU,
    _reasons.ECC_UNCORRECTABLE: _health.RESET_GPU,
    _reasons.FABRIC_NOT_READY: _health.RESET_GPU,
    _reasons.CUDA_HUNG: _health.REBOOT,
    _reasons.CUDA_ERROR: _health.RESET_GPU,
    _reasons.CUDA_RESIDUE: _health.RESET_GPU,
}
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
) -> tuple[dict[int, dict[str, t.Any]], dict[str, t.Any] | None, list[int]]:
    """:func:`probe`, and with ``peers`` the peer check of those GPUs beside it (:func:`._cuda_program.probe_all`)."""
    return _cuda_program.probe_all(targets, fraction, timeout, peers, on_step=on_step)


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
    reason, detail = _why(raw, gpu, fraction, timeout, devices, compute_mode, nvml_free_mib)
    record.update(reason=reason, detail=detail)
    return record


def _why(
    raw: dict[str, t.Any], gpu: int, fraction: float, timeout: float, devices: dict[str, t.Any], compute_mode: str | None, nvml_free_mib: int | None
) -> tuple[str, str]:
    code, step = raw.get("code"), raw.get("step")
    said = f"CUDA error {code} ({error_name(code)}{': ' + raw['text'] if raw.get('text') else ''}) in {step}"
    uvm = devices.get("uvm") or {"ok": True}
    node = (devices.get("gpus") or {}).get(gpu) or {"ok": True}
    if "unproven" in raw:
        return _reasons.CUDA_UNPROVEN, (
            f"{raw['unproven']} NVML reads the GPU clean, but a server may still fail to start there (a device file not passed"
            " through, nvidia-uvm missing): it is not proven startable."
        )
    if "dlopen_error" in raw:
        return _reasons.NO_LIBCUDA, (
            f"libcuda.so.1 cannot be loaded ({raw['dlopen_error']}): NVML works, but no CUDA program can start. Install the driver's"
            " user-space libraries of the kernel module's version (in an LXC container, the host's driver version) or put their"
            " directory on the loader's path."
        )
    if "hung" in raw or "died" in raw or "abandoned" in raw:
        where = raw.get("hung") or raw.get("died") or raw.get("abandoned")
        if "died" in raw:
            return _reasons.CUDA_ERROR, f"the CUDA probe's helper died in {where} before it answered. Check dmesg for Xid errors and segfaults."
        if "abandoned" in raw:
            return _reasons.CUDA_ERROR, f"the CUDA probe's helper was killed in {where}: the run that asked for it went away. Run again."
        return _reasons.CUDA_HUNG, (
            f"the CUDA start did not finish within {timeout:g} s (cuda_probe_timeout): it was stuck in {where}, and its helper"
            " process was killed. A GPU that hangs a CUDA start is wedged in the driver (often in UVM): reboot the node (or follow"
            " its documented recovery: stop every user of the GPU, then nvidia-smi -r -i <index>). Check dmesg for Xid errors first."
        )
    if not uvm["ok"]:
        major = devices.get("uvm_major")
        number = f" (its major number is {major} on this kernel, from /proc/devices)" if major else ""
        return _reasons.UVM_MISSING, (
            f"{said}: {uvm['why']}. NVML works without it, every CUDA start fails. On the host load the module (nvidia-modprobe"
            f" -u -c=0, or modprobe nvidia-uvm); in an LXC container pass /dev/nvidia-uvm and /dev/nvidia-uvm-tools through{number}:"
            " the number is dynamic, so a device rule written for 195 misses it. Then restart the container."
        )
    if not node["ok"] and code in (100, 101, 999, None):
        return _reasons.DEVICE_MISSING, f"{said}: {node['why']}. Pass the GPU's device file into the container (or load the driver), then run again."
    if "mismatch" in raw:
        return _reasons.CUDA_ERROR, f"CUDA_VISIBLE_DEVICES named {raw['mismatch']}'s GPU but CUDA opened another: the UUIDs NVML and CUDA report differ."
    reason = _CODE_REASONS.get(code or 0, _reasons.CUDA_ERROR)
    if reason == _reasons.CUDA_BUSY:
        holder = "another process holds a context on it" + (
            " (one this namespace cannot see when NVML lists none)" if compute_mode == "exclusive_process" else ""
        )
        mode = compute_mode or "not default"
        return reason, (
            f"{said}: the GPU's compute mode is {mode} and {holder}. End that process where it runs (on the host, or in the"
            " container that owns it), or put the compute mode back to default (gpuops.clean_slate.gpu_mode_restore)."
        )
    if reason == _reasons.CUDA_OOM:
        asked = int((raw.get("cuda_total_mib") or 0) * fraction)
        free = raw.get("cuda_free_mib")
        nvml = f" where NVML reads {nvml_free_mib} MiB free" if nvml_free_mib is not None else ""
        return reason, (
            f"{said}, asking for {asked} MiB ({fraction:.0%} of {raw.get('cuda_total_mib')} MiB, what a server asks for): CUDA"
            f" reports {free} MiB free{nvml}. A server asking for this share would not start. Memory the driver holds that no"
            " process explains needs a GPU reset (nvidia-smi -r -i <index>) or a reboot; lower cuda_probe_memory_fraction only if"
            " your servers ask for less."
        )
    if reason == _reasons.ECC_UNCORRECTABLE:
        return (
            reason,
            f"{said}: an uncorrectable ECC error this GPU has not been reset from. Reset it (nvidia-smi -r -i <index>) before the"
            " next job; if it recurs, drain the node for NVIDIA's field diagnosis.",
        )
    if reason == _reasons.FABRIC_NOT_READY:
        return reason, (
            f"{said}: the NVLink fabric is not up, so CUDA says 'system not yet initialized' while nvidia-smi works. Start"
            " nvidia-fabricmanager (systemctl start nvidia-fabricmanager), wait for it to complete, then run again."
        )
    advice = {
        35: "the CUDA driver library is older than the kernel module: after a driver upgrade reboot; in a container install the host's driver version.",
        803: "the CUDA driver library and the kernel module differ: after a driver upgrade reboot; in a container install the host's driver version.",
        100: "CUDA sees no device: check the device files and CUDA_VISIBLE_DEVICES.",
        999: "check that the nvidia-uvm module is loaded (lsmod) and dmesg for Xid errors; a GPU reset or a reboot may be needed.",
    }
    return _reasons.CUDA_ERROR, f"{said}: {advice.get(code or 0, 'check dmesg for Xid errors; a GPU reset or a reboot may be needed.')}"


def finding(record: dict[str, t.Any]) -> tuple[str, str] | None:
    """``(verdict, sentence)`` of a failed start for the GPU's health, None for one that worked, did not run or could not be made."""
    if not record or record.get("ok") is not False or record.get("reason") not in VERDICTS:
        return None
    return VERDICTS[record["reason"]], f"{record['reason']}: a CUDA start failed ({record['detail']})"


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
