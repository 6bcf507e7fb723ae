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

from ansible_collections.gpuops.clean_slate.plugins.module_utils import _findings, _nvml, _reasons, _xids

try:
    import pynvml

    HAS_PYNVML = True
except ImportError:  # pragma: no cover - depends on the target host
    HAS_PYNVML = False

# ---------------------------------------------------------------------- verdicts
OK = _findings.OK
RESTART_APP = _findings.RESTART_APP
#: A configuration fault (a device file, nvidia-uvm, libcuda, a flagged variable, a driver service): no reset or reboot
#: fixes it, and none is needed; the configuration does (DCGM's CONFIG severity, not its RESET).
FIX_CONFIG = _findings.FIX_CONFIG
RESET_GPU = _findings.RESET_GPU
REBOOT = _findings.REBOOT
DRAIN = _findings.DRAIN
#: Worst last: the host's verdict is the worst of its GPUs' and its own findings.
VERDICTS = (OK, RESTART_APP, FIX_CONFIG, RESET_GPU, REBOOT, DRAIN)
#: ``fail_on`` also accepts this: report, never fail.
NEVER = "never"
FAIL_ON_CHOICES = (*VERDICTS, NEVER)

#: What each verdict asks for, said once after the findings (each finding's own fix is in _findings.FINDINGS).
ADVICE = {
    RESTART_APP: "the GPUs work; the application, or a setting it left, must be dealt with (each finding says how).",
    FIX_CONFIG: "fix the configuration each finding names, on the node or in the container: the GPUs themselves need nothing.",
    RESET_GPU: "reset the GPUs the reset plan names, from where it says, or reboot the node.",
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
#: The verdict of each bucket of the Xid catalog (the table itself: :mod:`._xids`; the buckets' verdicts: _findings).
BUCKET_VERDICTS = _findings.XID_BUCKETS

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
    # The fabric's cluster and clique: the GPUs that share them are one NVLink fabric (a reset plan resets them together).
    return {
        "state": FABRIC_STATES.get(int(info.state), f"unknown_{int(info.state)}"),
        "status": int(info.status),
        "cluster_uuid": bytes(info.clusterUuid).hex(),
        "clique_id": int(info.cliqueId),
    }


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
#: A finding as the judges collect it: (name, verdict, sentence); the name is a key of _findings.FINDINGS.
Found = t.Tuple[str, str, str]


def judge_gpu(readings: dict[str, t.Any], diagnosis: str | None = None, extra: t.Sequence[Found] = ()) -> dict[str, t.Any]:
    """``{verdict, evidence, findings, readings}`` of one GPU: each finding named (``findings``: name, verdict, text) and
    as a sentence naming its verdict (``evidence``), the verdict the worst. ``extra`` are findings read elsewhere (a
    failed CUDA start: ``_cuda.finding``), as ``(name, verdict, sentence)``."""
    found: list[Found] = list(extra)
    if diagnosis == _reasons.DRIVER_HUNG:
        found.append((_reasons.DRIVER_HUNG, REBOOT, "an NVML call on this GPU did not return (the driver is hung)"))
    elif diagnosis == _reasons.GPU_LOST:
        found.append((_reasons.GPU_LOST, REBOOT, "the GPU has fallen off the bus (NVML_ERROR_GPU_IS_LOST, Xid 79)"))
    action = readings.get("recovery_action")
    if action and action != "none":
        found.append(("recovery_action", RECOVERY_VERDICTS.get(action, RESET_GPU), f"the driver's recovery action is {action}"))
    seen: set[tuple[int, str]] = set()
    for event in readings.get("xid") or []:
        verdict = BUCKET_VERDICTS.get(event["bucket"], RESET_GPU)
        if verdict == OK or (event["xid"], verdict) in seen:
            continue
        seen.add((event["xid"], verdict))
        unknown = " (not in the collection's table of NVIDIA's Xid catalog: treated as needing a reset)" if event["bucket"] == "UNKNOWN" else ""
        found.append(("xid", verdict, f"Xid {event['xid']} in the kernel log ({event['bucket']}){unknown}: {event['line']}"))
    rows = readings.get("remapped_rows")
    if rows:
        if rows["failure"]:
            found.append(("row_remap_failure", DRAIN, "a row remapping failed (the memory cannot be repaired in the field: RMA)"))
        elif rows["pending"]:
            found.append(("row_remap_pending", RESET_GPU, "a row remapping is pending: it takes effect at the next GPU reset"))
    pages = readings.get("retired_pages")
    if pages and pages["pending"]:
        found.append(("page_retirement_pending", RESET_GPU, "a page retirement is pending: it takes effect at the next GPU reset"))
    ecc = readings.get("ecc_volatile_uncorrected")
    if ecc:
        found.append(
            (
                "ecc_volatile",
                RESTART_APP,
                f"{ecc} uncorrectable ECC error(s) since the driver loaded (volatile count): the application that met them must restart",
            )
        )
    fabric = readings.get("fabric")
    if fabric and fabric["state"] in ("not_started", "in_progress"):
        # Fabric Manager's work, not the GPU's: it brings the fabric up (a reset does not), and CUDA waits for it.
        found.append(
            (
                "fabric_incomplete",
                FIX_CONFIG,
                f"the GPU's NVLink fabric is {fabric['state']} (CUDA answers 'system not yet initialized' until nvidia-fabricmanager completes it)",
            )
        )
    elif fabric and fabric["state"] == "completed" and fabric["status"] not in (0, None):
        found.append(("fabric_error", RESET_GPU, f"the GPU's NVLink fabric setup completed with NVML error {fabric['status']}"))
    mode = readings.get("compute_mode")
    if mode and mode != "default":
        found.append(("compute_mode", RESTART_APP, f"compute mode is {mode}: a second CUDA process gets 'CUDA-capable device(s) is/are busy or unavailable'"))
    mig = readings.get("mig_mode")
    if mig and mig["current"] != mig["pending"]:
        found.append(("mig_pending", RESET_GPU, f"a MIG mode change ({'on' if mig['pending'] else 'off'}) is pending: it takes effect at the next GPU reset"))
    verdict = worst(v for _n, v, _text in found)
    return {
        "verdict": verdict,
        "evidence": [f"{v}: {text}." for _n, v, text in found],
        "findings": [{"name": n, "verdict": v, "text": text} for n, v, text in found],
        "readings": readings,
    }


def judge_host(
    gpu_health: t.Sequence[tuple[int, dict[str, t.Any]]],
    host: dict[str, t.Any],
    fail_on: str,
    stray_xids: t.Sequence[dict[str, t.Any]] = (),
    extra: t.Sequence[t.Mapping[str, t.Any]] = (),
) -> dict[str, t.Any]:
    """The host's ``{verdict, fail_on, evidence, findings, host}``: the worst of the GPUs' verdicts (``(index, health)``
    pairs) and the host's own findings; ``stray_xids`` are Xid events of a PCI device no GPU NVML lists has (a GPU that
    fell off the bus no longer says where it is); ``extra`` are findings read elsewhere (the software checks,
    ``_software.findings``: name, verdict, text and the GPU or GPUs they are about).

    ``findings`` says each distinct finding once, with the GPUs it applies to (:func:`grouped`); ``evidence`` keeps a
    sentence per finding and GPU, as before."""
    found: list[dict[str, t.Any]] = [dict(f) for f in extra]
    if host.get("mps_daemon"):
        pids = ", ".join(map(str, host["mps_daemon"]))
        found.append({"name": "mps_daemon", "verdict": RESTART_APP, "text": f"an MPS daemon is left behind (PID(s) {pids})"})
    if host.get("fabricmanager") == "not_running" and any(
        (g["readings"].get("fabric") or {}).get("state") in ("not_started", "in_progress") for _i, g in gpu_health
    ):
        found.append(
            {"name": "fabricmanager_not_running", "verdict": FIX_CONFIG, "text": "nvidia-fabricmanager is not running, and the GPUs' fabric is not up"}
        )
    for event in stray_xids:
        verdict = BUCKET_VERDICTS.get(event["bucket"], RESET_GPU)
        if verdict != OK:
            found.append(
                {
                    "name": "xid",
                    "verdict": verdict,
                    "text": f"Xid {event['xid']} in the kernel log ({event['bucket']}) of a PCI device no listed GPU has: {event['line']}",
                }
            )
    evidence = [f"{f['verdict']}: {f['text']}." for f in found if f.get("gpu") is None and not f.get("gpus")]
    evidence += [f"GPU {f['gpu']}: {f['verdict']}: {f['text']}." for f in found if f.get("gpu") is not None and not f.get("gpus")]
    evidence += [f"{gpu_list(f['gpus'])}: {f['verdict']}: {f['text']}." for f in found if f.get("gpus")]
    per_gpu = list(found)
    for index, g in gpu_health:
        evidence += [f"GPU {index}: {e}" for e in g["evidence"]]
        per_gpu += [{**f, "gpu": index} for f in g.get("findings") or []]
    verdict = worst([f["verdict"] for f in found] + [g["verdict"] for _i, g in gpu_health])
    return {"verdict": verdict, "fail_on": fail_on, "evidence": evidence, "findings": grouped(per_gpu), "host": host}


def advice(verdict: str) -> str:
    """What to do about a verdict (empty for ok)."""
    return ADVICE.get(verdict, "")


# ---------------------------------------------------------------------- findings, each said once
# A failure is read once, in a few lines: the same finding on eight GPUs is one line naming the eight, and its fix (from
# the one table, _findings.FINDINGS) is said once. The per-GPU records (gpus[], evidence) keep every GPU's own sentence.
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


def shape(sentence: str) -> str:
    """``sentence`` with the numbers of the GPUs it names taken out (``GPU 3``, ``nvidia3``): what two GPUs' sentences
    about the same thing have in common."""
    return _GPU_REF.sub(lambda m: f"{m.group(1)}#", sentence)


def for_several(sentence: str) -> str:
    # One sentence said for several GPUs: their own numbers in it read as each one's.
    return re.sub(r"\bnvidia\d+\b", "nvidia<minor>", re.sub(r"\bGPU \d+\b", "each GPU", sentence))


def grouped(found: t.Sequence[t.Mapping[str, t.Any]]) -> list[dict[str, t.Any]]:
    """Each distinct finding once: those of the same name, verdict and sentence (but for the GPU it names) become one,
    with every GPU they apply to (``gpus``, [] for the host's own), where it is fixed and the fix (``_findings``)."""
    groups: dict[tuple[str, str, str], dict[str, t.Any]] = {}
    for f in found:
        text = str(f.get("text", ""))
        key = (str(f.get("name")), str(f.get("verdict")), shape(text))
        g = groups.setdefault(key, {"name": key[0], "verdict": key[1], "gpus": [], "text": text})
        for index in [f["gpu"]] if f.get("gpu") is not None else list(f.get("gpus") or []):
            if index not in g["gpus"]:
                g["gpus"].append(index)
    out = []
    for g in groups.values():
        entry = _findings.FINDINGS.get(g["name"])
        g["gpus"] = sorted(g["gpus"])
        if len(g["gpus"]) > 1:
            g["text"] = for_several(g["text"])
        g["where"] = entry.where if entry else ""
        g["fix"] = entry.fix if entry else ""
        out.append(g)
    # Worst first: the line an engineer acts on comes first.
    return sorted(out, key=lambda g: -rank(g["verdict"]) if g["verdict"] in VERDICTS else 0)


def lines(findings: t.Sequence[t.Mapping[str, t.Any]], said: t.Container[str] = ()) -> list[str]:
    """A line per distinct finding (:func:`grouped`): the GPUs, the name and verdict, the sentence, and the fix once per
    name (the first line of that name says it). Findings named in ``said`` are left out (the message said them), and so
    are warnings (``ok``)."""
    out = []
    fixed: set[str] = set()
    for f in findings:
        # A warning (ok) changes no verdict: it stays in the findings and the report, not in the message.
        if f["name"] in said or f["verdict"] == OK:
            continue
        where = f"{gpu_list(f['gpus'])}: " if f.get("gpus") else ""
        fix = f" Fix: {f['fix']}" if f.get("fix") and f["name"] not in fixed else ""
        fixed.add(f["name"])
        out.append(f"{where}{f['name']} ({f['verdict']}): {str(f['text']).rstrip('.')}.{fix}")
    return out
