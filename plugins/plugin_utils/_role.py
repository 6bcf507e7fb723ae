# Copyright (c) 2026, gpuops.clean_slate maintainers
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# Note: this plugin_util is PRIVATE to the collection; it may change without notice.

"""The clean_slate role's controller-side logic for one host, in Python (the clean_slate_host action plugin).

The role used to work these out in Jinja, in set_fact tasks of their own: the role variables read as
lists (survey text included), the sentence per wrong variable, the targets of each phase, the module's
arguments, the phases' results in phase order, the node_exporter text. Each task costs Ansible a worker,
templating and a callback round (0.02-0.14 s each on a GPU node, 0.5 s for the thirteen of them), which
issue 13 measured as a third of the playbook's own cost. Here they are plain functions of the values,
run inside the one task that cleans the host and the one that records it.

``v`` below is a mapping of the role's variables (``clean_slate_*``), already templated.
"""

from __future__ import annotations

import json
import os
import re
import typing as t
from collections.abc import Mapping

import yaml  # type: ignore[import-untyped]  # no stubs installed; only YAMLError is used
from ansible.module_utils.common.arg_spec import ArgumentSpecValidator
from ansible.module_utils.common.yaml import yaml_load
from ansible.module_utils.parsing.convert_bool import boolean as convert_bool

_NUMBER = re.compile(r"^[+-]?([0-9]+([.][0-9]*)?|[.][0-9]+)([eE][+-]?[0-9]+)?$")
_UUID = re.compile(r"^(GPU|MIG)-[0-9A-Fa-f-]+$")
_DEVICE = re.compile(r"^/dev/nvidia[0-9]+$")

#: The module options that the modules name in their messages, and the role variable that feeds each one,
#: so that a bad value is reported under the name the user typed.
OPTION_VARS: dict[str, str] = {
    "gpus": "clean_slate_gpus",
    "patterns": "clean_slate_patterns",
    "users": "clean_slate_users",
    "where": "clean_slate_where",
    "protect": "clean_slate_protect",
    "unprotect": "clean_slate_unprotect",
    "containers": "clean_slate_vmid",
    "vmid": "clean_slate_vmid",
    "grace_period": "clean_slate_grace_period",
    "kill_timeout": "clean_slate_kill_timeout",
    "timeout": "clean_slate_verify_timeout",
    "interval": "clean_slate_verify_interval",
    "max_used_mib": "clean_slate_max_used_mib",
    "expected_count": "clean_slate_expected_gpus",
    "device_dir": "clean_slate_device_dir",
    "shm": "clean_slate_residue_shm",
    "sockets": "clean_slate_residue_sockets",
    "locks": "clean_slate_residue_locks",
    "dirs": "clean_slate_residue_dirs",
    "remove": "clean_slate_residue_remove",
    "ports": "clean_slate_residue_ports",
    "time_wait_timeout": "clean_slate_residue_time_wait_timeout",
    "fail_on": "clean_slate_residue_fail_on",
    "list_limit": "clean_slate_residue_list_limit",
    "since": "clean_slate_health_since",
    "kernel_log": "clean_slate_health_kernel_log",
    "compute_mode": "clean_slate_restore",
    "mps": "clean_slate_restore",
    "mps_timeout": "clean_slate_restore",
}

#: List variables: (name, split a plain string at its commas). Patterns and commands are never split (a regular
#: expression or a command may hold a comma), so a plain string is one of them.
LIST_VARS: tuple[tuple[str, bool], ...] = (
    ("clean_slate_patterns", False),
    ("clean_slate_users", True),
    ("clean_slate_protect", True),
    ("clean_slate_unprotect", True),
    ("clean_slate_pre_stop_commands", False),
    ("clean_slate_python_packages", True),
)

#: Health verdicts from best to worst (the metrics give the verdict's rank).
HEALTH_ORDER = ("ok", "restart_app", "reset_gpu", "reboot", "drain")


def boolean(value: t.Any) -> bool:
    """The role's ``| bool``: Ansible's own non-strict conversion (yes, on, 1, true, ... are true; anything else false)."""
    return bool(convert_bool(value, strict=False))


