# Copyright (c) 2026, gpuops.clean_slate maintainers
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# Note: this module_util is PRIVATE to the collection; it may change without notice.

"""The clean_slate_node module: every phase of a clean slate in one remote execution.

Ansible pays for each module it runs (a worker fork on the controller, the
module's transfer, an interpreter start on the host: about 0.3 s in a torch
environment). The role used to run four (the before picture, the kill, the
residue, the verification) and more with pre-stop commands; this runs them
in one process, each through the entry point of its own module, so that each
phase's result is exactly what that module returns on its own, and an option
added to a module reaches the umbrella through the argument spec the two share
(``_verify.argument_spec()``, ``_kill.argument_spec()``, ``_residue.module.argument_spec()``).

The phases, in order, each only when selected (``phases``):

* ``preflight``: gpu_mem_verify with the ``verify`` options, ``timeout: 0`` and
  ``fail_on_dirty: false``: the before picture. A kill never runs on GPUs that
  were not read (``gpus_not_read``) unless ``kill.allow_name_only``, which also
  lets a driver that cannot be read go on to a name-only kill;
* ``kill``: when ``pre_stop`` commands are given, gpu_procs_kill in check mode
  (the plan), then the commands only when the plan has targets, then
  gpu_procs_kill for real, with the same options: the plan shown before the
  commands is the kill's own, by construction;
* ``residue``: gpu_job_residue. With the kill in the same run, who held each
  candidate is read before the kill, and what the kill ended is handed to it
  (``_residue.module.Handoff``): a file whose holders this run's kill ended is
  orphaned at once, whatever its age (in check mode: whose holders the kill
  would end).

``profiles`` (the role's server profiles, resolved: the ``server_profiles``
filter) adds to the kill's and the residue phase's options before they are
checked: process patterns (to both), the servers' stops (``kill.servers``),
residue globs of each kind, ``dirs_holding``, ``keep_while`` and the ports the
next starts bind (``residue.server_ports``).
* ``restore``: gpu_mode_restore (put back the modes the last job changed; in check mode a GPU still in use
  is the expected picture and does not stop the run);
* ``verify``: gpu_mem_verify.

Every option of every selected phase is checked before the first phase runs
(bad input is refused before anything is read, signalled or removed). The run
stops at the first phase that fails; the module then fails with that phase's
``reason`` and ``msg`` and names it in ``phase``; each phase's result is kept
under its name (``before``, ``plan``, ``pre_stop``, ``kill``, ``residue``,
``restore``, ``verify``), a failed one with ``failed: true``.

With ``metrics``, the host's outcome (_outcome.result, the same the role's
result filter computes) is written as node_exporter textfile metrics at the
end of the run, whatever it was; the directory is checked before anything
runs. With ``stop`` (the role refused the host before the clean: a bad
variable, dependencies it could not install) no phase runs: the module fails
with that phase, reason and message, after writing the metrics of it.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import shlex
import time
import typing as t

from ansible.module_utils.common.arg_spec import ArgumentSpecValidator

from ansible_collections.gpuops.clean_slate.plugins.module_utils import (
    _checks,
    _inside,
    _kill,
    _metrics,
    _module,
    _nvml,
    _outcome,
    _pct,
    _phases,
    _procs,
    _protection,
    _reasons,
    _signals,
    _verify,
)
from ansible_collections.gpuops.clean_slate.plugins.module_utils._errors import CleanSlateError
from ansible_collections.gpuops.clean_slate.plugins.module_utils._residue import module as residue_module

PHASES = _phases.PHASES
#: Where the role may stop a host before any phase, and why (the ``stop`` option).
STOP_PHASES = _outcome.BEFORE_PHASES
STOP_REASONS = (_reasons.BAD_VARIABLE, _reasons.MISSING_DEPENDENCIES, _reasons.DEPENDENCY_INSTALL_FAILED)
#: The readings that fail because the driver cannot be read at all: with kill.allow_name_only they do not stop the kill.
UNREADABLE = (
    _reasons.LIBRARY_NOT_FOUND,
    _reasons.DRIVER_NOT_LOADED,
    _reasons.DRIVER_LIBRARY_MISMATCH,
    _reasons.NO_PERMISSION,
    _reasons.TIMEOUT,
    _reasons.NVML_ERROR,
)


def argument_spec() -> dict[str, dict[str, t.Any]]:
    """The umbrella's own options; ``kill``, ``residue`` and ``verify`` are checked against their modules' specs by :func:`phase_params`."""
    return {
        "phases": {"type": "list", "elements": "str", "choices": list(PHASES)},
        "verify": {"type": "dict", "default": {}},
        "kill": {"type": "dict", "default": {}},
        "residue": {"type": "dict", "default": {}},
        "restore": {"type": "dict", "default": {}},
        "pre_stop": {"type": "list", "elements": "str", "default": []},
        # What the server profiles add to the kill and residue options (merge_profiles).
        "profiles": {"type": "dict", "default": {}},
        "pre_stop_timeout": {"type": "float", "default": 60},
        # For the action plugin (the interpreter that runs this module; the host's record); the module itself ignores them.
        "python": {"type": "str"},
        "record": {"type": "dict"},
        "metrics": {
            "type": "dict",
            "options": {"dir": {"type": "path", "required": True}, "host": {"type": "str", "required": True}},
        },
        "stop": {
            "type": "dict",
            "options": {
                "phase": {"type": "str", "required": True, "choices": list(STOP_PHASES)},
                "reason": {"type": "str", "required": True, "choices": list(STOP_REASONS)},
                "msg": {"type": "str", "required": True},
            },
        },
        **_pct.SCOPE_OPTIONS,
    }


def failure_details(_reason: str) -> dict[str, t.Any]:
    """What every failure carries, also one refused before any phase ran: the interpreter, and where it stopped."""
    return {"python": _verify.python_facts(), "phase": "arguments"}


class Phase:
    """What a module's body needs of its module (params, check mode, diff, warn, run_command, get_bin_path), for one phase."""

    def __init__(self, module: t.Any, params: dict[str, t.Any], check_mode: bool) -> None:
        self.module = module
        self.params = params
        self.check_mode = check_mode
        self._diff = module._diff  # pylint: disable=protected-access

    def warn(self, warning: str) -> None:
        self.module.warn(warning)

    def run_command(self, *args: t.Any, **kwargs: t.Any) -> t.Any:
        return self.module.run_command(*args, **kwargs)

    def get_bin_path(self, *args: t.Any, **kwargs: t.Any) -> t.Any:
        return self.module.get_bin_path(*args, **kwargs)


