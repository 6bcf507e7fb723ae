# Copyright (c) 2026, gpuops.clean_slate maintainers
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# Note: this module_util is PRIVATE to the collection; it may change without notice.

"""The phases of a clean slate, in the order they run, and which of them a run's tags select.

The one table of the phases: the clean_slate_node module runs them in this order, its action plugin picks them
from ``--tags``/``--skip-tags`` with :func:`selected`, and the role's result reads them in this order.
"""

from __future__ import annotations

import typing as t

#: The phases, in the order they run.
PHASES = ("preflight", "kill", "residue", "restore", "verify")

#: Each phase's tags. The kill needs the preflight reading, so the preflight carries the kill's tag:
#: ``--tags clean_slate_kill`` reads the GPUs first.
PHASE_TAGS: dict[str, frozenset[str]] = {
    phase: frozenset({"clean_slate", f"clean_slate_{phase}"} | ({"clean_slate_kill"} if phase == "preflight" else set())) for phase in PHASES
}

#: Every tag of the role's phases.
ALL_TAGS: frozenset[str] = frozenset().union(*PHASE_TAGS.values())


def should_run(tags: t.AbstractSet[str], only_tags: t.Iterable[str], skip_tags: t.Iterable[str]) -> bool:
    """Ansible's own rule for a task with ``tags`` (ansible.playbook.taggable.Taggable.evaluate_tags), ``always`` aside."""
    only, skip = set(only_tags or ()), set(skip_tags or ())
    run = True
    if only:
        run = ("all" in only and "never" not in tags) or not tags.isdisjoint(only) or ("tagged" in only and bool(tags) and "never" not in tags)
    if run and skip:
        run = not ("all" in skip or not tags.isdisjoint(skip) or ("tagged" in skip and bool(tags)))
    return run


def selected(inherited: t.AbstractSet[str], only_tags: t.Iterable[str], skip_tags: t.Iterable[str]) -> list[str]:
    """The phases a task carrying ``inherited`` tags runs, each judged with its own tags added."""
    only, skip = list(only_tags or ()), list(skip_tags or ())
    return [phase for phase, tags in PHASE_TAGS.items() if should_run(set(inherited) | tags, only, skip)]


def in_run(inherited: t.AbstractSet[str], only_tags: t.Iterable[str]) -> bool:
    """Whether ``--tags`` asks for the clean at all: some phase would run if nothing were skipped.

    A run for other tags (``--tags nginx``) leaves the role out: nothing is read, recorded or failed. A run that asks for
    the role but skips what proves the GPUs clean (``--skip-tags clean_slate_verify``) is in the run, and its host is
    not proven clean."""
    return bool(selected(inherited, only_tags, ()))