def text(value: t.Any) -> str:
    """Jinja's ``| string``."""
    return str(value)


def to_json(value: t.Any) -> str:
    return json.dumps(value)


def _is_list(value: t.Any) -> bool:
    """Jinja's ``is sequence and is not string and is not mapping``."""
    return isinstance(value, (list, tuple))


def _from_yaml_list(value: str) -> t.Any:
    # As Jinja's from_yaml read it in the role (PyYAML's safe loader); text that is no YAML stays one value.
    try:
        # A plain str: PyYAML's C loader refuses Ansible's tagged strings (variables carry their origin).
        return yaml_load(value.encode("utf-8").decode("utf-8"))
    except Exception:  # noqa: BLE001 - PyYAML's errors (yaml.YAMLError and others): text that is no YAML list stays one value
        return [value]


def gpu_list(value: t.Any) -> list[t.Any]:
    """clean_slate_gpus as a list: "[0, 1]" read as YAML, "0,1" split at its commas, digit strings as integers."""
    v = value if value is not None else []
    if isinstance(v, str):
        v = _from_yaml_list(v) if re.match(r"^\[.*\]$", v.strip()) else [x.strip() for x in v.split(",") if x.strip() != ""]
    out: list[t.Any] = []
    for g in v if _is_list(v) else [v]:
        if isinstance(g, str):
            out.append(int(g.strip()) if re.match(r"^[0-9]+$", g.strip()) else g.strip())
        else:
            out.append(g)
    return out


def lists(v: Mapping[str, t.Any]) -> dict[str, list[t.Any]]:
    """The list variables, each read once as a list (survey text included)."""
    out: dict[str, list[t.Any]] = {}
    for name, split in LIST_VARS:
        x = v.get(name)
        x = [] if x is None else x
        if isinstance(x, str):
            if re.match(r"^\[.*\]$", x.strip()):
                x = _from_yaml_list(x)
                x = [e for e in x if e != ""] if _is_list(x) else x
            else:
                x = [e for e in ([p.strip() for p in x.split(",")] if split else [x]) if e != ""]
        out[name] = list(x) if _is_list(x) else [x]
    return out


def _int(value: t.Any) -> int:
    """Jinja's ``| int``: 0 for what is not a number."""
    try:
        return int(value)
    except (TypeError, ValueError):
        try:
            return int(float(value))
        except (TypeError, ValueError):
            return 0


def problems(v: Mapping[str, t.Any], gpus: list[t.Any], given: Mapping[str, list[t.Any]], mode: str, host: str, wheels_path: str) -> list[str]:
    """One sentence per wrong variable, each naming that variable; empty when every value is usable."""
    p: list[str] = []
    for name, low, strict in (
        ("clean_slate_grace_period", 0, False),
        ("clean_slate_kill_timeout", 0, False),
        ("clean_slate_verify_timeout", 0, False),
        ("clean_slate_verify_interval", 0, True),
        ("clean_slate_max_used_mib", 0, False),
        ("clean_slate_expected_gpus", 0, False),
        ("clean_slate_pre_stop_timeout", 0, True),
    ):
        x = v.get(name)
        cmp = "> " if strict else ">= "
        if isinstance(x, bool) or not _NUMBER.match(text(x).strip()):
            p.append(f"{name} must be a number {cmp}{low}, got {to_json(text(x))}.")
        elif (strict and float(text(x)) <= low) or float(text(x)) < low:
            p.append(f"{name} must be {cmp}{low}, got {x}.")
    for g in gpus:
        ok = (isinstance(g, int) and not isinstance(g, bool) and g >= 0) or (isinstance(g, str) and bool(_UUID.match(g) or _DEVICE.match(g)))
        if not ok:
            p.append(
                f"clean_slate_gpus: {to_json(text(g))} is not a GPU index, a GPU UUID nor a device path (given: {to_json(text(v.get('clean_slate_gpus')))});"
                ' use a list such as [0, 1], the text "0,1", UUIDs (nvidia-smi -L) or /dev/nvidia0.'
            )
    for name, values in given.items():
        for x in values:
            if not (isinstance(x, str) and len(x) > 0):
                p.append(f"{name}: every element must be a non-empty string, got {to_json(text(x))}.")
    if boolean(v.get("clean_slate_install_dependencies")):
        venv = v.get("clean_slate_venv_dir")
        if not (isinstance(venv, str) and re.match(r"^/.*[^/]$", venv)):
            p.append(f"clean_slate_venv_dir must be an absolute path on the host where the modules run, got {to_json(venv)}.")
        if wheels_path and not os.path.isdir(wheels_path):
            p.append(
                f"clean_slate_wheels_dir must be a directory on the controller holding the wheels to install, got {to_json(v.get('clean_slate_wheels_dir'))}"
                f" ({wheels_path} is not a directory)."
            )
    metrics = text(v.get("clean_slate_metrics_dir") or "")
    if metrics and not metrics.startswith("/"):
        p.append(f"clean_slate_metrics_dir must be an absolute path on the GPU node (node_exporter's --collector.textfile.directory), got {to_json(metrics)}.")
    if mode == "hypervisor":
        if not text(v.get("clean_slate_hypervisor") or ""):
            p.append(
                f"clean_slate_hypervisor is empty, but clean_slate_mode is hypervisor for {host}:"
                " name the Proxmox node that hosts it (the gpuops.clean_slate.proxmox inventory sets proxmox_node_host)."
            )
        vmid = v.get("clean_slate_vmid")
        if not (re.match(r"^[0-9]+$", text(vmid)) and _int(vmid) >= 100):
            p.append(
                f"clean_slate_vmid must be the container's vmid (an integer from 100) in hypervisor mode, got {to_json(text(vmid))}"
                " (the gpuops.clean_slate.proxmox inventory sets proxmox_vmid)."
            )
    return p


