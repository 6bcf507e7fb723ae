# Copyright (c) 2026, gpuops.clean_slate maintainers
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# Note: this plugin_util is PRIVATE to the collection; it may change without notice.

"""The role's per-host result, built in Python (the clean_slate_result filter).

The role's one failure path: every phase registers its result, vars/main.yml lists them in phase order
(``_clean_slate_steps``: phase, name, result, the reason used when a failed result has none), and this
reads them for the report, the metrics, the set_stats entry and the final verdict. It was a Jinja
template of some 150 lines, which Ansible compiled and ran on the controller for every host and every
use (about 0.2 s of controller CPU per host); here it is a function.
"""

from __future__ import annotations

import json
import re
import typing as t
from collections.abc import Mapping

#: The role's own reasons (the guide's reason table lists them with the modules').
UNREACHABLE = "unreachable"
NOT_VERIFIED = "not_verified"
TOO_FEW_GPUS = "too_few_gpus"
#: gpu_mem_verify fails a dirty node with these; the role names the first dirty GPU's diagnosis instead.
VERIFY_FAILURES = ("", "not_clean", "missing_gpus")
UNHEALTHY = "unhealthy"
#: The module reason whose message starts with the option's name, which the role renames to its variable.
BAD_ARGUMENTS = "bad_arguments"
#: Health verdicts, from best to worst (gpu_mem_verify's health).
VERDICTS = ("ok", "restart_app", "reset_gpu", "reboot", "drain")

Step = t.Sequence[t.Any]  # [phase, name, registered result, default reason]


def _mapping(value: t.Any) -> Mapping[str, t.Any]:
    return value if isinstance(value, Mapping) else {}


def _failed(r: Mapping[str, t.Any]) -> bool:
    return "skipped" not in r and bool(r.get("failed"))


def _bad_rc(r: Mapping[str, t.Any]) -> bool:
    return "rc" in r and r["rc"] not in (0, "0", None)


def step_error(steps: t.Sequence[Step], ctx: Mapping[str, t.Any]) -> dict[str, t.Any]:
    """The first phase result that failed or found its host unreachable: {phase, reason, msg, fatal}, or {}."""
    messages = _mapping(ctx.get("step_messages"))
    option_vars = _mapping(ctx.get("option_vars"))
    for phase, name, r, default_reason in steps:
        if not isinstance(r, Mapping):
            continue
        items = [i for i in r.get("results") or [] if isinstance(i, Mapping)] if isinstance(r.get("results"), list) else []
        group = [r, *items]
        down = [x for x in group if x.get("unreachable")]
        bad = [x for x in group if _failed(x)] + [x for x in group if _bad_rc(x)]
        if down:
            return {
                "phase": phase,
                "reason": UNREACHABLE,
                "fatal": True,
                "msg": f"{ctx.get('delegate') or ctx.get('host')} is unreachable ({str(down[0].get('msg', 'no answer')).strip()}). Nothing more was done"
                " on it: make it reachable (SSH, credentials, the hypervisor) and run again.",
            }
        if not bad:
            continue
        f = next((i for i in items if _failed(i)), bad[0])
        dirty = [g.get("diagnosis") for g in f.get("gpus") or [] if isinstance(g, Mapping) and "clean" in g and not g["clean"]]
        reason = f.get("reason") or f.get("diagnosis") or ""
        if phase == "verify" and "gpus" in f and reason in VERIFY_FAILURES:
            reason = dirty[0] if dirty else TOO_FEW_GPUS
        reason = reason or default_reason
        msg = str(f.get("msg", "")).strip() or f"exit status {f.get('rc', '?')}"
        if name in messages:
            said = _mapping(messages[name])
            item = f" ({json.dumps(f['item'])})" if "item" in f else ""
            detail = str(f.get("stderr", "")).strip() or f"exit status {f.get('rc', '?')}"
            msg = f"{said.get('msg', '')}{item}: {detail}. {said.get('advice', '')}"
        option = re.match(r"([a-z_]+): ", msg)
        if reason == BAD_ARGUMENTS and option and option.group(1) in option_vars:
            msg = option_vars[option.group(1)] + msg[len(option.group(1)) :]
        return {"phase": phase, "reason": reason, "msg": msg, "fatal": True}
    return {}


def _named(steps: t.Sequence[Step]) -> dict[str, Mapping[str, t.Any]]:
    return {str(step[1]): _mapping(step[2]) for step in steps}


