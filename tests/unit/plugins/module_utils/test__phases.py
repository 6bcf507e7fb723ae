"""_phases: the clean_slate_node action plugin selects each phase as Ansible would select a task carrying its tags."""

from __future__ import annotations

import pytest

from ansible_collections.gpuops.clean_slate.plugins.module_utils import _phases

ALL = ["preflight", "kill", "residue", "restore", "verify"]


@pytest.mark.parametrize(
    ("inherited", "only", "skip", "phases"),
    [
        (set(), ["all"], [], ALL),
        (set(), [], [], ALL),
        (set(), ["clean_slate"], [], ALL),
        (set(), ["clean_slate_verify"], [], ["verify"]),
        # The kill needs the reading: its tag selects the preflight too.
        (set(), ["clean_slate_kill"], [], ["preflight", "kill"]),
        (set(), ["clean_slate_kill"], ["clean_slate_preflight"], ["kill"]),
        (set(), ["all"], ["clean_slate_residue"], ["preflight", "kill", "restore", "verify"]),
        (set(), ["clean_slate_residue", "clean_slate_verify"], [], ["residue", "verify"]),
        # A run for other tags selects nothing (the task runs only because it is tagged always).
        (set(), ["nginx"], [], []),
        # ... unless the task inherits that tag (an include's apply, a role's tags).
        ({"deploy"}, ["deploy"], [], ALL),
        ({"deploy"}, ["deploy"], ["clean_slate_residue"], ["preflight", "kill", "restore", "verify"]),
        (set(), ["clean_slate_restore"], [], ["restore"]),
        ({"deploy"}, ["clean_slate_verify"], [], ["verify"]),
        (set(), ["tagged"], [], ALL),
        (set(), ["all"], ["all"], []),
        (set(), ["all"], ["clean_slate"], []),
        ({"never"}, ["all"], [], []),
    ],
)
def test_phases_follow_ansibles_tag_rule(inherited: set[str], only: list[str], skip: list[str], phases: list[str]) -> None:
    assert _phases.selected(inherited, only, skip) == phases


def test_the_rule_is_ansibles() -> None:
    """Cross-checked against Ansible's own evaluate_tags on a real Task."""
    from ansible.parsing.dataloader import DataLoader
    from ansible.playbook.block import Block
    from ansible.playbook.task import Task
    from ansible.plugins.loader import init_plugin_loader

    init_plugin_loader()

    cases = [
        (["a"], ["a"], []),
        (["a"], ["b"], []),
        (["a"], ["all"], ["a"]),
        ([], ["tagged"], []),
        (["a", "never"], ["all"], []),
        (["a"], ["tagged"], ["tagged"]),
    ]
    for tags, only, skip in cases:
        task = Task.load({"name": "x", "ansible.builtin.debug": {"msg": "x"}, "tags": tags}, block=Block(), loader=DataLoader())
        assert _phases.should_run(set(tags), only, skip) == task.evaluate_tags(only, skip, {}), (tags, only, skip)


@pytest.mark.parametrize(
    ("inherited", "only", "in_run"),
    [
        (set(), ["all"], True),
        (set(), ["clean_slate_residue"], True),
        # A run for other tags is not about the clean ...
        (set(), ["nginx"], False),
        # ... unless the role inherits that tag (an include's apply).
        ({"deploy"}, ["deploy"], True),
        ({"deploy"}, ["nginx"], False),
    ],
)
def test_a_run_for_other_tags_leaves_the_clean_out(inherited: set[str], only: list[str], in_run: bool) -> None:
    assert _phases.in_run(inherited, only) is in_run


def test_each_phase_carries_its_tags_and_the_kill_tag_reads_first() -> None:
    assert tuple(_phases.PHASE_TAGS) == _phases.PHASES
    for phase, tags in _phases.PHASE_TAGS.items():
        assert {"clean_slate", f"clean_slate_{phase}"} <= tags
    assert "clean_slate_kill" in _phases.PHASE_TAGS["preflight"]