def phase_params(name: str, spec: dict[str, dict[str, t.Any]], given: t.Any) -> dict[str, t.Any]:
    """``given`` checked against a module's argument spec, its defaults filled in; ``bad_arguments`` naming ``name.option``."""
    if not isinstance(given, dict):
        raise CleanSlateError(f"{name}: must be a dictionary of options, got {given!r}.", reason=_reasons.BAD_ARGUMENTS, option=name)
    checked = ArgumentSpecValidator(spec).validate(dict(given))
    if checked.error_messages:
        raise CleanSlateError(f"{name}: {' '.join(checked.error_messages)}", reason=_reasons.BAD_ARGUMENTS, option=name)
    return dict(checked.validated_parameters)


def selected_phases(p: t.Mapping[str, t.Any]) -> list[str]:
    """The phases asked for (all by default), in their order; restore only when its options declare something."""
    return [name for name in PHASES if (p["phases"] is None or name in p["phases"]) and (name != "restore" or p["restore"])]


#: What ``profiles`` holds, and the phase option each key joins (a list: added, without repeats, after the given ones).
PROFILE_KEYS = {
    "patterns": (("kill", "patterns"), ("residue", "patterns")),
    "servers": (("kill", "servers"),),
    **{kind: (("residue", kind),) for kind in residue_module.walk.KINDS},
    "dirs_holding": (("residue", "dirs_holding"),),
    "keep_while": (("residue", "keep_while"),),
    "ports": (("residue", "server_ports"),),
}


