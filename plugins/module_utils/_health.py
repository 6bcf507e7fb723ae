# Copyright (c) 2026, gpuops.clean_slate maintainers
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# Note: this module_util is PRIVATE to the collection; it may change without notice.

"""A health verdict per GPU: free memory is not a healthy GPU.

After a crash the next job can land on a GPU that needs a reset, a reboot or an
RMA, or on one the last job left in exclusive compute mode with an MPS daemon
running. Three kinds of evidence are read, all cheap (tens of microseconds per
GPU from NVML; one read of the kernel log per run):

* :func:`read_gpu`: the NVML readings of one GPU (recovery action, row remaps,
  retired pages, volatile ECC, fabric state, compute/MIG/persistence modes),
  ``None`` where the GPU or driver does not support one: never guessed. It is a
  plain function of a device handle so that it runs wherever the per-GPU
  snapshot is taken (inside the deadline helper of the hang-proof probes);
* :func:`read_xids`: Xid lines from the kernel log (``/dev/kmsg``, else
  ``journalctl -k``), since a given time, each mapped to the resolution bucket
  of NVIDIA's Xid catalog;
* :func:`host_findings`: an MPS control daemon left behind, and whether
  ``nvidia-fabricmanager`` runs where the GPUs have a fabric to bring up.

:func:`judge_gpu` and :func:`judge_host` turn them into a verdict, pure and
unit-tested: ``ok < restart_app < reset_gpu < reboot < drain``, each finding with
a sentence of evidence saying what to do.
"""

from __future__ import annotations

import collections
import ctypes
import datetime
import errno
import math
import os
import re
import shutil
import stat
import time
import typing as t

from ansible_collections.gpuops.clean_slate.plugins.module_utils import _nvml, _reasons, _xids

try:
    import pynvml

    HAS_PYNVML = True
except ImportError:  # pragma: no cover - depends on the target host
    HAS_PYNVML = False

# ---------------------------------------------------------------------- verdicts
OK = "ok"
RESTART_APP = "restart_app"
RESET_GPU = "reset_gpu"
REBOOT = "reboot"
DRAIN = "drain"
#: Worst last: the host's verdict is the worst of its GPUs' and its own findings.
VERDICTS = (OK, RESTART_APP, RESET_GPU, REBOOT, DRAIN)
#: ``fail_on`` also accepts this: report, never fail.
NEVER = "never"
FAIL_ON_CHOICES = (*VERDICTS, NEVER)

ADVICE = {
    RESTART_APP: "the GPU works; restart the application (or restore the settings the last job left with gpuops.clean_slate.gpu_mode_restore).",
    RESET_GPU: (
        "drain the GPU and reset it before the next job: stop its management daemons (nvidia-persistenced, nv-hostengine,"
        " dcgm-exporter, and on NVSwitch systems nvidia-fabricmanager) and run nvidia-smi -r -i <index>, or reboot the node."
    ),
    REBOOT: "drain the node and reboot it (a GPU reset cannot recover this).",
    DRAIN: "drain the node and keep it out of service: the GPU needs NVIDIA's field diagnosis (and likely an RMA), or its peers' P2P traffic must stop first.",
}


def rank(verdict: str) -> int:
    """The verdict's place in ``VERDICTS`` (``never`` ranks above every verdict)."""
    return len(VERDICTS) if verdict == NEVER else VERDICTS.index(verdict)


def worst(verdicts: t.Iterable[str]) -> str:
    """The worst of ``verdicts`` (``ok`` for none)."""
    out = OK
    for v in verdicts:
        if rank(v) > rank(out):
            out = v
    return out


def fails(verdict: str, fail_on: str) -> bool:
    """Whether ``verdict`` fails a host with threshold ``fail_on``: a finding (any verdict but ``ok``) at or above it.

    A healthy GPU never fails, so ``fail_on: ok`` fails on any finding, as ``restart_app`` does; ``never`` never fails.
    """
    return verdict != OK and fail_on != NEVER and rank(verdict) >= rank(fail_on)


