# Copyright (c) 2026, gpuops.clean_slate maintainers
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# Note: this module_util is PRIVATE to the collection; it may change without notice.

"""A small, careful NVML layer on top of nvidia-ml-py (``pynvml``).

Why not call pynvml directly from the modules:

* pynvml's default ``nvmlDeviceGetMemoryInfo(h)`` has v1 semantics, whose
  ``used`` includes driver-reserved memory (about 615 MiB on an idle H200), so
  an idle GPU looks dirty. We read v2 and fall back explicitly.
* Process lists exist in three flavours (compute, graphics, MPS) and three
  struct versions; drivers and bindings disagree on which exist. We probe
  once per session, newest first, and map the "not available" sentinel.
* NVML errors arrive as numeric codes; operators need a diagnosis and a next
  step, so every failure becomes an :class:`NvmlError` with a ``reason``.
"""

from __future__ import annotations

import ctypes
import os
import re
import traceback
import typing as t
from dataclasses import dataclass, field

from ansible_collections.gpuops.clean_slate.plugins.module_utils import _reasons
from ansible_collections.gpuops.clean_slate.plugins.module_utils._errors import CleanSlateError

try:
    import pynvml

    HAS_PYNVML = True
    PYNVML_IMPORT_ERROR: str | None = None
except ImportError:  # pragma: no cover - depends on the target host
    HAS_PYNVML = False
    PYNVML_IMPORT_ERROR = traceback.format_exc()

MIB = 1024 * 1024
DEVICE_RE = re.compile(r"^(?:.*/)?nvidia(\d+)$")
UUID_RE = re.compile(r"^(GPU|MIG)-[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$")
VALUE_NOT_AVAILABLE = 0xFFFFFFFFFFFFFFFF
FIELD_RECOVERY_ACTION = 230
RECOVERY_ACTIONS = {
    0: "none",
    1: "gpu_reset",
    2: "node_reboot",
    3: "drain_p2p",
    4: "drain_and_reset",
    5: "recover_imex_domain",
    6: "bus_reset",
    7: "system_reboot",
}

# NVML return codes we act on (values from nvml.h; stable across releases).
NVML_SUCCESS = 0
NVML_ERROR_UNINITIALIZED = 1
NVML_ERROR_INVALID_ARGUMENT = 2
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_NO_PERMISSION = 4
NVML_ERROR_NOT_FOUND = 6
NVML_ERROR_INSUFFICIENT_SIZE = 7
NVML_ERROR_DRIVER_NOT_LOADED = 9
NVML_ERROR_TIMEOUT = 10
NVML_ERROR_LIBRARY_NOT_FOUND = 12
NVML_ERROR_FUNCTION_NOT_FOUND = 13
NVML_ERROR_GPU_IS_LOST = 15
NVML_ERROR_RESET_REQUIRED = 16
NVML_ERROR_LIB_RM_VERSION_MISMATCH = 18
NVML_ERROR_ARGUMENT_VERSION_MISMATCH = 25

# Codes that mean "this entry point or struct version is not here": try an older one.
_FALLBACK_CODES = (NVML_ERROR_FUNCTION_NOT_FOUND, NVML_ERROR_ARGUMENT_VERSION_MISMATCH, NVML_ERROR_NOT_SUPPORTED)