#: The role's argument spec, from the collection's root.
ARGUMENT_SPECS = os.path.join("roles", "clean_slate", "meta", "argument_specs.yml")
_VARIABLE = re.compile(r"clean_slate_[a-z_]+")


def argument_spec(collection_root: str) -> dict[str, t.Any]:
    """The options of the role's entry point ``main`` in meta/argument_specs.yml; empty when there is none.

    A file that cannot be parsed raises ValueError, which the clean step turns into the host's refusal (recorded),
    not an exception that would leave the host without a record."""
    path = os.path.join(collection_root, ARGUMENT_SPECS)
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml_load(f)
    except OSError:
        return {}
    except yaml.YAMLError as e:
        raise ValueError(f"the role's argument spec {path} could not be parsed: {e}") from e
    spec = data.get("argument_specs") if isinstance(data, Mapping) else None
    main = spec.get("main") if isinstance(spec, Mapping) else None
    options = main.get("options") if isinstance(main, Mapping) else None
    return dict(options) if isinstance(options, Mapping) else {}


def spec_problems(spec: Mapping[str, t.Any], values: Mapping[str, t.Any]) -> list[str]:
    """The role's argument spec applied to the role variables as Ansible's own validation applies it before a role's
    first task (ansible.builtin.validate_argument_spec: its validator, on the same templated values of the variables
    that are defined): one sentence per error, each naming its variable.

    Ansible's validation stops a host before the role can record it (the report, set_stats and the metrics would
    not know the host failed); run here, in the clean step, a wrong type or choice is refused like any other bad
    variable, and recorded. playbooks/clean_slate.yml therefore imports the role with ``rolespec_validate: false``."""
    return spec_check(spec, values)[0]


def spec_check(spec: Mapping[str, t.Any], values: Mapping[str, t.Any]) -> tuple[list[str], dict[str, t.Any]]:
    """:func:`spec_problems`, and the values as the validator read them (the spec's types applied)."""
    if not spec:
        return [], dict(values)
    checked = ArgumentSpecValidator(dict(spec)).validate({k: x for k, x in values.items() if k in spec}, validate_role_argument_spec=True)
    return [m if m.endswith(".") else m + "." for m in (str(e) for e in checked.error_messages)], dict(checked.validated_parameters)


