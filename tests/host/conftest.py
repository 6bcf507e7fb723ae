"""The host gate: the modules in the machine's initial PID namespace, as on a real GPU host.

Every other gate runs in a private PID namespace (tools/pidns-run) or in the lab's
namespaces, so the branches real hosts take never ran there: kernel threads and the machine's
PID 1 in view, an unflagged orphan diagnosed as ``orphaned_context``, the host branch of the
/proc readers, and the default ``device_dir`` (``/dev``). This gate runs them, as root, in the
initial PID namespace, against a simulated node whose device files the test publishes at
``/dev/nvidia*``.

Why it cannot signal anything but the victims it creates, four independent layers:

1. **The kernel refuses.** Ansible and everything it starts run under a seccomp filter
   (tests/support/sigguard.py) that stops every signal system call before it takes effect; the
   guard in this process lets it through only to a victim this test spawned (its child, not
   reaped while Ansible runs, so its pid cannot be reused), to a process of Ansible's own tree, or
   as signal 0. Anything else fails with EPERM and fails the test. A bug in layers 2-4 can
   therefore not reach PID 1, sshd or another engineer's process: it is refused and reported.
2. **Discovery sees only the test's processes.** NVML is the simulator, which lists only the
   contexts of this test's workers (and, where a test asks, pids named on purpose to prove the
   protection rules); ``/dev`` is a tmpfs private to this process's mount namespace
   (gpusim.devns), holding only the node's files, so the device-file scan finds only its holders.
3. **The patterns cannot match anything else**: each carries a random token that only the
   victims' command lines contain.
4. **The protection rules** of the modules (PID 1, kernel threads, the module and its ancestors,
   protected daemons) are the last net, and a test proves they hold here.

Run by ``tools/run-gates`` (gate "host") and ``make host``; never under pidns-run. It
fails, rather than skips, where it cannot run guarded.
"""

from __future__ import annotations

import fcntl
import os
import typing as t

import pytest
from gpusim import Node
from gpusim.devns import dev_is_private, private_dev
from host.hostgate import Host

INITIAL_PIDNS = 0xEFFFFFFC
MACHINE_LOCK = "/run/lock/gpuops-clean-slate-host-gate.lock"
_MACHINE_LOCK = -1


def pytest_configure(config: pytest.Config) -> None:
    if os.geteuid() != 0:
        raise pytest.UsageError("tests/host needs root (it publishes device files and guards signals with seccomp)")
    if os.stat("/proc/self/ns/pid").st_ino != INITIAL_PIDNS:
        raise pytest.UsageError("tests/host runs in the machine's initial PID namespace: start it directly, not under pidns-run")
    # One host gate per machine at a time. It runs in the machine's initial PID namespace, where every
    # process that holds an NVIDIA character device counts as a GPU holder, as on a real host: a second
    # gate running beside this one (another checkout's `make test`) would have its workers found here and
    # the guard would (rightly) refuse the signals. Held until this process exits.
    global _MACHINE_LOCK
    _MACHINE_LOCK = os.open(MACHINE_LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(_MACHINE_LOCK, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        print(f"tests/host: another host gate runs on this machine; waiting for {MACHINE_LOCK}", flush=True)
        fcntl.flock(_MACHINE_LOCK, fcntl.LOCK_EX)
    # Before any thread starts: this process (and what it starts) gets a mount namespace with a
    # /dev of its own; the machine's /dev is not touched.
    private_dev()
    assert dev_is_private()


@pytest.fixture
def host() -> t.Iterator[Host]:
    with Node(gpus=4) as node:
        # Realistic teardown here too: workers wait in the kernel until their contexts are freed.
        assert node.teardown, "no FUSE in the private /dev: the simulated driver could not mount teardown/"
        node.publish_devices("/dev")
        h = Host(node)
        yield h
        assert h.guard.violations == [], h.guard.violations
