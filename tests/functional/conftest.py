"""Fixtures for functional tests: a simulated GPU node, a sandbox (private PID
namespace) for the workloads and the Ansible run, and a helper that runs a
module through real ansible-playbook inside that sandbox."""

from __future__ import annotations

import typing as t

import pytest
from gpusim import Node
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
def mod(node: Node, sandbox) -> ModuleRunner:
    return ModuleRunner(node, sandbox)
