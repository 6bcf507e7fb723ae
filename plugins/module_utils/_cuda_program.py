# Copyright (c) 2026, gpuops.clean_slate maintainers
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# Note: this module_util is PRIVATE to the collection; it may change without notice.

"""The startability program: a CUDA start on each GPU, and the device files a start needs, in one self-contained text.

The same text runs in two places:

* in the module's process, imported (:mod:`._cuda`, :mod:`._software`): the device files are looked at there, and
  each GPU's start runs in a helper forked from the module;
* inside an LXC container, where the next server starts (container scope, :mod:`._inside`): its text is handed to
  the container's own ``python3`` (``pct exec <vmid> -- ... python3 -I -c <this text> <request>``), nothing copied,
  and it answers one line on stdout (:data:`ANSWER`, then JSON).

So it imports nothing but the standard library (ctypes for ``libcuda.so.1``) and runs on Python 3.6 and later: no
``from __future__ import annotations``, and a function's annotations are strings unless they are plain builtins (a
3.6 interpreter evaluates them when it defines the function; those of variables in a function body it never does). tests/unit checks its syntax against 3.6 and
runs it with pyenv's 3.6.

The start (:func:`start`) is what a server does: ``cuInit``, the primary context, an allocation of ``fraction`` of the
GPU's memory, a memset, a synchronize, the free and the release, each call timed. CUDA is not fork-safe, so the
process that forks the helpers never loads it. Each GPU's helper has ``CUDA_VISIBLE_DEVICES`` set to that GPU's UUID
and says which call it is making before it makes it (a line on a pipe); one that has not answered by its deadline
is killed (SIGKILL: the driver's waits are killable) and reaped, and its GPU is named by that call. A helper dies
with its parent (``PR_SET_PDEATHSIG``); inside a container the program also ends every helper when its caller
goes away (its stdin, the caller's pipe, reads end-of-file), so a run the node gave up on leaves nothing behind.
"""

import ctypes
import errno
import json
import os
import re
import select
import signal
import stat
import sys
import time
import typing as t

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
#: What the program's answer line starts with on stdout (whatever else a container prints there is not its answer).
ANSWER = "gpuops-cuda-probe "
_PR_SET_PDEATHSIG = 1
MIB = 1 << 20


# ---------------------------------------------------------------------- the device files
#: The names the NVIDIA driver registers its character devices under in /proc/devices: the GPUs' nodes (major 195:
#: "nvidia", "nvidia-frontend" on older drivers), nvidiactl (195 too, listed again as "nvidiactl" by R580), the
#: unified-memory devices (a dynamic major: 238 on an H100 with driver 580.159.04,
#: docs/results/round4-facts-h100x1-2026-12-05.json) and the MIG capabilities.
FRONTEND = ("nvidia", "nvidia-frontend")
CTL = ("nvidiactl", *FRONTEND)
UVM = ("nvidia-uvm",)
CAPS = ("nvidia-caps",)
#: nvidiactl's minor on the GPUs' major; nvidia-uvm-tools is nvidia-uvm's major, minor 1.
CTL_MINOR = 255


def char_majors() -> "dict[int, str]":
    """The character devices' majors and the drivers /proc/devices names for them ({} when it cannot be read)."""
    out: dict[int, str] = {}  # a local's annotation is never evaluated, on 3.6 too
    try:
        with open("/proc/devices", encoding="utf-8") as fh:
            block = False
            for line in fh:
                if line.strip().endswith(":"):
                    block = line.startswith("Character")
                    continue
                parts = line.split()
                # A major listed under two names (195: nvidia, then nvidiactl) is named by its first.
                if block and len(parts) == 2 and parts[0].isdigit():
                    out.setdefault(int(parts[0]), parts[1])
    except OSError:
        return {}
    return out


def driver_major(names: "t.Sequence[str]", majors: "dict[int, str]") -> "int | None":
    """The major /proc/devices gives the first of ``names`` it lists (None where the driver is not listed)."""
    for name in names:
        for major, driver in sorted(majors.items()):
            if driver == name:
                return major
    return None


