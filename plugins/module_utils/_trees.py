# Copyright (c) 2026, gpuops.clean_slate maintainers
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# Note: this module_util is PRIVATE to the collection; it may change without notice.

"""Whole server trees: the sessions and process groups of the kill's targets.

A server is a tree of processes, and not every one of them holds a GPU or matches a pattern: SGLang's
detokenizer and data-parallel controller, a multiprocessing resource tracker, torch's compile workers.
Nor do they stay children of their launcher: SGLang starts each scheduler in a session of its own
(``start_new_session``), and when a launcher or an engine core dies its workers are reparented to PID 1
or the nearest subreaper, where the parent links no longer tie them to anything. What survives
reparenting is the session and the process group (sglang PR#31645 kills by process group for this
reason). So a target lends:

* its session, when the session's leader is itself a candidate: a scheduler leading the session it made,
  a launcher that a pattern matched. The session's members are that server's;
* its process group, when the group's leader is a candidate or has exited: a tree whose launcher died
  (vLLM's API server gone, its workers left in its group).

A session or group whose leader lives and is not a candidate (a login shell, a supervisor, a container's
init, a CI runner) is never entered: its other jobs are not the server's. Nor is a session whose leader
has exited (the nohup'd jobs of a closed login share one); its server's own process group still is.
Nothing is entered that holds a guarded process (this module, its ancestors, Ansible) or the PID 1 of a
namespace. With a GPU subset, a tree with a member holding a GPU outside it is not ended: only its
targets are, and its other members (they serve the ranks left running) are left out, with why.
Protection, scope, users and ``where`` apply afterwards to every member found here, as to any candidate.
"""

from __future__ import annotations

import typing as t

from ansible_collections.gpuops.clean_slate.plugins.module_utils import _proctable


class Facts(t.Protocol):
    """What this file reads of a process (``_procs.ProcFacts`` has it)."""

    pid: int
    pgid: int
    sid: int
    comm: str
    cmdline: str
    kernel: bool


def _leader(facts: t.Mapping[int, Facts], lead: int, of_session: bool) -> Facts | None:
    """The live leader of session (or group) ``lead``; None when it has exited (its pid free, or taken by another process)."""
    f = facts.get(lead)
    if f is None or (f.sid if of_session else f.pgid) != lead:
        return None
    return f


def _name(f: Facts) -> str:
    return f.cmdline or f.comm


def members(
    facts: t.Mapping[int, Facts],
    roots: t.Iterable[int],
    guarded: t.Container[int],
    foreign_gpu: t.Callable[[int], str | None],
) -> tuple[dict[int, str], list[dict[str, t.Any]]]:
    """The members the targets' sessions and groups add (pid -> the reason), and those left out, with why.

    ``roots`` are the candidates that may lend their tree (not guarded, not protected, not an init);
    ``foreign_gpu(pid)`` names a GPU the process holds outside the selection, or None.
    """
    roots = [pid for pid in roots if pid in facts]
    is_root = set(roots)
    sessions: dict[int, list[int]] = {}
    groups: dict[int, list[int]] = {}
    for pid, f in facts.items():
        if f.kernel:
            continue
        sessions.setdefault(f.sid, []).append(pid)
        groups.setdefault(f.pgid, []).append(pid)
    entered: dict[tuple[str, int], str] = {}
    for pid in roots:
        f = facts[pid]
        leader = _leader(facts, f.sid, of_session=True)
        if leader is not None and leader.pid in is_root:
            entered.setdefault(("session", f.sid), f"in the session of PID {f.sid} ({_name(leader)}), which a target leads")
        leader = _leader(facts, f.pgid, of_session=False)
        if leader is None:
            entered.setdefault(("group", f.pgid), f"in process group {f.pgid} of PID {pid} ({_name(f)}), whose leader has exited")
        elif leader.pid in is_root:
            entered.setdefault(("group", f.pgid), f"in process group {f.pgid}, led by PID {f.pgid} ({_name(leader)}), a target")
    added: dict[int, str] = {}
    left_out: list[dict[str, t.Any]] = []
    for (kind, lead), why in entered.items():
        pids = (sessions if kind == "session" else groups).get(lead, [])
        # Never a tree that holds this module, its ancestors or Ansible, nor one with an init in it.
        if any(p in guarded or p <= 1 or _init(p) for p in pids):
            continue
        others = [p for p in pids if p not in is_root]
        foreign = {p: gpu for p in others if (gpu := foreign_gpu(p)) is not None}
        if foreign:
            # Part of this tree runs on GPUs outside the selection: its shared members serve those ranks too.
            holder, gpu = next(iter(foreign.items()))
            for p in others:
                held = f"it holds {foreign[p]}" if p in foreign else f"PID {holder} of its tree holds {gpu}"
                left_out.append({"pid": p, "why": f"{why}, but {held}, which is not selected"})
            continue
        for p in others:
            added.setdefault(p, why)
    return added, left_out


def _init(pid: int) -> bool:
    nspid = _proctable.nspids(pid)
    return bool(nspid) and nspid[-1] == 1
