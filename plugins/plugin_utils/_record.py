# Copyright (c) 2026, gpuops.clean_slate maintainers
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# Note: this plugin_util is PRIVATE to the collection; it may change without notice.

"""A host's clean-slate record, on the controller: the ``clean_slate_result`` filter and clean_slate_node's action
plugin (which builds it right after the run, so that the role needs no task of its own per host for it) both call
:func:`result`; the outcome itself is ``module_utils/_outcome`` (which the module also uses for its metrics)."""

from __future__ import annotations

import functools
import os
import re
import typing as t

import yaml  # type: ignore[import-untyped]  # no stubs installed

from ansible_collections.gpuops.clean_slate.plugins.module_utils import _outcome, _reasons

_VARIABLE = re.compile(r"(?<![A-Za-z0-9_])clean_slate_[a-z_]+")
_INTERNAL = re.compile(r"(?<![A-Za-z0-9_])_clean_slate_[a-z_]+")


def _load(path: str) -> t.Any:
    try:
        with open(path, encoding="utf-8") as f:
            return yaml.load(f, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    except (OSError, yaml.YAMLError):
        return None


@functools.lru_cache(maxsize=8)
def option_variables(role_path: str) -> dict[str, str]:
    """Each clean_slate_node option the role's tasks (tasks/main.yml) write out from a role variable, as
    ``<section>.<option>`` (or the top-level option) -> the first clean_slate_* variable its value names, directly or
    through the role's internal values (vars/main.yml: ``_clean_slate_verify_gpus`` names ``clean_slate_gpus``)."""
    tasks = _load(os.path.join(role_path, "tasks", "main.yml"))
    internal = _load(os.path.join(role_path, "vars", "main.yml"))
    internal = internal if isinstance(internal, dict) else {}
    out: dict[str, str] = {}

    def named(text: str, seen: frozenset[str] = frozenset()) -> str | None:
        found = _VARIABLE.search(text)
        if found:
            return found.group(0)
        for name in _INTERNAL.findall(text):
            if name in internal and name not in seen:
                through = named(str(internal[name]), seen | {name})
                if through:
                    return through
        return None

    def walk(items: t.Any) -> None:
        for task in items or []:
            if not isinstance(task, dict):
                continue
            for key in ("block", "rescue", "always"):
                walk(task.get(key))
            args = task.get("gpuops.clean_slate.clean_slate_node")
            if not isinstance(args, dict):
                continue
            for option, value in args.items():
                if isinstance(value, dict):
                    for sub, text in value.items():
                        found = named(str(text))
                        if found:
                            out.setdefault(f"{option}.{sub}", found)
                else:
                    found = named(str(value))
                    if found:
                        out.setdefault(str(option), found)

    walk(tasks)
    return out


def result(run: dict[str, t.Any], context: dict[str, t.Any]) -> dict[str, t.Any]:
    """The host's record from clean_slate_node's run (registered, also failed or unreachable) and the context the
    ``clean_slate_result`` filter documents (host, label, mode, delegate, check_mode, fail_on_dirty, health_fail_on,
    error, report, report_path, role_path)."""
    ctx = dict(context)
    role_path = ctx.pop("role_path", None)
    if role_path:
        ctx["option_vars"] = option_variables(str(role_path))
    records = {"error": ctx.pop("error", None) or {}, "report": ctx.pop("report", None) or {}}
    error = records["error"]
    if isinstance(error, dict) and error.get("phase") == "before_kill":
        # One of the user's tasks before the kill failed: nothing was ended.
        records["error"] = {}
        run = {**error, "phase": "before_kill", "reason": _reasons.BEFORE_KILL_FAILED, "msg": f"{error.get('msg', '')}. Nothing was ended."}
    mode = str(ctx.get("mode") or "local")
    return _outcome.result(_outcome.steps(_outcome.phase_results(run, mode), records), ctx)