def node(path: str, want: "t.Any" = None, majors: "dict[int, str] | None" = None) -> "dict[str, t.Any]":
    """``{path, ok, why, fault}`` of one device file: present, the device it is named for, and openable.

    ``want`` is ``(driver names, minor)``: the node must be a character device of the major /proc/devices gives that
    driver (``majors``, :func:`char_majors`), with that minor (None: any). Where /proc/devices lists no such driver (a
    simulated driver, a sandbox that hides it) the numbers cannot be checked and only presence and opening count.
    ``fault`` names what is wrong: ``absent``, ``wrong`` (another device, or a regular file where the driver serves
    nodes), ``refused`` (the device cgroup, or the file's permissions), ``unopenable`` (any other error), or None.
    """
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return {"path": path, "ok": False, "why": f"{path} is absent", "fault": "absent"}
    except OSError as exc:
        return {"path": path, "ok": False, "why": f"{path} cannot be looked at ({exc.strerror})", "fault": "unopenable"}
    if os.path.isdir(path):
        names = sorted(os.listdir(path))
        if not names:
            return {"path": path, "ok": False, "why": f"{path} is empty", "fault": "absent"}
        bad = [n for n in (node(os.path.join(path, name)) for name in names) if not n["ok"]]
        return {"path": path, "ok": not bad, "why": bad[0]["why"] if bad else None, "fault": bad[0]["fault"] if bad else None}
    majors = char_majors() if majors is None and want is not None else (majors or {})
    if want is not None:
        names, minor = want
        major = driver_major(names, majors)
        if major is not None:
            # The kernel says which driver serves which numbers: hold the node to it. A node with another device's numbers
            # (/dev/null bound over it, a node made with the GPUs' 195 for nvidia-uvm's dynamic major) opens, and CUDA fails.
            numbers = f"{major}:{minor}" if minor is not None else f"major {major}"
            if not stat.S_ISCHR(st.st_mode):
                return {
                    "path": path,
                    "ok": False,
                    "fault": "wrong",
                    "why": f"{path} is a regular file, not the {names[0]} device ({numbers}): a bind mount whose source was missing leaves one",
                }
            got = (os.major(st.st_rdev), os.minor(st.st_rdev))
            if got[0] != major or (minor is not None and got[1] != minor):
                owner = majors.get(got[0])
                whose = f" ({owner}'s numbers)" if owner and owner not in names else ""
                return {
                    "path": path,
                    "ok": False,
                    "fault": "wrong",
                    "rdev": list(got),
                    "why": f"{path} is {got[0]}:{got[1]}{whose}, not the {names[0]} device ({numbers} on this kernel, from /proc/devices)",
                }
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as exc:
        # EPERM: the device cgroup (a container's device rules refuse at open, not at stat); EACCES: the file's mode.
        refused = exc.errno in (errno.EPERM, errno.EACCES)
        what = {errno.EPERM: "the device cgroup refuses it", errno.EACCES: "its permissions refuse it"}.get(exc.errno or 0, exc.strerror or "")
        if exc.errno in (errno.ENXIO, errno.ENODEV):
            what = "no driver serves its numbers"
        return {
            "path": path,
            "ok": False,
            "fault": "refused" if refused else "unopenable",
            "why": f"{path} is present but cannot be opened: {what} ({exc.strerror})",
            "mode": oct(st.st_mode),
        }
    os.close(fd)
    return {"path": path, "ok": True, "why": None, "fault": None}


def uvm_major(majors: "dict[int, str] | None" = None) -> "int | None":
    """nvidia-uvm's major number from /proc/devices (dynamic: 511, 508, 238 ... where 195 is the GPUs'), or None."""
    return driver_major(UVM, char_majors() if majors is None else majors)