def text_dicts(spec: Mapping[str, t.Any], v: Mapping[str, t.Any], read: Mapping[str, t.Any]) -> dict[str, t.Any]:
    """The dictionary variables given as text (an AWX survey answer, ``-e clean_slate_restore=compute_mode=default``,
    JSON text), as the spec's validator read them. Ansible's check accepts such text but hands the role the text,
    and a phase that wants a dictionary would see none: the restore asked for would silently not happen."""
    return {
        name: read[name]
        for name, option in spec.items()
        if isinstance(option, Mapping) and option.get("type") == "dict" and isinstance(v.get(name), str) and isinstance(read.get(name), Mapping)
    }


def refusals(spec_bad: list[str], bad: list[str]) -> list[str]:
    """The argument spec's sentences, then those of :func:`problems` about the variables the spec did not name."""
    named = {name for m in spec_bad for name in _VARIABLE.findall(m)}

    def about(m: str) -> str:
        found = _VARIABLE.match(m)
        return found.group(0) if found else ""

    return spec_bad + [m for m in bad if about(m) not in named]


def targets(v: Mapping[str, t.Any], gpus: list[t.Any], mode: str, host: str, devices: t.Any, cwd: str) -> dict[str, t.Any]:
    """The targets of each phase: where the module runs, the label of the host, the containers, the GPUs of the
    kill and of the verification, and the JSON report's path on the controller."""
    hypervisor = text(v.get("clean_slate_hypervisor") or "")
    vmid = _int(v.get("clean_slate_vmid"))
    local = mode == "local"
    # Without a hypervisor (refused by problems()) the host itself: it is where the refusal is recorded.
    through = mode == "hypervisor" and bool(hypervisor)
    devs = [d for d in (devices if _is_list(devices) else []) if isinstance(d, str) and _DEVICE.match(d)]
    report_dir = text(v.get("clean_slate_report_dir") or "")
    return {
        "mode": mode,
        "delegate": hypervisor if through else host,
        "label": f"{hypervisor}/ct{vmid}" if through else host,
        "containers": [vmid] if mode == "hypervisor" else [],
        # In container scope the kill covers every GPU the container touches; verification covers its devices.
        "kill_gpus": gpus if local else [],
        "verify_gpus": gpus if (gpus or local) else devs,
        # A relative report directory is taken from where ansible-playbook was started, not from the playbook's
        # directory (which, for gpuops.clean_slate.clean_slate, is inside the installed collection).
        "report_path": os.path.join(cwd, os.path.expanduser(report_dir), f"{host}.json") if report_dir else "",
    }