# ---------------------------------------------------------------------- Xid catalog
#: The verdict of each bucket of the Xid catalog (the table itself: :mod:`._xids`).
BUCKET_VERDICTS = {
    _xids.IGNORE: OK,
    _xids.RESTART_APP: RESTART_APP,
    _xids.RESET_GPU: RESET_GPU,
    _xids.RESTART_BM: REBOOT,
    _xids.CONTACT_SUPPORT: DRAIN,
    _xids.CHECK_MECHANICALS: DRAIN,
    _xids.DRAIN_P2P: DRAIN,
    _xids.UNKNOWN: RESET_GPU,
}

# Xid 154: "GPU recovery action changed from 0x0 (None) to 0x1 (GPU Reset Required)".
_XID154_TO = re.compile(r"to\s+0x([0-9a-fA-F]+)")
# NVML's recovery actions (nvmlDeviceGpuRecoveryAction_t) and the verdict each one means.
RECOVERY_VERDICTS = {
    "none": OK,
    "gpu_reset": RESET_GPU,
    "node_reboot": REBOOT,
    "drain_p2p": DRAIN,
    "drain_and_reset": DRAIN,
    "recover_imex_domain": RESET_GPU,
    "bus_reset": RESET_GPU,
    "system_reboot": REBOOT,
}
# NVML's recovery action codes by name: one table, _nvml's (the verify module reads the same field).
RECOVERY_NAMES = _nvml.RECOVERY_ACTIONS


def xid_bucket(xid: int, text: str = "") -> str:
    """The catalog's resolution bucket of an Xid (``UNKNOWN`` for one the table does not list)."""
    if xid == 154:
        m = _XID154_TO.search(text)
        name = RECOVERY_NAMES.get(int(m.group(1), 16)) if m else None
        return _xids.XID154_BUCKETS.get(name or "", _xids.RESET_GPU)
    entry = _xids.XIDS.get(xid)
    return entry.bucket if entry is not None else _xids.UNKNOWN


# ---------------------------------------------------------------------- the kernel log
# "NVRM: Xid (PCI:0000:18:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus."
XID_RE = re.compile(r"NVRM: Xid \(PCI:([0-9a-fA-F]+):([0-9a-fA-F]+):([0-9a-fA-F]+)(?:\.[0-9a-fA-F]+)?\): (\d+),")
KMSG = "/dev/kmsg"


def bus_key(pci_bus_id: str | None) -> tuple[int, int, int] | None:
    """(domain, bus, device) of ``00000000:18:00.0`` (NVML) or ``0000:18:00`` (an Xid line)."""
    if not pci_bus_id:
        return None
    m = re.match(r"^([0-9a-fA-F]+):([0-9a-fA-F]+):([0-9a-fA-F]+)", pci_bus_id)
    return (int(m.group(1), 16), int(m.group(2), 16), int(m.group(3), 16)) if m else None


def boot_epoch() -> float:
    """The wall-clock time of the kernel's clock zero: /dev/kmsg stamps records in microseconds of
    CLOCK_MONOTONIC (printk's clock), so epoch = boot_epoch() + stamp."""
    return time.time() - time.clock_gettime(time.CLOCK_MONOTONIC)


def parse_kmsg(data: bytes, boot: float, needle: bytes | None = b"NVRM: Xid") -> list[tuple[float, str]]:
    """(epoch time, message) of each /dev/kmsg record in ``data``: ``prio,seq,usec,flags[,...];message``.

    Only records holding ``needle`` are decoded, found with a byte search (a busy ring buffer holds thousands
    of other lines; splitting them all costs ten times more); ``None`` decodes every record.
    Continuation lines (`` KEY=value`` dictionary entries) are skipped.
    """
    if needle is None:
        lines = data.split(b"\n")
    else:
        lines = []
        at = data.find(needle)
        while at >= 0:
            start = data.rfind(b"\n", 0, at) + 1
            end = data.find(b"\n", at)
            end = len(data) if end < 0 else end
            lines.append(data[start:end])
            at = data.find(needle, end)
    out = []
    for raw in lines:
        if not raw or raw[:1] == b" " or b";" not in raw:
            continue
        head, _sep, message = raw.partition(b";")
        fields = head.split(b",")
        try:
            stamp = int(fields[2]) / 1e6
        except (IndexError, ValueError):
            continue
        out.append((boot + stamp, message.decode("utf-8", "backslashreplace")))
    return out