def device_nodes(device_dir: str, gpus: "t.Sequence[t.Sequence[t.Any]]", nvml_count: int) -> "dict[str, t.Any]":
    """What the device files say: ``gpus`` (index -> node), ``ctl``, ``uvm``, ``uvm_tools``, ``caps`` (where a selected
    GPU has MIG on, else None), ``gpu_files`` (how many ``nvidia<N>`` files), ``nvml_count``, ``uvm_major`` and
    ``numbers_checked`` (whether /proc/devices lists the driver, so that each node's numbers were held to it).

    ``gpus`` is ``(index, minor, mig_on)`` of each selected GPU.
    """
    join = os.path.join
    majors = char_majors()
    try:
        files = sum(1 for name in os.listdir(device_dir) if re.match(r"^nvidia\d+$", name))
    except OSError:
        files = 0
    return {
        "dir": device_dir,
        "gpus": {
            index: node(join(device_dir, f"nvidia{minor}"), (FRONTEND, minor), majors)
            if minor is not None
            else {"path": None, "ok": True, "why": None, "fault": None}
            for index, minor, _mig in gpus
        },
        "ctl": node(join(device_dir, "nvidiactl"), (CTL, CTL_MINOR), majors),
        "uvm": node(join(device_dir, "nvidia-uvm"), (UVM, 0), majors),
        "uvm_tools": node(join(device_dir, "nvidia-uvm-tools"), (UVM, 1), majors),
        "caps": node(join(device_dir, "nvidia-caps")) if any(mig for _i, _m, mig in gpus) else None,
        "gpu_files": files,
        "nvml_count": nvml_count,
        "uvm_major": uvm_major(majors),
        "numbers_checked": driver_major(FRONTEND, majors) is not None,
        "uvm_loaded": None if driver_major(FRONTEND, majors) is None else uvm_major(majors) is not None,
    }


# ---------------------------------------------------------------------- the helper
def start(out_fd: int, uuid: str, fraction: float, context_only: bool) -> None:  # pragma: no cover - runs in the helper
    """The start, in the forked helper: each call announced (``S <name>``) before it is made, the answer last (``R <json>``)."""

    def say(line: str) -> None:
        data = (line + "\n").encode()
        while data:
            data = data[os.write(out_fd, data) :]

    res: dict[str, t.Any] = {"steps": {}, "code": None, "step": None}

    def call(name: str, fn: "t.Any", *args: "t.Any") -> bool:
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


def detach(parent: int) -> bool:  # pragma: no cover - runs in a forked helper
    """A forked helper's first steps (this program's and ``_probe``'s NVML helper's): die with ``parent``
    (``PR_SET_PDEATHSIG``), the default action for the signals a caller may have caught, and standard input, output
    and error on /dev/null, so that nothing it does reaches the caller's output (a module's JSON result) or keeps it
    open. False when the parent died before the death signal took effect: the helper should end at once."""
    try:
        ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:
        return False
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGPIPE):
        signal.signal(sig, signal.SIG_DFL)
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    os.close(null)
    return True


