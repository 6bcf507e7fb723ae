# Copyright (c) 2026, gpuops.clean_slate maintainers
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

"""Action plugin of gpuops.clean_slate.clean_slate_host: the clean_slate role's work on one host in two tasks.

``step: clean`` reads the role's variables, refuses bad ones, looks for the modules' virtual environment when
the role installs dependencies, and runs gpuops.clean_slate.clean_slate_node once, for the phases the run's
tags select, on the host where it runs (the task's delegate). ``step: record`` turns everything the run
registered into the host's result, writes the node_exporter metrics on the GPU node and the JSON report on
the controller, and publishes the result (set_stats). The role ran each of these as a task of its own (0.5 s
on a GPU node for thirteen of them, issue 13); plugin_utils/_role.py holds the logic.

Neither step fails the task for a host that is not clean: the role's last task does, once, after the record
(a failed task's variables and stats are not kept by Ansible). A host that does not answer makes the clean
step unreachable, as any task; the record step, in the block's ``always``, records it.
"""

from __future__ import annotations

import json
import os
import shlex
import tempfile
import time
import typing as t

from ansible.errors import AnsibleConnectionFailure, AnsibleError
from ansible.plugins.action import ActionBase
from ansible.utils.vars import load_extra_vars

from ansible_collections.gpuops.clean_slate.plugins.plugin_utils import _phases, _result, _role

#: The role variables this plugin reads (templated when read).
_ROLE_VARS = (
    "clean_slate_mode",
    "clean_slate_hypervisor",
    "clean_slate_vmid",
    "clean_slate_gpus",
    "clean_slate_expected_gpus",
    "clean_slate_patterns",
    "clean_slate_include_children",
    "clean_slate_process_group",
    "clean_slate_users",
    "clean_slate_where",
    "clean_slate_protect",
    "clean_slate_unprotect",
    "clean_slate_kill_management_clients",
    "clean_slate_signal",
    "clean_slate_grace_period",
    "clean_slate_kill_timeout",
    "clean_slate_device_dir",
    "clean_slate_allow_name_only",
    "clean_slate_pre_stop_commands",
    "clean_slate_pre_stop_timeout",
    "clean_slate_residue_enabled",
    "clean_slate_residue_shm",
    "clean_slate_residue_sockets",
    "clean_slate_residue_locks",
    "clean_slate_residue_dirs",
    "clean_slate_residue_remove",
    "clean_slate_residue_users",
    "clean_slate_residue_ports",
    "clean_slate_residue_time_wait_timeout",
    "clean_slate_residue_fail_on",
    "clean_slate_residue_list_limit",
    "clean_slate_verify_timeout",
    "clean_slate_verify_interval",
    "clean_slate_max_used_mib",
    "clean_slate_require_no_processes",
    "clean_slate_fail_on_dirty",
    "clean_slate_health",
    "clean_slate_health_fail_on",
    "clean_slate_health_since",
    "clean_slate_health_kernel_log",
    "clean_slate_restore",
    "clean_slate_install_dependencies",
    "clean_slate_python_packages",
    "clean_slate_venv_dir",
    "clean_slate_wheels_dir",
    "clean_slate_report_dir",
    "clean_slate_metrics_dir",
)

#: The collection's root (this file is plugins/action/clean_slate_host.py in it): where the role's argument spec is.
_COLLECTION_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

#: The role variables the record step reads.
_RECORD_VARS = ("clean_slate_metrics_dir", "clean_slate_fail_on_dirty", "clean_slate_health_fail_on", "clean_slate_venv_dir")