def node_args(v: Mapping[str, t.Any], tg: Mapping[str, t.Any], given: Mapping[str, list[t.Any]], check_mode: bool, started: float) -> dict[str, t.Any]:
    """The arguments of gpuops.clean_slate.clean_slate_node for this host (the role's one source of them)."""
    restore = v.get("clean_slate_restore")
    restore = restore if isinstance(restore, Mapping) else {}
    patterns = given["clean_slate_patterns"]
    residue_users = v.get("clean_slate_residue_users")
    since = v.get("clean_slate_health_since")
    expected = _int(v.get("clean_slate_expected_gpus"))
    return {
        # The most the module may run; the action picks those of them that --tags and --skip-tags select.
        "phases": ["preflight", "kill"]
        + (["residue"] if boolean(v.get("clean_slate_residue_enabled")) else [])
        + (["restore"] if restore else [])
        + ["verify"],
        "containers": tg["containers"],
        "pre_stop": given["clean_slate_pre_stop_commands"],
        "pre_stop_timeout": v.get("clean_slate_pre_stop_timeout"),
        "verify": {
            "gpus": tg["verify_gpus"],
            "expected_count": expected if expected > 0 else None,
            "max_used_mib": v.get("clean_slate_max_used_mib"),
            "require_no_processes": boolean(v.get("clean_slate_require_no_processes")),
            # In check mode nothing was ended: waiting for the GPUs to come clean would only wait out the timeout.
            "timeout": 0 if check_mode else v.get("clean_slate_verify_timeout"),
            "interval": v.get("clean_slate_verify_interval"),
            # In check mode nothing was ended, so a busy GPU is the expected picture, not a failure.
            "fail_on_dirty": boolean(v.get("clean_slate_fail_on_dirty")) and not check_mode,
            "device_dir": v.get("clean_slate_device_dir"),
            "health": boolean(v.get("clean_slate_health")),
            # The threshold stays what the user asked in check mode too: the module then reports (fail_on_dirty false).
            "fail_on": v.get("clean_slate_health_fail_on"),
            # Xids since the role started on this host, unless told otherwise (the job's start, from a scheduler).
            "since": since if len(text(since if since is not None else "")) > 0 else started,
            "kernel_log": v.get("clean_slate_health_kernel_log"),
        },
        "kill": {
            "gpus": tg["kill_gpus"],
            "patterns": patterns,
            "users": given["clean_slate_users"],
            "where": v.get("clean_slate_where") if text(v.get("clean_slate_where") or "") else None,
            "include_children": boolean(v.get("clean_slate_include_children")),
            "process_group": boolean(v.get("clean_slate_process_group")),
            "protect": given["clean_slate_protect"],
            "unprotect": given["clean_slate_unprotect"],
            "kill_management_clients": boolean(v.get("clean_slate_kill_management_clients")),
            "allow_name_only": boolean(v.get("clean_slate_allow_name_only")),
            "signal": v.get("clean_slate_signal"),
            "grace_period": v.get("clean_slate_grace_period"),
            "kill_timeout": v.get("clean_slate_kill_timeout"),
            "device_dir": v.get("clean_slate_device_dir"),
        },
        "residue": {
            "shm": v.get("clean_slate_residue_shm"),
            "sockets": v.get("clean_slate_residue_sockets"),
            "locks": v.get("clean_slate_residue_locks"),
            "dirs": v.get("clean_slate_residue_dirs"),
            "remove": v.get("clean_slate_residue_remove"),
            "users": residue_users if residue_users else given["clean_slate_users"],
            "ports": v.get("clean_slate_residue_ports"),
            "time_wait_timeout": v.get("clean_slate_residue_time_wait_timeout"),
            # Only flags which port owners the kill phase would end; the residue phase signals nothing.
            "patterns": patterns,
            "protect": given["clean_slate_protect"],
            # In check mode nothing was ended, so a listener the kill phase would end is the expected picture.
            "fail_on": [] if check_mode else v.get("clean_slate_residue_fail_on"),
            "list_limit": v.get("clean_slate_residue_list_limit"),
        },
        # Opt-in (clean_slate_restore): the modes the last job changed, put back after the residue and before the verification.
        # Only the keys given: an option passed as None is an option given, and None is none of mps's or
        # compute_mode's choices (clean_slate_restore: {compute_mode: default} alone was refused).
        "restore": {
            k: x
            for k, x in (
                ("gpus", restore.get("gpus", tg["verify_gpus"])),
                ("compute_mode", restore.get("compute_mode")),
                ("mps", restore.get("mps")),
                ("mps_timeout", restore.get("mps_timeout", 10)),
            )
            if x is not None
        },
    }


def deps_needed(run: Mapping[str, t.Any]) -> bool:
    """The module stopped because its Python lacks dependencies (tasks/dependencies.yml deals with them)."""
    python = run.get("python")
    return run.get("reason") == "missing_library" and isinstance(python, Mapping) and len(python.get("missing") or []) > 0


_PHASES = ("arguments", "preflight", "kill", "residue", "restore", "verify")


def phase_results(run: Mapping[str, t.Any], mode: str) -> dict[str, Mapping[str, t.Any]]:
    """clean_slate_node's phase results under the names the role's phases always had. A host that did not answer
    is the preflight's failure; a run stopped by missing Python dependencies is not (tasks/dependencies.yml deals
    with them, and runs the module again). A run refused before any phase ran (bad options) is the failure of the
    phase whose options were refused."""
    phase = run.get("phase") or ""
    refused: dict[str, Mapping[str, t.Any]] = {}
    if run.get("failed") and phase in _PHASES and ("before" if phase == "preflight" else phase) not in run and "guard" not in run:
        refused = {("preflight" if phase == "arguments" else phase): run}
    if run.get("unreachable"):
        before: Mapping[str, t.Any] = run
    elif "before" in run and deps_needed(run):
        before = {**run["before"], "failed": False}
    else:
        before = run.get("before", refused.get("preflight", {}))
    pre_stop = {"results": run["pre_stop"]} if "pre_stop" in run else {}
    return {
        "before": before,
        "guard": run.get("guard", {}),
        "plan": run.get("plan", {}),
        "pre_stop_host": pre_stop if mode == "local" else {},
        "pre_stop_ct": pre_stop if mode != "local" else {},
        "kill": run.get("kill", refused.get("kill", {})),
        "residue": run.get("residue", refused.get("residue", {})),
        "restore": run.get("restore", refused.get("restore", {})),
        "verify": run.get("verify", refused.get("verify", {})),
    }


