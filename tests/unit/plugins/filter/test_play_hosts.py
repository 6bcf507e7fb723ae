"""The play_hosts filter's decision and messages (the playbook runs it for real in tests/functional/test_role_failures.py)."""

from __future__ import annotations

import multiprocessing
import typing as t

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


def refused(capsys: pytest.CaptureFixture[str], *args: t.Any) -> str:
    """The one error play_hosts displays when it stops the run (exit status 1), on one line. (Ansible's display shows
    each error once per process: every test gives a message of its own.)"""
    with pytest.raises(SystemExit) as stop:
        ph.play_hosts(*args)
    assert stop.value.code == 1
    err = capsys.readouterr().err
    assert err.startswith("[ERROR]: gpuops.clean_slate: ") and err.count("[ERROR]") == 1, err
    # Nothing of Ansible's wrapping of a failed filter, nor a source excerpt: the refusal reads as a message.
    assert "The filter plugin" not in err and "Origin:" not in err and "Traceback" not in err
    return " ".join(err.split())


def test_a_pattern_with_hosts_left_by_the_limit_is_returned_unchanged() -> None:
    assert ph.play_hosts("gpu_nodes", ["pve1", "ct101"], ["pve1", "ct101", "db1"], GROUPS) == "gpu_nodes"
    assert ph.play_hosts("gpu_nodes", ["pve1", "ct101"], ["ct101"], GROUPS, "ct101") == "gpu_nodes"


def test_no_such_group_names_the_pattern_the_groups_and_the_fix(capsys: pytest.CaptureFixture[str]) -> None:
    msg = refused(capsys, "gpu-nodes", [], ["pve1", "ct101", "db1"], GROUPS)
    assert "the host pattern 'gpu-nodes' matches no host of the inventory. Groups with hosts: gpu_nodes, storage." in msg
    assert "ungrouped" not in msg and "-e clean_slate_hosts=<group or pattern>" in msg


def test_a_limit_outside_the_pattern_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    msg = refused(capsys, "gpu_nodes", ["pve1", "ct101"], ["db1"], GROUPS, "db1")
    assert "--limit 'db1' leaves none of the 2 host(s) of 'gpu_nodes' (pve1, ct101)" in msg and msg.endswith("Nothing was done.")


def test_many_hosts_are_shortened(capsys: pytest.CaptureFixture[str]) -> None:
    many = [f"n{i}" for i in range(8)]
    assert "of 'gpu_nodes' (n0, n1, n2, n3, n4, ...)" in refused(capsys, "gpu_nodes", many, ["db1"], {"all": [*many, "db1"], "gpu_nodes": many}, "db1")


def test_an_empty_inventory_points_at_the_inventory_source(capsys: pytest.CaptureFixture[str]) -> None:
    assert "the inventory has no hosts. An inventory source failed to parse" in refused(capsys, "gpu_nodes", [], [], {"all": [], "ungrouped": []}, "gpu_nodes")


def test_the_implicit_localhost_runs_without_a_limit_only(capsys: pytest.CaptureFixture[str]) -> None:
    assert ph.play_hosts("localhost", ["localhost"], [], {"all": [], "ungrouped": []}) == "localhost"
    msg = refused(capsys, "localhost", ["localhost"], [], {"all": ["db1"], "ungrouped": ["db1"]}, "gpu_nodes")
    assert "--limit 'gpu_nodes' leaves none of the 1 host(s) of 'localhost'" in msg


@pytest.mark.parametrize("flag", ["syntax", "listtasks", "listtags"])
def test_listings_run_no_host_and_are_not_judged(flag: str) -> None:
    context.CLIARGS = ImmutableDict({"syntax": False, "listtasks": False, "listtags": False, flag: True})
    assert ph.play_hosts("gpu_nodes", [], [], {"all": []}) == "gpu_nodes"


@pytest.mark.parametrize("bad", ["", "  ", None, ["gpu_nodes"]])
def test_a_pattern_that_is_not_a_string_names_clean_slate_hosts(capsys: pytest.CaptureFixture[str], bad: object) -> None:
    assert "(clean_slate_hosts)" in refused(capsys, bad, [], [], GROUPS)


def _in_a_worker(queue: t.Any) -> None:
    try:
        ph.play_hosts("gpu_nodes", ["pve1"], ["db1"], GROUPS, "db1")
    except AnsibleFilterError as exc:
        queue.put(("raised", str(exc)))
    except SystemExit:
        queue.put(("exited", ""))


def test_in_a_worker_process_it_raises_instead_of_exiting() -> None:
    """Used in a task's template (Ansible runs tasks in forked workers), exiting would only end that worker."""
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_in_a_worker, args=(queue,))
    child.start()
    how, msg = queue.get(timeout=30)
    child.join(30)
    assert how == "raised" and "--limit 'db1' leaves none of the 1 host(s) of 'gpu_nodes'" in msg
