# Copyright (c) 2026, gpuops.clean_slate maintainers
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# Note: this plugin_util is PRIVATE to the collection; it may change without notice.

"""Which phases of the clean slate a run's tags select (the clean_slate_node action plugin's choice)."""

from __future__ import annotations

import typing as t

#: Each phase and its tags, in the order the phases run. The kill needs the preflight reading, so the
#: preflight carries the kill's tag: ``--tags clean_slate_kill`` reads the GPUs first.
PHASE_TAGS: dict[str, frozenset[str]] = {
    "preflight": frozenset({"clean_slate", "clean_slate_preflight", "clean_slate_kill"}),
    "kill": frozenset({"clean_slate", "clean_slate_kill"}),
    "residue": frozenset({"clean_slate", "clean_slate_residue"}),
    "restore": frozenset({"clean_slate", "clean_slate_restore"}),
    "verify": frozenset({"clean_slate", "clean_slate_verify"}),
}


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