def steps(records: Mapping[str, t.Any], phases: Mapping[str, Mapping[str, t.Any]]) -> list[list[t.Any]]:
    """Every result of the run, in phase order, with the reason used when a failed result has none: what the
    gpuops.clean_slate.clean_slate_result filter (plugin_utils/_result.py) reads. ``records`` holds the role's
    own steps (resolve, args, the dependencies' tasks, metrics, report) by name."""

    def r(name: str) -> t.Any:
        x = records.get(name)
        return x if isinstance(x, Mapping) else {}

    return [
        ["arguments", "resolve", r("resolve"), "bad_variable"],
        ["arguments", "args", r("args"), "bad_variable"],
        ["preflight", "before", phases["before"], "gpus_unreadable"],
        ["dependencies", "deps", r("deps"), "missing_dependencies"],
        ["dependencies", "venv_pkg", r("venv_pkg"), "dependency_install_failed"],
        ["dependencies", "venv", r("venv"), "dependency_install_failed"],
        ["dependencies", "wheels", r("wheels"), "dependency_install_failed"],
        ["dependencies", "pip", r("pip"), "dependency_install_failed"],
        ["pre_stop", "plan", phases["plan"], "pre_stop_failed"],
        ["pre_stop", "pre_stop_ct", phases["pre_stop_ct"], "command_failed"],
        ["pre_stop", "pre_stop_host", phases["pre_stop_host"], "command_failed"],
        ["kill", "guard", phases["guard"], "gpus_not_read"],
        ["kill", "kill", phases["kill"], "kill_failed"],
        ["residue", "residue", phases["residue"], "residue_failed"],
        ["restore", "restore", phases["restore"], "restore_failed"],
        ["verify", "verify", phases["verify"], "not_clean"],
        ["report", "metrics", r("metrics"), "metrics_not_written"],
        ["report", "report", r("report"), "report_not_written"],
    ]


def step_messages(
    v: Mapping[str, t.Any], delegate: str, packages: list[t.Any], venv: Mapping[str, t.Any], wheels_path: str, metrics_path: str, report_path: str
) -> dict[str, dict[str, str]]:
    """What a failed command of the role says (its own message is only "non-zero return code")."""
    venv_dir = text(v.get("clean_slate_venv_dir"))
    if wheels_path:
        source = f"Put wheels of them for Python {venv.get('version', '?')} and the architecture of that host into clean_slate_wheels_dir ({wheels_path})"
    else:
        source = (
            "Let that host reach a package index (its pip configuration: /etc/pip.conf or PIP_INDEX_URL), or set clean_slate_wheels_dir to a"
            " directory of wheels on the controller"
        )
    return {
        "venv": {
            "msg": f"could not create the virtual environment {venv_dir} on {delegate}",
            "advice": "Install python3-venv (Debian, Ubuntu) there, or set clean_slate_venv_dir to a directory that its python3 can create; nothing was ended.",
        },
        "pip": {"msg": f"could not install {', '.join(text(p) for p in packages)} into {venv_dir} on {delegate}", "advice": f"{source}; nothing was ended."},
        "pre_stop_host": {
            "msg": f"a pre-stop command failed on {delegate}",
            "advice": "Fix it or remove it from clean_slate_pre_stop_commands; nothing was ended.",
        },
        "metrics": {
            "msg": f"could not write the metrics file {metrics_path} on {delegate}",
            "advice": "Set clean_slate_metrics_dir to node_exporter's textfile directory (its --collector.textfile.directory) on that host.",
        },
        "report": {
            "msg": f"could not write the JSON report {report_path} on the controller",
            "advice": "Set clean_slate_report_dir to a directory the controller (or the execution environment) can write.",
        },
    }


