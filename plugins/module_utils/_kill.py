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

Each round stops the servers in their own order (:mod:`._stop`): a live root of a
server (``servers``: the server profiles' launchers and API servers) first, alone,
with its server's grace, so that the server tears itself down; then what is left
(the tree's members its stop did not end, and every other target) as before; a
resource tracker last, once its clients are gone (``spare_trackers``). A round
without a live root (a crash: the root is dead, its workers reparented) goes
straight to the rest. Each target's record says which step it was in (``step``)
and how it ended (``ended_by``).

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

from ansible_collections.gpuops.clean_slate.plugins.module_utils import (
    _checks,
    _nvml,
    _probe,
    _procs,
    _proctable,
    _protection,
    _reasons,
    _scope,
    _signals,
    _stop,
)
from ansible_collections.gpuops.clean_slate.plugins.module_utils._errors import CleanSlateError
from ansible_collections.gpuops.clean_slate.plugins.module_utils._procs import Candidate, Plan

#: The steps of a round (the ``step`` of a target's record), in order.
ROOT, TREE, TRACKER = "root", "tree", "tracker"


@dataclass
class Ended:
    """One target, the pinned process behind it, the round that found it and its step in that round's stop."""

    candidate: Candidate
    victim: _signals.Victim
    round: int
    step: str = TREE
    server: _stop.Server | None = None  # a root's server
    why: str | None = None  # a spared tracker: who still needs it

    def record(self) -> dict[str, t.Any]:
        """The target record the module returns."""
        rec = self.candidate.record()
        v = self.victim
        rec.update(signals_sent=list(v.signals_sent), outcome=v.outcome, seconds=v.seconds, round=self.round, step=self.step, ended_by=v.ended_by)
        if self.server is not None:
            rec.update(server=self.server.name, grace=self.server.grace)
        if self.why:
            rec["why"] = self.why
        if v.teardown_s is not None:
            rec["teardown_s"] = v.teardown_s
        if v.outcome == "unkillable":
            rec.update(state=v.state, wchan=v.wchan, exiting=v.exiting_since is not None)
        return rec


def _comm(pid: int) -> str:
    st = _proctable.read_stat(pid)
    return st["comm"] if st else "?"


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
        servers: t.Sequence[_stop.Server] = (),
        spare_trackers: bool = False,
        tracker_timeout: float = 2.0,
        progress: t.Callable[[list[_signals.Victim]], bool] | None = None,
        teardown_timeout: float | None = None,
        teardown_stall: float = 10.0,
    ) -> None:
        self._discover = discover
        self.first = first
        self.grace_period = grace_period
        self.kill_timeout = kill_timeout
        self.deadline = deadline
        self.clock = clock
        self.servers = list(servers)
        self.spare_trackers = spare_trackers
        self.tracker_timeout = tracker_timeout
        self.progress = progress
        self.teardown_timeout = teardown_timeout
        self.teardown_stall = teardown_stall
        self.spared: set[tuple[int, t.Any]] = set()
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
    def plan(self, targets: t.Sequence[Candidate], round_: int) -> list[Ended]:
        """Each target's step in a round's stop (a server's root, a resource tracker, the rest), pinned (a victim of a
        check-mode plan is not: it is never signalled)."""
        out = []
        for c in targets:
            server = _stop.server_of(c.facts.cmdline, self.servers) if self.servers else None
            fd = _stop.tracker_fd(c.facts.cmdline) if self.spare_trackers else None
            step = ROOT if server is not None else TRACKER if fd is not None else TREE
            out.append(Ended(c, _signals.Victim(pid=c.pid, identity=c.identity), round_, step, server))
        return out

    def run(self) -> None:
        """Discover, end, discover again, until a discovery finds nothing new or the deadline passes."""
        done: set[tuple[int, t.Any]] = set()
        plan = self.discover()
        start: float | None = None
        while True:
            new = [c for c in plan.targets if _key(c) not in done]
            if not new:
                # Anything still found was already ended once and is back under the same identity:
                # it did not end, so it is reported rather than trusted gone (a spared tracker is still needed).
                self.remaining = [c for c in plan.targets if _key(c) in done and _key(c) not in self.spared]
                return
            now = self.clock()
            if start is not None and now >= start + self.deadline:
                self.deadline_passed = True
                self.remaining = list(plan.targets)
                return
            if start is None:
                start = now
            self.rounds += 1
            entries = self.plan(new, self.rounds)
            for e in entries:
                done.add(_key(e.candidate))
                e.victim = _signals.pin(e.candidate.pid, e.candidate.identity)
                self.ended.append(e)
            grace = self.grace_period if self.rounds == 1 else min(self.grace_period, max(0.0, start + self.deadline - now))
            self._round(entries, grace, start)
            if any(e.victim.outcome == "unkillable" for e in entries):
                # Stuck in the kernel: another round cannot help, and the caller fails with their state.
                return
            plan = self.discover()

    def _round(self, entries: list[Ended], grace: float, start: float) -> None:
        """One round's stop: the live roots alone with their servers' grace, then the rest, then the trackers."""
        roots = [e for e in entries if e.step == ROOT and not e.victim.done and not _signals.exiting(e.victim.pid, e.victim.identity)]
        stopping = self._stop_roots(roots, start) if roots else None
        if stopping is not None:
            for e in entries:
                if e.step != ROOT and not e.victim.done and _signals.exited(e.victim):
                    # Its server's own stop ended it (SGLang's launcher kills its tree once its schedulers have exited).
                    e.victim.outcome, e.victim.seconds, e.victim.ended_by = "stopped", round(self.clock() - stopping, 4), "server_stop"
                    _signals.close(e.victim)
        rest = [e for e in entries if e.step != TRACKER and not e.victim.done]
        # A process whose GPU teardown is under way is waited for until the deadline; past it, while it makes progress.
        _signals.escalate(
            [e.victim for e in rest],
            first=self.first,
            grace_period=grace,
            kill_timeout=self.kill_timeout,
            clock=self.clock,
            deadline=start + self.deadline,
            progress=self.progress,
            cap=None if self.teardown_timeout is None else start + self.teardown_timeout,
            stall=self.teardown_stall,
        )
        trackers = [e for e in entries if e.step == TRACKER and not e.victim.done]
        if trackers and not any(e.victim.outcome == "unkillable" for e in rest):
            self._end_trackers(trackers, start)

    def _stop_roots(self, roots: list[Ended], start: float) -> float:
        """Send each live root the first signal, alone, and wait until it exits or its server's grace passes; one still
        there then gets SIGKILL with the rest (it had its signal and its time). Returns when the stop began."""
        began = self.clock()
        for e in roots:
            if not _signals.send(e.victim, self.first):
                e.victim.outcome, e.victim.seconds, e.victim.ended_by = "vanished", 0.0, "gone"
        pending = [e for e in roots if not e.victim.done]

        def grace(e: Ended) -> float:
            return e.server.grace if e.server is not None else self.grace_period

        while pending:
            now = self.clock()
            late = [e for e in pending if now >= began + grace(e)]
            for e in late:
                e.victim.first = "KILL"
            pending = [e for e in pending if e not in late]
            if not pending:
                break
            until = min(began + grace(e) for e in pending)
            _signals.wait_exit([e.victim for e in pending], until, began, "terminated", self.clock)
            for e in pending:
                if e.victim.done:
                    e.victim.ended_by = "own_stop"  # it ran its own teardown and exited within its grace
                    _signals.close(e.victim)
            pending = [e for e in pending if not e.victim.done]
        return began

    def _end_trackers(self, trackers: list[Ended], start: float) -> None:
        """Spare each tracker while a client holds its pipe; give it ``tracker_timeout`` to unlink and exit once the
        last one is gone; end it when it is still there then. One whose client is not ended by this run stays."""
        waiting = []
        for e in trackers:
            fd = _stop.tracker_fd(e.candidate.facts.cmdline)
            pipe = _stop.pipe_of(e.victim.pid, fd) if fd is not None else None
            users = _stop.clients(e.victim.pid, pipe) if pipe is not None else []
            if users:
                names = ", ".join(f"PID {p} ({_comm(p)})" for p in users[:5])
                e.victim.outcome, e.victim.ended_by = "spared", None
                e.why = (
                    f"a resource tracker whose client {names} lives and is not ended by this run: spared, it unlinks what its clients"
                    " registered once they are gone"
                )
                self.spared.add(_key(e.candidate))
                _signals.close(e.victim)
            else:
                waiting.append(e)
        if not waiting:
            return
        began = self.clock()
        _signals.wait_exit([e.victim for e in waiting], began + self.tracker_timeout, began, "stopped", self.clock)
        for e in waiting:
            if e.victim.done:
                e.victim.ended_by = "own_exit"  # its clients gone, it unlinked what they registered and exited
                _signals.close(e.victim)
        left = [e.victim for e in waiting if not e.victim.done]
        if left:
            _signals.escalate(
                left,
                first=self.first,
                grace_period=min(1.0, self.grace_period),
                kill_timeout=self.kill_timeout,
                clock=self.clock,
                deadline=start + self.deadline,
            )

    # ------------------------------------------------------------------ results
    def targets(self) -> list[dict[str, t.Any]]:
        return [e.record() for e in self.ended]

    def signalled(self) -> bool:
        return any(e.victim.signals_sent for e in self.ended)


# ---------------------------------------------------------------------- options
def validate(p: t.Mapping[str, t.Any]) -> None:
    """Numbers, paths and combinations of gpu_procs_kill's options; raises before anything is read or signalled."""
    for name in ("grace_period", "kill_timeout", "deadline", "teardown_timeout", "teardown_stall", "tracker_timeout"):
        _checks.number(name, p.get(name), 0, _checks.MAX_SECONDS, unit="seconds")
    _stop.parse_servers(p.get("servers") or [], p["grace_period"])
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
    text = f"ended {counts['terminated'] + counts['killed'] + counts.get('stopped', 0)} process(es)"
    if counts["terminated"] and counts["killed"]:
        text += f" ({counts['terminated']} on their first signal, {counts['killed']} needed SIGKILL)"
    if counts.get("stopped"):
        text += f"; {counts['stopped']} of them by their server's own stop (its root had its grace) or, a resource tracker, on their own"
    if counts.get("spared"):
        text += f"; {counts['spared']} resource tracker(s) spared: a process this run did not end still needs them"
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
    for k in ("stopped", "spared"):
        # Only a stop in a server's own order has them (servers, spare_trackers): counted when there are any.
        n = sum(1 for x in targets if x["outcome"] == k)
        if n:
            counts[k] = n
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
        after = [f"{x['pid']} {x['name']}" for x in targets if x["outcome"] in ("unkillable", "spared")] + [f"{c.pid} {c.facts.comm}" for c in kill.remaining]
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
        "servers": {
            "type": "list",
            "elements": "dict",
            "default": [],
            "options": {
                "name": {"type": "str", "required": True},
                "roots": {"type": "list", "elements": "str", "required": True},
                "grace": {"type": "float"},
            },
        },
        "spare_trackers": {"type": "bool", "default": True},
        "tracker_timeout": {"type": "float", "default": 2},
        "teardown_timeout": {"type": "float", "default": 120},
        "teardown_stall": {"type": "float", "default": 10},
        "device_dir": {"type": "path", "default": "/dev"},
        "probe_timeout": {"type": "float", "default": 10},
    }


