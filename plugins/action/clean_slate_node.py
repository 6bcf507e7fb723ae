# Copyright (c) 2026, gpuops.clean_slate maintainers
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

"""Action plugin of gpuops.clean_slate.clean_slate_node: the phases chosen from the run's tags, then one module run.

The role's phases stay visible as tags (``--tags clean_slate_verify``, ``--skip-tags clean_slate_residue``),
but they run in one task: a task carrying every phase's tags would be skipped whole by ``--skip-tags`` of any
one of them. So the task is tagged ``always`` and this plugin decides each phase as Ansible decides a task:
the phase's own tags plus those the task inherits (an including task, its ``apply``, a block), against
``ansible_run_tags`` and ``ansible_skip_tags``. A playbook run for other tags (``--tags nginx``) selects no
phase, and nothing runs on the host.
"""

from __future__ import annotations

import typing as t

from ansible.plugins.action import ActionBase

from ansible_collections.gpuops.clean_slate.plugins.plugin_utils import _phases


class ActionModule(ActionBase):
    """Choose the phases the tags select (among those the task names), then run the module once."""

    _supports_check_mode = True
    _supports_async = False

    def run(self, tmp: t.Any = None, task_vars: dict[str, t.Any] | None = None) -> dict[str, t.Any]:
        task_vars = task_vars or {}
        result = super().run(tmp, task_vars)
        args = dict(self._task.args)
        inherited = set(self._task.tags or []) - {"always"}
        chosen = _phases.selected(inherited, task_vars.get("ansible_run_tags", ["all"]), task_vars.get("ansible_skip_tags", []))
        given = args.get("phases")
        # The task's own phases (when given) are the most it may run; the tags choose among them.
        args["phases"] = [p for p in chosen if given is None or (isinstance(given, list) and p in given)] if given is None or isinstance(given, list) else given
        if not args["phases"]:
            result.update(skipped=True, changed=False, phases=[], msg="no phase of the clean slate is selected by --tags/--skip-tags")
            return result
        result.update(self._execute_module(module_name="gpuops.clean_slate.clean_slate_node", module_args=args, task_vars=task_vars))
        return result
