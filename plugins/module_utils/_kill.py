# Copyright (c) 2026, gpuops.clean_slate maintainers
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# Note: this module_util is PRIVATE to the collection; it may change without notice.

"""End what discovery finds, then look again, round after round, until nothing is left.

One discovery and one escalation are not enough: a launcher that ignores
SIGTERM keeps forking workers through the grace period, and they hold the GPU
after the launcher is gone (an adversarial run left 10 such workers from a
launcher that forked every 100 ms). So after every escalation discovery runs
again with the same request, and whatever it finds that was not ended before
is ended in a new round. Later rounds get what is left of the deadline as
their grace period; no round starts after the deadline, and what is still
there then is reported, never passed over.

Every victim is recorded before it is signalled, so whatever fails later, the
caller can still report every signal sent (:attr:`Kill.ended`).

It is also the gpu_procs_kill module's logic (:class:`ModuleRun`): its
options, the request, the rounds, the result; the container lookup (pct) is
handed in, so that this file does not depend on it.
"""

from __future__ import annotations

import dataclasses
import datetime
import time
import traceback
import typing as t
from dataclasses import dataclass

from ansible.module_utils.basic import missing_required_lib

from ansible_collections.gpuops.clean_slate.plugins.module_utils import _checks, _nvml, _probe, _procs, _protection, _reasons, _scope, _signals
from ansible_collections.gpuops.clean_slate.plugins.module_utils._errors import CleanSlateError
from ansible_collections.gpuops.clean_slate.plugins.module_utils._procs import Candidate, Plan


@dataclass
class Ended:
    """One target, the pinned process behind it and the round that found it."""

    candidate: Candidate
    victim: _signals.Victim
    round: int

    def record(self) -> dict[str, t.Any]:
        """The target record the module returns."""
        rec = self.candidate.record()
        v = self.victim
        rec.update(signals_sent=list(v.signals_sent), outcome=v.outcome, seconds=v.seconds, round=self.round)
        if v.teardown_s is not None:
            rec["teardown_s"] = v.teardown_s
        if v.outcome == "unkillable":
            rec.update(state=v.state, wchan=v.wchan, exiting=v.exiting_since is not None)
        return rec


def _key(c: Candidate) -> tuple[int, t.Any]:
    # pid and full identity: a pid reused by a new process, or a process that renamed itself
    # between discovery and pinning (and so was not signalled), is a new target.
    return (c.pid, c.identity)


class Kill:
    """Rounds of discovery and escalation (see the module docstring).

    :param discover: runs discovery afresh (NVML's process lists re-read) and returns the plan.
    :param deadline: seconds from the first signal after which no new round starts.
    """

    def __init__(
        self,
        discover: t.Callable[[], Plan],
        first: str = "TERM",
        grace_period: float = 10.0,
        kill_timeout: float = 10.0,
        deadline: float = 40.0,
        clock: t.Callable[[], float] = time.monotonic,
    ) -> None:
        self._discover = discover
        self.first = first
        self.grace_period = grace_period
        self.kill_timeout = kill_timeout
        self.deadline = deadline
        self.clock = clock
        self.ended: list[Ended] = []
        self.rounds = 0
        self.remaining: list[Candidate] = []
        self.deadline_passed = False
        self.protected: list[dict[str, t.Any]] = []
        self.ignored: list[dict[str, t.Any]] = []
        self.notes: list[str] = []
        self.unreadable = 0

    # ------------------------------------------------------------------ discovery
    def discover(self) -> Plan:
        """One discovery; its protected, ignored and notes are merged into this run's."""
        plan = self._discover()
        ended = {e.candidate.pid for e in self.ended}
        seen_protected = {p["pid"] for p in self.protected}
        for rec in plan.protected:
            if rec["pid"] not in seen_protected:
                self.protected.append(rec)
        seen_ignored = {(i.get("pid"), i.get("why")) for i in self.ignored}
        for rec in plan.ignored:
            # After a round NVML still lists the processes just ended until the driver frees their
            # memory: those are not "ignored", they are targets already reported.
            if rec.get("pid") not in ended and (rec.get("pid"), rec.get("why")) not in seen_ignored:
                self.ignored.append(rec)
        for note in plan.notes:
            if note not in self.notes:
                self.notes.append(note)
        self.unreadable = max(self.unreadable, plan.unreadable)
        return plan

    # ------------------------------------------------------------------ rounds
    def run(self) -> None:
        """Discover, end, discover again, until a discovery finds nothing new or the deadline passes."""
        done: set[tuple[int, t.Any]] = set()
        plan = self.discover()
        start: float | None = None
        while True:
            new = [c for c in plan.targets if _key(c) not in done]
            if not new:
                # Anything still found was already ended once and is back under the same identity:
                # it did not end, so it is reported rather than trusted gone.
                self.remaining = [c for c in plan.targets if _key(c) in done]
                return
            now = self.clock()
            if start is not None and now >= start + self.deadline:
                self.deadline_passed = True
                self.remaining = list(plan.targets)
                return
            if start is None:
                start = now
            self.rounds += 1
            victims = []
            for c in new:
                done.add(_key(c))
                victim = _signals.pin(c.pid, c.identity)
                self.ended.append(Ended(c, victim, self.rounds))
                victims.append(victim)
            grace = self.grace_period if self.rounds == 1 else min(self.grace_period, max(0.0, start + self.deadline - now))
            # A process whose GPU teardown is under way is waited for until the deadline, never beyond it.
            _signals.escalate(victims, first=self.first, grace_period=grace, kill_timeout=self.kill_timeout, clock=self.clock, deadline=start + self.deadline)
            if any(v.outcome == "unkillable" for v in victims):
                # Stuck in the kernel: another round cannot help, and the caller fails with their state.
                return
            plan = self.discover()

    # ------------------------------------------------------------------ results
    def targets(self) -> list[dict[str, t.Any]]:
        return [e.record() for e in self.ended]

    def signalled(self) -> bool:
        return any(e.victim.signals_sent for e in self.ended)