def metrics_path(v: Mapping[str, t.Any], host: str) -> str:
    """node_exporter's textfile for this host in clean_slate_metrics_dir ("" when none)."""
    d = text(v.get("clean_slate_metrics_dir") or "")
    return f"{d.rstrip('/')}/clean_slate_{re.sub(r'[^A-Za-z0-9_.-]', '_', host)}.prom" if d else ""


def _label(value: t.Any) -> str:
    return re.sub(r'([\\"])', r"\\\1", text(value))


def metrics_text(r: Mapping[str, t.Any], host: str, started: float, now: float) -> str:
    """node_exporter textfile metrics of this host, labelled host=<inventory name>; the per-GPU series carry
    dcgm-exporter's GPU labels (gpu, UUID, pci_bus_id, device, modelName) so that the two join in Grafana."""
    h = f'host="{_label(host)}"'
    residual = (r.get("gpus") or []) if (r.get("after") or not r.get("targets")) else []
    lines = [
        "# HELP clean_slate_last_run_timestamp_seconds Unix time at which the last gpuops.clean_slate run for this host ended.",
        "# TYPE clean_slate_last_run_timestamp_seconds gauge",
        f"clean_slate_last_run_timestamp_seconds{{{h}}} {now:.3f}",
        "# HELP clean_slate_last_run_success 1 when the last run proved every selected GPU clean, else 0.",
        "# TYPE clean_slate_last_run_success gauge",
        f"clean_slate_last_run_success{{{h}}} {1 if r.get('clean') else 0}",
        "# HELP clean_slate_last_run_duration_seconds Wall time of the last run for this host, from the role's start to its report.",
        "# TYPE clean_slate_last_run_duration_seconds gauge",
        f"clean_slate_last_run_duration_seconds{{{h}}} {max(now - started, 0):.3f}",
        "# HELP clean_slate_last_run_processes_ended Processes ended (SIGTERM or SIGKILL) by the last run.",
        "# TYPE clean_slate_last_run_processes_ended gauge",
        f"clean_slate_last_run_processes_ended{{{h}}} {r.get('ended', 0)}",
        '# HELP clean_slate_last_run_info Phase and reason of the last run (phase done and reason "" when clean).',
        "# TYPE clean_slate_last_run_info gauge",
        f'clean_slate_last_run_info{{{h},phase="{r.get("phase", "")}",reason="{r.get("reason", "")}"}} 1',
        "# HELP clean_slate_last_run_health Health verdict of the last run: 0 ok, 1 restart_app, 2 reset_gpu, 3 reboot, 4 drain (no sample when not judged).",
        "# TYPE clean_slate_last_run_health gauge",
    ]
    health = r.get("health")
    if isinstance(health, Mapping) and health.get("verdict") in HEALTH_ORDER:
        lines.append(f'clean_slate_last_run_health{{{h},verdict="{health["verdict"]}"}} {HEALTH_ORDER.index(health["verdict"])}')
    lines += [
        "# HELP clean_slate_gpu_used_mib GPU memory in use after the last run, in MiB (reserved memory excluded), per GPU.",
        "# TYPE clean_slate_gpu_used_mib gauge",
    ]
    for g in residual:
        if not isinstance(g, Mapping):
            continue
        labels = (
            f'{h},gpu="{g.get("index")}",UUID="{text(g.get("uuid") or "")}",pci_bus_id="{text(g.get("pci_bus_id") or "")}",'
            f'device="nvidia{g.get("minor", g.get("index"))}",modelName="{_label(g.get("name") or "")}"'
        )
        lines.append(f"clean_slate_gpu_used_mib{{{labels}}} {g.get('used_mib', 0)}")
    return "\n".join(lines) + "\n"


def published(host: str, r: Mapping[str, t.Any]) -> dict[str, t.Any]:
    """The set_stats entry of this host: the result without the per-GPU and per-process lists."""
    return {host: {k: x for k, x in r.items() if k not in ("gpus", "targets")}}