#: The newest this many bytes of a kernel log file are read (a busy node's /var/log/kern.log grows past 50 MB).
MAX_LOG_BYTES = 16 * 1024 * 1024
#: /dev/kmsg is read record by record, from its oldest: at most this long.
KMSG_READ_S = 5.0
#: At most this many records holding the needle are kept (the newest).
MAX_RECORDS = 100000


class LogRead(t.NamedTuple):
    """What one read of a kernel log gave: the records that hold the needle, the bytes of older records not read,
    and whether the read reached the log's end."""

    data: bytes
    skipped_bytes: int
    complete: bool


def read_kmsg(
    path: str = KMSG, max_bytes: int = MAX_LOG_BYTES, needle: bytes = b"NVRM: Xid", max_s: float = KMSG_READ_S, clock: t.Callable[[], float] = time.monotonic
) -> LogRead | None:
    """The records of a kernel log that hold ``needle``, newest first in what is kept; None when it cannot be read.

    A regular file in /dev/kmsg's format (the simulator's kernel log, a saved copy) is read from its end: its last
    ``max_bytes`` (whole records), in one read; what is older is counted in ``skipped_bytes``. /dev/kmsg itself
    (a character device) answers one record per read(), from the oldest the ring buffer holds, EAGAIN at its end
    (non-blocking) and EPIPE for a record overwritten while reading (skip on); it is read to its end unless that
    takes longer than ``max_s`` (then ``complete`` is False). Either way only records holding ``needle`` are kept,
    at most ``MAX_RECORDS`` of them, so memory stays bounded whatever the log's size.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISCHR(st.st_mode):
            return _read_file_tail(fd, st.st_size, max_bytes, needle)
        return _read_records(fd, needle, max_s, clock)
    finally:
        os.close(fd)


def _read_file_tail(fd: int, size: int, max_bytes: int, needle: bytes) -> LogRead | None:
    start = max(0, size - max_bytes)
    try:
        os.lseek(fd, start, os.SEEK_SET)
        chunks = []
        left = size - start
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 22))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
    except OSError:
        return None
    data = b"".join(chunks)
    skipped = start
    if start > 0:
        # The read began inside a record: drop it, whole records only.
        cut = data.find(b"\n") + 1
        skipped += cut if cut else len(data)
        data = data[cut:] if cut else b""
    lines = [line for line in data.split(b"\n") if needle in line] if needle in data else []
    return LogRead(b"\n".join(lines[-MAX_RECORDS:]) + (b"\n" if lines else b""), skipped, True)


def _read_records(fd: int, needle: bytes, max_s: float, clock: t.Callable[[], float]) -> LogRead | None:
    kept: collections.deque[bytes] = collections.deque(maxlen=MAX_RECORDS)
    end = clock() + max_s
    complete = False
    reads = 0
    while True:
        reads += 1
        if reads % 1024 == 0 and clock() > end:
            break
        try:
            record = os.read(fd, 8192)
        except OSError as exc:
            if exc.errno == errno.EPIPE:
                continue
            if exc.errno in (errno.EAGAIN, errno.EWOULDBLOCK):
                complete = True
                break
            if not kept:
                return None
            break
        if not record:
            complete = True
            break
        if needle in record:
            kept.append(record if record.endswith(b"\n") else record + b"\n")
    return LogRead(b"".join(kept), 0, complete)


#: How a command is run: argv -> (rc, stdout, stderr); the module's ``run_command``.
Run = t.Callable[[t.List[str]], t.Tuple[int, str, str]]


def read_journal(since: float, run: Run | None) -> list[tuple[float, str]] | None:
    """Kernel messages since ``since`` from ``journalctl -k`` (where /dev/kmsg is not readable), or None."""
    journalctl = shutil.which("journalctl")
    if journalctl is None or run is None:
        return None
    rc, stdout, _stderr = run([journalctl, "-k", "-q", "--no-pager", "-o", "short-unix", "--since", f"@{max(0.0, since):.0f}"])
    if rc != 0:
        return None
    out = []
    for line in stdout.splitlines():
        stamp, _sep, rest = line.partition(" ")
        try:
            when = float(stamp)
        except ValueError:
            continue
        # "host kernel: NVRM: Xid ...": the message follows "kernel: ".
        out.append((when, rest.split("kernel: ", 1)[-1]))
    return out


def xid_events(messages: t.Iterable[tuple[float, str]], since: float) -> list[dict[str, t.Any]]:
    """The Xid events among ``messages`` at or after ``since``: ``{xid, time, bucket, line, bus}``."""
    out = []
    for when, message in messages:
        if when < since:
            continue
        m = XID_RE.search(message)
        if not m:
            continue
        xid = int(m.group(4))
        out.append(
            {
                "xid": xid,
                "time": round(when, 6),
                "bucket": xid_bucket(xid, message),
                "line": message.strip(),
                "bus": (int(m.group(1), 16), int(m.group(2), 16), int(m.group(3), 16)),
            }
        )
    return out


class Xids(t.NamedTuple):
    """The Xid events since a time, where they were read, and how much of the log was read."""

    source: str  # kmsg, journalctl or unreadable
    events: list[dict[str, t.Any]]
    log: dict[str, t.Any]  # {complete, skipped_bytes, read_from}: read_from is the time of the oldest record read


def read_xids(since: float, kernel_log: str = KMSG, run: Run | None = None) -> Xids:
    """The Xid events since ``since``: from ``kernel_log`` (``kmsg``), else ``journalctl -k`` (run with ``run``), else none (``unreadable``).

    ``log`` tells when older records of a large file were not read (``skipped_bytes``, and ``read_from``, the time of
    the oldest record that was) and when /dev/kmsg could not be read to its end in time (``complete`` False).
    """
    read = read_kmsg(kernel_log)
    if read is not None:
        boot = boot_epoch()
        messages = parse_kmsg(read.data, boot)
        read_from = None
        if read.skipped_bytes:
            read_from = _first_stamp(kernel_log, read.skipped_bytes, boot)
        log = {"complete": read.complete, "skipped_bytes": read.skipped_bytes, "read_from": read_from}
        return Xids("kmsg", xid_events(messages, since), log)
    journal = read_journal(since, run)
    if journal is not None:
        return Xids("journalctl", xid_events(journal, since), {"complete": True, "skipped_bytes": 0, "read_from": None})
    return Xids("unreadable", [], {"complete": False, "skipped_bytes": 0, "read_from": None})


def _first_stamp(path: str, offset: int, boot: float) -> float | None:
    """The time of the record at ``offset`` of a kmsg-format file (the oldest one read)."""
    try:
        with open(path, "rb") as fh:
            fh.seek(offset)
            line = fh.readline(65536)
    except OSError:
        return None
    parsed = parse_kmsg(line, boot, None)
    return round(parsed[0][0], 6) if parsed else None


def unread_note(log: t.Mapping[str, t.Any], since: float, kernel_log: str) -> str | None:
    """A sentence for the result when part of the kernel log that may hold Xids since ``since`` was not read, else None."""
    if not log.get("complete", True):
        return (
            f"The kernel log ({kernel_log}) could not be read to its end within {KMSG_READ_S:.0f} s: its newest records, where Xid errors"
            " of the last job would be, were not read; the health verdict does not cover them."
        )
    if log.get("skipped_bytes"):
        read_from = log.get("read_from")
        covered = read_from is not None and read_from <= since
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(read_from)) if read_from is not None else "an unknown time"
        return (
            f"The kernel log ({kernel_log}) is larger than {MAX_LOG_BYTES // (1024 * 1024)} MiB: only its newest records were read"
            f" (from {when} on), {log['skipped_bytes']} bytes of older records were not"
            + ("; they are all older than since." if covered else "; Xid errors logged between since and then were not seen.")
        )
    return None


def parse_since(value: t.Any, default: float) -> float | None:
    """``since`` as epoch seconds: a number, an ISO 8601 time (naive = local time), or ``default`` when empty; None when unreadable."""
    if value is None or (isinstance(value, str) and not value.strip()):
        return default
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        # nan would count every Xid (no comparison with it is true) and inf none: neither is a time.
        return float(value) if math.isfinite(value) else None
    text = str(value).strip()
    try:
        number = float(text)
    except ValueError:
        pass
    else:
        return number if math.isfinite(number) else None
    try:
        parsed = datetime.datetime.fromisoformat(text.replace("Z", "+00:00").replace(" ", "T", 1))
    except ValueError:
        return None
    return parsed.timestamp()


# ---------------------------------------------------------------------- NVML readings
READING_KEYS = (
    "recovery_action",
    "xid",
    "remapped_rows",
    "retired_pages",
    "ecc_volatile_uncorrected",
    "fabric",
    "compute_mode",
    "mig_mode",
    "persistence_mode",
)
COMPUTE_MODES = {0: "default", 1: "exclusive_thread", 2: "prohibited", 3: "exclusive_process"}
FABRIC_STATES = {0: "not_supported", 1: "not_started", 2: "in_progress", 3: "completed"}
_FIELD_RECOVERY_ACTION = 230
_NVML_ERROR_FUNCTION_NOT_FOUND = 13
_NVML_ERROR_ARGUMENT_VERSION_MISMATCH = 25


class _FabricV2(ctypes.Structure):
    # nvmlGpuFabricInfo_v2_t (nvml.h), what nvmlDeviceGetGpuFabricInfoV fills with version 2.
    _fields_ = [
        ("version", ctypes.c_uint),
        ("clusterUuid", ctypes.c_uint8 * 16),
        ("status", ctypes.c_uint),
        ("cliqueId", ctypes.c_uint32),
        ("state", ctypes.c_uint8),
        ("healthMask", ctypes.c_uint32),
    ]


class _FabricV1(ctypes.Structure):
    # nvmlGpuFabricInfo_t: the unversioned call of drivers before R550.
    _fields_ = [("clusterUuid", ctypes.c_uint8 * 16), ("status", ctypes.c_uint), ("cliqueId", ctypes.c_uint32), ("state", ctypes.c_uint8)]


def _code(exc: BaseException) -> int:
    value = getattr(exc, "value", None)
    return int(value) if isinstance(value, int) else -1


def _fabric(handle: t.Any) -> dict[str, t.Any] | None:
    """The GPU's fabric state, versioned call first; None where the GPU or driver has none."""
    info: ctypes.Structure = _FabricV2()
    try:
        fn = pynvml._nvmlGetFunctionPointer("nvmlDeviceGetGpuFabricInfoV")
        info.version = ctypes.sizeof(_FabricV2) | (2 << 24)
        ret = fn(handle, ctypes.byref(info))
    except pynvml.NVMLError as exc:  # the entry point is not in this library
        ret = _code(exc)
    if ret in (_NVML_ERROR_FUNCTION_NOT_FOUND, _NVML_ERROR_ARGUMENT_VERSION_MISMATCH):
        info = _FabricV1()
        try:
            fn = pynvml._nvmlGetFunctionPointer("nvmlDeviceGetGpuFabricInfo")
            ret = fn(handle, ctypes.byref(info))
        except pynvml.NVMLError as exc:
            ret = _code(exc)
    if ret != 0:
        return None
    return {"state": FABRIC_STATES.get(int(info.state), f"unknown_{int(info.state)}"), "status": int(info.status)}