# ---------------------------------------------------------------------- options
def validate(p: t.Mapping[str, t.Any]) -> None:
    """Numbers, paths and combinations of gpu_procs_kill's options; raises before anything is read or signalled."""
    for name in ("grace_period", "kill_timeout", "deadline"):
        _checks.number(name, p[name], 0, _checks.MAX_SECONDS, unit="seconds")
    _checks.number("probe_timeout", p["probe_timeout"], 0.1, 3600, unit="seconds")
    for vmid in p["containers"]:
        _checks.vmid("containers", vmid)
    _checks.existing_dir("device_dir", p["device_dir"])
    _checks.executable("pct_path", p["pct_path"])
    if not p["discovery"] and not p["patterns"]:
        raise CleanSlateError(
            "discovery is empty and no patterns are given, so nothing could ever be found; leave discovery at its default"
            " (nvml, device_files) or give patterns.",
            reason=_reasons.BAD_ARGUMENTS,
        )


def sources(p: t.Mapping[str, t.Any], facts: _nvml.GpuFacts, patterns: list[t.Any], warnings: list[str]) -> bool:
    """Warn for each discovery source asked for but unavailable; refuse name-only matching unless allowed.

    Returns whether the device files can serve (without them, NVML's entries are trusted alone).
    """
    use_nvml, use_files = "nvml" in p["discovery"], "device_files" in p["discovery"]
    files_problem = _nvml.device_files_problem(p["device_dir"]) if use_files else None
    if use_nvml and facts.nvml_problem:
        warnings.append(f"NVML cannot be read ({facts.nvml_problem}): GPU processes are found through the device files and patterns only.")
    if files_problem:
        warnings.append(f"The GPU device files cannot be used ({files_problem}): forked children that NVML does not list cannot be found.")
    nvml_ok = use_nvml and facts.nvml_problem is None
    files_ok = use_files and files_problem is None
    if nvml_ok or files_ok:
        return files_ok
    why = "; ".join(
        x
        for x in (
            "" if p["discovery"] else "discovery is empty",
            f"NVML: {facts.nvml_problem}" if use_nvml and facts.nvml_problem else "",
            f"device files: {files_problem}" if files_problem else "",
        )
        if x
    )
    if not p["allow_name_only"] or not patterns:
        raise CleanSlateError(
            f"No GPU discovery source is available ({why}), so only names could select processes, and a name alone cannot tell"
            " a GPU job from any other process that matches it. Fix the driver (gpu_mem_verify names the problem) or device_dir;"
            " or, to end what patterns match anyway, set allow_name_only: true (clean_slate_allow_name_only in the role) and give patterns.",
            reason=_reasons.NO_DISCOVERY_SOURCE,
        )
    warnings.append(f"No GPU discovery source ({why}): processes are ended by name only (patterns), as allow_name_only allows.")
    return False


