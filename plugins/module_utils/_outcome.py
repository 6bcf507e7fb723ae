# Copyright (c) 2026, gpuops.clean_slate maintainers
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# Note: this module_util is PRIVATE to the collection; it may change without notice.

"""A host's outcome: whether its GPUs are proven clean, and if not, where and why.

One function for both sides of the run: the clean_slate_node module computes it on the node for the metrics it
writes there, and the gpuops.clean_slate.clean_slate_result filter computes it on the controller for the role's
``clean_slate_result`` (with what only the controller knows: an unreachable host, a role step that failed, the
JSON report). Both read the same steps in phase order (:func:`steps`): the first that failed or found its host
unreachable is the host's failure (its reason, or the step's default reason; a failed verification names the first
dirty GPU's diagnosis); otherwise the verdict of what ran, where a kill without a verification, or no reading at
all, is ``not_verified``.
"""

from __future__ import annotations

import json
import re
import typing as t

from ansible_collections.gpuops.clean_slate.plugins.module_utils import _health, _phases, _reasons

#: A step: [phase, name, result, the reason used when a failed result has none].
Step = t.Sequence[t.Any]

#: gpu_mem_verify fails a dirty node with these; the host's reason is the first dirty GPU's diagnosis instead.
VERIFY_FAILURES = ("", _reasons.NOT_CLEAN, _reasons.MISSING_GPUS)
#: The keys of clean_slate_node's result that hold a phase's own result.
PHASE_RESULTS = ("before", "guard", "plan", "pre_stop", "kill", "residue", "restore", "verify")
#: Where a run can stop before any phase: its own options (arguments) or the modules' Python (dependencies).
BEFORE_PHASES = ("arguments", "dependencies")
#: Where the role can stop a host besides: one of the user's tasks between the preflight and the kill.
ROLE_PHASES = (*BEFORE_PHASES, "before_kill")


def _mapping(value: t.Any) -> t.Mapping[str, t.Any]:
    return value if isinstance(value, t.Mapping) else {}


def failed(r: t.Mapping[str, t.Any]) -> bool:
    """A result that failed: ``failed`` (a skipped task never), or a clean_slate_node run that stopped in a phase
    (the role registers it with ``failed_when: false``, so that the host fails once, after its record)."""
    if "skipped" in r and r.get("skipped"):
        return False
    # module_failed: clean_slate_node's action plugin keeps that the module failed (Ansible's own failures included).
    return bool(r.get("failed") or r.get("module_failed")) or ("reason" in r and r.get("phase") not in (None, "done"))


def _bad_rc(r: t.Mapping[str, t.Any]) -> bool:
    return "rc" in r and r["rc"] not in (0, "0", None)


def deps_missing(run: t.Mapping[str, t.Any]) -> bool:
    """The run stopped because the modules' Python lacks dependencies."""
    python = run.get("python")
    return run.get("reason") == _reasons.MISSING_LIBRARY and isinstance(python, t.Mapping) and len(python.get("missing") or []) > 0


def phase_results(run: t.Mapping[str, t.Any], mode: str) -> dict[str, t.Mapping[str, t.Any]]:
    """clean_slate_node's results by step name. A host that did not answer is the preflight's failure. A run stopped
    before any phase (its options refused, or the role's refusal it was asked to record) is the failure of the phase
    whose options were refused, or of ``arguments`` / ``dependencies``."""
    run = _mapping(run)
    if failed(run) and not run.get("unreachable") and "phase" not in run:
        # Failed without a phase of the module's: Ansible failed the run (no Python there, MODULE FAILURE, a task
        # timeout). It is the first phase's failure, with Ansible's message.
        run = {**run, "phase": "preflight"}
    phase = run.get("phase") or ""
    refused: dict[str, t.Mapping[str, t.Any]] = {}
    if failed(run) and (phase in ROLE_PHASES or phase in _phases.PHASES) and ("before" if phase == "preflight" else phase) not in run and "guard" not in run:
        # Stopped before that phase ran: its options were refused (or the role stopped the host there).
        refused = {phase: {**run, "failed": True, "before_any_phase": not any(k in run for k in PHASE_RESULTS)}}
    if deps_missing(run):
        # The modules' Python lacks their dependencies: the role's dependencies phase, which says what to do.
        python = _mapping(run.get("python"))
        missing = ", ".join(str(m) for m in python.get("missing") or [])
        refused["dependencies"] = {
            "failed": True,
            "reason": _reasons.MISSING_DEPENDENCIES,
            "msg": f"the Python at {python.get('executable', '?')} lacks {missing}. Install them (pip install"
            f" {missing.replace(', ', ' ')}, into a virtual environment where the system Python is externally managed, then point"
            " ansible_python_interpreter at it) or set clean_slate_install_dependencies: true.",
        }
        run = {k: x for k, x in run.items() if k != "before"}
    if run.get("unreachable"):
        before: t.Mapping[str, t.Any] = run
    else:
        before = run.get("before", refused.get("preflight", {}))
    pre_stop = {"results": run["pre_stop"]} if "pre_stop" in run else {}
    return {
        "arguments": refused.get("arguments", {}),
        "dependencies": refused.get("dependencies", {}),
        "before": before,
        "before_kill": refused.get("before_kill", {}),
        "guard": run.get("guard", {}),
        "plan": run.get("plan", {}),
        "pre_stop_host": pre_stop if mode == "local" else {},
        "pre_stop_ct": pre_stop if mode != "local" else {},
        "kill": run.get("kill", refused.get("kill", {})),
        "residue": run.get("residue", refused.get("residue", {})),
        "restore": run.get("restore", refused.get("restore", {})),
        "verify": run.get("verify", refused.get("verify", {})),
    }