# What each failure means, and what to do: the reason and the advice an NvmlError carries.
_BY_CODE: dict[int, tuple[str, str]] = {
    NVML_ERROR_LIBRARY_NOT_FOUND: (
        _reasons.LIBRARY_NOT_FOUND,
        "libnvidia-ml.so.1 was not found: the NVIDIA driver is not installed on this host, or its library is not on the"
        " loader path. Install the driver (in an LXC guest: the userspace driver matching the host's kernel module).",
    ),
    NVML_ERROR_DRIVER_NOT_LOADED: (
        _reasons.DRIVER_NOT_LOADED,
        "the NVIDIA kernel driver is not loaded (NVML_ERROR_DRIVER_NOT_LOADED). Load it (modprobe nvidia) or reboot;"
        " in an LXC guest, check that the host's /dev/nvidia* devices are passed through.",
    ),
    NVML_ERROR_LIB_RM_VERSION_MISMATCH: (
        _reasons.DRIVER_LIBRARY_MISMATCH,
        "the NVML library and the loaded kernel driver have different versions (NVML_ERROR_LIB_RM_VERSION_MISMATCH),"
        " usually after a driver upgrade without a reboot. GPU memory cannot be verified until they match: reboot, or"
        " stop every /dev/nvidia* user and reload the module. In an LXC guest, install the userspace driver that"
        " matches the host's kernel module.",
    ),
    NVML_ERROR_GPU_IS_LOST: (
        _reasons.GPU_LOST,
        "the GPU has fallen off the bus or is otherwise inaccessible (NVML_ERROR_GPU_IS_LOST, often Xid 79)."
        " Killing processes cannot fix this: drain the node and reboot or power-cycle it.",
    ),
    NVML_ERROR_NO_PERMISSION: (
        _reasons.NO_PERMISSION,
        "NVML refused the query (NVML_ERROR_NO_PERMISSION). Run the task with become: true.",
    ),
    NVML_ERROR_NOT_SUPPORTED: (_reasons.NOT_SUPPORTED, "the driver does not support this query on this GPU (NVML_ERROR_NOT_SUPPORTED)."),
    NVML_ERROR_TIMEOUT: (_reasons.TIMEOUT, "the driver timed out answering (NVML_ERROR_TIMEOUT); the GPU may be hung or busy resetting."),
    NVML_ERROR_RESET_REQUIRED: (_reasons.NEEDS_RESET, "the GPU requires a reset (NVML_ERROR_RESET_REQUIRED)."),
}


class NvmlError(CleanSlateError):
    """An NVML failure with a diagnosis (``reason``) and advice in ``msg``."""

    def __init__(self, code: int, call: str = "", gpu: int | None = None) -> None:
        reason, advice = _BY_CODE.get(code, (_reasons.NVML_ERROR, f"NVML call failed with code {code} ({error_string(code)})."))
        where = f" (GPU {gpu})" if gpu is not None else ""
        prefix = f"{call}{where}: " if call else ""
        super().__init__(f"{prefix}{advice}", reason=reason, nvml_code=code)
        self.code = code
        self.gpu = gpu


def error_string(code: int) -> str:
    """A short human name for an NVML return code, without needing the library."""
    if HAS_PYNVML:
        text = pynvml.NVMLError._errcode_to_string.get(code)
        if text:
            return str(text)
    return f"NVML error {code}"


def _code_of(exc: BaseException) -> int:
    value = getattr(exc, "value", None)
    return int(value) if isinstance(value, int) else -1


class _ProcessInfoV1(ctypes.Structure):
    # nvmlProcessInfo_v1_t: what drivers before R470 return from the unversioned entry points.
    _fields_ = [("pid", ctypes.c_uint), ("usedGpuMemory", ctypes.c_ulonglong)]


class _ProcessInfoV2(ctypes.Structure):
    # nvmlProcessInfo_v2_t, also the struct the _v3 entry points fill (nvml.h).
    _fields_ = [
        ("pid", ctypes.c_uint),
        ("usedGpuMemory", ctypes.c_ulonglong),
        ("gpuInstanceId", ctypes.c_uint),
        ("computeInstanceId", ctypes.c_uint),
    ]


_PROCESS_APIS: tuple[tuple[str, type[ctypes.Structure]], ...] = (
    ("_v3", _ProcessInfoV2),
    ("_v2", _ProcessInfoV2),
    ("", _ProcessInfoV1),
)
_PROCESS_KINDS = (
    ("compute", "nvmlDeviceGetComputeRunningProcesses"),
    ("graphics", "nvmlDeviceGetGraphicsRunningProcesses"),
    ("mps", "nvmlDeviceGetMPSComputeRunningProcesses"),
)


@dataclass
class Memory:
    """Device memory in MiB with v2 semantics: ``used`` excludes ``reserved``."""

    total_mib: int
    used_mib: int
    reserved_mib: int | None
    free_mib: int
    api: str  # "v2", or "v1" when the driver lacks v2 (used is then v1 used, reserved included)


