"""The play_hosts filter's decision and messages (the playbook runs it for real in tests/functional/test_role_failures.py)."""

from __future__ import annotations

import pytest
from ansible import context
from ansible.errors import AnsibleFilterError
from ansible.module_utils.common.collections import ImmutableDict

from ansible_collections.gpuops.clean_slate.plugins.filter import play_hosts as ph

GROUPS = {"all": ["pve1", "ct101", "db1"], "ungrouped": [], "gpu_nodes": ["pve1", "ct101"], "storage": ["db1"]}


@pytest.fixture(autouse=True)
def cliargs():
    """A plain ansible-playbook run (no --syntax-check), restored afterwards."""
    saved = context.CLIARGS
    context.CLIARGS = ImmutableDict({"syntax": False, "listtasks": False, "listtags": False})
    yield
    context.CLIARGS = saved


def test_a_pattern_with_hosts_left_by_the_limit_is_returned_unchanged() -> None:
    assert ph.play_hosts("gpu_nodes", ["pve1", "ct101"], ["pve1", "ct101", "db1"], GROUPS) == "gpu_nodes"
    assert ph.play_hosts("gpu_nodes", ["pve1", "ct101"], ["ct101"], GROUPS, "ct101") == "gpu_nodes"


def test_no_such_group_names_the_pattern_the_groups_and_the_fix() -> None:
    with pytest.raises(AnsibleFilterError) as err:
        ph.play_hosts("gpu-nodes", [], ["pve1", "ct101", "db1"], GROUPS)
    msg = str(err.value)
    assert "the host pattern 'gpu-nodes' matches no host of the inventory. Groups with hosts: gpu_nodes, storage." in msg
    assert "ungrouped" not in msg and "-e clean_slate_hosts=<group or pattern>" in msg


def test_a_limit_outside_the_pattern_says_so() -> None:
    with pytest.raises(AnsibleFilterError, match=r"--limit 'db1' leaves none of the 2 host\(s\) of 'gpu_nodes' \(pve1, ct101\)"):
        ph.play_hosts("gpu_nodes", ["pve1", "ct101"], ["db1"], GROUPS, "db1")


def test_many_hosts_are_shortened() -> None:
    many = [f"n{i}" for i in range(8)]
    with pytest.raises(AnsibleFilterError, match=r"of 'gpu_nodes' \(n0, n1, n2, n3, n4, \.\.\.\)"):
        ph.play_hosts("gpu_nodes", many, ["db1"], {"all": [*many, "db1"], "gpu_nodes": many}, "db1")


def test_an_empty_inventory_points_at_the_inventory_source() -> None:
    with pytest.raises(AnsibleFilterError, match=r"the inventory has no hosts\. An inventory source failed to parse"):
        ph.play_hosts("gpu_nodes", [], [], {"all": [], "ungrouped": []}, "gpu_nodes")


def test_the_implicit_localhost_runs_without_a_limit_only() -> None:
    assert ph.play_hosts("localhost", ["localhost"], [], {"all": [], "ungrouped": []}) == "localhost"
    with pytest.raises(AnsibleFilterError):
        ph.play_hosts("localhost", ["localhost"], [], {"all": [], "ungrouped": []}, "gpu_nodes")


@pytest.mark.parametrize("flag", ["syntax", "listtasks", "listtags"])
def test_listings_run_no_host_and_are_not_judged(flag: str) -> None:
    context.CLIARGS = ImmutableDict({"syntax": False, "listtasks": False, "listtags": False, flag: True})
    assert ph.play_hosts("gpu_nodes", [], [], {"all": []}) == "gpu_nodes"


@pytest.mark.parametrize("bad", ["", "  ", None, ["gpu_nodes"]])
def test_a_pattern_that_is_not_a_string_names_clean_slate_hosts(bad: object) -> None:
    with pytest.raises(AnsibleFilterError, match="clean_slate_hosts"):
        ph.play_hosts(bad, [], [], GROUPS)  # type: ignore[arg-type]
