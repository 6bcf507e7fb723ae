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
from ansible.module_utils.parsing.convert_bool import boolean
from ansible.parsing.splitter import parse_kv

from ansible_collections.gpuops.clean_slate.plugins.module_utils import _outcome
from ansible_collections.gpuops.clean_slate.plugins.plugin_utils import _profiles, _record

#: Variables named clean_slate_* that are not options of the role but that users and the role set legitimately: the
#: playbook's host pattern, the role's result and the reading its hook sees.
NOT_OPTIONS = frozenset({"clean_slate_hosts", "clean_slate_result", "clean_slate_preflight"})
#: clean_slate_node's option sections whose values the role's tasks write out from its variables.
SECTIONS = ("verify", "kill", "residue", "restore", "metrics")


@functools.lru_cache(maxsize=8)
def role_spec(role_path: str) -> dict[str, t.Any]:
    """The options of the role's entry point ``main`` (meta/argument_specs.yml), read once per process."""
    try:
        with open(os.path.join(role_path, "meta", "argument_specs.yml"), encoding="utf-8") as f:
            data = yaml.load(f, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    except (OSError, yaml.YAMLError) as exc:
        raise AnsibleFilterError(f"the role's argument spec under {role_path} could not be read: {exc}") from exc
    return dict(data["argument_specs"]["main"]["options"])


def clean_slate_result(run: t.Any, context: t.Any = None) -> dict[str, t.Any]:
    """The role's per-host result from clean_slate_node's registered run (see clean_slate_result.yml)."""
    if not isinstance(run, dict):
        raise AnsibleFilterError("clean_slate_result: the input must be clean_slate_node's registered result (a dictionary)")
    if context is not None and not isinstance(context, dict):
        raise AnsibleFilterError("clean_slate_result: the context must be a dictionary")
    return _record.result(run, dict(context or {}))


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


def role_refusals(given: t.Any, role_path: t.Any, mode: t.Any = None, host: t.Any = None, wheels_path: t.Any = "") -> list[str]:
    """One sentence per refused role variable (see role_refusals.yml): ``given`` maps the host's clean_slate_* variables
    to their values, checked against meta/argument_specs.yml with the validator of ansible.builtin.validate_argument_spec
    (the same call, so the same words), and every name the spec does not know is refused with the nearest known one.
    The server profiles' contents are checked too (plugin_utils/_profiles: unknown keys, ports, patterns, globs outside
    the roots). With ``mode`` (the host's clean_slate_mode, auto resolved), also what the spec cannot say
    (:func:`_beyond_spec`)."""
    if not isinstance(given, dict):
        raise AnsibleFilterError("role_refusals: the input must map the host's clean_slate_* variables to their values")
    beyond = _beyond_spec(given, str(mode), str(host or ""), str(wheels_path or "")) if mode is not None else []
    spec = _spec_refusals(given, role_path)
    # The profiles' own contents (the spec says only that they are a list and dictionaries), once their types are right.
    typed = not any(s.startswith(("clean_slate_profile", "clean_slate_server_ports", "clean_slate_residue_roots")) for s in spec)
    profiles = _profiles.refusals({k: _plain(v) for k, v in given.items()}, str(role_path)) if typed else []
    return spec + profiles + beyond


def _beyond_spec(given: dict[str, t.Any], mode: str, host: str, wheels_path: str) -> list[str]:
    """What the argument spec cannot say: a container cleaned from its node needs the node and its vmid; the modules'
    virtual environment needs an absolute path on the node, and the wheels a directory on the controller (a relative
    clean_slate_wheels_dir is taken from where ansible-playbook was started: ``wheels_path``, the role's
    _clean_slate_wheels_path)."""
    out: list[str] = []
    if mode == "hypervisor":
        if not str(given.get("clean_slate_hypervisor") or ""):
            out.append(
                f"clean_slate_hypervisor is empty, but clean_slate_mode is hypervisor for {host}: name the Proxmox node"
                " that hosts it (the gpuops.clean_slate.proxmox inventory sets proxmox_node_host)."
            )
        vmid = str(given.get("clean_slate_vmid"))
        if not (re.match(r"^[0-9]+$", vmid) and int(vmid) >= 100):
            out.append(
                f"clean_slate_vmid must be the container's vmid (an integer from 100) in hypervisor mode, got {json.dumps(vmid)}"
                " (the gpuops.clean_slate.proxmox inventory sets proxmox_vmid)."
            )
    if boolean(given.get("clean_slate_install_dependencies", False), strict=False):
        venv = given.get("clean_slate_venv_dir")
        if not re.match(r"^/.*[^/]$", str(venv)):
            out.append(f"clean_slate_venv_dir must be an absolute path on the host where the modules run, got {json.dumps(venv)}.")
        wheels = given.get("clean_slate_wheels_dir") or ""
        path = wheels_path
        if path and not os.path.isdir(path):
            out.append(
                f"clean_slate_wheels_dir must be a directory on the controller holding the wheels to install, got {json.dumps(wheels)}"
                f" ({path} is not a directory)."
            )
    return out


def _spec_refusals(given: dict[str, t.Any], role_path: t.Any) -> list[str]:
    """The argument spec's refusals, and the names it does not know."""
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