@dataclass
class GpuProcess:
    """One process NVML lists on a GPU (pid as NVML reports it, in the caller's namespace)."""

    pid: int
    used_mib: int | None  # None: NVML_VALUE_NOT_AVAILABLE (MIG, WDDM)
    kinds: list[str] = field(default_factory=list)


@dataclass
class Gpu:
    """Identity of one GPU; ``error`` is set when even its handle could not be obtained."""

    index: int
    handle: t.Any = None
    uuid: str | None = None
    name: str | None = None
    pci_bus_id: str | None = None
    minor: int | None = None
    error: NvmlError | None = None


def _text(value: t.Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


class NvmlSession:
    """An initialised NVML library; use as a context manager.

    Holds no state beyond the probe results, so one session serves a whole
    polling loop (``nvmlInit`` costs about 13 ms on real hardware; a query of
    memory and processes about 0.07 ms per GPU).
    """

    def __init__(self) -> None:
        self._process_api: dict[str, tuple[str, type[ctypes.Structure]] | None] = {}
        self._memory_v2: bool | None = None
        self._open = False

    def __enter__(self) -> NvmlSession:
        self.open()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def open(self) -> None:
        """Initialise NVML, turning every failure into an :class:`NvmlError`."""
        if not HAS_PYNVML:
            raise CleanSlateError(
                "nvidia-ml-py (import name pynvml) is not installed for the Python that runs this module;"
                " install it on the target (pip install nvidia-ml-py) or set clean_slate_install_dependencies.",
                reason=_reasons.MISSING_LIBRARY,
            )
        if not hasattr(pynvml, "nvmlDeviceGetMemoryInfo") or not hasattr(pynvml, "_nvmlGetFunctionPointer"):
            raise CleanSlateError(
                "the installed 'pynvml' module is not NVIDIA's nvidia-ml-py (a different package shadows it);"
                " pip uninstall pynvml && pip install nvidia-ml-py.",
                reason=_reasons.MISSING_LIBRARY,
            )
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as exc:
            raise NvmlError(_code_of(exc), "nvmlInit") from None
        self._open = True

    def close(self) -> None:
        """Shut NVML down (it closes the device files it opened)."""
        if self._open:
            self._open = False
            try:
                pynvml.nvmlShutdown()
            except pynvml.NVMLError:
                pass

    # ------------------------------------------------------------------ system
    def driver_version(self) -> str | None:
        """The kernel driver version string, or None when the driver will not say."""
        try:
            return _text(pynvml.nvmlSystemGetDriverVersion())
        except pynvml.NVMLError:
            return None

    def device_count(self) -> int:
        """Number of GPUs the driver reports (lost GPUs included)."""
        try:
            return int(pynvml.nvmlDeviceGetCount())
        except pynvml.NVMLError as exc:
            raise NvmlError(_code_of(exc), "nvmlDeviceGetCount") from None

    def gpus(self, skip: t.Mapping[int, CleanSlateError] | None = None, on_gpu: t.Callable[[int], None] | None = None) -> list[Gpu]:
        """Every GPU with its identity; a GPU whose handle fails carries ``error``.

        ``skip`` maps GPUs not to touch at all (their calls hung before) to the error they carry;
        ``on_gpu(index)`` is told before each GPU's calls (the helper process of _probe announces it).
        """
        result = []
        for index in range(self.device_count()):
            gpu = Gpu(index=index)
            if skip and index in skip:
                gpu.error = t.cast(NvmlError, skip[index])
                result.append(gpu)
                continue
            if on_gpu is not None:
                on_gpu(index)
            try:
                gpu.handle = pynvml.nvmlDeviceGetHandleByIndex(index)
                gpu.uuid = _text(pynvml.nvmlDeviceGetUUID(gpu.handle))
                gpu.name = _text(pynvml.nvmlDeviceGetName(gpu.handle))
                gpu.pci_bus_id = _text(pynvml.nvmlDeviceGetPciInfo(gpu.handle).busId)
                gpu.minor = int(pynvml.nvmlDeviceGetMinorNumber(gpu.handle))
            except pynvml.NVMLError as exc:
                gpu.error = NvmlError(_code_of(exc), "reading the GPU's identity", gpu=index)
            result.append(gpu)
        return result

    # ------------------------------------------------------------------ memory
    def memory(self, gpu: Gpu) -> Memory:
        """Memory with v2 semantics; on drivers without v2, raw v1 values (``api='v1'``)."""
        if self._memory_v2 is not False:
            try:
                mem = pynvml.nvmlDeviceGetMemoryInfo(gpu.handle, version=pynvml.nvmlMemory_v2)
                self._memory_v2 = True
                return Memory(
                    total_mib=_mib(mem.total),
                    used_mib=_mib(mem.used),
                    reserved_mib=_mib(mem.reserved),
                    free_mib=_mib(mem.free),
                    api="v2",
                )
            except pynvml.NVMLError as exc:
                if _code_of(exc) not in _FALLBACK_CODES or self._memory_v2:
                    raise NvmlError(_code_of(exc), "nvmlDeviceGetMemoryInfo_v2", gpu=gpu.index) from None
                self._memory_v2 = False
        try:
            mem = pynvml.nvmlDeviceGetMemoryInfo(gpu.handle)
        except pynvml.NVMLError as exc:
            raise NvmlError(_code_of(exc), "nvmlDeviceGetMemoryInfo", gpu=gpu.index) from None
        return Memory(total_mib=_mib(mem.total), used_mib=_mib(mem.used), reserved_mib=None, free_mib=_mib(mem.free), api="v1")

    # --------------------------------------------------------------- processes
    def processes(self, gpu: Gpu) -> list[GpuProcess]:
        """Compute, graphics and MPS processes merged by pid (memory summed per list, max across lists)."""
        merged: dict[int, GpuProcess] = {}
        for kind, base in _PROCESS_KINDS:
            for pid, used in self._process_list(kind, base, gpu):
                proc = merged.setdefault(pid, GpuProcess(pid=pid, used_mib=used, kinds=[]))
                if kind not in proc.kinds:
                    proc.kinds.append(kind)
                if used is not None and (proc.used_mib is None or used > proc.used_mib):
                    proc.used_mib = used
        return list(merged.values())

    def _process_list(self, kind: str, base: str, gpu: Gpu) -> list[tuple[int, int | None]]:
        chosen = self._process_api.get(kind, ())
        apis = _PROCESS_APIS if chosen == () else ((chosen,) if chosen else ())
        for suffix, struct in apis:
            try:
                entries = _call_process_api(base + suffix, struct, gpu.handle)
            except pynvml.NVMLError as exc:
                code = _code_of(exc)
                if code in _FALLBACK_CODES and kind not in self._process_api:
                    continue
                if code == NVML_ERROR_NOT_SUPPORTED and kind != "compute":
                    # Graphics and MPS lists are optional: datacenter GPUs may not offer them.
                    return []
                raise NvmlError(code, base + suffix, gpu=gpu.index) from None
            self._process_api[kind] = (suffix, struct)
            return entries
        if kind not in self._process_api:
            self._process_api[kind] = None
        if kind == "compute":
            raise NvmlError(NVML_ERROR_NOT_SUPPORTED, base, gpu=gpu.index)
        return []

    # ---------------------------------------------------------------- recovery
    def recovery_action(self, gpu: Gpu) -> int | None:
        """NVML_FI_DEV_GET_GPU_RECOVERY_ACTION (field 230), or None where the driver lacks it."""
        try:
            values = pynvml.nvmlDeviceGetFieldValues(gpu.handle, [FIELD_RECOVERY_ACTION])
        except pynvml.NVMLError as exc:
            if _code_of(exc) in (NVML_ERROR_GPU_IS_LOST, NVML_ERROR_TIMEOUT):
                raise NvmlError(_code_of(exc), "nvmlDeviceGetFieldValues", gpu=gpu.index) from None
            return None
        value = values[0]
        if value.nvmlReturn != NVML_SUCCESS:
            return None
        return int(value.value.uiVal)


def _call_process_api(name: str, struct: type[ctypes.Structure], handle: t.Any) -> list[tuple[int, int | None]]:
    """Call one ``nvmlDevice*RunningProcesses*`` entry point with the count protocol."""
    fn = pynvml._nvmlGetFunctionPointer(name)
    count = ctypes.c_uint(0)
    ret = fn(handle, ctypes.byref(count), None)
    if ret == NVML_SUCCESS:
        return []
    # Processes can appear between the two calls, so oversize and retry like nvidia-smi does.
    for _attempt in range(3):
        if ret != NVML_ERROR_INSUFFICIENT_SIZE:
            raise pynvml.NVMLError(ret)
        size = count.value * 2 + 5
        array = (struct * size)()
        count = ctypes.c_uint(size)
        ret = fn(handle, ctypes.byref(count), array)
        if ret == NVML_SUCCESS:
            entries = []
            for i in range(min(count.value, size)):
                used = int(array[i].usedGpuMemory)
                entries.append((int(array[i].pid), None if used == VALUE_NOT_AVAILABLE else _mib(used)))
            return entries
    raise pynvml.NVMLError(ret)


def _mib(value: int) -> int:
    # Round to the nearest MiB, as nvidia-smi prints it.
    return int((int(value) + MIB // 2) // MIB)


def recovery_action_name(code: int | None) -> str | None:
    """``gpu_reset`` for 1 and so on; None stays None."""
    if code is None:
        return None
    return RECOVERY_ACTIONS.get(code, f"unknown_{code}")


def parse_gpu_selectors(values: t.Sequence[t.Any] | None, option: str = "gpus") -> list[int | str]:
    """Validate the ``gpus`` option: integers (indices), GPU/MIG UUIDs, or device paths (``/dev/nvidia3``, by minor).

    Raises :class:`CleanSlateError` naming the option for anything else, before
    anything touches the GPUs.
    """
    selectors: list[int | str] = []
    for value in values or []:
        text = str(value).strip()
        if re.fullmatch(r"\d+", text):
            selectors.append(int(text))
        elif UUID_RE.match(text) or DEVICE_RE.match(text):
            selectors.append(text)
        elif re.fullmatch(r"-\d+", text):
            raise CleanSlateError(
                f"{option}: GPU index {text} is negative; use indices from 0 (nvidia-smi -L lists them).", reason=_reasons.BAD_ARGUMENTS, option=option
            )
        else:
            raise CleanSlateError(
                f"{option}: {text!r} is neither a GPU index, a GPU UUID nor a device path; use an index such as 0, a UUID of the"
                " form GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx (nvidia-smi -L lists both) or a path such as /dev/nvidia0.",
                reason=_reasons.BAD_ARGUMENTS,
                option=option,
            )
    return selectors


def select_gpus(gpus: list[Gpu], selectors: list[int | str], option: str = "gpus") -> list[Gpu]:
    """The GPUs named by ``selectors`` (all when empty), in index order; unknown ones are an error."""
    if not selectors:
        return list(gpus)
    by_index = {g.index: g for g in gpus}
    by_uuid = {g.uuid.lower(): g for g in gpus if g.uuid}
    by_minor = {g.minor: g for g in gpus if g.minor is not None}
    chosen: dict[int, Gpu] = {}
    for sel in selectors:
        device = DEVICE_RE.match(sel) if isinstance(sel, str) else None
        if device:
            gpu = by_minor.get(int(device.group(1)))
            if gpu is None:
                raise CleanSlateError(
                    f"{option}: no GPU on this host has the device file {sel} (minor {device.group(1)}).", reason=_reasons.BAD_ARGUMENTS, option=option
                )
        elif isinstance(sel, int):
            gpu = by_index.get(sel)
            if gpu is None:
                span = f"0-{len(gpus) - 1}" if gpus else "none"
                raise CleanSlateError(
                    f"{option}: GPU index {sel} does not exist; this host has {len(gpus)} GPU(s) (indices {span}).",
                    reason=_reasons.BAD_ARGUMENTS,
                    option=option,
                )
        else:
            gpu = by_uuid.get(sel.lower())
            if gpu is None:
                raise CleanSlateError(
                    f"{option}: no GPU on this host has UUID {sel}; nvidia-smi -L lists the UUIDs.", reason=_reasons.BAD_ARGUMENTS, option=option
                )
        chosen[gpu.index] = gpu
    return [chosen[i] for i in sorted(chosen)]


def device_file_gpus(device_dir: str) -> list[Gpu]:
    """GPUs known only from their device files (index = minor), for when NVML is unavailable."""
    try:
        names = os.listdir(device_dir)
    except OSError:
        names = []
    minors = sorted(int(m.group(1)) for m in (re.match(r"^nvidia(\d+)$", n) for n in names) if m)
    return [Gpu(index=m, minor=m) for m in minors]


def device_files_problem(device_dir: str) -> str | None:
    """Why the GPUs' device files cannot serve to find their holders, or None when they can."""
    try:
        names = os.listdir(device_dir)
    except OSError as exc:
        return f"{device_dir} cannot be listed ({exc.strerror or exc})"
    if not any(re.match(r"^nvidia\d+$", n) for n in names):
        return f"{device_dir} holds no GPU device file (nvidia0, nvidia1, ...): the driver is not loaded, or the GPUs are not passed through"
    return None


@dataclass
class GpuFacts:
    """What NVML (or, without it, the device files) says about the GPUs, for discovery."""

    every: list[Gpu]
    selected: list[Gpu]
    processes: dict[int, list[GpuProcess]]  # GPU index -> processes NVML lists, every GPU
    nvml_problem: str | None = None  # why NVML could not be used; None when it answered


def gpus_and_processes(selectors: list[int | str], want_processes: bool, device_dir: str, notes: list[str], prober: t.Any = None) -> GpuFacts:
    """Every GPU, the selected ones, and the processes NVML lists on each GPU (all of them,
    so that a process can be told to use GPU 0 only although it holds every device file).

    Without a working driver the device files still tell which processes hold
    a GPU (ending them is the first step of recovering from a driver/library
    mismatch), so only choosing a subset of GPUs strictly needs NVML.

    ``prober`` (a ``_probe.Prober``) makes the calls in its helper process under its deadline, so a
    hung driver costs the caller a GPU's listing, not the run; without one they are made here.
    """
    if not HAS_PYNVML and not selectors:
        problem = "nvidia-ml-py is not installed for the Python that runs the module"
        notes.append(f"{problem}: processes are found through device files and patterns only.")
        found = device_file_gpus(device_dir)
        return GpuFacts(found, found, {}, problem)
    try:
        if prober is not None:
            return _listed(
                prober.start(), selectors, want_processes, notes, lambda gpus: [(a.value, a.error) for a in prober.each(NvmlSession.processes, gpus)]
            )
        with NvmlSession() as session:
            return _listed(session.gpus(), selectors, want_processes, notes, lambda gpus: [_in_process(session, g) for g in gpus])
    except CleanSlateError as exc:
        if selectors or exc.reason == _reasons.BAD_ARGUMENTS:
            if exc.reason == _reasons.BAD_ARGUMENTS:
                raise
            raise CleanSlateError(f"gpus: selecting GPUs needs NVML, which failed: {exc.msg}", reason=exc.reason) from None
        notes.append(f"NVML unavailable ({exc.msg}); processes are found through device files and patterns only, and GPU indices are device minors.")
        found = device_file_gpus(device_dir)
        return GpuFacts(found, found, {}, exc.msg)


def _in_process(session: NvmlSession, gpu: Gpu) -> tuple[list[GpuProcess] | None, BaseException | None]:
    try:
        return session.processes(gpu), None
    except NvmlError as exc:
        return None, exc


def _listed(
    every: list[Gpu],
    selectors: list[int | str],
    want_processes: bool,
    notes: list[str],
    list_processes: t.Callable[[list[Gpu]], list[tuple[list[GpuProcess] | None, BaseException | None]]],
) -> GpuFacts:
    gpus = select_gpus(every, selectors)
    processes: dict[int, list[GpuProcess]] = {}
    for gpu in every:
        if gpu.error is not None and gpu in gpus:
            notes.append(f"GPU {gpu.index}: {gpu.error.msg}")
    listable = [g for g in every if g.error is None]
    if want_processes:
        for gpu, (procs, error) in zip(listable, list_processes(listable)):
            if error is None:
                processes[gpu.index] = t.cast(t.List[GpuProcess], procs)
            elif gpu in gpus:
                notes.append(f"GPU {gpu.index}: NVML process list unavailable ({getattr(error, 'msg', error)}); using device files.")
    return GpuFacts(every, gpus, processes)
