# Copyright (c) 2026, gpuops.clean_slate maintainers
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# Note: this module_util is PRIVATE to the collection; it may change without notice.

"""The startability program inside a container, from its Proxmox VE node (gpu_mem_verify's container scope).

A container cleaned from its node is started in by the next server, not the node: a container without
``/dev/nvidia-uvm`` (or without a GPU's device file, or with a device cgroup that refuses one) reads clean through
NVML on the node while every CUDA start inside it fails. So in container scope the device files are looked at and
the CUDA start is made inside the container: :mod:`._cuda_program`'s text, handed to the container's own Python 3
(3.6 or later, the standard library only) through ``pct exec <vmid> --keep-env 0 -- /bin/sh -c <launch> ...``
(:data:`LAUNCH` picks the interpreter), nothing copied into the container. It answers one line of JSON.

A hang must not hang the run: the program kills each GPU's helper at its own deadline inside the container, and
this side gives the whole ``pct exec`` that deadline plus :data:`PCT_GRACE_S`, then SIGKILLs its process group
(pct, lxc-attach) and closes the program's stdin, which the program watches: it then ends its helpers too.

The program and its helpers are verified gone from the node before the verdict (:func:`end_strays`): each run's request
carries a random token, so every process of that run (pct, lxc-attach, the program, its forked helpers) has it on its
command line, and the node sees the container's processes in its own /proc. Whatever still carries it once ``pct exec``
has returned is pinned (pidfd, identity read again) and SIGKILLed; one that does not go is said.

Each way the start cannot be made there (no pct, no python3 in the container, pct's own failure, the deadline, an
unreadable answer) comes back as a sentence that says what to do; the caller names it ``cuda_unproven``.
"""

from __future__ import annotations

import json
import os
import secrets
import select
import signal
import subprocess
import time
import typing as t

from ansible_collections.gpuops.clean_slate.plugins.module_utils import _cuda_program, _pct, _proctable

#: Seconds ``pct exec`` may take beyond the probes' own deadline: pct's start (about a second on Proxmox VE, which
#: compiles its Perl modules first), lxc-attach, and the container's python3 starting on a loaded node.
PCT_GRACE_S = 15.0
#: The program's first Python 3 on the container's PATH (``--keep-env 0``: LXC's default PATH), or RHEL's platform
#: Python; exit 127 saying :data:`NO_PYTHON` when there is none. The program text and the request arrive as
#: positional parameters, so the shell never parses them.
LAUNCH = (
    'for py in python3 /usr/libexec/platform-python; do if command -v "$py" >/dev/null 2>&1; then exec "$py" -I -c "$1" "$2"; fi; done;'
    ' echo "$0: no python3" >&2; exit 127'
)
NAME = "gpuops-cuda-probe"
NO_PYTHON = f"{NAME}: no python3"
#: Most bytes kept of the program's stdout and stderr (its answer is a few KiB per GPU).
MAX_OUTPUT = 4 << 20


def argv(pct: str, vmid: int, request: dict[str, t.Any], sudo: t.Sequence[str] = ()) -> list[str]:
    """The ``pct exec`` command line that runs the program with ``request`` in container ``vmid``."""
    inner = ["/bin/sh", "-c", LAUNCH, NAME, _cuda_program.source(), json.dumps(request, separators=(",", ":"))]
    return _pct.PctExec(pct, _no_run, sudo=list(sudo)).exec_argv(vmid, inner, keep_env=False)


def _no_run(_argv: list[str], _data: str | None, _binary: bool) -> tuple[int, str, str]:  # pragma: no cover - never called
    raise AssertionError("exec_argv runs nothing")