def steps(phases: t.Mapping[str, t.Mapping[str, t.Any]], records: t.Mapping[str, t.Any] | None = None) -> list[list[t.Any]]:
    """Every result of the run, in phase order, with the reason used when a failed result has none. ``records``
    holds what only the controller sees: ``error`` (a role task that failed before the clean, for example a variable
    that cannot be templated) and ``report`` (the JSON report's write)."""
    rec = _mapping(records)

    def r(name: str) -> t.Mapping[str, t.Any]:
        return _mapping(rec.get(name))

    error = r("error")
    error_phase = str(error.get("phase") or "arguments")
    return [
        # A role task that failed: in the opt-in dependencies (a package install, the wheels' copy), or a variable that cannot be templated.
        [error_phase, "error", error, _reasons.DEPENDENCY_INSTALL_FAILED if error_phase == "dependencies" else _reasons.BAD_VARIABLE],
        ["arguments", "arguments", phases["arguments"], _reasons.BAD_VARIABLE],
        ["dependencies", "dependencies", phases["dependencies"], _reasons.DEPENDENCY_INSTALL_FAILED],
        ["preflight", "before", phases["before"], _reasons.GPUS_UNREADABLE],
        ["before_kill", "before_kill", phases["before_kill"], _reasons.BEFORE_KILL_FAILED],
        ["pre_stop", "plan", phases["plan"], _reasons.PRE_STOP_FAILED],
        ["pre_stop", "pre_stop_ct", phases["pre_stop_ct"], _reasons.COMMAND_FAILED],
        ["pre_stop", "pre_stop_host", phases["pre_stop_host"], _reasons.COMMAND_FAILED],
        ["kill", "guard", phases["guard"], _reasons.GPUS_NOT_READ],
        ["kill", "kill", phases["kill"], _reasons.KILL_FAILED],
        ["residue", "residue", phases["residue"], _reasons.RESIDUE_FAILED],
        ["restore", "restore", phases["restore"], _reasons.RESTORE_FAILED],
        ["verify", "verify", phases["verify"], _reasons.NOT_CLEAN],
        ["report", "report", r("report"), _reasons.REPORT_NOT_WRITTEN],
    ]


#: What a failed step says when its own message is only "non-zero return code" (the commands a host runs).
STEP_MESSAGES = {
    "pre_stop_host": ("a pre-stop command failed on {delegate}", "Fix it or remove it from clean_slate_pre_stop_commands; nothing was ended."),
    "report": (
        "could not write the JSON report {report_path} on the controller",
        "Set clean_slate_report_dir to a directory the controller (or the execution environment) can write.",
    ),
}