def merge_profiles(p: t.Mapping[str, t.Any]) -> dict[str, t.Any]:
    """The kill's and residue phase's options with what ``profiles`` adds (each list after the given one, no repeats);
    ``bad_arguments`` naming ``profiles`` for what is not one of its keys or not a list."""
    profiles = p["profiles"] or {}
    out = {"kill": dict(p["kill"] or {}), "residue": dict(p["residue"] or {})}
    unknown = sorted(str(k) for k in profiles if k not in PROFILE_KEYS)
    if unknown:
        raise CleanSlateError(
            f"profiles: unknown key(s) {', '.join(unknown)} (known: {', '.join(PROFILE_KEYS)}).",
            reason=_reasons.BAD_ARGUMENTS,
            option="profiles",
            phase="arguments",
        )
    for key, places in PROFILE_KEYS.items():
        added = profiles.get(key) or []
        if not isinstance(added, list):
            raise CleanSlateError(f"profiles: {key} must be a list, got {added!r}.", reason=_reasons.BAD_ARGUMENTS, option="profiles", phase="arguments")
        if not added:
            continue
        for section, option in places:
            given = out[section].get(option)
            if given is None:
                # Not written out: the module's default, then what the profiles add (the default is what they extend).
                spec = (_kill.argument_spec() if section == "kill" else residue_module.argument_spec())[option]
                given = list(spec.get("default") or [])
            if not isinstance(given, list):
                continue  # the phase's own check refuses it, naming the option
            out[section][option] = [*given, *(x for x in added if x not in given)]
    return out


def selected_params(p: t.Mapping[str, t.Any]) -> dict[str, dict[str, t.Any]]:
    """Every selected phase's options, checked as its own module checks them, before anything runs.

    Every phase's options are checked, so that one refusal names every wrong option at once: its ``phase`` is the
    first refused phase's (``arguments`` for the umbrella's own), its ``msg`` one sentence per refused phase, and
    ``refused`` lists each (``phase``, ``option``, ``msg``).
    """
    phases = selected_phases(p)
    scope = {"containers": p["containers"], "pct_path": p["pct_path"]}
    out: dict[str, dict[str, t.Any]] = {}
    errors: list[CleanSlateError] = []
    if p.get("profiles"):
        with refused("arguments", errors):
            p = {**p, **merge_profiles(p)}
    with refused("arguments", errors):
        _checks.number("pre_stop_timeout", p["pre_stop_timeout"], 0, _checks.MAX_SECONDS, low_open=True, unit="seconds")
        for vmid in p["containers"]:
            _checks.vmid("containers", vmid)
        _checks.executable("pct_path", p["pct_path"])
    if "preflight" in phases or "verify" in phases:
        with refused("preflight" if "preflight" in phases else "verify", errors):
            # The container scope is the umbrella's, as the kill's and the residue's: the CUDA start is made in that container.
            out["verify"] = {**phase_params("verify", _verify.argument_spec(), p["verify"]), **scope}
            _verify.validate(out["verify"])
            # The before picture: one reading, judged but never failed for being dirty, without the count check.
            out["preflight"] = {**out["verify"], "timeout": 0.0, "progress_timeout": 0.0, "fail_on_dirty": False, "expected_count": None}
            if "health" in out["preflight"]:
                # The health verdict is the verify phase's (after the kill, when the job's Xids are in the log).
                out["preflight"]["health"] = False
            if "cuda_probe" in out["preflight"]:
                # A CUDA start proves the GPUs the kill and the residue left: the verify phase's, never the before picture's.
                out["preflight"]["cuda_probe"] = False
    if "kill" in phases:
        with refused("kill", errors):
            k = out["kill"] = {**phase_params("kill", _kill.argument_spec(), p["kill"]), **scope}
            _kill.validate(k)
            _nvml.parse_gpu_selectors(k["gpus"])
            _procs.compile_patterns(k["patterns"])
            _protection.protect_list(k["protect"], k["unprotect"])
            _kill.compile_where(k["where"])
    if "restore" in phases:
        # Imported only when the (opt-in) phase runs: every module run pays for what it imports (issue 13).
        from ansible_collections.gpuops.clean_slate.plugins.module_utils import _restore  # pylint: disable=import-outside-toplevel

        with refused("restore", errors):
            out["restore"] = phase_params("restore", _restore.argument_spec(), p["restore"])
            _restore.validate(out["restore"])
    if "residue" in phases:
        with refused("residue", errors):
            r = out["residue"] = {**phase_params("residue", residue_module.argument_spec(), p["residue"]), **scope}
            residue_module.build_request(r, list)  # checks every option; the containers are looked up when it runs
    if errors:
        first = errors[0]
        if len(errors) == 1:
            raise first
        each = [{"phase": e.details.get("phase"), "option": e.details.get("option"), "msg": e.msg} for e in errors]
        raise CleanSlateError(" ".join(e.msg for e in errors), reason=_reasons.BAD_ARGUMENTS, **{**first.details, "refused": each})
    return out