class ActionModule(ActionBase):
    """One step of the clean_slate role on one host (see the module's documentation)."""

    _supports_check_mode = True
    _supports_async = False
    TRANSFERS_FILES = False

    # ------------------------------------------------------------------ helpers
    def _var(self, task_vars: dict[str, t.Any], name: str, default: t.Any = None) -> t.Any:
        if name not in task_vars:
            return default
        return self._templar.template(task_vars[name])

    def _role_vars(self, task_vars: dict[str, t.Any]) -> dict[str, t.Any]:
        return {name: self._var(task_vars, name) for name in _ROLE_VARS}

    def _resolve(self, task_vars: dict[str, t.Any], started: float) -> dict[str, t.Any]:
        """The host's targets and arguments, and the refusal of bad variables (records resolve and args)."""
        host = str(task_vars.get("inventory_hostname"))
        out: dict[str, t.Any] = {"host": host, "started": started, "records": {}}
        spec_bad: list[str] = []
        try:
            v = self._role_vars(task_vars)
            # The role's argument spec, as Ansible would apply it, but refused and recorded like any bad variable.
            spec = _role.argument_spec(_COLLECTION_ROOT)
            spec_bad, read = _role.spec_check(spec, {n: (v[n] if n in v else self._var(task_vars, n)) for n in spec if n in task_vars})
            v.update(_role.text_dicts(spec, v, read))
            mode = str(self._var(task_vars, "_clean_slate_mode", "local"))
            gpus = _role.gpu_list(v["clean_slate_gpus"])
            given = _role.lists(v)
            wheels = str(self._var(task_vars, "_clean_slate_wheels_path", "") or "")
            tg = _role.targets(v, gpus, mode, host, self._var(task_vars, "proxmox_gpu_devices", []), os.path.realpath("."))
        except (AnsibleError, TypeError, ValueError) as e:  # a variable that cannot be templated or read: the host's arguments are refused
            why = " ".join(spec_bad) if spec_bad else f"the role variables could not be read: {e}"
            out["records"]["resolve"] = {"failed": True, "msg": f"{host}: {why} Nothing was changed."}
            out.update(mode=str(task_vars.get("clean_slate_mode", "local")), delegate=host, label=host, lists={}, report_path="", wheels_path="")
            return out
        out.update(tg, lists=given, wheels_path=wheels, vars=v)
        try:
            more = _role.problems(v, gpus, given, mode, host, wheels)
        except (TypeError, ValueError):
            if not spec_bad:
                raise
            more = []  # a value of the wrong type, which the argument spec has named already
        bad = _role.refusals(spec_bad, more)
        if bad:
            out["records"]["args"] = {"failed": True, "msg": f"{host}: {' '.join(bad)} Nothing was changed."}
        return out

    def _command(self, argv: list[str], stdin: str | None = None) -> dict[str, t.Any]:
        """A command on the host the task runs on, as ansible.builtin.command would report it (rc, stdout, stderr)."""
        # With the task's environment, as a module gets it (the play's PATH decides which python3 runs).
        env = self._compute_environment_string()
        cmd = " ".join(shlex.quote(a) for a in argv)
        res = self._low_level_execute_command(f"{env} {cmd}" if env else cmd, in_data=None if stdin is None else stdin.encode("utf-8"))
        return {"rc": res.get("rc"), "stdout": res.get("stdout", ""), "stderr": res.get("stderr", ""), "changed": False}

    # ------------------------------------------------------------------ steps
    def run(self, tmp: t.Any = None, task_vars: dict[str, t.Any] | None = None) -> dict[str, t.Any]:
        task_vars = task_vars or {}
        result = super().run(tmp, task_vars)
        step = self._task.args.get("step")
        if step == "clean":
            return self._clean(result, task_vars)
        if step == "record":
            return self._record(result, task_vars)
        result.update(failed=True, msg=f"step must be clean or record, got {json.dumps(str(step))}")
        return result

    def _clean(self, result: dict[str, t.Any], task_vars: dict[str, t.Any]) -> dict[str, t.Any]:
        started = time.time()
        r = self._resolve(task_vars, started)
        info: dict[str, t.Any] = {k: r.get(k) for k in ("started", "mode", "delegate", "label", "lists", "report_path", "wheels_path", "records")}
        info["after_install"] = bool(self._task.args.get("python"))
        result.update(changed=False, clean_slate=info, deps_needed=False)
        if r["records"]:
            return result  # refused: nothing runs on the host
        v = r["vars"]
        check_mode = bool(task_vars.get("ansible_check_mode", self._task.check_mode))
        python = self._task.args.get("python")
        if not python and _role.boolean(v["clean_slate_install_dependencies"]):
            # A complete environment is used at once, so a second run costs this one command. It only looks.
            script = str(self._var(task_vars, "_clean_slate_venv_script", ""))
            try:
                probe = self._command(["python3", "-I", "-c", script, str(v["clean_slate_venv_dir"]), "probe"])
            except AnsibleConnectionFailure:
                raise
            except AnsibleError as e:  # no python3 there: the dependencies phase says so, where it would make the environment with it
                probe = {"rc": 1, "stdout": "", "stderr": "", "msg": str(e)}
            try:
                venv = json.loads(probe["stdout"]) if probe.get("rc") == 0 else {}
            except ValueError:
                venv = {}
            info.update(venv_probe=probe, venv=venv)
            if venv.get("venv") == "ok":
                python = f"{v['clean_slate_venv_dir']}/bin/python"
        mod_vars = task_vars
        # An extra variable wins over anything a role sets, as Ansible's own precedence has it.
        if python and "ansible_python_interpreter" not in load_extra_vars(self._loader):
            mod_vars = dict(task_vars)
            delegate = self._task.delegate_to
            if delegate and isinstance(task_vars.get("ansible_delegated_vars"), dict) and delegate in task_vars["ansible_delegated_vars"]:
                dv = dict(task_vars["ansible_delegated_vars"][delegate], ansible_python_interpreter=python)
                mod_vars["ansible_delegated_vars"] = dict(task_vars["ansible_delegated_vars"], **{delegate: dv})
            else:
                mod_vars["ansible_python_interpreter"] = python
            info["python"] = python
        args = _role.node_args(v, r, r["lists"], check_mode, started)
        inherited = set(self._task.tags or []) - {"always"}
        chosen = _phases.selected(inherited, task_vars.get("ansible_run_tags", ["all"]), task_vars.get("ansible_skip_tags", []))
        args["phases"] = [p for p in chosen if p in args["phases"]]
        if not args["phases"]:
            result.update(skipped=True, phases=[], msg="no phase of the clean slate is selected by --tags/--skip-tags")
            return result
        run = self._execute_module(module_name="gpuops.clean_slate.clean_slate_node", module_args=args, task_vars=mod_vars)
        # The module's own result, whole (the phases' results are read from it), but the task does not fail: the role
        # fails the host once, after the record. module_failed keeps what the module said.
        module_failed = bool(run.pop("failed", False))
        result.update(run)
        result.update(module_failed=module_failed, deps_needed=_role.deps_needed(run), clean_slate=info)
        return result

    def _record(self, result: dict[str, t.Any], task_vars: dict[str, t.Any]) -> dict[str, t.Any]:
        args = self._task.args
        run = args.get("run") if isinstance(args.get("run"), dict) else {}
        deps = args.get("deps") if isinstance(args.get("deps"), dict) else {}
        host = str(task_vars.get("inventory_hostname"))
        info = run.get("clean_slate") if isinstance(run.get("clean_slate"), dict) else None
        if info is None:
            # The clean step did not return (the host did not answer, or the step broke): work the targets out again.
            r = self._resolve(task_vars, time.time())
            info = {k: r.get(k) for k in ("started", "mode", "delegate", "label", "lists", "report_path", "wheels_path", "records")}
        else:
            run = {**run, "failed": bool(run.get("module_failed"))}
        if run.get("failed") and not run.get("unreachable") and "phase" not in run:
            # Failed without a phase of the module's: Ansible failed the run (no Python there, MODULE FAILURE, a task
            # timeout) or the clean step broke. It is the first phase's failure, with Ansible's message (the guide's
            # gpus_unreadable), not a run in which no phase was selected.
            run = {**run, "phase": "preflight"}
        # Only what the record needs: each variable read costs a templating call, per host.
        v = {name: self._var(task_vars, name) for name in _RECORD_VARS}
        mode = str(info.get("mode") or "local")
        delegate = str(info.get("delegate") or host)
        lists = info.get("lists") or {}
        records: dict[str, t.Any] = dict(info.get("records") or {})
        records.update({k: x for k, x in deps.items() if isinstance(x, dict)})
        phases = _role.phase_results(run, mode)
        metrics_path = _role.metrics_path(v, host)
        report_path = str(info.get("report_path") or "")
        check_mode = bool(task_vars.get("ansible_check_mode", self._task.check_mode))
        ctx = {
            "host": host,
            "label": info.get("label") or host,
            "mode": mode,
            "delegate": delegate,
            "check_mode": check_mode,
            "fail_on_dirty": _role.boolean(v["clean_slate_fail_on_dirty"]),
            "health_fail_on": v["clean_slate_health_fail_on"],
            "option_vars": _role.OPTION_VARS,
            "step_messages": _role.step_messages(
                v,
                delegate,
                list(lists.get("clean_slate_python_packages") or []),
                info.get("venv") or {},
                str(info.get("wheels_path") or ""),
                metrics_path,
                report_path,
            ),
        }
        res = _result.result(_role.steps(records, phases), ctx)
        # node_exporter's textfile on the GPU node: written whole (a temporary file beside it, renamed over it), not for a
        # host whose variables were refused (nothing ran there) nor one that does not answer.
        if metrics_path and not check_mode and res["phase"] != "arguments" and res["reason"] != _result.UNREACHABLE:
            text = _role.metrics_text(res, host, float(info.get("started") or time.time()), time.time())
            script = str(self._var(task_vars, "_clean_slate_write_script", ""))
            try:
                records["metrics"] = self._command(["/bin/sh", "-c", script, "sh", metrics_path, "exists"], stdin=text)
            except AnsibleConnectionFailure as e:
                records["metrics"] = {"unreachable": True, "msg": str(e)}
            except AnsibleError as e:  # the record is written whatever happens to the metrics
                records["metrics"] = {"rc": 1, "stderr": str(e), "changed": False}
            res = _result.result(_role.steps(records, phases), ctx)
        # The JSON report on the controller: an output of the run, written in check mode too.
        if report_path:
            records["report"] = self._write_report(report_path, res)
            res = _result.result(_role.steps(records, phases), ctx)
        result.update(
            changed=False,
            clean_slate_result=res,
            ansible_stats={"data": {"clean_slate": _role.published(host, res)}, "per_host": False, "aggregate": True},
        )
        return result

    @staticmethod
    def _write_report(path: str, res: dict[str, t.Any]) -> dict[str, t.Any]:
        """Write the report whole: a temporary file beside it (not ending in .json, so no reader takes it half written), renamed over it."""
        tmp = ""
        try:
            d = os.path.dirname(path) or "."
            os.makedirs(d, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=os.path.basename(path) + ".", dir=d)
            with os.fdopen(fd, "w") as f:
                json.dump(res, f, indent=4, sort_keys=True)
            os.chmod(tmp, 0o644)
            os.replace(tmp, path)
            tmp = ""
            return {"rc": 0, "changed": False}
        except (OSError, TypeError, ValueError) as e:  # not writable, or a value JSON cannot hold: the record says so
            return {"rc": 1, "stderr": str(e), "changed": False}
        finally:
            if tmp:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