def step_error(all_steps: t.Sequence[Step], ctx: t.Mapping[str, t.Any]) -> dict[str, t.Any]:
    """The first step that failed or found its host unreachable: {phase, reason, msg, fatal}, or {}."""
    option_vars = _mapping(ctx.get("option_vars"))
    for phase, name, r, default_reason in all_steps:
        if not isinstance(r, t.Mapping):
            continue
        items = [i for i in r.get("results") or [] if isinstance(i, t.Mapping)] if isinstance(r.get("results"), list) else []
        group = [r, *items]
        down = [x for x in group if x.get("unreachable")]
        bad = [x for x in group if failed(x)] + [x for x in group if _bad_rc(x)]
        if down:
            return {
                "phase": phase,
                "reason": _reasons.UNREACHABLE,
                "fatal": True,
                "msg": f"{ctx.get('delegate') or ctx.get('host')} is unreachable ({str(down[0].get('msg', 'no answer')).strip()}). Nothing more was done"
                " on it: make it reachable (SSH, credentials, the hypervisor) and run again.",
            }
        if not bad:
            continue
        f = next((i for i in items if failed(i)), bad[0])
        dirty = [g.get("diagnosis") for g in f.get("gpus") or [] if isinstance(g, t.Mapping) and "clean" in g and not g["clean"]]
        reason = f.get("reason") or f.get("diagnosis") or ""
        if phase == "verify" and "gpus" in f and reason in VERIFY_FAILURES:
            reason = dirty[0] if dirty else _reasons.TOO_FEW_GPUS
        reason = reason or default_reason
        msg = str(f.get("msg", "")).strip() or f"exit status {f.get('rc', '?')}"
        if name in STEP_MESSAGES:
            said, advice = STEP_MESSAGES[name]
            item = f" ({json.dumps(f['item'])})" if "item" in f else ""
            # A command's own message is only "non-zero return code": its stderr, or its exit status, says more.
            detail = str(f.get("stderr", "")).strip() or (f"exit status {f['rc']}" if "rc" in f else msg)
            msg = f"{said.format(**{k: ctx.get(k, '') for k in ('delegate', 'report_path')})}{item}: {detail}. {advice}"
        if reason == _reasons.BAD_ARGUMENTS and option_vars:
            phase, reason, msg = refusal(f, phase, option_vars)
        return {"phase": phase, "reason": reason, "msg": msg, "fatal": True}
    return {}


def named_after_variable(msg: str, r: t.Mapping[str, t.Any], phase: str, option_vars: t.Mapping[str, str]) -> str:
    """A refused module option named as the role variable that feeds it (``kill.grace_period`` -> clean_slate_grace_period).

    ``option_vars`` maps ``<section>.<option>`` (the sections of clean_slate_node's arguments: verify, kill, residue,
    restore, metrics) to the role variable; the gpuops.clean_slate.clean_slate_result filter reads it from the role's tasks."""
    option = str(r.get("option") or "")
    lead = re.match(r"([a-z_.]+)(?=[ :])", msg)
    if not option and lead:
        option = lead.group(1)
    section = "verify" if phase == "preflight" else phase
    # The option as named (metrics.dir), within its phase's section (kill.grace_period), or its section's (metrics).
    variable = option_vars.get(option) or option_vars.get(f"{section}.{option}") or option_vars.get(option.split(".")[0])
    if not variable:
        return msg
    if lead and lead.group(1) == option:
        return variable + msg[len(option) :]
    return f"{variable}: {msg}"


def refusal(r: t.Mapping[str, t.Any], phase: str, option_vars: t.Mapping[str, str]) -> tuple[str, str, str]:
    """A run whose options clean_slate_node refused, as the role sees it: each refused option named after the role
    variable that feeds it, one sentence per variable. Refused before any phase ran, every option fed by a role
    variable: the role's ``arguments`` phase, ``bad_variable``."""
    each = [x for x in r.get("refused") or [] if isinstance(x, t.Mapping)] or [r]
    sentences: dict[str, str] = {}
    named = True
    for x in each:
        section = str(x.get("phase") or phase)
        text = named_after_variable(str(x.get("msg", "")).strip(), x, section, option_vars)
        variable = re.match(r"clean_slate_[a-z_]+", text)
        named = named and bool(variable)
        # One sentence per variable: an option fed by the same variable in two phases (clean_slate_gpus) says it once.
        sentences.setdefault(variable.group(0) if variable else text, text)
    msg = " ".join(s if s.endswith(".") else s + "." for s in sentences.values())
    if r.get("before_any_phase") and named:
        return "arguments", _reasons.BAD_VARIABLE, msg
    return phase, _reasons.BAD_ARGUMENTS, msg


def _named(all_steps: t.Sequence[Step]) -> dict[str, t.Mapping[str, t.Any]]:
    return {str(step[1]): _mapping(step[2]) for step in all_steps}


