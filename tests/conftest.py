"""Shared pytest setup. The checkout (ansible_collections.gpuops.clean_slate) and the test kit (support, lab,
gpusim, pvesim) are importable because ``make setup`` installs them into the venv as a .pth file
(the Makefile's ``.testkit`` rule; tests/README.md maps the tree): nothing here patches sys.path."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent

if not (ROOT / "ansible_collections" / "gpuops" / "clean_slate").exists():
    raise RuntimeError("run `make setup` first: ansible_collections/gpuops/clean_slate is missing")


def pytest_configure(config: pytest.Config) -> None:
    # A pytest-xdist worker of the functional gate runs in a PID namespace of its own with a fresh /tmp
    # (tools/functional): the basetemp its controller hands it lies under the controller's /tmp, whose
    # directories this /tmp does not have. pytest makes the basetemp itself, not its parents.
    basetemp = config.getoption("basetemp", None)
    if basetemp and hasattr(config, "workerinput"):
        Path(basetemp).parent.mkdir(parents=True, exist_ok=True)


_kit = importlib.util.find_spec("gpusim")
if _kit is None or _kit.origin is None or Path(_kit.origin).resolve().parents[3] != ROOT:
    raise RuntimeError("run `make setup` first: the test kit (tests/, tests/sim) of this checkout is not installed in the venv")