def read_gpu(handle: t.Any) -> dict[str, t.Any]:
    """The NVML health readings of one GPU: every key of ``READING_KEYS`` (``xid`` is filled by the
    caller from the kernel log), ``None`` for what the GPU or driver does not answer.

    One plain function of a handle, so that it can run wherever NVML is called (for example in the
    helper process that bounds a call that may hang); it never raises an NVML error.
    """
    out: dict[str, t.Any] = dict.fromkeys(READING_KEYS)

    def ask(fn: t.Callable[[], t.Any]) -> t.Any:
        try:
            return fn()
        except pynvml.NVMLError:
            return None

    values = ask(lambda: pynvml.nvmlDeviceGetFieldValues(handle, [_FIELD_RECOVERY_ACTION]))
    if values and values[0].nvmlReturn == 0:
        code = int(values[0].value.uiVal)
        out["recovery_action"] = RECOVERY_NAMES.get(code, f"unknown_{code}")
    rows = ask(lambda: pynvml.nvmlDeviceGetRemappedRows(handle))
    if rows is not None:
        out["remapped_rows"] = {"correctable": int(rows[0]), "uncorrectable": int(rows[1]), "pending": bool(rows[2]), "failure": bool(rows[3])}
    pending = ask(lambda: pynvml.nvmlDeviceGetRetiredPagesPendingStatus(handle))
    if pending is not None:
        sbe = ask(lambda: pynvml.nvmlDeviceGetRetiredPages(handle, pynvml.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS))
        dbe = ask(lambda: pynvml.nvmlDeviceGetRetiredPages(handle, pynvml.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR))
        out["retired_pages"] = {"pending": bool(pending), "single_bit": None if sbe is None else len(sbe), "double_bit": None if dbe is None else len(dbe)}
    ecc = ask(lambda: pynvml.nvmlDeviceGetTotalEccErrors(handle, pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, pynvml.NVML_VOLATILE_ECC))
    if ecc is not None:
        out["ecc_volatile_uncorrected"] = int(ecc)
    out["fabric"] = _fabric(handle)
    mode = ask(lambda: pynvml.nvmlDeviceGetComputeMode(handle))
    if mode is not None:
        out["compute_mode"] = COMPUTE_MODES.get(int(mode), f"unknown_{int(mode)}")
    mig = ask(lambda: pynvml.nvmlDeviceGetMigMode(handle))
    if mig is not None:
        out["mig_mode"] = {"current": bool(mig[0]), "pending": bool(mig[1])}
    persistence = ask(lambda: pynvml.nvmlDeviceGetPersistenceMode(handle))
    if persistence is not None:
        out["persistence_mode"] = bool(persistence)
    return out