def read_ok(before: t.Mapping[str, t.Any]) -> t.Mapping[str, t.Any]:
    """The preflight reading when it read the GPUs (a failed reading carries a reason, or a diagnosis), else {}."""
    return before if "clean" in before and "reason" not in before and "diagnosis" not in before else {}


def health_fails(verify: t.Mapping[str, t.Any], fail_on: t.Any) -> bool:
    """Whether the verify phase's health verdict fails the host at ``fail_on`` (the module judges the same; in check
    mode and with clean_slate_fail_on_dirty false it only reports, and this tells why a host whose memory is clean is not)."""
    h = verify.get("health")
    if not isinstance(h, t.Mapping) or fail_on not in _health.FAIL_ON_CHOICES or h.get("verdict") not in _health.VERDICTS:
        return False
    return _health.fails(h["verdict"], fail_on)


def error(all_steps: t.Sequence[Step], ctx: t.Mapping[str, t.Any]) -> dict[str, t.Any]:
    """The host's failure, or why it is not proven clean: the first failed step, else the verdict of what ran
    (phases that --tags or --skip-tags left out cannot prove anything). {} means proven clean.

    fatal: the host fails (false in check mode and with clean_slate_fail_on_dirty: false, which only report).
    """
    e = step_error(all_steps, ctx)
    if e:
        return e
    named = _named(all_steps)
    fatal = bool(ctx.get("fail_on_dirty")) and not ctx.get("check_mode")
    v = named.get("verify", {})
    v = v if "clean" in v and "gpus" in v else {}
    k = named.get("kill", {})
    k = k if "summary" in k else {}
    b = read_ok(named.get("before", {}))
    if v:
        if v["clean"]:
            return {}
        dirty = [g.get("diagnosis") for g in v["gpus"] if not g.get("clean")]
        apart = (v.get("together") or {}).get("ready") is False  # clean one by one, not together (issue 39)
        reason = (
            dirty[0]
            if dirty
            else _reasons.NOT_READY_TOGETHER
            if apart
            else _reasons.UNHEALTHY
            if health_fails(v, ctx.get("health_fail_on"))
            else _reasons.TOO_FEW_GPUS
        )
        return {"phase": "verify", "reason": reason, "msg": v.get("msg", ""), "fatal": False}
    summary = _mapping(k.get("summary"))
    if summary.get("signals"):
        ended = int(summary.get("terminated", 0) or 0) + int(summary.get("killed", 0) or 0)
        return {
            "phase": "verify",
            "reason": _reasons.NOT_VERIFIED,
            "fatal": fatal,
            "msg": f"{ended} process(es) were ended, but the GPUs were not verified afterwards: the clean_slate_verify phase did not run (--tags or"
            " --skip-tags left it out). Run the role with the clean_slate_verify tag to prove them clean.",
        }
    if b:
        if b["clean"]:
            return {}
        dirty = [g.get("diagnosis") for g in b.get("gpus") or [] if not g.get("clean")]
        return {
            "phase": "preflight",
            "reason": dirty[0] if dirty else _reasons.TOO_FEW_GPUS,
            "fatal": fatal,
            "msg": f"{b.get('msg', '')} Only the GPUs were read: the kill and verify phases did not run (--tags or --skip-tags).",
        }
    return {
        "phase": "verify",
        "reason": _reasons.NOT_VERIFIED,
        "fatal": fatal,
        "msg": "No phase read the GPUs of this host: --tags or --skip-tags left out both clean_slate_preflight and clean_slate_verify,"
        " so nothing proves them clean and the tasks after the role do not run on it. Run the role without skipping them.",
    }


def _float(value: t.Any) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return 0.0


