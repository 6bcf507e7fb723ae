# Copyright (c) 2026, gpuops.clean_slate maintainers
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

"""The clean_slate role's filters: its per-host result, the set_stats entry, the refusal of its variables and the
restore phase's options (the documentation of each is in the .yml file of its name beside this one)."""

from __future__ import annotations

import difflib
import functools
import json
import os
import re
import typing as t

import yaml  # type: ignore[import-untyped]  # no stubs installed
from ansible.errors import AnsibleFilterError
from ansible.module_utils.common.arg_spec import ArgumentSpecValidator
from ansible.parsing.splitter import parse_kv

from ansible_collections.gpuops.clean_slate.plugins.module_utils import _outcome, _reasons

#: Variables named clean_slate_* that are not options of the role but that users and the role set legitimately: the
#: playbook's host pattern, the role's result and the reading its hook sees.
NOT_OPTIONS = frozenset({"clean_slate_hosts", "clean_slate_result", "clean_slate_preflight"})
#: clean_slate_node's option sections whose values the role's tasks write out from its variables.
SECTIONS = ("verify", "kill", "residue", "restore", "metrics")
_VARIABLE = re.compile(r"(?<![A-Za-z0-9_])clean_slate_[a-z_]+")


@functools.lru_cache(maxsize=8)
def role_spec(role_path: str) -> dict[str, t.Any]:
    """The options of the role's entry point ``main`` (meta/argument_specs.yml), read once per process."""
    try:
        with open(os.path.join(role_path, "meta", "argument_specs.yml"), encoding="utf-8") as f:
            data = yaml.load(f, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    except (OSError, yaml.YAMLError) as exc:
        raise AnsibleFilterError(f"the role's argument spec under {role_path} could not be read: {exc}") from exc
    return dict(data["argument_specs"]["main"]["options"])


@functools.lru_cache(maxsize=8)
def option_variables(role_path: str) -> dict[str, str]:
    """Each clean_slate_node option the role's tasks (tasks/main.yml) write out from a role variable, as
    ``<section>.<option>`` (or the top-level option) -> the first clean_slate_* variable its value names."""
    try:
        with open(os.path.join(role_path, "tasks", "main.yml"), encoding="utf-8") as f:
            tasks = yaml.load(f, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    except (OSError, yaml.YAMLError):
        return {}
    out: dict[str, str] = {}

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
                        found = _VARIABLE.search(str(text))
                        if found:
                            out.setdefault(f"{option}.{sub}", found.group(0))
                else:
                    found = _VARIABLE.search(str(value))
                    if found:
                        out.setdefault(str(option), found.group(0))

    walk(tasks)
    return out


def clean_slate_result(run: t.Any, context: t.Any = None) -> dict[str, t.Any]:
    """The role's per-host result from clean_slate_node's registered run (see clean_slate_result.yml)."""
    if not isinstance(run, dict):
        raise AnsibleFilterError("clean_slate_result: the input must be clean_slate_node's registered result (a dictionary)")
    if context is not None and not isinstance(context, dict):
        raise AnsibleFilterError("clean_slate_result: the context must be a dictionary")
    ctx = dict(context or {})
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


def clean_slate_published(result: t.Any, hostvars: t.Any = None) -> dict[str, t.Any]:
    """The host's set_stats entry: its result without the per-GPU and per-process lists. With ``hostvars``, the input is
    a list of hosts (a batch), and the output each host's entry under its name, for the hosts the role recorded: those
    with a ``clean_slate_result`` whose clean step was in the run (a run for other --tags records none)."""
    if hostvars is not None:
        if not isinstance(result, (list, tuple)):
            raise AnsibleFilterError("clean_slate_published: with hostvars, the input must be a list of hosts (ansible_play_batch)")
        out: dict[str, t.Any] = {}
        for host in result:
            if host not in hostvars:
                continue
            facts = hostvars[host]
            record, run = facts.get("clean_slate_result"), facts.get("_clean_slate_r_node")
            if isinstance(record, dict) and not (isinstance(run, dict) and run.get("in_run") is False):
                out[str(host)] = _outcome.published(record)
        return out
    if not isinstance(result, dict):
        raise AnsibleFilterError("clean_slate_published: the input must be clean_slate_result")
    return _outcome.published(result)


_WANT = {
    "float": "a number",
    "int": "an integer",
    "bool": "true or false",
    "list": "a list (or text such as a,b)",
    "dict": "a dictionary (or text such as key=value)",
    "str": "a string",
    "path": "a path",
}
_GOT = {"str": "text", "int": "an integer", "float": "a number", "bool": "a boolean", "list": "a list", "dict": "a dictionary"}
_CONVERT = re.compile(r"^argument '(?P<name>[^']+)' is of type (?P<got>\S+) and we were unable to convert to (?P<want>\w+)")


def _sentence(message: str) -> str:
    """Ansible's argument-spec message as a sentence that names the variable without Python's internal types."""
    m = _CONVERT.match(message)
    if m:
        got = _GOT.get(m.group("got"), m.group("got"))
        return f"{m.group('name')} must be {_WANT.get(m.group('want'), m.group('want'))}; the value given is {got} that cannot be read as one."
    message = re.sub(r"<class '[^']*'>", "the value", message).strip()
    return message if message.endswith(".") else message + "."


def _plain(value: t.Any) -> t.Any:
    """A variable's value as plain lists and dictionaries: the validator copies what it checks, and Ansible's lazily
    templated containers would take their templar (and its plugin loaders) into the copy."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def role_refusals(given: t.Any, role_path: t.Any) -> list[str]:
    """One sentence per refused role variable (see role_refusals.yml): ``given`` maps the host's clean_slate_* variables
    to their values, checked against meta/argument_specs.yml with the validator of ansible.builtin.validate_argument_spec
    (the same call, so the same words), and every name the spec does not know is refused with the nearest known one."""
    if not isinstance(given, dict):
        raise AnsibleFilterError("role_refusals: the input must map the host's clean_slate_* variables to their values")
    spec = role_spec(str(role_path))
    checked = ArgumentSpecValidator(spec).validate({k: _plain(v) for k, v in given.items() if k in spec}, validate_role_argument_spec=True)
    out = [_sentence(str(e)) for e in checked.error_messages]
    known = set(spec) | NOT_OPTIONS
    # Compared without the prefix every name shares, which would make any two names look alike.
    stems = {k[len("clean_slate_") :]: k for k in known}
    unknown: list[tuple[str, str]] = []
    for name in sorted({str(n) for n in given} - known):
        near = difflib.get_close_matches(name[len("clean_slate_") :], sorted(stems), n=1, cutoff=0.6)
        unknown.append((name, f" (did you mean {stems[near[0]]}?)" if near else ""))
    # Every unknown name in one sentence, the advice said once.
    role, docs = "the gpuops.clean_slate.clean_slate role", "(ansible-doc -t role gpuops.clean_slate.clean_slate lists them)."
    if len(unknown) == 1:
        name, hint = unknown[0]
        out.append(f"{name} is not a variable of {role}{hint}: rename or remove it {docs}")
    elif unknown:
        listed = [name + hint for name, hint in unknown]
        out.append(f"{', '.join(listed[:-1])} and {listed[-1]} are not variables of {role}: rename or remove them {docs}")
    return out


def _parsed(value: str) -> t.Any:
    text = value.strip()
    if text.startswith(("{", "[")):
        try:
            return json.loads(text)
        except ValueError:
            try:
                return yaml.safe_load(text)
            except yaml.YAMLError:
                return value
    return value


def restore_options(value: t.Any, gpus: t.Any) -> dict[str, t.Any]:
    """clean_slate_restore as gpu_mode_restore's options: the keys it declares, the GPUs the role verifies by default;
    {} when it declares nothing. Text (an AWX survey answer, -e clean_slate_restore=compute_mode=default, JSON) is read
    as the argument spec reads it."""
    if value in (None, "", {}):
        return {}
    if isinstance(value, str):
        parsed = _parsed(value)
        value = parsed if isinstance(parsed, dict) else parse_kv(value)
    if not isinstance(value, dict):
        raise AnsibleFilterError(f"clean_slate_restore must be a dictionary such as {{compute_mode: default, mps: stopped}}, got {value!r}")
    return {"gpus": gpus, **{str(k): v for k, v in value.items() if v is not None}} if value else {}


class FilterModule:
    def filters(self) -> dict[str, t.Callable[..., t.Any]]:
        return {
            "clean_slate_result": clean_slate_result,
            "clean_slate_published": clean_slate_published,
            "role_refusals": role_refusals,
            "restore_options": restore_options,
        }