@contextlib.contextmanager
def refused(phase: str, errors: list[CleanSlateError] | None = None) -> t.Iterator[None]:
    """A :class:`CleanSlateError` raised inside names ``phase`` (whose options were refused); collected into ``errors``
    when given (the checks go on with the next phase), else raised."""
    try:
        yield
    except CleanSlateError as exc:
        exc.details.setdefault("phase", phase)
        if errors is None:
            raise
        errors.append(exc)


def read_ok(before: dict[str, t.Any]) -> bool:
    """Whether the before picture read the GPUs (a failed reading carries a reason, or a diagnosis)."""
    return "clean" in before and not before.get("failed") and "reason" not in before and "diagnosis" not in before


def run_pre_stop(module: t.Any, commands: list[str], timeout: float, containers: list[int], check_mode: bool) -> list[dict[str, t.Any]]:
    """Run each pre-stop command (inside the container in container scope, else on this host), stopping at the first failure.

    Each result is what ansible.builtin.command (on the host) or pct_exec (in the container) returns, with
    ``item`` the command; a failed one has ``failed: true``.
    """
    results: list[dict[str, t.Any]] = []
    for command in commands:
        if containers:
            params = {
                "vmid": containers[0],
                "argv": None,
                "command": command,
                "chdir": None,
                "env": {},
                "stdin": None,
                "stdin_add_newline": True,
                "timeout": max(1, int(timeout)),
                "kill_after": 5,
                "keep_env": False,
                "creates": None,
                "removes": None,
                "pct_path": module.params["pct_path"],
                "node": None,
            }
            result = _module.outcome(Phase(module, params, check_mode), _pct.execute, "pct_exec", details=lambda reason: {"vmid": containers[0]})
            if not result.get("failed") and result.get("rc") not in (None, 0):
                result.update(failed=True, reason=_reasons.COMMAND_FAILED)
        elif check_mode:
            result = {"changed": False, "skipped": True, "msg": "check mode: the command would run", "cmd": command}
        else:
            result = run_local(module, command, timeout)
        result["item"] = command
        results.append(result)
        if result.get("failed"):
            break
    return results


#: Exit codes of coreutils ``timeout``: 124 after SIGTERM, 128+9 after the SIGKILL of ``-k``.
TIMED_OUT = (124, 137)


def run_local(module: t.Any, command: str, timeout: float) -> dict[str, t.Any]:
    """One pre-stop command on this host, split as ansible.builtin.command splits ``cmd`` (no shell, nothing
    expanded), under coreutils ``timeout`` (SIGTERM at the timeout, SIGKILL 5 s later), through the module's
    ``run_command``."""
    argv = shlex.split(command)
    wrapper = module.get_bin_path("timeout")
    cmd = [wrapper, "-k", "5", f"{timeout:g}", *argv] if wrapper else argv
    started = time.monotonic()
    try:
        rc, out, err = module.run_command(cmd, expand_user_and_vars=False, handle_exceptions=False)
    except OSError as exc:
        return {"changed": False, "failed": True, "reason": _reasons.COMMAND_FAILED, "cmd": argv, "rc": 2, "stdout": "", "stderr": str(exc), "msg": str(exc)}
    elapsed = time.monotonic() - started
    result = {"changed": True, "cmd": argv, "rc": rc, "stdout": out.rstrip("\n"), "stderr": err.rstrip("\n"), "delta_s": round(elapsed, 3), "msg": ""}
    if wrapper and rc in TIMED_OUT and elapsed >= timeout:
        result.update(
            failed=True,
            reason=_reasons.TIMEOUT,
            stderr=f"the command did not end within {timeout:g} s (clean_slate_pre_stop_timeout) and was killed",
            msg=f"the command did not end within {timeout:g} s",
        )
    elif rc != 0:
        result.update(failed=True, reason=_reasons.COMMAND_FAILED, msg="non-zero return code")
    return result