def result(all_steps: t.Sequence[Step], ctx: t.Mapping[str, t.Any]) -> dict[str, t.Any]:
    """The host's result: clean (true only when proven clean), phase (the phase that failed, or done), reason ("" when
    clean), msg, the counts, the residue and health summaries and the one-line summary."""
    e = error(all_steps, ctx)
    named = _named(all_steps)
    check_mode = bool(ctx.get("check_mode"))
    v = named.get("verify", {})
    v = v if "clean" in v and "gpus" in v else {}
    k = named.get("kill", {})
    k = k if "summary" in k else {}
    b = read_ok(named.get("before", {}))
    label = str(ctx.get("label") or ctx.get("host"))
    gpus = list(v["gpus"] if v else b.get("gpus") or [])
    clean_count = int(v["clean_count"]) if v else len([g for g in gpus if g.get("clean")])
    summary = _mapping(k.get("summary"))
    signals = dict(_mapping(summary.get("signals")))
    terminated = int(summary.get("terminated", 0) or 0)
    killed = int(summary.get("killed", 0) or 0)
    # Ended without a signal of the kill's: by their server's own stop, or a resource tracker on its own (issue 38).
    stopped = int(summary.get("stopped", 0) or 0)
    ended = terminated + killed + stopped
    # Everything the verdict waited for: the kill, then the verification (its polling, the CUDA start, the health readings).
    seconds = round(_float(k.get("elapsed_s", 0)) + _float(v.get("elapsed_s", 0)), 2)
    cuda_s = v.get("cuda_s") if v else None
    targets = list(k.get("targets") or [])
    if v:
        gpu_part = f"{clean_count}/{len(gpus)} GPUs clean"
    elif signals:
        gpu_part = "GPUs not verified"
    elif b:
        gpu_part = f"{clean_count}/{len(gpus)} GPUs clean (preflight reading)"
    else:
        gpu_part = "GPUs not read"
    if check_mode and k:
        kill_part = f"{len(targets)} processes would be ended (check mode)"
    elif k:
        # How each ended: by SIGTERM within the grace period, or by SIGKILL (the two add up to the count).
        kill_part = f"{ended} processes ended ({terminated} by TERM, {killed} by KILL" + (f", {stopped} by their own stop)" if stopped else ")")
    else:
        kill_part = "no process ended"
    residue = dict(_mapping(_mapping(named.get("residue")).get("summary")))
    residue_part = f"; {residue['msg']}" if residue.get("msg") else ""
    restore = _mapping(named.get("restore"))
    restore_part = f"; {restore['msg']}" if restore.get("changed") and "msg" in restore else ""
    h = v.get("health") if v else None
    health = {"verdict": h.get("verdict"), "evidence": h.get("evidence"), "findings": h.get("findings") or []} if isinstance(h, t.Mapping) else None
    health_part = f"; health: {h['verdict']}" if isinstance(h, t.Mapping) and h.get("verdict") != _health.OK else ""
    tail = ""
    if e:
        tail = f" - FAILED in {e['phase']} ({e['reason']}): {e['msg']}" if e["fatal"] else f" - NOT CLEAN ({e['reason']})"
    took = (f" in {seconds} s" + (f" (CUDA start {cuda_s:.2f} s)" if isinstance(cuda_s, (int, float)) else "")) if (v or k) else ""
    why = e.get("reason", "")
    head = f"{label}: {gpu_part}{took}, {kill_part}{residue_part}{restore_part}{health_part}"
    # What the last task shows: the summary, or, where the verification has more to say (a failure, findings below the
    # threshold), its few lines after the head: each distinct finding once, its fix once, the reset plan.
    said = [str(x) for x in v.get("lines") or []] if v else []
    if e and e.get("phase") == "verify" and said and e.get("msg") == v.get("msg"):
        shown = [head + (f" - FAILED in verify ({why}):" if e["fatal"] else f" - NOT CLEAN ({why}):"), *said]
    elif not e and said and h and h.get("verdict") != _health.OK:
        shown = [f"{head}{tail}", *said[1:]]
    else:
        shown = [f"{head}{tail}"]
    return {
        "host": ctx.get("host"),
        "label": label,
        "mode": ctx.get("mode"),
        "check_mode": check_mode,
        "clean": not e,
        "phase": e.get("phase", "done"),
        "reason": why,
        "msg": e.get("msg", ""),
        "gpu_count": len(gpus),
        "clean_count": clean_count,
        "seconds": float(seconds),
        "ended": ended,
        "would_end": len(targets) if check_mode else 0,
        "signals": signals,
        "protected": len(k.get("protected") or []),
        "failure": e["msg"] if e and e["fatal"] else "",
        "before": [g.get("used_mib") for g in b.get("gpus") or []],
        "after": [g.get("used_mib") for g in v.get("gpus") or []],
        "gpus": gpus,
        "targets": targets,
        "residue": residue,
        "health": health,
        "cuda_s": cuda_s,
        "reset_plan": v.get("reset_plan") if v else None,
        "summary": f"{head}{tail}",
        "lines": shown,
    }


def published(r: t.Mapping[str, t.Any]) -> dict[str, t.Any]:
    """The host's set_stats entry: its result without the per-GPU and per-process lists (and the display lines, which
    repeat its msg)."""
    return {k: x for k, x in r.items() if k not in ("gpus", "targets", "lines")}