# ---------------------------------------------------------------------- host findings
MPS_NAMES = ("nvidia-cuda-mps-control", "nvidia-cuda-mps-server")
FABRICMANAGER_NAMES = ("nv-fabricmanager", "nvidia-fabricmanager")


def _exe_names(pid: int) -> set[str]:
    """What a process calls itself: comm, argv[0]'s and the executable's base names."""
    names = set()
    try:
        with open(f"/proc/{pid}/comm", encoding="utf-8", errors="backslashreplace") as fh:
            names.add(fh.read().strip())
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            argv0 = fh.read().split(b"\0", 1)[0].decode("utf-8", "backslashreplace")
        names.add(os.path.basename(argv0))
    except OSError:
        return names
    try:
        names.add(os.path.basename(os.readlink(f"/proc/{pid}/exe")))
    except OSError:
        pass
    return names


def find_processes(wanted: t.Sequence[str]) -> dict[str, list[int]]:
    """Pids of the processes whose executable or argv[0] is one of ``wanted`` (comm is cut at 15 characters, so it only preselects)."""
    found: dict[str, list[int]] = {name: [] for name in wanted}
    short = {name[:15]: name for name in wanted}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        pid = int(entry)
        try:
            with open(f"/proc/{pid}/comm", encoding="utf-8", errors="backslashreplace") as fh:
                comm = fh.read().strip()
        except OSError:
            continue
        if comm not in short:
            continue
        names = _exe_names(pid)
        for name in wanted:
            if name in names:
                found[name].append(pid)
                break
    return found


