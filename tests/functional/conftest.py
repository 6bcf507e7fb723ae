"""Fixtures for functional tests: a simulated GPU node, a sandbox (private PID
namespace) for the workloads and the Ansible run, and a helper that runs a
module through real ansible-playbook inside that sandbox."""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
import typing as t
from pathlib import Path

import pytest
from gpusim import Node
from gpusim.residue import private_shm
from support.modules import ModuleRunner


@pytest.fixture
def node() -> t.Iterator[Node]:
    with Node(gpus=8) as n:
        yield n


@pytest.fixture
def sandbox(node: Node):
    sb = node.sandbox()
    yield sb
    sb.stop()


@pytest.fixture
def stand_in_tmp() -> t.Iterator[Path]:
    """A test-owned stand-in for /tmp with a short path (a unix socket path has 107 bytes at most): the temp
    directory of the servers a test starts, which no other test's residue shares."""
    top = Path(tempfile.mkdtemp(prefix="t-"))
    yield top
    shutil.rmtree(top, ignore_errors=True)


@pytest.fixture
def shm_sandbox(sandbox):
    """The sandbox with a /dev/shm of its own (a tmpfs), for residue made there."""
    private_shm(sandbox)
    return sandbox


@pytest.fixture
def mod(node: Node, sandbox) -> ModuleRunner:
    return ModuleRunner(node, sandbox)


def pytest_configure(config: pytest.Config) -> None:
    """Let other users traverse the checkout (not list it), as a checkout under a 0755 directory already does.

    Tests run modules as uid 65534 (test_nonroot, the unprivileged container of test_realism) with the venv's
    interpreter inside the checkout; a clone into `mktemp -d` (mode 0700, as CI makes it) would hide it from
    them. Only the checkout's own directory gets o+x, and only when it lacks it; nothing is listed or readable
    that was not before below it.
    """
    root = Path(__file__).resolve().parents[2]
    mode = root.stat().st_mode
    if not mode & stat.S_IXOTH:
        os.chmod(root, stat.S_IMODE(mode) | stat.S_IXOTH)
