"""Shared pytest setup: make the checkout importable as gpuops.clean_slate
and the test support packages (tests/support, tests/sim) importable."""

from __future__ import annotations

import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent

for p in (ROOT, TESTS, TESTS / "sim"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

if not (ROOT / "ansible_collections" / "gpuops" / "clean_slate").exists():
    raise RuntimeError("run `make setup` first: ansible_collections/gpuops/clean_slate is missing")