def read_ok(before: Mapping[str, t.Any]) -> Mapping[str, t.Any]:
    """The preflight reading when it read the GPUs (a failed reading carries a reason, or a diagnosis), else {}."""
    return before if "clean" in before and "reason" not in before and "diagnosis" not in before else {}


def health_fails(verify: Mapping[str, t.Any], fail_on: t.Any) -> bool:
    """Whether the verify phase's health verdict is at or above ``fail_on`` (never: never). The module judges the
    same; in check mode and with clean_slate_fail_on_dirty false it only reports, and this tells why a host whose
    memory is clean is not."""
    h = verify.get("health")
    if not isinstance(h, Mapping) or fail_on not in VERDICTS or h.get("verdict") not in VERDICTS:
        return False
    return VERDICTS.index(h["verdict"]) >= VERDICTS.index(fail_on)


def error(steps: t.Sequence[Step], ctx: Mapping[str, t.Any]) -> dict[str, t.Any]:
    """The host's failure, or why it is not proven clean: the first failed phase, else the verdict of what ran
    (phases that --tags or --skip-tags left out cannot prove anything). {} means proven clean.

    fatal: the host fails (false in check mode and with clean_slate_fail_on_dirty: false, which only report).
    """
    e = step_error(steps, ctx)
    if e:
        return e
    named = _named(steps)
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
        reason = dirty[0] if dirty else (UNHEALTHY if health_fails(v, ctx.get("health_fail_on")) else TOO_FEW_GPUS)
        return {"phase": "verify", "reason": reason, "msg": v.get("msg", ""), "fatal": False}
    summary = _mapping(k.get("summary"))
    if summary.get("signals"):
        ended = int(summary.get("terminated", 0) or 0) + int(summary.get("killed", 0) or 0)
        return {
            "phase": "verify",
            "reason": NOT_VERIFIED,
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
            "reason": dirty[0] if dirty else TOO_FEW_GPUS,
            "fatal": fatal,
            "msg": f"{b.get('msg', '')} Only the GPUs were read: the kill and verify phases did not run (--tags or --skip-tags).",
        }
    return {
        "phase": "verify",
        "reason": NOT_VERIFIED,
        "fatal": fatal,
        "msg": "No phase read the GPUs of this host: --tags or --skip-tags left out both clean_slate_preflight and clean_slate_verify"
        " (for include_role, tag the include with always, or use apply: see the user guide).",
    }


def _float(value: t.Any) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return 0.0


def result(steps: t.Sequence[Step], ctx: Mapping[str, t.Any]) -> dict[str, t.Any]:
    """clean_slate_result: the keys of round 1, plus clean (true only when proven clean), phase (the phase that
    failed, or done), reason ("" when clean), msg, residue and the summary line."""
    e = error(steps, ctx)
    named = _named(steps)
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
    ended = int(summary.get("terminated", 0) or 0) + int(summary.get("killed", 0) or 0)
    seconds = round(_float(k.get("elapsed_s", 0)) + _float(v.get("time_to_clean_s") or v.get("elapsed_s", 0)), 2)
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
        kill_part = f"{ended} processes ended ({signals.get('TERM', 0)} TERM, {signals.get('KILL', 0)} KILL)"
    else:
        kill_part = "no process ended"
    residue = dict(_mapping(_mapping(named.get("residue")).get("summary")))
    residue_part = f"; {residue['msg']}" if residue.get("msg") else ""
    restore = _mapping(named.get("restore"))
    restore_part = f"; {restore['msg']}" if restore.get("changed") and "msg" in restore else ""
    h = v.get("health") if v else None
    health = {"verdict": h.get("verdict"), "evidence": h.get("evidence")} if isinstance(h, Mapping) else None
    health_part = f"; health: {h['verdict']}" if isinstance(h, Mapping) and h.get("verdict") != "ok" else ""
    tail = ""
    if e:
        tail = f" - FAILED in {e['phase']} ({e['reason']}): {e['msg']}" if e["fatal"] else f" - NOT CLEAN ({e['reason']})"
    took = f" in {seconds} s" if (v or k) else ""
    return {
        "host": ctx.get("host"),
        "label": label,
        "mode": ctx.get("mode"),
        "check_mode": check_mode,
        "clean": not e,
        "phase": e.get("phase", "done"),
        "reason": e.get("reason", ""),
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
        "summary": f"{label}: {gpu_part}{took}, {kill_part}{residue_part}{restore_part}{health_part}{tail}",
    }