def run(cmd: list[str], deadline_s: float, clock: t.Callable[[], float] = time.monotonic) -> dict[str, t.Any]:
    """Run ``cmd`` in a session of its own, its stdin a pipe held open until it ends; at ``deadline_s`` its process group
    is SIGKILLed. ``{rc, stdout, stderr, elapsed_s, timed_out}`` (``rc`` None when it could not be reaped)."""
    began = clock()
    try:
        # Not the module's run_command: it closes stdin once its data is written (here the program's lifeline, held open
        # until pct ends) and has no deadline that can kill a process group.
        proc = subprocess.Popen(  # pylint: disable=ansible-bad-function
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True
        )
    except OSError as exc:
        return {"rc": None, "stdout": "", "stderr": str(exc), "elapsed_s": 0.0, "timed_out": False, "error": str(exc)}
    stdout, stderr = t.cast(t.IO[bytes], proc.stdout), t.cast(t.IO[bytes], proc.stderr)
    got: dict[int, bytearray] = {stdout.fileno(): bytearray(), stderr.fileno(): bytearray()}
    out, err = got[stdout.fileno()], got[stderr.fileno()]
    open_fds = list(got)
    try:
        while open_fds:
            left = began + deadline_s - clock()
            if left <= 0:
                break
            for fd in select.select(open_fds, [], [], left)[0]:
                chunk = os.read(fd, 65536)
                if not chunk:
                    open_fds.remove(fd)
                elif len(got[fd]) < MAX_OUTPUT:
                    got[fd] += chunk
        timed_out = bool(open_fds)
        if timed_out:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
    finally:
        # The program's lifeline: at this end-of-file it ends whatever helper it still runs.
        for stream in (proc.stdin, stdout, stderr):
            if stream is not None:
                stream.close()
    try:
        rc: int | None = proc.wait(timeout=max(1.0, began + deadline_s - clock()) if not timed_out else 5.0)
    except subprocess.TimeoutExpired:
        rc = None
    return {
        "rc": rc,
        "stdout": out.decode("utf-8", "replace"),
        "stderr": err.decode("utf-8", "replace"),
        "elapsed_s": round(clock() - began, 4),
        "timed_out": timed_out,
    }


def answer_of(vmid: int, done: dict[str, t.Any], deadline_s: float) -> dict[str, t.Any]:
    """The program's answer from a finished run (``ok`` True, with ``devices``, ``raw``, ``left_behind``, ``python``, and
    ``peers``, ``shm`` and ``p2p_caches`` of the checks together), or
    ``ok`` False with ``why``: a sentence that says why the start could not be made in the container and what to do."""
    base = {"vmid": vmid, "elapsed_s": done["elapsed_s"], "rc": done["rc"]}
    lines = [line for line in done["stdout"].splitlines() if line.startswith(_cuda_program.ANSWER)]
    if lines and done["rc"] == 0 and not done["timed_out"]:
        try:
            answer = json.loads(lines[-1][len(_cuda_program.ANSWER) :])
        except ValueError:
            answer = None
        if isinstance(answer, dict) and {"devices", "raw", "left_behind"} <= set(answer):
            devices = dict(answer["devices"])
            devices["gpus"] = {int(k): v for k, v in devices["gpus"].items()}  # JSON keys are text
            raw = {int(k): v for k, v in answer["raw"].items()}
            together = {k: answer.get(k) for k in ("peers", "shm", "p2p_caches")}  # ready together (issue 39), the container's
            return {**base, "ok": True, "devices": devices, "raw": raw, "left_behind": answer["left_behind"], "python": answer.get("python"), **together}
    stderr = done["stderr"].strip()
    last = stderr.splitlines()[-1] if stderr else ""
    if done.get("error"):
        why = f"pct could not be started ({done['error']})"
    elif done["timed_out"]:
        why = (
            f"pct exec did not answer within {deadline_s:g} s (cuda_probe_timeout plus {PCT_GRACE_S:g} s for pct and the container's"
            " python3), and its process group was killed. Check that pct answers on this node (pct exec"
            f" {vmid} -- true) and that the container is not frozen"
        )
    elif done["rc"] == 127 and NO_PYTHON in stderr:
        why = (
            f"container {vmid} has no python3, which the probe runs in there (Python 3.6 or later, its standard library only, nothing"
            " is installed or copied). Install one in the container (apt-get install python3-minimal, dnf install python3), or"
            " clean the container from inside (its own SSH, or the inventory's pct_remote), or set cuda_probe: false"
            " (clean_slate_cuda_probe) to accept its GPUs on NVML's word alone"
        )
    elif done["rc"] == 255 and _pct.classify_pct_error(stderr, vmid):
        why = t.cast(tuple, _pct.classify_pct_error(stderr, vmid))[1].split("\n")[0]
    elif "SyntaxError" in stderr:
        why = f"the container's python3 cannot run the probe ({last}): it is older than Python 3.6. Install Python 3.6 or later in container {vmid}"
    elif done["rc"] != 0:
        why = f"the probe failed in container {vmid} (exit status {done['rc']}{': ' + last if last else ''})"
    else:
        why = f"the probe in container {vmid} printed no answer{' (' + last + ')' if last else ''}"
    return {**base, "ok": False, "why": why, "stderr": stderr[-2000:]}