# ---------------------------------------------------------------------- result
def protected_holders(protected: list[dict[str, t.Any]]) -> list[str]:
    """Warnings for protected processes that hold GPU memory: their GPUs cannot come clean."""
    out = []
    for rec in protected:
        if rec.get("holds_gpu_memory"):
            mib = f"{rec['used_mib']} MiB" if rec.get("used_mib") is not None else "memory"
            gpus = ", ".join(str(g) for g in rec.get("gpus", []))
            out.append(
                f"PID {rec['pid']} ({rec['name']}) holds {mib} on GPU {gpus} and is not ended: {rec['why']}. That GPU cannot come clean"
                " while it runs; stop it through its service or, if it must go, take it off the protect list (unprotect)."
            )
    return out


def message(check_mode: bool, counts: dict[str, t.Any], targets: list[dict[str, t.Any]], protected: list[dict[str, t.Any]]) -> str:
    """One sentence: what was ended (processes gone before their first signal are not counted as ended)."""
    holding = sum(1 for x in protected if x.get("holds_gpu_memory"))
    tail = f"; {len(protected)} protected" + (f", {holding} of them holding GPU memory (see the warnings)" if holding else "")
    if check_mode:
        return f"would end {len(targets)} process(es){tail}"
    text = f"ended {counts['terminated'] + counts['killed']} process(es)"
    if counts["terminated"] and counts["killed"]:
        text += f" ({counts['terminated']} on their first signal, {counts['killed']} needed SIGKILL)"
    if counts.get("exited"):
        text += f"; {counts['exited']} were already exiting and were waited for"
    if counts.get("teardown"):
        text += f"; waited {counts['teardown_s']} s for the GPU teardown of {counts['teardown']}"
    if counts["vanished"]:
        text += f"; {counts['vanished']} had exited before their signal"
    if counts["respawned"]:
        text += f"; {counts['respawned']} of them appeared during the kill and were ended in {counts['rounds']} rounds"
    return text + tail


def outcome(
    kill: Kill,
    ended: list[Ended],
    check_mode: bool,
    kill_timeout: float,
    elapsed: float,
    notes: list[str],
    warnings: list[str],
    diff: bool,
) -> tuple[dict[str, t.Any], str | None, list[str]]:
    """(result, failure reason or None, warnings) of a run: unkillable or remaining processes fail it."""
    warnings = list(warnings)
    if kill.unreadable:
        warnings.append(
            f"{kill.unreadable} process(es) could not be inspected for device files (permission): a GPU holder among them is found only if"
            " NVML lists it; run with become: true."
        )
    warnings.extend(protected_holders(kill.protected))
    targets = []
    for e in ended:
        rec = e.record()
        if check_mode:
            rec["round"] = None
        targets.append(rec)
    counts: dict[str, t.Any] = {k: sum(1 for x in targets if x["outcome"] == k) for k in ("terminated", "killed", "exited", "vanished", "unkillable")}
    # Processes the kill found in their teardown (dying, SIGKILL powerless) and waited for, and the longest wait.
    waits = [x["teardown_s"] for x in targets if x.get("teardown_s") is not None]
    counts["teardown"] = len(waits)
    counts["teardown_s"] = max(waits, default=0.0)
    signals: dict[str, int] = {}
    for x in targets:
        for s in x["signals_sent"]:
            signals[s] = signals.get(s, 0) + 1
    counts["signals"] = signals
    counts["rounds"] = kill.rounds
    counts["respawned"] = sum(1 for x in targets if (x["round"] or 0) > 1)
    result: dict[str, t.Any] = {
        "changed": bool(targets) if check_mode else bool(signals),
        "targets": targets,
        "protected": kill.protected,
        "ignored": kill.ignored,
        "summary": counts,
        "notes": notes,
        "elapsed_s": round(elapsed, 4),
        "msg": message(check_mode, counts, targets, kill.protected),
    }
    if diff:
        before = [f"{x['pid']} {x['name']}" for x in targets]
        after = [f"{x['pid']} {x['name']}" for x in targets if x["outcome"] == "unkillable"] + [f"{c.pid} {c.facts.comm}" for c in kill.remaining]
        result["diff"] = {"before": "".join(f"{line}\n" for line in before), "after": "".join(f"{line}\n" for line in after)}
    stuck = [x for x in targets if x["outcome"] == "unkillable"]
    if stuck:
        detail = "; ".join(stuck_detail(x, kill_timeout) for x in stuck)
        # The verdict of the health ladder (ok < restart_app < fix_config < reset_gpu < reboot < drain): a task the kernel
        # cannot finish keeps its GPU until the node reboots.
        result["verdict"] = "reboot"
        result["msg"] = (
            f"{len(stuck)} process(es) could not be ended: {detail}. They are stuck in the kernel (usually the NVIDIA driver);"
            " verdict reboot: only a reboot (or a GPU reset, where the driver allows it) frees them and their GPUs."
        )
        return result, _reasons.UNKILLABLE, warnings
    if kill.remaining:
        result["remaining"] = [c.record() for c in kill.remaining]
        names = ", ".join(f"PID {c.pid} ({c.facts.comm})" for c in kill.remaining[:10]) + (" ..." if len(kill.remaining) > 10 else "")
        result["msg"] = (
            f"{len(kill.remaining)} process(es) were still there after {elapsed:.1f} s and {kill.rounds} round(s) of ending"
            f" ({counts['respawned']} process(es) appeared during the kill): {names}. Something keeps starting them (a service manager,"
            " or a launcher that is protected or not among the targets): stop it first (for example systemctl stop <service>, or the"
            " role's clean_slate_pre_stop_commands), then run again; or raise deadline."
        )
        return result, _reasons.HOLDERS_REMAIN, warnings
    return result, None, warnings


