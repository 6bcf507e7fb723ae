"""The PID-reuse race: a target exits and a new process takes its pid between
discovery and signal. Forced with /proc/sys/kernel/ns_last_pid inside this
test's private PID namespace, against the real discovery and escalation code."""

from __future__ import annotations

import subprocess
import sys
import time

from support.orphans import end, spawn_orphan

from ansible_collections.gpuops.clean_slate.plugins.module_utils import _procs, _proctable, _signals


def spawn_sleeper() -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    # Until the child has exec'd, its command line is still the parent's.
    for _unused in range(500):
        with open(f"/proc/{proc.pid}/cmdline", "rb") as fh:
            if b"time.sleep(60)" in fh.read():
                break
        time.sleep(0.005)
    return proc


def spawn_unrelated() -> subprocess.Popen:
    # What usually takes a recycled pid: some other program, started in the same clock tick or not.
    return subprocess.Popen(["sleep", "60"])


def test_reused_pid_is_never_signalled() -> None:
    # Not a child of this process, which plays the module here (discovery protects what the module started).
    pid = spawn_orphan([sys.executable, "-c", "import time; time.sleep(60)"], ready=b"time.sleep(60)")
    req = _procs.Request(
        gpus=[], all_gpus=True, nvml_processes={}, use_nvml=False, use_device_files=False, patterns=_procs.compile_patterns(["time.sleep\\(60\\)"])
    )
    plan = _procs.discover(req)
    candidate = next(c for c in plan.targets if c.pid == pid)

    # The target exits and is reaped; the next fork in this namespace gets the same pid.
    end(pid)
    with open("/proc/sys/kernel/ns_last_pid", "w") as fh:
        fh.write(str(pid - 1))
    impostor = spawn_unrelated()
    try:
        assert impostor.pid == pid, "could not force the pid to be reused"
        victim = _signals.pin(pid, candidate.identity)
        _signals.escalate([victim], grace_period=0.5, kill_timeout=0.5)
        assert victim.outcome == "vanished"
        assert victim.signals_sent == []
        assert impostor.poll() is None, "the process that took over the pid was signalled"
    finally:
        impostor.kill()
        impostor.wait()


def test_pid_reused_after_pinning_is_not_signalled_either() -> None:
    # Pinned with a pidfd first; then the pid is recycled: the pidfd still names the dead process.
    target = spawn_sleeper()
    victim = _signals.pin(target.pid, _proctable.identity(target.pid))
    assert victim.outcome is None and victim.pidfd is not None
    pid = target.pid
    target.kill()
    target.wait()
    with open("/proc/sys/kernel/ns_last_pid", "w") as fh:
        fh.write(str(pid - 1))
    # Even an identical twin started in the same tick cannot be hit: the pidfd names the dead one.
    impostor = spawn_sleeper()
    try:
        assert impostor.pid == pid
        _signals.escalate([victim], grace_period=0.5, kill_timeout=0.5)
        assert victim.signals_sent == []
        assert victim.outcome == "vanished"
        assert impostor.poll() is None
    finally:
        impostor.kill()
        impostor.wait()
