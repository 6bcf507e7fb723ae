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

Peer readiness (:func:`together`, issue 39) is one more helper beside the starts, with every GPU of the check visible: a
context on each GPU, made in parallel threads, two small buffers each and a known pattern in one; then, once every
start has passed its memset (the parent says "go": the starts' memsets would share the memory bandwidth the copies
measure), for every pair what the driver says of peer access (``cuDeviceCanAccessPeer``), peer access enabled both ways
(``cuCtxEnablePeerAccess``), the pattern copied both ways (``cuMemcpyPeer``, timed with events) and read back and
compared. Each pair's answer is a line of its own (``P <json>``) as soon as it is known, and every call is announced
(``cuMemcpyPeer 0->3``), so that a pair whose copy hangs is named by its two GPUs when the helper is killed at its
deadline, with the pairs before it answered.
"""

import ctypes
import errno
import fnmatch
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
#: ... and, for a killed peer helper, this much more for each context it held: the kernel tears a dying process's
#: contexts down one device file after another (the H200: a killed context's memory back 0.12-0.22 s after the signal).
TEARDOWN_PER_CONTEXT_S = 0.25
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
def read_go(fd: int) -> "dict[str, t.Any] | None":  # pragma: no cover - runs in the helpers
    """The parent's word on the helper's pipe: one line of JSON; None at end-of-file (the helper is not needed)."""
    got = b""
    while not got.endswith(b"\n"):
        chunk = os.read(fd, 4096)
        if not chunk:
            return None
        got += chunk
    return t.cast("dict[str, t.Any]", json.loads(got.decode("utf-8")))


def start(out_fd: int, uuid: str, fraction: float, context_only: bool, go_fd: "int | None" = None) -> None:  # pragma: no cover - runs in the helper
    """The start, in the forked helper: each call announced (``S <name>``) before it is made, the answer last (``R <json>``).

    With ``go_fd`` the helper was started early (:class:`Helpers`): after ``cuInit`` and the device's identity it says
    ``S ready`` and waits for its word there (``fraction``, ``context_only``), or ends at end-of-file."""

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
    if go_fd is not None:
        say("S ready")
        word = read_go(go_fd)
        if word is None:
            return  # not needed: the GPU is not to be started after all
        fraction, context_only = float(word["fraction"]), bool(word["context_only"])
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


def helper(  # pragma: no cover - runs in the helper
    out_fd: int, parent: int, uuid: str, fraction: float, context_only: bool, go_fd: "int | None" = None
) -> None:
    """The forked helper's life: die with the parent, keep nothing of it open, then the start on ``uuid`` alone."""
    if not detach(parent):
        return
    # Nothing of the parent's (its NVML helper's pipes, Ansible's files, the caller's pipe) stays open in the helper.
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd > 2 and fd not in (out_fd, go_fd):
            try:
                os.close(fd)
            except OSError:
                pass
    os.environ["CUDA_VISIBLE_DEVICES"] = uuid
    os.environ["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
    for name in BAD_ENV:
        os.environ.pop(name, None)
    start(out_fd, uuid, fraction, context_only, go_fd)


def pattern(gpu: int, size: int) -> bytes:
    """The bytes GPU ``gpu``'s buffer holds for the peer copies: a 4 KiB block that differs from every other GPU's at every
    offset (29 is odd, so ``gpu * 29`` differs mod 256 for 256 GPUs), repeated; a copy that did not happen, or came from
    another GPU, or changed a byte, does not compare equal."""
    block = bytes((k * 167 + gpu * 29 + 7) & 0xFF for k in range(4096))
    return block * (size // 4096) + block[: size % 4096]


def together(out_fd: int, in_fd: int) -> None:  # pragma: no cover - runs in the helper
    """Peer readiness, in the forked helper: after ``cuInit`` and the devices' identities it says ``S ready`` and waits for
    its word on ``in_fd`` (``gpus``: ``[index, uuid]`` of those to check, ``size``, ``reps``); then a context and two buffers
    on each of them, and once the parent writes ``go`` (``S wait``), every pair both ways; each call announced (``S``),
    each pair's answer as it comes (``P``), the whole answer last (``R``). End-of-file on ``in_fd`` ends it."""
    import threading  # pylint: disable=import-outside-toplevel

    lock = threading.Lock()

    def say(line: str) -> None:
        data = (line + "\n").encode()
        with lock:
            while data:
                data = data[os.write(out_fd, data) :]

    res = {"steps": {}, "gpus": {}, "code": None, "step": None}  # type: dict[str, t.Any]

    #: Calls that only set the thread's context or read what is done already: not announced (a copy's other calls are,
    #: and name its pair), so that 28 pairs cost the parent a few hundred lines, not a thousand.
    quiet = ("cuCtxSetCurrent", "cuEventRecord", "cuEventElapsedTime")

    def call(name: str, fn: "t.Any", *args: "t.Any") -> int:
        if not name.startswith(quiet):
            say("S " + name)
        began = time.monotonic()
        code = int(fn(*args))
        kind = name.split(" ")[0]
        res["steps"][kind] = round(max(res["steps"].get(kind, 0.0), time.monotonic() - began), 4)
        return code

    say("S dlopen")
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError as exc:
        res.update(step="dlopen", dlopen_error=str(exc))
        say("R " + json.dumps(res))
        return
    count, dev, raw = ctypes.c_int(), ctypes.c_int(), (ctypes.c_ubyte * 16)()
    for name, fn, args in (("cuInit", cuda.cuInit, (0,)), ("cuDeviceGetCount", cuda.cuDeviceGetCount, (ctypes.byref(count),))):
        code = call(name, fn, *args)
        if code:
            res.update(code=code, step=name)
            say("R " + json.dumps(res))
            return
    ordinal = {}
    for o in range(count.value):
        if call("cuDeviceGet", cuda.cuDeviceGet, ctypes.byref(dev), o) == 0 and call("cuDeviceGetUuid_v2", cuda.cuDeviceGetUuid_v2, raw, dev) == 0:
            uuid = "GPU-" + "-".join(bytes(raw).hex()[a:b] for a, b in ((0, 8), (8, 12), (12, 16), (16, 20), (20, 32)))
            ordinal[uuid.lower()] = dev.value
    say("S ready")
    word = read_go(in_fd)
    if word is None:
        return  # no peer check after all
    gpus, size, reps = word["gpus"], int(word["size"]), int(word["reps"])
    elapsed = getattr(cuda, "cuEventElapsedTime_v2", None) or cuda.cuEventElapsedTime
    release = getattr(cuda, "cuDevicePrimaryCtxRelease_v2", None) or cuda.cuDevicePrimaryCtxRelease
    state = {}  # type: dict[int, dict[str, t.Any]]

    def setup(gpu: int, uuid: str) -> None:
        # One GPU's part, in a thread of its own: the contexts are made side by side.
        mine = state[gpu] = {"ok": False, "steps": {}}
        if uuid.lower() not in ordinal:
            mine.update(code=100, step="cuDeviceGetUuid_v2", why="CUDA does not see this GPU")
            return
        d = ordinal[uuid.lower()]
        ctx, src, dst = ctypes.c_void_p(), ctypes.c_uint64(), ctypes.c_uint64()
        events = [ctypes.c_void_p(), ctypes.c_void_p()]
        steps = (
            ("cuDevicePrimaryCtxRetain", cuda.cuDevicePrimaryCtxRetain, (ctypes.byref(ctx), d)),
            ("cuCtxSetCurrent", cuda.cuCtxSetCurrent, (ctx,)),
            ("cuMemAlloc_v2", cuda.cuMemAlloc_v2, (ctypes.byref(src), ctypes.c_size_t(size))),
            ("cuMemAlloc_v2", cuda.cuMemAlloc_v2, (ctypes.byref(dst), ctypes.c_size_t(size))),
            ("cuMemcpyHtoD_v2", cuda.cuMemcpyHtoD_v2, (src, pattern(gpu, size), ctypes.c_size_t(size))),
            ("cuEventCreate", cuda.cuEventCreate, (ctypes.byref(events[0]), 0)),
            ("cuEventCreate", cuda.cuEventCreate, (ctypes.byref(events[1]), 0)),
        )
        for name, fn, args in steps:
            code = call(f"{name} {gpu}", fn, *args)
            if code:
                mine.update(code=code, step=name)
                break
            if name == "cuDevicePrimaryCtxRetain":
                mine["retained"] = d
        else:
            mine.update(ok=True, ctx=ctx, src=src, dst=dst, events=events)

    def each(fn: "t.Callable[..., None]", args: "t.Sequence[t.Sequence[t.Any]]") -> None:
        threads = [threading.Thread(target=fn, args=tuple(a)) for a in args]
        for th in threads:
            th.start()
        for th in threads:
            th.join()

    began = time.monotonic()
    each(setup, gpus)
    res["setup_s"] = round(time.monotonic() - began, 4)
    for gpu, mine in state.items():
        res["gpus"][str(gpu)] = {k: mine[k] for k in ("ok", "code", "step", "why") if k in mine}
    say("S wait")
    if read_go(in_fd) is None:
        return  # the caller is gone: nothing to answer
    began = time.monotonic()
    host = ctypes.create_string_buffer(size)
    libc = ctypes.CDLL(None)
    libc.memcmp.restype = ctypes.c_int
    libc.memcmp.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)
    expected = {gpu: pattern(gpu, size) for gpu in state}
    ready = [gpu for gpu, _uuid in gpus if state[gpu]["ok"]]
    can, ms = ctypes.c_int(), ctypes.c_float()

    def copy(src: int, dst: int) -> "dict[str, t.Any]":
        # The pattern of src's buffer into dst's, ``reps`` times between two events, then dst's buffer read back and compared.
        sa, sb = state[src], state[dst]
        out = {"from": src, "to": dst, "code": None, "call": None, "gbps": None, "match": None}  # type: dict[str, t.Any]
        label = f"{src}->{dst}"
        steps = [("cuCtxSetCurrent", cuda.cuCtxSetCurrent, (sa["ctx"],)), ("cuEventRecord", cuda.cuEventRecord, (sa["events"][0], None))]
        steps += [("cuMemcpyPeer", cuda.cuMemcpyPeer, (sb["dst"], sb["ctx"], sa["src"], sa["ctx"], ctypes.c_size_t(size)))] * reps
        steps += [
            ("cuEventRecord", cuda.cuEventRecord, (sa["events"][1], None)),
            ("cuEventSynchronize", cuda.cuEventSynchronize, (sa["events"][1],)),
            ("cuEventElapsedTime", elapsed, (ctypes.byref(ms), sa["events"][0], sa["events"][1])),
            ("cuCtxSetCurrent", cuda.cuCtxSetCurrent, (sb["ctx"],)),
            ("cuMemcpyDtoH_v2", cuda.cuMemcpyDtoH_v2, (host, sb["dst"], ctypes.c_size_t(size))),
        ]
        for k, (name, fn, args) in enumerate(steps):
            # The timed copies are announced once: they are the same call, between the same two GPUs.
            code = call(f"{name} {label}", fn, *args) if name != "cuMemcpyPeer" or steps[k - 1][0] != name else int(fn(*args))
            if code:
                out.update(code=code, call=name)
                return out
            if name == "cuEventElapsedTime" and ms.value > 0:
                out["gbps"] = round(size * reps / (ms.value / 1000.0) / 1e9, 2)
        out["match"] = libc.memcmp(host, expected[src], size) == 0
        return out

    for x, a in enumerate(ready):
        for b in ready[x + 1 :]:
            pair = {"gpus": [a, b], "can": [None, None], "enable": [None, None], "copies": []}  # type: dict[str, t.Any]
            for k, (p, q) in enumerate(((a, b), (b, a))):
                code = call(f"cuDeviceCanAccessPeer {p}->{q}", cuda.cuDeviceCanAccessPeer, ctypes.byref(can), state[p]["retained"], state[q]["retained"])
                pair["can"][k] = bool(can.value) if code == 0 else f"CUresult {code}"
            if pair["can"] == [True, True]:
                for k, (p, q) in enumerate(((a, b), (b, a))):
                    call(f"cuCtxSetCurrent {p}", cuda.cuCtxSetCurrent, state[p]["ctx"])
                    pair["enable"][k] = call(f"cuCtxEnablePeerAccess {p}->{q}", cuda.cuCtxEnablePeerAccess, state[q]["ctx"], 0)
                if all(code in (0, 704) for code in pair["enable"]):  # 704: CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED
                    pair["copies"] = [copy(a, b), copy(b, a)]
            say("P " + json.dumps(pair))
    res["matrix_s"] = round(time.monotonic() - began, 4)

    def finish(gpu: int) -> None:
        if "retained" in state[gpu]:
            call(f"cuDevicePrimaryCtxRelease {gpu}", release, state[gpu]["retained"])

    began = time.monotonic()
    each(finish, [(gpu,) for gpu in state])
    res["release_s"] = round(time.monotonic() - began, 4)
    res["ok"] = True
    say("R " + json.dumps(res))


def together_helper(out_fd: int, in_fd: int, parent: int, gpus: "t.Sequence[t.Sequence[t.Any]]") -> None:  # pragma: no cover - runs in the helper
    """The peer helper's life: die with the parent, keep nothing of it open, every GPU it may check (``gpus``) visible."""
    if not detach(parent):
        return
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd > 2 and fd not in (out_fd, in_fd):
            try:
                os.close(fd)
            except OSError:
                pass
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(uuid for _gpu, uuid in gpus)
    os.environ["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
    for name in BAD_ENV:
        os.environ.pop(name, None)
    together(out_fd, in_fd)


# ---------------------------------------------------------------------- the parent's side
class _Running:
    def __init__(self, gpu: "int | str", pid: int, fd: int, go: int) -> None:
        self.gpu = gpu
        self.pid = pid
        self.fd = fd
        self.began = 0.0  # when it was told what to do (its deadline runs from then)
        self.step = "fork"
        self.buffer = b""
        self.result = None  # type: dict[str, t.Any] | None
        self.go = go  # the helper's pipe (its write end): its word, and the peer helper's "go"; -1 once closed
        self.gated = False  # the peer helper's "go" was written
        self.pairs = []  # type: list[dict[str, t.Any]]
        self.uuid = ""  # a start helper's GPU

    def tell(self, word: "dict[str, t.Any]") -> None:
        try:
            os.write(self.go, (json.dumps(word) + "\n").encode())
        except OSError:
            pass  # it answered already (libcuda could not be loaded, cuInit failed) and ended, or died: its pipe says which

    def dismiss(self) -> None:
        if self.go >= 0:
            os.close(self.go)
            self.go = -1


#: The steps of a start after its memset has completed: the peer copies may run beside them.
_PAST_MEMSET = ("cuMemFree_v2", "cuDevicePrimaryCtxRelease")


def _reap(pids: "list[int]", wait: float = REAP_WAIT_S) -> "list[int]":
    """Wait up to ``wait`` seconds for the helpers to be reaped; the pids still not reaped (stuck in the driver)."""
    left = list(pids)
    deadline = time.monotonic() + wait
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


class Helpers:
    """The CUDA starts' helpers, and the peer check's, forked before what they are to do is known.

    A CUDA start spends its first tenth of a second or more in ``cuInit`` and the device's identity (0.10-0.22 s on an
    H200), before it touches the GPU's memory. So the helpers can be forked while the processes that held the GPUs are
    still being ended (the kill and the residue phases of clean_slate_node): they make those calls, say ``S ready`` and
    wait, holding no context and no memory; :meth:`run` then tells each what to do (or to end: a GPU not read clean),
    and each deadline runs from then. Forked where they are needed at once (:func:`probe_all`), they are told at once.

    ``starts`` are ``[gpu, uuid]`` of the GPUs that may be started; ``peers`` those the peer check may cover (two or more,
    every one visible to its helper), or None.
    """

    def __init__(self, starts: "t.Sequence[t.Sequence[t.Any]]", peers: "t.Sequence[t.Sequence[t.Any]] | None" = None) -> None:
        self.running = []  # type: list[_Running]
        self.peer_gpus = [list(g) for g in peers] if peers and len(peers) >= 2 else []
        parent = os.getpid()
        for gpu, uuid in starts:
            read_fd, write_fd = os.pipe()
            go_read, go_write = os.pipe()
            pid = os.fork()
            if pid == 0:  # pragma: no cover - runs in the helper
                try:
                    os.close(read_fd)
                    os.close(go_write)
                    helper(write_fd, parent, uuid, 0.0, False, go_read)
                finally:
                    os._exit(0)
            os.close(write_fd)
            os.close(go_read)
            self.running.append(_Running(int(gpu), pid, read_fd, go_write))
            self.running[-1].uuid = str(uuid)
        if self.peer_gpus:
            read_fd, write_fd = os.pipe()
            go_read, go_write = os.pipe()
            pid = os.fork()
            if pid == 0:  # pragma: no cover - runs in the helper
                try:
                    os.close(read_fd)
                    os.close(go_write)
                    together_helper(write_fd, go_read, parent, self.peer_gpus)
                finally:
                    os._exit(0)
            os.close(write_fd)
            os.close(go_read)
            self.running.append(_Running("peers", pid, read_fd, go_write))
        self.done = False

    @property
    def pids(self) -> "list[int]":
        """The helpers' pids."""
        return [r.pid for r in self.running]

    def covers(self, targets: "t.Sequence[t.Sequence[t.Any]]", peers: "dict[str, t.Any] | None") -> bool:
        """Whether these helpers can do what is asked: not run yet, a start helper for every target (by UUID) and, for a
        peer check, its GPUs among the peer helper's."""
        if self.done:
            return False
        have = {(int(r.gpu), r.uuid) for r in self.running if r.gpu != "peers"}
        if not {(int(gpu), str(uuid)) for gpu, uuid, _c in targets} <= have:
            return False
        if peers and len(peers["gpus"]) >= 2:
            return {(int(g), str(u)) for g, u in peers["gpus"]} <= {(int(g), str(u)) for g, u in self.peer_gpus}
        return True

    def run(
        self,
        targets: "t.Sequence[t.Sequence[t.Any]]",
        fraction: float,
        timeout: float,
        peers: "dict[str, t.Any] | None" = None,
        clock: "t.Callable[[], float]" = time.monotonic,
        lifeline: "int | None" = None,
        on_step: "t.Callable[[int, str], None] | None" = None,
    ) -> "tuple[dict[int, dict[str, t.Any]], dict[str, t.Any] | None, list[int]]":
        """Tell each helper what to do (``targets``: ``(gpu, uuid, context_only)``, a GPU with a helper; ``peers``: what
        :func:`probe_all` takes, its GPUs among the peer helper's), end the others, wait for the answers: what
        :func:`probe_all` returns."""
        self.done = True
        wanted = {int(gpu): bool(context_only) for gpu, _uuid, context_only in targets}
        active = []  # type: list[_Running]
        for r in self.running:
            if r.gpu == "peers":
                if peers and len(peers["gpus"]) >= 2:
                    r.tell({"gpus": peers["gpus"], "size": int(peers["size"]), "reps": int(peers.get("reps", 2))})
                    r.began = clock()
                    active.append(r)
                else:
                    r.dismiss()
            elif int(r.gpu) in wanted:
                r.tell({"fraction": fraction, "context_only": wanted[int(r.gpu)]})
                r.began = clock()
                active.append(r)
            else:
                r.dismiss()
        starts = [r for r in active if r.gpu != "peers"]
        pending = list(active)
        while pending:
            now = clock()
            for r in list(pending):
                if now - r.began >= timeout:
                    _kill(r.pid)
                    r.result = {"ok": False, "hung": r.step, "waited_s": round(now - r.began, 3), "steps": {}}
                    pending.remove(r)
            for r in pending:
                # The peer copies wait until every start has passed its memset, which would share their memory bandwidth.
                if r.gpu == "peers" and not r.gated and r.step == "wait" and all(x.result is not None or x.step in _PAST_MEMSET for x in starts):
                    r.tell({"go": True})
                    r.gated = True
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
                        if on_step is not None and r.gpu != "peers":
                            on_step(int(r.gpu), body)
                    elif kind == "P":
                        r.pairs.append(json.loads(body))
                    elif kind == "R":
                        r.result = json.loads(body)
                if not chunk or r.result is not None:
                    if r.result is None:
                        r.result = {"ok": False, "died": r.step, "steps": {}}
                    r.result["elapsed_s"] = round(clock() - r.began, 4)
                    pending.remove(r)
        killed = [r for r in active if r.gpu == "peers" and r.result is not None and ("hung" in r.result or "abandoned" in r.result)]
        left = self._end(REAP_WAIT_S + (TEARDOWN_PER_CONTEXT_S * len(peers["gpus"]) if killed and peers else 0.0))
        out = {}  # type: dict[int, dict[str, t.Any]]
        together_raw = None
        for r in active:
            result = dict(r.result or {})
            result["pid"] = r.pid
            result.setdefault("elapsed_s", round(clock() - r.began, 4))
            if r.gpu == "peers":
                result["pairs"] = r.pairs
                together_raw = result
            else:
                out[int(r.gpu)] = result
        return out, together_raw, left

    def _end(self, wait: float) -> "list[int]":
        """Close every pipe and reap every helper (a dismissed one ends by itself, having made no context); the pids still
        not reaped after ``wait`` seconds (stuck in the driver)."""
        for r in self.running:
            r.dismiss()
            if r.fd >= 0:
                os.close(r.fd)
                r.fd = -1
        return _reap([r.pid for r in self.running], wait)

    def close(self) -> "list[int]":
        """End helpers that were never told what to do (the run stopped before the verification): killed and reaped."""
        if self.done:
            return []
        self.done = True
        for r in self.running:
            _kill(r.pid)
        return self._end(REAP_WAIT_S)


def probe(
    targets: "t.Sequence[t.Sequence[t.Any]]",
    fraction: float,
    timeout: float,
    clock: "t.Callable[[], float]" = time.monotonic,
    lifeline: "int | None" = None,
) -> "tuple[dict[int, dict[str, t.Any]], list[int]]":
    """Start CUDA on every target (``(gpu, uuid, context_only)``) at once, each in a helper of its own under ``timeout`` seconds
    (:func:`probe_all` without the peer check): each GPU's raw answer, and the helpers that did not die of SIGKILL in time."""
    raw, _peers, left = probe_all(targets, fraction, timeout, clock=clock, lifeline=lifeline)
    return raw, left


def probe_all(
    targets: "t.Sequence[t.Sequence[t.Any]]",
    fraction: float,
    timeout: float,
    peers: "dict[str, t.Any] | None" = None,
    clock: "t.Callable[[], float]" = time.monotonic,
    lifeline: "int | None" = None,
    on_step: "t.Callable[[int, str], None] | None" = None,
    early: "Helpers | None" = None,
) -> "tuple[dict[int, dict[str, t.Any]], dict[str, t.Any] | None, list[int]]":
    """Start CUDA on every target (``(gpu, uuid, context_only)``) at once, each in a helper of its own under ``timeout`` seconds,
    and with ``peers`` (``gpus``: ``[index, uuid]`` of two or more GPUs, ``size``: bytes a copy moves, ``reps``: copies
    timed together) the peer check of those GPUs in one more helper (:func:`together`), under the same deadline. With
    ``early`` (:class:`Helpers` forked before, covering every target and the peer check's GPUs), its helpers do it.

    Returns each GPU's raw answer (``ok``, ``code``, ``text``, ``step``, ``steps``, ``cuda_free_mib``,
    ``cuda_total_mib``, ``allocated_mib``, ``pid``, ``elapsed_s``; ``hung`` with the call it was in; ``dlopen_error``;
    ``abandoned`` with the call it was in when the caller went away), the peer helper's (its ``pairs`` as they came, and
    ``hung``, ``died`` or ``abandoned`` with the call it was in; None without ``peers``) and the helpers that did not die
    of SIGKILL in time. With ``lifeline`` (a file descriptor the caller holds the other end of), its end-of-file kills
    every helper still running. ``on_step(gpu, call)`` is called as each start announces a call (the module reads the
    GPU's PCIe link while its start keeps it busy).
    """
    if early is None or not early.covers(targets, peers):
        if early is not None:
            early.close()
        early = Helpers([(gpu, uuid) for gpu, uuid, _context_only in targets], peers["gpus"] if peers else None)
    return early.run(targets, fraction, timeout, peers, clock=clock, lifeline=lifeline, on_step=on_step)


# ---------------------------------------------------------------------- the room the next start needs, vLLM's cached answer
#: Where vLLM keeps its P2P answer: ``$VLLM_CACHE_ROOT``, by default ``~/.cache/vllm`` (vllm/envs.py), as
#: ``gpu_p2p_access_cache_for_<CUDA_VISIBLE_DEVICES>.json`` (vllm/distributed/device_communicators/all_reduce_utils.py,
#: custom_all_reduce_utils.py in older releases):
#: root's and each user's under /home, unless told otherwise (``peers_cache_dirs``: a server's own VLLM_CACHE_ROOT).
P2P_CACHE_DIRS = ("/root/.cache/vllm", "/home/*/.cache/vllm")
P2P_CACHE_NAME = re.compile(r"^gpu_p2p_access_cache_for_(.+)\.json$")
_P2P_CACHE_MAX = 1 << 20
_GLOB = re.compile(r"[*?[]")


def shm_room(path: str = "/dev/shm") -> "dict[str, t.Any]":
    """``{path, size_mib, free_mib}`` of the file system the next start's shared memory goes to (``error`` when it cannot be read)."""
    try:
        st = os.statvfs(path)
    except OSError as exc:
        return {"path": path, "size_mib": None, "free_mib": None, "error": exc.strerror}
    return {"path": path, "size_mib": st.f_blocks * st.f_frsize // MIB, "free_mib": st.f_bavail * st.f_frsize // MIB}


def pair_works(pair: "dict[str, t.Any]") -> "bool | None":
    """What the peer check found of one pair (its ``P`` answer): True when the driver offers peer access both ways, it was
    enabled and both copies came back equal; False when the driver refuses it, enabling it failed or a copy failed or
    came back changed; None when it was not checked."""
    can = pair.get("can")
    if not can or None in can:
        return None
    if can != [True, True]:
        return False  # the driver refuses it (False), or its answer was an error (the CUresult)
    if any(code not in (0, 704) for code in pair.get("enable") or []):
        return False
    copies = pair.get("copies") or []
    if len(copies) < 2:
        return None
    return all(c.get("code") is None and c.get("match") is True for c in copies)


def _no_link_below(root: str, parts: "t.Sequence[str]") -> bool:
    """No component of ``root/parts...`` below ``root`` is a symbolic link (nothing is followed out of the scope)."""
    here = root
    for part in parts:
        here = os.path.join(here, part)
        if os.path.islink(here) or not os.path.isdir(here):
            return False
    return True


def _cache_dirs(root: str, patterns: "t.Sequence[str]") -> "list[list[str]]":
    """The directories ``patterns`` name under ``root`` (a component may be a glob: ``/home/*/.cache/vllm``), as lists of
    components, those reached through a symbolic link left out (nothing is followed out of the scope)."""
    found = []  # type: list[list[str]]
    for pattern in patterns:
        partial = [[]]  # type: list[list[str]]
        for part in [x for x in pattern.split("/") if x]:
            grown = []
            for parts in partial:
                if _GLOB.search(part):
                    try:
                        names = sorted(os.listdir(os.path.join(root, *parts)))
                    except OSError:
                        names = []
                    grown += [[*parts, n] for n in names if fnmatch.fnmatchcase(n, part)]
                else:
                    grown.append([*parts, part])
            partial = [parts for parts in grown if _no_link_below(root, parts)]
        found += [parts for parts in partial if parts and parts not in found]
    return found


def p2p_caches(root: str = "/", dirs: "t.Sequence[str]" = P2P_CACHE_DIRS) -> "list[dict[str, t.Any]]":
    """vLLM's cached P2P answers in ``dirs`` under ``root``: ``{path, devices, entries, dev, ino}`` each (``error`` for one
    that cannot be read); ``devices`` is its name's CUDA_VISIBLE_DEVICES list, ``entries`` its ``"a->b": bool`` (local ids)."""
    out = []
    for parts in _cache_dirs(root, dirs):
        where = os.path.join(root, *parts)
        try:
            names = sorted(os.listdir(where))
        except OSError:
            continue
        for name in names:
            m = P2P_CACHE_NAME.match(name)
            if not m:
                continue
            path = os.path.join(where, name)
            item = {"path": "/" + "/".join([*parts, name]), "devices": m.group(1).split(","), "entries": {}}  # type: dict[str, t.Any]
            try:
                fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
            except OSError as exc:
                item["error"] = exc.strerror
                out.append(item)
                continue
            try:
                st = os.fstat(fd)
                item.update(dev=st.st_dev, ino=st.st_ino)
                if not stat.S_ISREG(st.st_mode) or st.st_size > _P2P_CACHE_MAX:
                    item["error"] = "not a regular file of at most 1 MiB"
                else:
                    data = json.loads(os.read(fd, _P2P_CACHE_MAX).decode("utf-8", "replace"))
                    item["entries"] = {str(k): v for k, v in data.items() if isinstance(v, bool)} if isinstance(data, dict) else {}
            except (OSError, ValueError) as exc:
                item["error"] = str(exc)
            finally:
                os.close(fd)
            out.append(item)
    return out


def stale_pairs(cache: "dict[str, t.Any]", ordinals: "t.Sequence[int]", uuids: "dict[str, int]", works: "dict[str, bool | None]") -> "list[list[int]]":
    """The GPU pairs (indexes, ``[a, b]`` with a < b) one cache says peer access works between and the check found it does not.

    A cache's local id ``k`` is the ``k``-th entry of its name's device list: a UUID (``GPU-...``), or a CUDA ordinal,
    the ``ordinals[ordinal]``-th GPU here (CUDA numbers the GPUs a process sees in PCI order, as NVML does, for GPUs of
    one model). ``works`` is :func:`pair_works` of each checked pair, keyed ``"a-b"`` (a < b)."""
    index = []  # type: list[int | None]
    for entry in cache.get("devices") or []:
        entry = entry.strip()
        if entry.lower().startswith("gpu-"):
            index.append(uuids.get(entry.lower()))
        elif entry.isdigit() and int(entry) < len(ordinals):
            index.append(ordinals[int(entry)])
        else:
            index.append(None)
    found = set()
    for key, said in (cache.get("entries") or {}).items():
        a, _sep, b = key.partition("->")
        if said is not True or not (a.isdigit() and b.isdigit()) or max(int(a), int(b)) >= len(index):
            continue
        x, y = index[int(a)], index[int(b)]
        if x is None or y is None or x == y:
            continue
        pair = (min(x, y), max(x, y))
        if works.get("{}-{}".format(*pair)) is False:
            found.add(pair)
    return [list(p) for p in sorted(found)]


def remove_cache(root: str, item: "dict[str, t.Any]") -> "str | None":
    """Remove one cache file, only when it is still the file that was read (device and inode, through its directory, never
    following a link); None when removed, else why not."""
    where, name = os.path.split(item["path"])
    try:
        dfd = os.open(os.path.join(root, where.lstrip("/")), os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        return exc.strerror
    try:
        st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
        if (st.st_dev, st.st_ino) != (item.get("dev"), item.get("ino")) or not stat.S_ISREG(st.st_mode):
            return "it changed since it was read"
        os.unlink(name, dir_fd=dfd)
    except OSError as exc:
        return exc.strerror
    finally:
        os.close(dfd)
    return None


def next_start(root: str, raw_peers: "dict[str, t.Any] | None", request: "dict[str, t.Any]") -> "dict[str, t.Any]":
    """The room in /dev/shm and vLLM's cached answers of one scope (``root``: / here, the container's own inside it), each
    cache with the pairs it is stale for and, with ``remove``, removed. ``request``: ``shm`` (a path or None),
    ``peers_cache`` (None, or ``dirs`` to look in, ``remove``, and ``ordinals`` and ``uuids`` as :func:`stale_pairs` takes them)."""
    out = {"shm": shm_room(request["shm"]) if request.get("shm") else None, "p2p_caches": None}  # type: dict[str, t.Any]
    asked = request.get("peers_cache")
    if asked:
        works = {}
        for pair in (raw_peers or {}).get("pairs") or []:
            a, b = sorted(pair["gpus"])
            works[f"{a}-{b}"] = pair_works(pair)
        caches = p2p_caches(root, asked.get("dirs") or P2P_CACHE_DIRS)
        for item in caches:
            item["stale"] = stale_pairs(item, asked["ordinals"], asked["uuids"], works)
            item["removed"] = False
            if item["stale"] and asked.get("remove"):
                why = remove_cache(root, item)
                item["removed"] = why is None
                if why:
                    item["not_removed"] = why
        out["p2p_caches"] = caches
    return out


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
    mig_on]`` each), ``nvml_count``, ``targets`` (``[gpu, uuid, context_only]`` each), ``fraction``, ``timeout`` and
    ``peers`` (None, or what :func:`probe_all` takes), ``shm`` and ``peers_cache`` (:func:`next_start`). Prints :data:`ANSWER`
    and JSON: ``devices`` (:func:`device_nodes`), ``raw``, ``peers`` and ``left_behind`` (:func:`probe_all`), ``shm`` and
    ``p2p_caches`` (:func:`next_start`, the container's own),
    ``python`` (this interpreter's version) and ``pid`` (the program's, as the container numbers it)."""
    request = json.loads(argv[1])
    # stdin is the caller's pipe: it reads end-of-file once the caller (pct exec, the module) is gone. Anything else
    # there (a terminal, /dev/null) says nothing of the caller, and only the deadlines hold.
    mode = os.fstat(0).st_mode
    lifeline = 0 if stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode) else None
    raw, peers, left = probe_all(request["targets"], request["fraction"], request["timeout"], request.get("peers"), lifeline=lifeline)
    # The device files after the starts: the driver's nvidia-modprobe may have made a missing node (as root), as a
    # server's start would; what is still absent, wrong or refused then is the fault.
    devices = device_nodes(request["device_dir"], request["gpus"], request["nvml_count"])
    answer = {"devices": devices, "raw": raw, "peers": peers, "left_behind": left, "python": ".".join(map(str, sys.version_info[:3])), "pid": os.getpid()}
    answer.update(next_start("/", peers, request))
    sys.stdout.write(ANSWER + json.dumps(answer) + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
