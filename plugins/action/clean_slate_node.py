# Copyright (c) 2026, gpuops.clean_slate maintainers
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

"""Action plugin of gpuops.clean_slate.clean_slate_node: the phases chosen from the run's tags, then one module run.

The role's phases stay visible as tags (``--tags clean_slate_verify``, ``--skip-tags clean_slate_residue``),
but they run in one task: a task carrying every phase's tags would be skipped whole by ``--skip-tags`` of any
one of them. So the task is tagged ``always`` and this plugin decides each phase as Ansible decides a task:
the phase's own tags plus those the task inherits (an including task, its ``apply``, a block), against
``ansible_run_tags`` and ``ansible_skip_tags``.

* A run for other tags (``--tags nginx``) is not about the clean: nothing runs and the result says
  ``in_run: false``.
* A run that asks for the clean but selects no phase (``--skip-tags clean_slate``) runs nothing either, but it is
  in the run: its host is not proven clean. With ``metrics`` the module still runs, only to record that.
* The result says ``module_failed`` when the module failed (also when the task's ``failed_when`` says otherwise).
* A ``stop`` (the role refused the host) runs the module only to write its ``metrics``; without them the plugin
  answers itself, and nothing reaches the host.
* ``python`` runs the module with that interpreter (the role's virtual environment), unless an extra variable
  sets ``ansible_python_interpreter``, which wins over anything a role says, as Ansible's precedence has it.
* ``record`` (the context of the ``clean_slate_result`` filter) makes the plugin build the host's record from the run
  right away, with the filter's own code (``plugin_utils/_record``), and set it as the host's ``clean_slate_result``
  the way ``set_fact`` sets a variable; the result says ``recorded: true``. A fleet pays for every task on every host
  (docs/benchmarks.md, "Fleet"), and this saves the role one per host. Ansible before 2.21 has no way for an action
  to set a variable but ``set_fact``'s own: there the result says ``recorded: false`` and the role builds the record
  with the filter, in a task.
"""

from __future__ import annotations

import typing as t

from ansible.plugins.action import ActionBase
from ansible.utils.vars import load_extra_vars

from ansible_collections.gpuops.clean_slate.plugins.module_utils import _phases
from ansible_collections.gpuops.clean_slate.plugins.plugin_utils import _payload, _record

try:
    # ansible-core 2.21 and later: an action may set host variables at set_fact's precedence (ActionBase.register_host_variables).
    from ansible.plugins.action import VariableLayer
except ImportError:  # pragma: no cover - older ansible-core
    VariableLayer = None


class ActionModule(ActionBase):
    """Choose the phases the tags select (among those the task names), then run the module once."""

    _supports_check_mode = True
    _supports_async = False

    def run(self, tmp: t.Any = None, task_vars: dict[str, t.Any] | None = None) -> dict[str, t.Any]:
        task_vars = task_vars or {}
        result = super().run(tmp, task_vars)
        args = dict(self._task.args)
        record = args.pop("record", None)
        result = self._run(result, args, task_vars)
        # Ansible applies a task's variables only to a result that is neither skipped nor failed (the role registers the
        # run with failed_when: false); a run that selected no phase is skipped, and the role records it in a task.
        if isinstance(record, dict) and result.get("in_run") and not result.get("skipped") and VariableLayer is not None:
            facts = {"clean_slate_result": _record.result(result, {**self._context(args, task_vars), **record})}
            # As set_fact does it: the variable at set_fact's precedence, not a fact for the fact cache, and shown in the
            # result's ansible_facts (callbacks, ARA, -v) without Ansible's legacy registration of ansible_facts.
            self.register_host_variables({}, VariableLayer.CACHEABLE_FACT)
            self.register_host_variables(facts, VariableLayer.EPHEMERAL_FACT)
            result.update(ansible_facts=facts, recorded=True)
        elif record is not None:
            result["recorded"] = False
        return result

    def _run(self, result: dict[str, t.Any], args: dict[str, t.Any], task_vars: dict[str, t.Any]) -> dict[str, t.Any]:
        """The phases the tags select, run in one module execution (or answered here when nothing is to run)."""
        python = args.pop("python", None)
        # The task's own phase tags (shown by --list-tasks) are not inherited ones: each phase is judged with its own.
        inherited = set(self._task.tags or []) - {"always"} - _phases.ALL_TAGS
        only, skip = task_vars.get("ansible_run_tags", ["all"]), task_vars.get("ansible_skip_tags", [])
        if not _phases.in_run(inherited, only):
            result.update(skipped=True, changed=False, in_run=False, phases=[], msg="the run's --tags do not ask for the clean slate")
            return result
        stop = args.get("stop")
        if isinstance(stop, dict) and (not args.get("metrics") or self._task.check_mode):
            # A host the role stopped before the clean, with no metrics to write there: nothing to run on it.
            result.update(changed=False, failed=True, module_failed=True, in_run=True, phases=[], **stop)
            return result
        chosen = _phases.selected(inherited, only, skip)
        given = args.get("phases")
        # The task's own phases (when given) are the most it may run; the tags choose among them.
        if given is None or isinstance(given, list):
            args["phases"] = [p for p in chosen if given is None or p in given]
        if not args["phases"] and not args.get("stop") and not args.get("metrics"):
            result.update(skipped=True, changed=False, in_run=True, phases=[], msg="no phase of the clean slate is selected by --tags/--skip-tags")
            return result
        # The payload built by an earlier run, when every source it was built from is unchanged (plugin_utils/_payload):
        # Ansible then finds it in its own cache instead of building it again; kept after a run that built it.
        _payload.restore()
        result.update(self._execute_module(module_name="gpuops.clean_slate.clean_slate_node", module_args=args, task_vars=self._with_python(task_vars, python)))
        _payload.keep()
        # Kept whatever the task's failed_when says (the role registers the run with failed_when: false and fails the
        # host once, after its record): the module failed, by its own reason or by Ansible's (no Python, MODULE FAILURE).
        result.update(in_run=True, module_failed=bool(result.get("failed")))
        return result

    def _context(self, args: dict[str, t.Any], task_vars: dict[str, t.Any]) -> dict[str, t.Any]:
        """What the record's context (the clean_slate_result filter's) is for this run, as far as the run itself says:
        the host, where the module ran, the scope (a container cleaned from its node: ``containers``), check mode, and
        the role whose tasks name the variable behind each option. ``record`` adds the rest and wins."""
        host = str(task_vars.get("inventory_hostname", ""))
        delegate = str(self._task.delegate_to or host)
        containers = args.get("containers") or []
        through = bool(containers) and delegate != host
        return {
            "host": host,
            "mode": "hypervisor" if containers else "local",
            "delegate": delegate,
            "label": f"{delegate}/ct{containers[0]}" if through else host,
            "check_mode": bool(self._task.check_mode),
            "role_path": task_vars.get("role_path"),
        }

    def _with_python(self, task_vars: dict[str, t.Any], python: t.Any) -> dict[str, t.Any]:
        """The task's variables with ``python`` as the module's interpreter (on the delegate, when delegated)."""
        if not python or "ansible_python_interpreter" in load_extra_vars(self._loader):
            return task_vars
        out = dict(task_vars)
        delegate = self._task.delegate_to
        delegated = task_vars.get("ansible_delegated_vars")
        if delegate and isinstance(delegated, dict) and delegate in delegated:
            out["ansible_delegated_vars"] = dict(delegated, **{delegate: dict(delegated[delegate], ansible_python_interpreter=python)})
        else:
            out["ansible_python_interpreter"] = python
        return out