def verify_phase(module: t.Any, params: dict[str, t.Any], early: t.Any = None) -> dict[str, t.Any]:
    nvml = _module.Library("nvidia-ml-py", _nvml.HAS_PYNVML, _nvml.PYNVML_IMPORT_ERROR)

    def body(phase: t.Any) -> dict[str, t.Any]:
        return verify_body(phase, early)

    return _module.outcome(Phase(module, params, module.check_mode), body, "gpu_mem_verify", libraries=[nvml], details=_verify.failure_details)


def verify_body(phase: t.Any, early: t.Any = None) -> dict[str, t.Any]:
    """gpu_mem_verify's run; in container scope the CUDA start and the device files are the container's, through pct.
    ``early``: the CUDA starts' helpers forked before the kill (:func:`early_starts`)."""
    return _verify.run(phase, _inside.runner(phase), early)


def early_starts(module: t.Any, phases: list[str], params: dict[str, dict[str, t.Any]], before: dict[str, t.Any]) -> t.Any:
    """The verification's CUDA helpers forked before the kill (``_verify.early_helpers``), for the GPUs the before picture
    read: each spends its ``cuInit`` (0.1-0.2 s on an H200) while the kill and the residue phases run, so that the
    verification's starts go on from there the moment the memory is free. Only when the verify phase will make them
    (not in check mode, nor in container scope, where they are made inside the container); None otherwise."""
    if "verify" not in phases or "kill" not in phases:
        return None
    gpus = [(g["index"], g["uuid"]) for g in before.get("gpus") or [] if isinstance(g, dict) and g.get("uuid")]
    return _verify.early_helpers(params["verify"], gpus, module.check_mode)


def kill_phase(module: t.Any, params: dict[str, t.Any], check_mode: bool, runs: list[_kill.ModuleRun] | None = None) -> dict[str, t.Any]:
    phase = Phase(module, params, check_mode)
    body = _kill.ModuleRun(_pct.scopes_of(phase))
    if runs is not None:
        runs.append(body)  # its Kill, for what the residue phase is handed
    psutil = _module.Library("psutil", _signals.HAS_PSUTIL)
    return _module.outcome(phase, body, "gpu_procs_kill", libraries=[psutil], details=body.details)


def residue_phase(module: t.Any, params: dict[str, t.Any], handoff: residue_module.Handoff | None = None) -> dict[str, t.Any]:
    phase = Phase(module, params, module.check_mode)
    body = residue_module.ModuleRun(_pct.scopes_of(phase), handoff=handoff)
    return _module.outcome(phase, body, "gpu_job_residue", details=body.details)


def restore_phase(module: t.Any, params: dict[str, t.Any]) -> dict[str, t.Any]:
    from ansible_collections.gpuops.clean_slate.plugins.module_utils import _restore  # pylint: disable=import-outside-toplevel

    nvml = _module.Library("nvidia-ml-py", _nvml.HAS_PYNVML, _nvml.PYNVML_IMPORT_ERROR)
    return _module.outcome(Phase(module, params, module.check_mode), _restore.run, "gpu_mode_restore", libraries=[nvml])


class Stop(Exception):
    """The run stops at a phase: its name and the result that stopped it."""

    def __init__(self, phase: str, result: dict[str, t.Any]) -> None:
        super().__init__(phase)
        self.phase = phase
        self.result = result