def host_findings(fabric_present: bool) -> dict[str, t.Any]:
    """``mps_daemon`` (pids of MPS control daemons and servers) and ``fabricmanager`` (running, not_running, not_needed)."""
    found = find_processes((*MPS_NAMES, *FABRICMANAGER_NAMES))
    mps = sorted(found[MPS_NAMES[0]] + found[MPS_NAMES[1]])
    fm_running = bool(found[FABRICMANAGER_NAMES[0]] or found[FABRICMANAGER_NAMES[1]])
    return {"mps_daemon": mps, "fabricmanager": "running" if fm_running else ("not_running" if fabric_present else "not_needed")}


def fabric_present(readings: t.Iterable[dict[str, t.Any]]) -> bool:
    """Whether any GPU has an NVLink fabric to bring up (an NVSwitch system)."""
    return any(r.get("fabric") and r["fabric"]["state"] != "not_supported" for r in readings)


# ---------------------------------------------------------------------- verdicts
def judge_gpu(readings: dict[str, t.Any], diagnosis: str | None = None, extra: t.Sequence[tuple[str, str]] = ()) -> dict[str, t.Any]:
    """``{verdict, evidence, readings}`` of one GPU: each finding a sentence naming its verdict, the verdict the worst.
    ``extra`` are findings read elsewhere (a failed CUDA start: ``_cuda.finding``), as ``(verdict, sentence)``."""
    found: list[tuple[str, str]] = list(extra)
    if diagnosis == _reasons.DRIVER_HUNG:
        found.append((REBOOT, "an NVML call on this GPU did not return (the driver is hung)"))
    elif diagnosis == _reasons.GPU_LOST:
        found.append((REBOOT, "the GPU has fallen off the bus (NVML_ERROR_GPU_IS_LOST, Xid 79)"))
    action = readings.get("recovery_action")
    if action and action != "none":
        found.append((RECOVERY_VERDICTS.get(action, RESET_GPU), f"the driver's recovery action is {action}"))
    seen: set[tuple[int, str]] = set()
    for event in readings.get("xid") or []:
        verdict = BUCKET_VERDICTS.get(event["bucket"], RESET_GPU)
        if verdict == OK or (event["xid"], verdict) in seen:
            continue
        seen.add((event["xid"], verdict))
        unknown = " (not in the collection's table of NVIDIA's Xid catalog: treated as needing a reset)" if event["bucket"] == "UNKNOWN" else ""
        found.append((verdict, f"Xid {event['xid']} in the kernel log ({event['bucket']}){unknown}: {event['line']}"))
    rows = readings.get("remapped_rows")
    if rows:
        if rows["failure"]:
            found.append((DRAIN, "a row remapping failed (the memory cannot be repaired in the field: RMA)"))
        elif rows["pending"]:
            found.append((RESET_GPU, "a row remapping is pending: it takes effect at the next GPU reset"))
    pages = readings.get("retired_pages")
    if pages and pages["pending"]:
        found.append((RESET_GPU, "a page retirement is pending: it takes effect at the next GPU reset"))
    ecc = readings.get("ecc_volatile_uncorrected")
    if ecc:
        found.append((RESTART_APP, f"{ecc} uncorrectable ECC error(s) since the driver loaded (volatile count): the application that met them must restart"))
    fabric = readings.get("fabric")
    if fabric and fabric["state"] in ("not_started", "in_progress"):
        found.append(
            (RESET_GPU, f"the GPU's NVLink fabric is {fabric['state']} (CUDA answers 'system not yet initialized' until nvidia-fabricmanager completes it)")
        )
    elif fabric and fabric["state"] == "completed" and fabric["status"] not in (0, None):
        found.append((RESET_GPU, f"the GPU's NVLink fabric setup completed with NVML error {fabric['status']}"))
    mode = readings.get("compute_mode")
    if mode and mode != "default":
        found.append((RESTART_APP, f"compute mode is {mode}: a second CUDA process gets 'CUDA-capable device(s) is/are busy or unavailable'"))
    mig = readings.get("mig_mode")
    if mig and mig["current"] != mig["pending"]:
        found.append((RESET_GPU, f"a MIG mode change ({'on' if mig['pending'] else 'off'}) is pending: it takes effect at the next GPU reset"))
    verdict = worst(v for v, _text in found)
    return {"verdict": verdict, "evidence": [f"{v}: {text}." for v, text in found], "readings": readings}


