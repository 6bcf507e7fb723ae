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

The module process never loads CUDA: CUDA is not fork-safe, and the module forks its NVML helpers. Each GPU's start
runs in a helper of its own, forked from the module (which has not touched CUDA) with ``CUDA_VISIBLE_DEVICES`` set to
that GPU's UUID, so that the GPUs are probed in parallel and a GPU that hangs holds up only its own helper. The
helper says which call it is making before it makes it (a line on a pipe); one that has not answered by its deadline
is killed (SIGKILL: the driver's waits are killable) and reaped, and its GPU is ``cuda_hung``, named by that call.
The caller then reads NVML again until the helpers' processes and memory are gone, so the probe is never the next
start's residue (:mod:`._verify`).
"""

from __future__ import annotations

import ctypes
import json
import os
import select
import signal
import time
import typing as t

from ansible_collections.gpuops.clean_slate.plugins.module_utils import _health, _reasons

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
    304: "CUDA_ERROR_OPERATING_SYSTEM",
    700: "CUDA_ERROR_ILLEGAL_ADDRESS",
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
#: Where each failed start puts the GPU on the health verdict's scale (``_health.VERDICTS``).
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
#: Variables DCGM's software plugin flags as breaking or slowing CUDA starts (NVIDIA/DCGM nvvs Software.cpp,
#: checkForBadEnvVaribles): the probe's helper runs without them, so that it proves the GPU, not the task's environment.
BAD_ENV = (
    "NSIGHT_CUDA_DEBUGGER",
    "CUDA_INJECTION32_PATH",
    "CUDA_INJECTION64_PATH",
    "CUDA_AUTO_BOOST",
    "CUDA_ENABLE_COREDUMP_ON_EXCEPTION",
    "CUDA_COREDUMP_FILE",
    "CUDA_DEVICE_WAITS_ON_EXCEPTION",
    "CUDA_PROFILE",
    "COMPUTE_PROFILE",
    "OPENCL_PROFILE",
)
#: How long a killed helper may take to be reaped (one stuck in an uninterruptible wait of the driver is left, and said).
REAP_WAIT_S = 0.5
#: A bare primary context on an H200 (docs/results/cuda-facts-h200x1-2026-12-02.json: free = total - 527 MiB).
CONTEXT_MIB = 527
_PR_SET_PDEATHSIG = 1
MIB = 1 << 20


class Target(t.NamedTuple):
    """One GPU to start CUDA on: its NVML index and UUID, and whether to stop after the context (no allocation)."""

    gpu: int
    uuid: str
    context_only: bool = False


# ---------------------------------------------------------------------- the helper
def _start(out_fd: int, uuid: str, fraction: float, context_only: bool) -> None:  # pragma: no cover - runs in the helper
    """The start, in the forked helper: each call announced (``S <name>``) before it is made, the answer last (``R <json>``)."""

    def say(line: str) -> None:
        data = (line + "\n").encode()
        while data:
            data = data[os.write(out_fd, data) :]

    res: dict[str, t.Any] = {"steps": {}, "code": None, "step": None}

    def call(name: str, fn: t.Any, *args: t.Any) -> bool:
        say(f"S {name}")
        began = time.monotonic()
        code = int(fn(*args))
        res["steps"][name] = round(time.monotonic() - began, 4)
        if code != 0:
            res.update(code=code, step=name)
            text = ctypes.c_char_p()
            if cuda.cuGetErrorString(code, ctypes.byref(text)) == 0 and text.value:
                res["text"] = text.value.decode("utf-8", "replace")
            return False
        return True

    say("S dlopen")
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError as exc:
        res.update(step="dlopen", dlopen_error=str(exc))
        say("R " + json.dumps(res))
        return
    dev, count, ctx, ptr = ctypes.c_int(), ctypes.c_int(), ctypes.c_void_p(), ctypes.c_uint64()
    free, total, raw = ctypes.c_size_t(), ctypes.c_size_t(), (ctypes.c_ubyte * 16)()
    ok = call("cuInit", cuda.cuInit, 0) and call("cuDeviceGetCount", cuda.cuDeviceGetCount, ctypes.byref(count))
    if ok and count.value < 1:
        res.update(code=100, step="cuDeviceGetCount")
        ok = False
    ok = ok and call("cuDeviceGet", cuda.cuDeviceGet, ctypes.byref(dev), 0)
    if ok and hasattr(cuda, "cuDeviceGetUuid_v2") and call("cuDeviceGetUuid_v2", cuda.cuDeviceGetUuid_v2, raw, dev):
        res["uuid"] = "GPU-" + "-".join(bytes(raw).hex()[a:b] for a, b in ((0, 8), (8, 12), (12, 16), (16, 20), (20, 32)))
    ok = ok and call("cuDevicePrimaryCtxRetain", cuda.cuDevicePrimaryCtxRetain, ctypes.byref(ctx), dev)
    retained = ok
    ok = ok and call("cuCtxSetCurrent", cuda.cuCtxSetCurrent, ctx)
    ok = ok and call("cuMemGetInfo_v2", cuda.cuMemGetInfo_v2, ctypes.byref(free), ctypes.byref(total))
    if ok:
        res["cuda_free_mib"], res["cuda_total_mib"] = free.value // MIB, total.value // MIB
    size = 0 if context_only else int(total.value * fraction)
    if ok and size > 0:
        ok = call("cuMemAlloc_v2", cuda.cuMemAlloc_v2, ctypes.byref(ptr), ctypes.c_size_t(size))
        if ok:
            res["allocated_mib"] = size // MIB
            ok = call("cuMemsetD8_v2", cuda.cuMemsetD8_v2, ptr, ctypes.c_ubyte(0xA5), ctypes.c_size_t(size))
            ok = call("cuCtxSynchronize", cuda.cuCtxSynchronize) and ok
            ok = call("cuMemFree_v2", cuda.cuMemFree_v2, ptr) and ok
    if retained:
        release = getattr(cuda, "cuDevicePrimaryCtxRelease_v2", None) or cuda.cuDevicePrimaryCtxRelease
        ok = call("cuDevicePrimaryCtxRelease", release, dev) and ok
    res["ok"] = ok
    if ok and res.get("uuid") and res["uuid"].lower() != uuid.lower():
        res.update(ok=False, step="cuDeviceGetUuid_v2", mismatch=res["uuid"])
    say("R " + json.dumps(res))


def _helper(out_fd: int, parent: int, target: Target, fraction: float) -> None:  # pragma: no cover - runs in the helper
    try:
        ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:
        return
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGPIPE):
        signal.signal(sig, signal.SIG_DFL)
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    os.close(null)
    # Nothing of the module's (its NVML helper's pipes, Ansible's files) stays open in the helper.
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd > 2 and fd != out_fd:
            try:
                os.close(fd)
            except OSError:
                pass
    os.environ["CUDA_VISIBLE_DEVICES"] = target.uuid
    os.environ["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
    for name in BAD_ENV:
        os.environ.pop(name, None)
    _start(out_fd, target.uuid, fraction, target.context_only)


# ---------------------------------------------------------------------- the module's side
class _Running:
    def __init__(self, target: Target, pid: int, fd: int, now: float) -> None:
        self.target = target
        self.pid = pid
        self.fd = fd
        self.began = now
        self.step = "fork"
        self.buffer = b""
        self.result: dict[str, t.Any] | None = None


def _reap(pids: list[int]) -> list[int]:
    """Wait up to REAP_WAIT_S for the helpers to be reaped; the pids still not reaped (stuck in the driver)."""
    left = list(pids)
    deadline = time.monotonic() + REAP_WAIT_S
    while left:
        for pid in list(left):
            try:
                done, _status = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                done = pid
            if done:
                left.remove(pid)
        if not left or time.monotonic() >= deadline:
            break
        time.sleep(0.002)
    return left


def probe(
    targets: t.Sequence[Target], fraction: float, timeout: float, clock: t.Callable[[], float] = time.monotonic
) -> tuple[dict[int, dict[str, t.Any]], list[int]]:
    """Start CUDA on every target at once, each in a helper of its own under ``timeout`` seconds.

    Returns each GPU's raw answer (``ok``, ``code``, ``text``, ``step``, ``steps``, ``cuda_free_mib``,
    ``cuda_total_mib``, ``allocated_mib``, ``pid``, ``elapsed_s``; ``hung`` with the call it was in; ``dlopen_error``)
    and the helpers that did not die of SIGKILL in time.
    """
    running: list[_Running] = []
    parent = os.getpid()
    for target in targets:
        read_fd, write_fd = os.pipe()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - runs in the helper
            try:
                os.close(read_fd)
                _helper(write_fd, parent, target, fraction)
            finally:
                os._exit(0)
        os.close(write_fd)
        running.append(_Running(target, pid, read_fd, clock()))
    pending = list(running)
    while pending:
        now = clock()
        for r in list(pending):
            if now - r.began >= timeout:
                try:
                    os.kill(r.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                r.result = {"ok": False, "hung": r.step, "waited_s": round(now - r.began, 3), "steps": {}}
                pending.remove(r)
        if not pending:
            break
        wait = min(r.began + timeout for r in pending) - now
        ready = select.select([r.fd for r in pending], [], [], max(0.0, wait))[0]
        for r in [r for r in pending if r.fd in ready]:
            chunk = os.read(r.fd, 65536)
            r.buffer += chunk
            *lines, r.buffer = r.buffer.split(b"\n")
            for line in lines:
                kind, _sep, body = line.decode("utf-8", "replace").partition(" ")
                if kind == "S":
                    r.step = body
                elif kind == "R":
                    r.result = json.loads(body)
            if not chunk or r.result is not None:
                if r.result is None:
                    r.result = {"ok": False, "died": r.step, "steps": {}}
                r.result["elapsed_s"] = round(clock() - r.began, 4)
                pending.remove(r)
    for r in running:
        os.close(r.fd)
    left = _reap([r.pid for r in running])
    out = {}
    for r in running:
        result = dict(r.result or {})
        result["pid"] = r.pid
        result.setdefault("elapsed_s", round(clock() - r.began, 4))
        out[r.target.gpu] = result
    return out, left


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
        "step": raw.get("step") or raw.get("hung") or raw.get("died"),
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
    if "dlopen_error" in raw:
        return _reasons.NO_LIBCUDA, (
            f"libcuda.so.1 cannot be loaded ({raw['dlopen_error']}): NVML works, but no CUDA program can start. Install the driver's"
            " user-space libraries of the kernel module's version (in an LXC container, the host's driver version) or put their"
            " directory on the loader's path."
        )
    if "hung" in raw or "died" in raw:
        where = raw.get("hung") or raw.get("died")
        if "died" in raw:
            return _reasons.CUDA_ERROR, f"the CUDA probe's helper died in {where} before it answered. Check dmesg for Xid errors and segfaults."
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
    """``(verdict, sentence)`` of a failed start for the GPU's health, None for one that worked or did not run."""
    if not record or record.get("ok") is not False or not record.get("reason"):
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