def run(module: t.Any) -> dict[str, t.Any]:
    """The clean_slate_node module: the selected phases in order, stopping at the first failure; then the metrics."""
    start = time.monotonic()
    started = datetime.datetime.now()
    # Before anything of the module's own: the interpreter's start and the payload's import (tools/bench/cost.py).
    before_run = since_process_start()
    p = module.params
    metrics = p["metrics"]
    if metrics:
        why = _metrics.directory_problem(metrics["dir"])
        if why:
            raise CleanSlateError(f"metrics.dir: {why}", reason=_reasons.BAD_ARGUMENTS, option="metrics.dir", phase="arguments")
    out: dict[str, t.Any] = {"changed": False, "phases": [], "python": _verify.python_facts(), "timings": {"before_run": before_run}}
    failure: dict[str, t.Any] = {}
    if p["stop"]:
        # The role stopped this host before the clean; the run only records it.
        failure = dict(p["stop"])  # its phase, reason and msg
    else:
        phases = out["phases"] = selected_phases(p)
        params = selected_params(p)
        try:
            steps(module, p, phases, params, out)
        except Stop as stop:
            cause = stop.result.get("reason")  # every phase's failure carries its reason (the modules' one failure shape)
            failure = {"phase": stop.phase, "reason": cause or _reasons.INTERNAL_ERROR, "msg": stop.result.get("msg", "")}
    out.update(elapsed_s=round(time.monotonic() - start, 4), start=str(started), end=str(datetime.datetime.now()), phase=failure.get("phase", "done"))
    out["changed"] = any(out.get(n, {}).get("changed") for n in ("kill", "residue", "restore")) or any(r.get("changed") for r in out.get("pre_stop", []))
    if not failure:
        diffs = [out[n]["diff"] for n in ("kill", "residue", "restore") if isinstance(out.get(n), dict) and "diff" in out[n]]
        if diffs:
            out["diff"] = diffs
        out["msg"] = "; ".join(f"{n}: {out[n]['msg']}" for n in ("before", "kill", "residue", "restore", "verify") if out.get(n, {}).get("msg"))
    if metrics and not module.check_mode:
        with timed(out["timings"], "metrics"):
            written = write_metrics(p, {**out, **failure}, metrics, time.monotonic() - start)
        out["metrics"] = written
        if written.get("failed") and not failure:
            failure = {"phase": "report", "reason": _reasons.METRICS_NOT_WRITTEN, "msg": written["msg"]}
            out["phase"] = "report"
    if failure:
        msg, why = failure["msg"], failure["reason"]
        raise CleanSlateError(msg, reason=why, **{k: x for k, x in out.items() if k != "msg"})
    return out


def write_metrics(p: t.Mapping[str, t.Any], run: dict[str, t.Any], metrics: t.Mapping[str, t.Any], seconds: float) -> dict[str, t.Any]:
    """The host's outcome as the role computes it, written as node_exporter textfile metrics; what was written, or why not."""
    target = _metrics.path(metrics["dir"], metrics["host"])
    ctx = {
        "host": metrics["host"],
        "mode": "hypervisor" if p["containers"] else "local",
        "fail_on_dirty": bool((p["verify"] or {}).get("fail_on_dirty", True)),
        "health_fail_on": (p["verify"] or {}).get("fail_on"),
    }
    r = _outcome.result(_outcome.steps(_outcome.phase_results(run, ctx["mode"])), ctx)
    try:
        _metrics.write(target, _metrics.text(r, metrics["host"], seconds, time.time()))
    except OSError as exc:
        return {"failed": True, "path": target, "msg": f"could not write the metrics file {target}: {exc}"}
    return {"path": target, "clean": r["clean"]}


