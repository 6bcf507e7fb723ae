"""Fixtures for the simulator's self-tests.

The simulator's tests start, stop and signal real processes (they carry the
``pidns`` marker), so they must run in a private PID namespace:
``tools/pidns-run .venv/bin/pytest tests/sim/tests``. Outside one they
are skipped, except those marked ``host_safe``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from gpusim import Node, Sandbox
from gpusim.procfs import in_private_pidns

PROBE = Path(__file__).resolve().parent / "nvml_probe.py"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "pidns: starts and signals processes: only in a private PID namespace")
    config.addinivalue_line("markers", "host_safe: exempt from the pidns rule (starts nothing that needs it)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests that start and signal processes (module marker ``pidns``, or any
    test here using the ``node`` fixture) run only in a private PID namespace."""
    if in_private_pidns():
        return
    skip = pytest.mark.skip(reason="signals processes: run under tools/pidns-run")
    here = Path(__file__).resolve().parent
    for item in items:  # this hook sees every item of the session: only ours are affected
        if not Path(str(item.fspath)).resolve().is_relative_to(here) or "host_safe" in item.keywords:
            continue
        if "pidns" in item.keywords or "node" in getattr(item, "fixturenames", ()):
            item.add_marker(skip)


@pytest.fixture
def node() -> Iterator[Node]:
    """A fresh default node (8 × H200), stopped afterwards."""
    n = Node().start()
    try:
        yield n
    finally:
        n.stop()


def run_nvml(node: Node, code: str, sandbox: Sandbox | None = None, env: dict[str, Any] | None = None, timeout: float = 60) -> Any:
    """Run `code` with the real pynvml in a subprocess on `node` (inside
    `sandbox` if given); return its `result`."""
    argv = [sys.executable, str(PROBE), textwrap.dedent(code)]
    if sandbox is not None:
        proc = sandbox.run(argv, env=env, capture_output=True, text=True, timeout=timeout)
    else:
        full = {**os.environ, **node.env(), **(env or {})}
        proc = subprocess.run(argv, env=full, capture_output=True, text=True, timeout=timeout, check=False)
    assert proc.returncode == 0, f"probe failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture
def nvml() -> Any:
    """run_nvml(node, code, sandbox=None, env=None): the real pynvml in a subprocess."""
    return run_nvml