def stuck_detail(x: dict[str, t.Any], kill_timeout: float) -> str:
    """One unkillable target, in words: still in its teardown at the deadline, or SIGKILL not even acted on."""
    where = f"state {x.get('state')} in {x.get('wchan') or '?'}"
    if x.get("exiting"):
        return f"PID {x['pid']} ({x['cmdline'] or x['name']}) was still in its teardown after {x['seconds']} s, at the deadline ({where})"
    return f"PID {x['pid']} ({x['cmdline'] or x['name']}) had not begun to exit {kill_timeout} s after SIGKILL ({where})"


# ---------------------------------------------------------------------- the gpu_procs_kill module
def compile_where(text: str | None) -> t.Any:
    """The ``where`` option as a compiled JMESPath expression (None when unset)."""
    if not text:
        return None
    # Imported only when needed: every module run pays for its imports.
    try:
        import jmespath
    except ImportError:
        raise CleanSlateError(missing_required_lib("jmespath"), reason=_reasons.MISSING_LIBRARY, exception=traceback.format_exc()) from None
    try:
        return jmespath.compile(text)
    except jmespath.exceptions.JMESPathError as exc:
        raise CleanSlateError(f"where: {text!r} is not a valid JMESPath expression: {exc}", reason=_reasons.BAD_ARGUMENTS, option="where") from None


def build_request(
    p: t.Mapping[str, t.Any],
    scopes_of: t.Callable[[], list[_scope.Scope]],
    notes: list[str],
    warnings: list[str],
    prober: _probe.Prober | None = None,
) -> tuple[_procs.Request, t.Callable[[], _procs.Request]]:
    """Validate every option and gather NVML facts; raises before anything is signalled.

    ``scopes_of`` resolves the ``containers`` option (pct is run only once the rest is known good).
    ``prober`` makes the NVML calls in a helper process under a deadline (one helper serves every round).
    Returns the request and a function giving it again with NVML's process lists re-read, for later rounds.
    """
    validate(p)
    selectors = _nvml.parse_gpu_selectors(p["gpus"])
    patterns = _procs.compile_patterns(p["patterns"])
    protect = _protection.protect_list(p["protect"], p["unprotect"])
    # The host's users are checked before NVML is asked; a container's are its own, known once its init is.
    users = None if p.get("containers") else _procs.users_by_scope(p["users"], [])
    where = compile_where(p["where"])
    use_nvml = "nvml" in p["discovery"]
    facts = _nvml.gpus_and_processes(selectors, use_nvml, p["device_dir"], notes, prober)
    files_ok = sources(p, facts, patterns, warnings)
    scopes = scopes_of()
    if scopes:
        users = _procs.users_by_scope(p["users"], scopes)
    request = _procs.Request(
        gpus=facts.selected,
        all_gpus=not selectors,
        nvml_processes=facts.processes,
        every_gpu=facts.every,
        use_nvml=use_nvml,
        use_device_files=files_ok,
        patterns=patterns,
        users=users,
        include_children=p["include_children"],
        process_group=p["process_group"],
        trees=p["trees"],
        scopes=scopes,
        device_dir=p["device_dir"],
        protect=protect,
        kill_management_clients=p["kill_management_clients"],
        where=where,
    )

    def fresh() -> _procs.Request:
        if not use_nvml or facts.nvml_problem:
            return request
        again = _nvml.gpus_and_processes(selectors, True, p["device_dir"], [], prober)
        return dataclasses.replace(request, nvml_processes=again.processes)

    return request, fresh