class Progress:
    """Whether the teardown of dying victims moved since it was last asked: the used memory of the selected GPUs went
    down (read through the prober: a hung driver costs its deadline, not the run), or a victim's state, wait channel or
    CPU time changed (/proc). A teardown in the driver frees its context's memory as it goes; a task stuck on a lock
    changes none of these."""

    def __init__(self, prober: _probe.Prober | None, gpus: t.Sequence[_nvml.Gpu]) -> None:
        self.prober = prober
        self.gpus = [g for g in gpus if g.error is None]
        self.memory: dict[int, int] = {}
        self.procs: dict[int, tuple[t.Any, ...]] = {}

    def __call__(self, victims: list[_signals.Victim]) -> bool:
        moved = False
        if self.prober is not None and self.gpus:
            for gpu, answer in zip(self.gpus, self.prober.each(_nvml.NvmlSession.memory, self.gpus)):
                if answer.error is None and answer.value is not None:
                    used = int(answer.value.used_mib)
                    if gpu.index in self.memory and used < self.memory[gpu.index]:
                        moved = True
                    self.memory[gpu.index] = used
        for v in victims:
            now = _proctable.progress(v.pid)
            if now is not None and v.pid in self.procs and now != self.procs[v.pid]:
                moved = True
            if now is not None:
                self.procs[v.pid] = now
        return moved