def helper(out_fd: int, parent: int, uuid: str, fraction: float, context_only: bool) -> None:  # pragma: no cover - runs in the helper
    """The forked helper's life: die with the parent, keep nothing of it open, then the start on ``uuid`` alone."""
    if not detach(parent):
        return
    # Nothing of the parent's (its NVML helper's pipes, Ansible's files, the caller's pipe) stays open in the helper.
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd > 2 and fd != out_fd:
            try:
                os.close(fd)
            except OSError:
                pass
    os.environ["CUDA_VISIBLE_DEVICES"] = uuid
    os.environ["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
    for name in BAD_ENV:
        os.environ.pop(name, None)
    start(out_fd, uuid, fraction, context_only)


# ---------------------------------------------------------------------- the parent's side
class _Running:
    def __init__(self, gpu: int, pid: int, fd: int, now: float) -> None:
        self.gpu = gpu
        self.pid = pid
        self.fd = fd
        self.began = now
        self.step = "fork"
        self.buffer = b""
        self.result = None  # type: dict[str, t.Any] | None


def _reap(pids: "list[int]") -> "list[int]":
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


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def probe(
    targets: "t.Sequence[t.Sequence[t.Any]]",
    fraction: float,
    timeout: float,
    clock: "t.Callable[[], float]" = time.monotonic,
    lifeline: "int | None" = None,
) -> "tuple[dict[int, dict[str, t.Any]], list[int]]":
    """Start CUDA on every target (``(gpu, uuid, context_only)``) at once, each in a helper of its own under ``timeout`` seconds.

    Returns each GPU's raw answer (``ok``, ``code``, ``text``, ``step``, ``steps``, ``cuda_free_mib``,
    ``cuda_total_mib``, ``allocated_mib``, ``pid``, ``elapsed_s``; ``hung`` with the call it was in; ``dlopen_error``;
    ``abandoned`` with the call it was in when the caller went away) and the helpers that did not die of SIGKILL in time.
    With ``lifeline`` (a file descriptor the caller holds the other end of), its end-of-file kills every helper still running.
    """
    running: list[_Running] = []
    parent = os.getpid()
    for gpu, uuid, context_only in targets:
        read_fd, write_fd = os.pipe()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - runs in the helper
            try:
                os.close(read_fd)
                helper(write_fd, parent, uuid, fraction, context_only)
            finally:
                os._exit(0)
        os.close(write_fd)
        running.append(_Running(gpu, pid, read_fd, clock()))
    pending = list(running)
    while pending:
        now = clock()
        for r in list(pending):
            if now - r.began >= timeout:
                _kill(r.pid)
                r.result = {"ok": False, "hung": r.step, "waited_s": round(now - r.began, 3), "steps": {}}
                pending.remove(r)
        if not pending:
            break
        wait = min(r.began + timeout for r in pending) - now
        watched = [r.fd for r in pending] + ([lifeline] if lifeline is not None else [])
        ready = select.select(watched, [], [], max(0.0, wait))[0]
        if lifeline is not None and lifeline in ready and not os.read(lifeline, 4096):
            # The caller is gone (the node gave up on this run): nothing may outlive it.
            for r in pending:
                _kill(r.pid)
                r.result = {"ok": False, "abandoned": r.step, "steps": {}}
            pending = []
            lifeline = None
            break
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
        out[r.gpu] = result
    return out, left


# ---------------------------------------------------------------------- in a container
def source() -> str:
    """This file's text, as its loader has it (a file, or the zip AnsiballZ runs the module from): what a container runs."""
    loader = globals().get("__loader__")
    text = loader.get_source(__name__) if loader is not None and hasattr(loader, "get_source") else None
    if not text:
        with open(__file__, encoding="utf-8") as fh:
            text = fh.read()
    return t.cast(str, text)


def main(argv: "t.Sequence[str]") -> int:
    """Run as ``python3 -I -c <this text> <request>``: ``request`` is JSON with ``device_dir``, ``gpus`` (``[index, minor,
    mig_on]`` each), ``nvml_count``, ``targets`` (``[gpu, uuid, context_only]`` each), ``fraction`` and ``timeout``.
    Prints :data:`ANSWER` and JSON: ``devices`` (:func:`device_nodes`), ``raw`` and ``left_behind`` (:func:`probe`),
    ``python`` (this interpreter's version) and ``pid`` (the program's, as the container numbers it)."""
    request = json.loads(argv[1])
    # stdin is the caller's pipe: it reads end-of-file once the caller (pct exec, the module) is gone. Anything else
    # there (a terminal, /dev/null) says nothing of the caller, and only the deadlines hold.
    mode = os.fstat(0).st_mode
    lifeline = 0 if stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode) else None
    raw, left = probe(request["targets"], request["fraction"], request["timeout"], lifeline=lifeline)
    # The device files after the starts: the driver's nvidia-modprobe may have made a missing node (as root), as a
    # server's start would; what is still absent, wrong or refused then is the fault.
    devices = device_nodes(request["device_dir"], request["gpus"], request["nvml_count"])
    answer = {"devices": devices, "raw": raw, "left_behind": left, "python": ".".join(map(str, sys.version_info[:3])), "pid": os.getpid()}
    sys.stdout.write(ANSWER + json.dumps(answer) + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