def judge_host(
    gpu_health: t.Sequence[tuple[int, dict[str, t.Any]]],
    host: dict[str, t.Any],
    fail_on: str,
    stray_xids: t.Sequence[dict[str, t.Any]] = (),
    extra: t.Sequence[tuple[str, str]] = (),
) -> dict[str, t.Any]:
    """The host's ``{verdict, fail_on, evidence, host}``: the worst of the GPUs' verdicts (``(index, health)``
    pairs) and the host's own findings; ``stray_xids`` are Xid events of a PCI device no GPU NVML lists has
    (a GPU that fell off the bus no longer says where it is); ``extra`` are findings read elsewhere (the software
    checks, ``_software.findings``), as ``(verdict, sentence)``."""
    found: list[tuple[str, str]] = list(extra)
    if host.get("mps_daemon"):
        pids = ", ".join(map(str, host["mps_daemon"]))
        found.append((RESTART_APP, f"an MPS daemon is left behind (PID(s) {pids}): stop it (gpuops.clean_slate.gpu_mode_restore with mps: stopped)"))
    if host.get("fabricmanager") == "not_running" and any(
        (g["readings"].get("fabric") or {}).get("state") in ("not_started", "in_progress") for _i, g in gpu_health
    ):
        found.append((RESET_GPU, "nvidia-fabricmanager is not running, and the GPUs' fabric is not up: start it (systemctl start nvidia-fabricmanager)"))
    for event in stray_xids:
        verdict = BUCKET_VERDICTS.get(event["bucket"], RESET_GPU)
        if verdict != OK:
            found.append((verdict, f"Xid {event['xid']} in the kernel log ({event['bucket']}) of a PCI device no listed GPU has: {event['line']}"))
    evidence = [f"{v}: {text}." for v, text in found]
    for index, g in gpu_health:
        evidence += [f"GPU {index}: {e}" for e in g["evidence"]]
    verdict = worst([v for v, _text in found] + [g["verdict"] for _i, g in gpu_health])
    return {"verdict": verdict, "fail_on": fail_on, "evidence": evidence, "host": host}