class ModuleRun:
    """One run of the gpu_procs_kill module; :attr:`kill` stays readable when it fails, for the failure's details.

    :param scopes_of: resolves the ``containers`` option (through pct, which this file does not need to know).
    """

    def __init__(self, scopes_of: t.Callable[[], list[_scope.Scope]]) -> None:
        self.scopes_of = scopes_of
        self.kill: Kill | None = None
        self.planned: list[Ended] = []  # check mode: the targets, each with its step

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
        servers = _stop.parse_servers(p.get("servers") or [], p["grace_period"])
        # A root's stop comes before the rest's grace and SIGKILL: the default deadline leaves room for the longest.
        stop_s = max((s.grace for s in servers), default=0.0)
        deadline = p["deadline"] if p["deadline"] is not None else min(_checks.MAX_SECONDS, 2 * (p["grace_period"] + p["kill_timeout"]) + stop_s)
        discoveries = [0]

        def discover() -> Plan:
            discoveries[0] += 1
            return _procs.discover(request if discoveries[0] == 1 else fresh())

        kill = self.kill = Kill(
            discover,
            first=p["signal"],
            grace_period=p["grace_period"],
            kill_timeout=p["kill_timeout"],
            deadline=deadline,
            servers=servers,
            spare_trackers=p.get("spare_trackers", True),
            tracker_timeout=p.get("tracker_timeout", 2.0),
            progress=Progress(prober, request.gpus) if request.use_nvml and request.gpus else Progress(None, []),
            teardown_timeout=p.get("teardown_timeout", 120.0),
            teardown_stall=p.get("teardown_stall", 10.0),
        )
        try:
            if module.check_mode:
                ended = self.planned = kill.plan(kill.discover().targets, 0)
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
