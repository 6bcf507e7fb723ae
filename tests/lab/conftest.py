"""Fixtures for the lab tests: the lab is built once per session and reset before each test.

The lab needs root and a private PID namespace (``make lab`` runs pytest under
tools/pidns-run); anywhere else its tests are skipped. It is torn down by the session
fixture's finalizer, which pytest also runs on Ctrl-C; SIGTERM and SIGHUP are turned into
KeyboardInterrupt so that they unwind the same way, and an atexit hook catches what is left.
Whatever still escaped dies with the pidns-run namespace (processes, and the network
namespaces, which live on the namespace's private /run/netns).
"""

from __future__ import annotations

import atexit
import os
import signal
import typing as t

import pytest
from lab.builder import Lab, in_private_pidns


def _interrupt(signum: int, _frame: t.Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


@pytest.fixture(scope="session")
def lab() -> t.Iterator[Lab]:
    if os.geteuid() != 0 or not in_private_pidns() or os.environ.get("GPUOPS_PIDNS") != "1":
        pytest.skip("the lab needs root inside tools/pidns-run: run `make lab`")
    previous = {sig: signal.signal(sig, _interrupt) for sig in (signal.SIGTERM, signal.SIGHUP)}
    the_lab = Lab()
    atexit.register(the_lab.teardown)
    try:
        the_lab.build()
        yield the_lab
    finally:
        try:
            the_lab.teardown()
        finally:
            atexit.unregister(the_lab.teardown)
            for sig, handler in previous.items():
                signal.signal(sig, handler)


@pytest.fixture
def fresh(lab: Lab) -> t.Iterator[Lab]:
    """The lab as built: every host up and reachable, no faults, a new workload everywhere."""
    lab.reset()
    yield lab