def advice(verdict: str) -> str:
    """What to do about a verdict (empty for ok)."""
    return ADVICE.get(verdict, "")


# ---------------------------------------------------------------------- messages
# A failure is read once, in one message: the same finding on eight GPUs is one sentence naming the eight, and the same
# advice after eight GPUs' own facts is said once. The per-GPU records (gpus[], evidence) keep every GPU's own sentence.
_GPU_NUMBER = re.compile(r"\bGPU (\d+)\b")
_GPU_REF = re.compile(r"\b(GPU |nvidia)\d+\b")


def gpu_list(indices: t.Iterable[int]) -> str:
    """``GPU 3``, ``GPUs 1-7``, ``GPUs 0, 2 and 5-7``: GPU indices as a reader counts them."""
    ordered = sorted(set(indices))
    runs: list[list[int]] = []
    for i in ordered:
        if runs and i == runs[-1][-1] + 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    words = [f"{r[0]}-{r[-1]}" if len(r) > 2 else ", ".join(map(str, r)) for r in runs]
    text = ", ".join(words[:-1]) + " and " + words[-1] if len(words) > 1 else (words[0] if words else "")
    return f"GPU {text}" if len(ordered) == 1 else f"GPUs {text}"


def _shape(sentence: str) -> tuple[str, int | None]:
    """``sentence`` with its GPU's numbers taken out (``GPU 3``, ``nvidia3``), and that GPU's index; the sentence itself
    and None when it names no GPU, or more than one."""
    numbers = set(_GPU_NUMBER.findall(sentence))
    if len(numbers) != 1:
        return sentence, None
    return _GPU_REF.sub(lambda m: f"{m.group(1)}#", sentence), int(numbers.pop())


def said_once(sentences: t.Sequence[str], shown: t.Sequence[str] | None = None) -> list[str]:
    """``sentences``, in order, with those that differ only in the GPU they name said once: the first of them, then
    ``(the same for GPUs 1-7)``. A sentence said twice word for word is said once. ``shown``, when given, is what to
    print for each sentence (its GPU's UUID besides), ``sentences`` what to compare."""
    shown = list(shown) if shown is not None else list(sentences)
    groups: dict[str, list[tuple[int | None, str]]] = {}
    for sentence, text in zip(sentences, shown):
        key, index = _shape(sentence)
        groups.setdefault(key, []).append((index, text))
    out = []
    for members in groups.values():
        first = members[0][1]
        others = [i for i, _text in members[1:] if i is not None]
        out.append(f"{first.rstrip().rstrip('.')} (the same for {gpu_list(others)})." if others else first)
    return out


def evidence_text(evidence: t.Sequence[str], said: t.Container[str] = ()) -> str:
    """The verdict's evidence for a message: sentences that differ only in their GPU said once, and those already in
    ``said`` (a failed CUDA start the message reports per GPU already) left out."""
    return " ".join(said_once([e for e in evidence if e not in said]))