def since_process_start() -> float | None:
    """Seconds since this process started (/proc/self/stat's start time against the boot clock, to the clock tick): what
    the interpreter's start and the payload's import took before the module's own code ran."""
    try:
        with open("/proc/self/stat", encoding="ascii", errors="replace") as fh:
            ticks = int(fh.read().rsplit(")", 1)[1].split()[19])
        return round(time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK"), 3)
    except (OSError, ValueError, IndexError):
        return None


@contextlib.contextmanager
def timed(timings: dict[str, float], name: str) -> t.Iterator[None]:
    """``timings[name]``: the seconds the block took (the profile of a run, tools/bench/cost.py)."""
    began = time.monotonic()
    try:
        yield
    finally:
        timings[name] = round(time.monotonic() - began, 4)


#: The outcomes of a process this run's kill ended (or, in check mode, that it would end: every target).
ENDED = ("terminated", "killed", "exited", "stopped")


def ended_by_kill(run: _kill.ModuleRun, check_mode: bool) -> frozenset[residue_module.Ident]:
    """The processes the kill ended, by pid and start time; in check mode, every target of its plan."""
    entries = run.planned if check_mode else run.kill.ended if run.kill is not None else []
    return frozenset((e.candidate.pid, e.candidate.identity[0]) for e in entries if e.candidate.identity and (check_mode or e.victim.outcome in ENDED))


def holders_before(module: t.Any, params: dict[str, t.Any], out: dict[str, t.Any]) -> dict[t.Any, frozenset[residue_module.Ident]] | None:
    """Who holds each residue candidate now (``_residue.module.holders_before``); None, with a note, when it cannot be
    read (the residue phase says why when it runs)."""
    phase = Phase(module, params, module.check_mode)
    try:
        return residue_module.holders_before(residue_module.build_request(params, _pct.scopes_of(phase)))
    except (CleanSlateError, OSError) as exc:
        out.setdefault("notes", []).append(f"The residue's holders could not be read before the kill ({exc}): its files go by their age alone.")
        return None


def steps(module: t.Any, p: t.Mapping[str, t.Any], phases: list[str], params: dict[str, dict[str, t.Any]], out: dict[str, t.Any]) -> None:
    """Run the phases into ``out``; raises :class:`Stop` at the first that fails. Each phase's seconds go to
    ``out["timings"]``. The verification's CUDA helpers are forked once the GPUs were read, before the kill
    (:func:`early_starts`), and never outlive the run."""
    with contextlib.ExitStack() as stack:
        _steps(module, p, phases, params, out, stack)


def _steps(
    module: t.Any, p: t.Mapping[str, t.Any], phases: list[str], params: dict[str, dict[str, t.Any]], out: dict[str, t.Any], stack: contextlib.ExitStack
) -> None:
    early = None
    timings = out.setdefault("timings", {})
    allow_name_only = "kill" in phases and params["kill"]["allow_name_only"]
    handoff: residue_module.Handoff | None = None
    if "preflight" in phases:
        with timed(timings, "preflight"):
            before = out["before"] = verify_phase(module, params["preflight"])
        if before.get("failed"):
            unreadable = before.get("reason", before.get("diagnosis")) in UNREADABLE
            if not (allow_name_only and unreadable):
                raise Stop("preflight", before)
            # A name-only kill goes on: the reading's failure is on record, not the run's.
            before["failed"] = False
    if "kill" in phases and read_ok(out.get("before", {})):
        early = early_starts(module, phases, params, out["before"])
        if early is not None:
            stack.callback(early.close)
    if "kill" in phases:
        if not allow_name_only and not read_ok(out.get("before", {})):
            guard = out["guard"] = {
                "failed": True,
                "reason": _reasons.GPUS_NOT_READ,
                "msg": "the kill was refused because the GPUs were not read first (the preflight phase did not run: --skip-tags left out"
                " clean_slate_preflight). Run the role without skipping clean_slate_preflight, or set clean_slate_allow_name_only: true to end"
                " processes by name and device files only. Nothing was signalled.",
            }
            raise Stop("kill", guard)
        if p["pre_stop"]:
            with timed(timings, "plan"):
                plan = out["plan"] = kill_phase(module, params["kill"], True)
            if plan.get("failed"):
                raise Stop("pre_stop", plan)
            if plan.get("targets"):
                with timed(timings, "pre_stop"):
                    ran = out["pre_stop"] = run_pre_stop(module, p["pre_stop"], p["pre_stop_timeout"], p["containers"], module.check_mode)
                if ran and ran[-1].get("failed"):
                    raise Stop("pre_stop", ran[-1])
        # Who holds each residue candidate, read right before the kill: what the kill then ends is this run's to release.
        held = holders_before(module, params["residue"], out) if "residue" in phases else None
        runs: list[_kill.ModuleRun] = []
        with timed(timings, "kill"):
            kill = out["kill"] = kill_phase(module, params["kill"], module.check_mode, runs)
        if kill.get("failed"):
            raise Stop("kill", kill)
        if held is not None and runs and runs[0].kill is not None:
            handoff = residue_module.Handoff(before=held, ended=ended_by_kill(runs[0], module.check_mode))
    if "residue" in phases:
        with timed(timings, "residue"):
            residue = out["residue"] = residue_phase(module, params["residue"], handoff)
        if residue.get("failed"):
            raise Stop("residue", residue)
    if "restore" in phases:
        with timed(timings, "restore"):
            restore = out["restore"] = restore_phase(module, params["restore"])
        if restore.get("failed"):
            if not module.check_mode:
                raise Stop("restore", restore)
            # In check mode nothing was ended, so a GPU still in use is the expected picture, not a failure.
            restore["failed"] = False
    if "verify" in phases:
        with timed(timings, "verify"):
            verify = out["verify"] = verify_phase(module, params["verify"], early)
        if verify.get("failed"):
            raise Stop("verify", verify)