def _gone(pid: int, fd: int | None) -> bool:
    if fd is not None:
        return bool(select.select([fd], [], [], 0)[0])  # a pidfd reads ready once its process has exited
    st = _proctable.read_stat(pid)
    return st is None or st["state"] in ("Z", "X")


def end_strays(token: str, wait_s: float = _cuda_program.REAP_WAIT_S, clock: t.Callable[[], float] = time.monotonic) -> dict[str, list[int]]:
    """End what is left of one run of the program: every process (but this one and its ancestors) whose command line
    carries ``token``. Each is pinned by a pidfd, its identity read again (a pid reused since cannot be hit), then
    SIGKILLed; up to ``wait_s`` seconds are given for all to go. ``ended``: the pids found (normally none: the program
    reaps its helpers and pct returns once it has exited), ``left``: those still there (stuck in the driver, state D).
    """
    mark = token.encode()
    mine = {os.getpid(), *_proctable.ancestors(os.getpid())}
    found: list[tuple[int, int | None]] = []
    for pid in _proctable.pids():
        st = None if pid in mine else _proctable.read_stat(pid)
        try:
            # A process in state D is read under a deadline (its command line may wait on a lock the driver holds).
            listed = st is not None and mark in _proctable.read_guarded(f"/proc/{pid}/cmdline", st["state"])
        except OSError:
            listed = False
        seen = _proctable.identity(pid) if listed else None
        if seen is None or mark not in seen[2]:
            continue
        fd: int | None = None
        try:
            fd = os.pidfd_open(pid) if hasattr(os, "pidfd_open") else None
        except OSError:
            continue  # gone already
        if _proctable.identity(pid) != seen:
            if fd is not None:
                os.close(fd)
            continue  # gone, or the pid already names another process
        try:
            if fd is not None:
                signal.pidfd_send_signal(fd, signal.SIGKILL)
            else:  # pragma: no cover - kernels before 5.3: the identity was read just before
                os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        found.append((pid, fd))
    deadline = clock() + wait_s
    left = [pid for pid, fd in found]
    while left:
        left = [pid for pid, fd in found if pid in left and not _gone(pid, fd)]
        if not left or clock() >= deadline:
            break
        time.sleep(0.005)
    for _pid, fd in found:
        if fd is not None:
            os.close(fd)
    return {"ended": [pid for pid, _fd in found], "left": left}


def runner(module: _pct.Host, clock: t.Callable[[], float] = time.monotonic) -> t.Callable[[int, dict[str, t.Any], float], dict[str, t.Any]]:
    """The container scope's way in for a module (``_verify.InContainer``): pct from ``pct_path`` (else PATH or /usr/sbin), through
    ``sudo -n`` when the module does not run as root (whose SIGKILL then reaches sudo only). The answer (:func:`answer_of`)
    also says what of the run was still there after ``pct exec`` returned and was ended, and what is left (:func:`end_strays`)."""

    def in_container(vmid: int, request: dict[str, t.Any], timeout: float) -> dict[str, t.Any]:
        deadline_s = timeout + _cuda_program.REAP_WAIT_S + PCT_GRACE_S
        pct = _pct.find_pct(module, module.params.get("pct_path"))
        if not pct:
            why = f"pct was not found on PATH or in /usr/sbin (set pct_path), so nothing could be run inside container {vmid}"
            return {"vmid": vmid, "ok": False, "why": why, "elapsed_s": 0.0, "rc": None}
        sudo: list[str] = []
        if os.geteuid() != 0:
            found = module.get_bin_path("sudo")
            sudo = [found, "-n"] if found else []
        # The run's mark on every process of it, by which the node finds anything of it left (end_strays).
        token = secrets.token_hex(16)
        done = run(argv(pct, vmid, {**request, "run": token}, sudo), deadline_s, clock)
        return {**answer_of(vmid, done, deadline_s), **end_strays(token, clock=clock)}

    return in_container