def argument_spec() -> dict[str, dict[str, t.Any]]:
    """The options of gpu_procs_kill, without the containers scope (``_pct.SCOPE_OPTIONS``): one source for it and the umbrella's kill phase."""
    return {
        "gpus": {"type": "list", "elements": "raw", "default": []},
        "discovery": {"type": "list", "elements": "str", "choices": ["nvml", "device_files"], "default": ["nvml", "device_files"]},
        "allow_name_only": {"type": "bool", "default": False},
        "patterns": {"type": "list", "elements": "str", "default": []},
        "users": {"type": "list", "elements": "str", "default": []},
        "include_children": {"type": "bool", "default": False},
        "process_group": {"type": "bool", "default": False},
        "trees": {"type": "bool", "default": True},
        "protect": {"type": "list", "elements": "str", "default": []},
        "unprotect": {"type": "list", "elements": "str", "default": []},
        "kill_management_clients": {"type": "bool", "default": False},
        "where": {"type": "str"},
        "signal": {"type": "str", "choices": ["TERM", "INT", "HUP", "QUIT", "USR1", "USR2", "KILL"], "default": "TERM"},
        "grace_period": {"type": "float", "default": 10},
        "kill_timeout": {"type": "float", "default": 10},
        "deadline": {"type": "float"},
        "device_dir": {"type": "path", "default": "/dev"},
        "probe_timeout": {"type": "float", "default": 10},
    }


class ModuleRun:
    """One run of the gpu_procs_kill module; :attr:`kill` stays readable when it fails, for the failure's details.

    :param scopes_of: resolves the ``containers`` option (through pct, which this file does not need to know).
    """

    def __init__(self, scopes_of: t.Callable[[], list[_scope.Scope]]) -> None:
        self.scopes_of = scopes_of
        self.kill: Kill | None = None

    def details(self, _reason: str) -> dict[str, t.Any]:
        """What every failure lists: every signal sent so far (none before the first), and what was protected."""
        if self.kill is None:
            return {"targets": [], "protected": []}
        return {"targets": self.kill.targets(), "protected": self.kill.protected}

    def __call__(self, module: t.Any) -> dict[str, t.Any]:
        """Discover, end, report; raises :class:`CleanSlateError` for every failure, after signals too."""
        start = time.monotonic()
        started = datetime.datetime.now()
        p = module.params
        notes: list[str] = []
        warnings: list[str] = []
        with _probe.Prober(p["probe_timeout"]) as prober:
            return self._run(module, start, started, notes, warnings, prober)

    def _run(self, module: t.Any, start: float, started: datetime.datetime, notes: list[str], warnings: list[str], prober: _probe.Prober) -> dict[str, t.Any]:
        p = module.params
        request, fresh = build_request(p, self.scopes_of, notes, warnings, prober)
        if prober.hung or prober.system_hung:
            hung = sorted(prober.hung) if not prober.system_hung else "every GPU (NVML did not open)"
            warnings.append(
                f"NVML did not answer within probe_timeout ({p['probe_timeout']} s) for GPU(s) {hung}: the driver is hung there; their processes"
                f" were found through the device files. {_probe.ADVICE}"
            )
        deadline = p["deadline"] if p["deadline"] is not None else min(_checks.MAX_SECONDS, 2 * (p["grace_period"] + p["kill_timeout"]))
        discoveries = [0]

        def discover() -> Plan:
            discoveries[0] += 1
            return _procs.discover(request if discoveries[0] == 1 else fresh())

        kill = self.kill = Kill(discover, first=p["signal"], grace_period=p["grace_period"], kill_timeout=p["kill_timeout"], deadline=deadline)
        try:
            if module.check_mode:
                ended = [Ended(c, _signals.Victim(pid=c.pid, identity=c.identity), 0) for c in kill.discover().targets]
            else:
                kill.run()
                ended = kill.ended
        except CleanSlateError:
            raise
        except Exception as exc:
            if not kill.ended:
                raise
            sent = sum(len(e.victim.signals_sent) for e in kill.ended)
            raise CleanSlateError(
                f"gpu_procs_kill failed unexpectedly after it had sent {sent} signal(s) to {len(kill.ended)} process(es): {exc}. targets lists every"
                " signal sent; run the task again to finish, and report this bug.",
                reason=_reasons.INTERNAL_ERROR,
                exception=traceback.format_exc(),
            ) from None
        notes.extend(n for n in kill.notes if n not in notes)
        diff = module._diff  # pylint: disable=protected-access
        result, reason, warnings = outcome(kill, ended, module.check_mode, p["kill_timeout"], time.monotonic() - start, notes, warnings, diff)
        result.update(start=str(started), end=str(datetime.datetime.now()))
        for warning in warnings:
            module.warn(warning)
        if reason:
            details = {k: v for k, v in result.items() if k != "msg"}
            raise CleanSlateError(result["msg"], reason=reason, **details)
        return result
