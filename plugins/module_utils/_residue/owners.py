# Copyright (c) 2026, gpuops.clean_slate maintainers
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# Note: this module_util is PRIVATE to the collection; it may change without notice.

"""Who holds the candidates: holder processes described once each, the judgement, bound sockets, zombies, port owners.

An item is held while a live process has it (or, for a directory, anything in it) open, mapped, locked, bound, or as
its working directory or root (the pass over /proc is :mod:`.._holders`); everything is matched by device and inode.
"""

from __future__ import annotations

import os
import re
import typing as t

from ansible_collections.gpuops.clean_slate.plugins.module_utils import _holders, _ports, _procs, _proctable, _protection, _scope
from ansible_collections.gpuops.clean_slate.plugins.module_utils._residue.walk import Item, Key, Root


# ---------------------------------------------------------------------- holders
class Holders:
    """Describes holder processes once each: name, protection, container.

    ``protected`` marks what the kill would never signal (:func:`.._protection.never_signal`, with this module's
    own line as the guarded processes: this module signals nothing, so the census of Ansible's processes the kill
    reads is not worth its cost here).
    """

    def __init__(self, protect: list[str], patterns: list[re.Pattern[str]]) -> None:
        self.protect = protect
        self.patterns = patterns
        self._cache: dict[int, dict[str, t.Any]] = {}
        self._start: dict[int, int] = {}
        self.guarded = _protection.lineage(os.getpid())

    def ident(self, pid: int) -> tuple[int, int]:
        """``pid`` and its start time (clock ticks since boot; 0 when gone): a process as the kill's handoff names it."""
        if pid not in self._start:
            st = _proctable.read_stat(pid) if pid > 0 else None
            self._start[pid] = int(st["starttime"]) if st else 0
        return (pid, self._start[pid])

    def describe(self, pid: int) -> dict[str, t.Any]:
        if pid in self._cache:
            return dict(self._cache[pid])
        facts = _procs.read_facts(pid) if pid > 0 else None
        rec: dict[str, t.Any] = {"pid": pid if pid > 0 else None, "name": None, "cmdline": None, "protected": False, "container": None}
        if facts is not None:
            why = _protection.never_signal(pid, facts, _proctable.nspids(pid), self.guarded, self.protect)
            rec.update(name=facts.comm, cmdline=facts.cmdline[:200], protected=why is not None, container=_proctable.container_of(pid))
            if why:
                rec["protected_why"] = why
        self._cache[pid] = rec
        return dict(rec)


def judge(
    items: list[Item],
    scan: _holders.Scan,
    locks: dict[Key, list[_holders.Hold]],
    bound: dict[Key, list[_holders.Hold]],
    unbound_names: dict[str, list[str]],
    holders: Holders,
) -> None:
    """Mark every item held (with its holders) or leave it orphaned."""
    held_keys = scan.holds.keys() | locks.keys() | bound.keys()
    for item in items:
        if item.verdict == "skipped":
            continue
        if item.kind != "dirs" and item.key not in held_keys and item.name not in scan.name_holds and item.name not in unbound_names:
            continue  # the common case, made cheap: nothing holds it
        keys = item.tree if item.kind == "dirs" else {item.key}
        found: dict[tuple[int, str], None] = {}
        for key in keys:
            for hold in (*scan.holds.get(key, ()), *locks.get(key, ()), *bound.get(key, ())):
                found[(hold.pid, hold.how)] = None
        names = item.tree_names if item.kind == "dirs" else {item.name}
        for name in names:
            for hold in scan.name_holds.get(name, ()):
                found[(hold.pid, hold.how)] = None
        records = []
        by_pid: dict[int, dict[str, t.Any]] = {}
        for pid, how in found:
            if pid in by_pid:
                by_pid[pid]["how"].append(how)
                continue
            rec = holders.describe(pid)
            rec["how"] = [how]
            by_pid[pid] = rec
            records.append(rec)
        unknown = False
        for name in item.tree_sockets if item.kind == "dirs" else (item.name,) if item.kind == "sockets" else ():
            for path in unbound_names.get(name, ()):
                unknown = True
                records.append({"pid": None, "name": None, "how": ["bound"], "protected": False, "container": None, "path": path})
        if records:
            item.verdict = "held"
            item.holders = records[:10]
            item.holder_pids = frozenset(by_pid) | ({0} if unknown else set())


def socket_files(items: list[Item]) -> tuple[set[Key], set[str]]:
    """Keys and names of the socket files judged: socket items and the sockets inside candidate directories."""
    keys, names = set(), set()
    for item in items:
        if item.kind == "sockets":
            keys.add(item.key)
            names.add(item.name)
        elif item.tree_sockets:
            keys.update(item.tree_sockets.values())
            names.update(item.tree_sockets)
    return keys, names


def bound_sockets(scan: _holders.Scan, keys: set[Key], names: set[str]) -> tuple[dict[Key, list[_holders.Hold]], dict[str, list[str]]]:
    """Socket files with a live socket bound to them, in any network namespace.

    The unix tables give the path as it was passed to bind(); it is resolved in
    the binder's own root (``/proc/<binder>/root``, and the root of each of its
    threads, which may have one of its own), so the same path in two mount
    namespaces is not confused. When no binder can be found the name alone
    decides, on the safe side: the file counts as held.
    """
    bound: dict[Key, list[_holders.Hold]] = {}
    unresolved: dict[str, list[str]] = {}
    if not keys:
        return bound, unresolved
    for pid in scan.netns.values():
        for inode, path in _holders.read_unix(pid):
            base = path.rpartition("/")[2]
            if base not in names:
                continue
            resolved = False
            if path.startswith("/"):
                for owner in scan.socket_owners.get(inode, []):
                    for root in _roots(owner):
                        try:
                            st = os.stat(root + path)
                        except OSError:
                            continue
                        resolved = True
                        key = (st.st_dev, st.st_ino)
                        if key in keys:
                            bound.setdefault(key, []).append(_holders.Hold(owner, "bound"))
                            break
                    if resolved:
                        break
            if not resolved:
                unresolved.setdefault(base, []).append(path)
    return bound, unresolved


def _roots(pid: int) -> list[str]:
    """The root directories of a process's threads as /proc paths: the main thread's first."""
    roots = [f"/proc/{pid}/root"]
    try:
        roots += [f"/proc/{pid}/task/{tid}/root" for tid in os.listdir(f"/proc/{pid}/task") if tid != str(pid)]
    except OSError:
        pass
    return roots


# ---------------------------------------------------------------------- zombies and ports
def scope_of(pid: int, scopes: list[_scope.Scope]) -> _scope.Scope | None:
    """The container of ``scopes`` a process belongs to, read from its /proc entry."""
    return _scope.member_of(scopes, _proctable.pidns_inode(pid), _proctable.container_of(pid))


def zombies(scan: _holders.Scan, roots: list[Root], holders: Holders) -> tuple[list[dict[str, t.Any]], list[dict[str, t.Any]]]:
    """Zombies in scope, and the parents that do not reap them."""
    scopes = [r.scope for r in roots if r.scope is not None]
    found: list[dict[str, t.Any]] = []
    parents: dict[int, dict[str, t.Any]] = {}
    for pid, ppid, comm in scan.zombies:
        if scopes:
            inside = scope_of(ppid, scopes)
            if inside is None:
                continue
            vmid: int | None = inside.vmid
        else:
            vmid = _proctable.container_of(ppid)
        found.append({"pid": pid, "name": comm, "ppid": ppid, "container": vmid})
        if ppid not in parents:
            parent = holders.describe(ppid)
            nspid = _proctable.nspids(ppid)
            init = bool(nspid and nspid[-1] == 1)
            parents[ppid] = {"pid": ppid, "name": parent["name"], "init": init, "container": vmid, "zombies": 0, "protected": parent["protected"]}
        parents[ppid]["zombies"] += 1
    for p in parents.values():
        if p["init"]:
            where = f"container {p['container']}" if p["container"] is not None else "its PID namespace"
            p["why"] = f"PID 1 of {where} ({p['name']}) does not reap its children: {p['zombies']} zombie(s)"
        else:
            p["why"] = f"PID {p['pid']} ({p['name']}) has not reaped {p['zombies']} exited child(ren)"
    return found, list(parents.values())


def port_record(
    ps: _ports.PortState, root: Root, holders: Holders, owners: dict[int, list[int]], waited: float, server: tuple[str, str] | None = None
) -> dict[str, t.Any]:
    """The result entry of one port, with the owners of its sockets; ``server`` (profile, port name) for a port a
    server profile names (``server_ports``)."""
    rec: dict[str, t.Any] = {"port": ps.port, "state": ps.state, "container": root.vmid, "owners": [], "connections": len(ps.connections)}
    if server is not None:
        rec.update(server=server[0], name=server[1])
    rec["time_wait"] = len(ps.closing)
    rec["remaining_s"] = ps.remaining_s if ps.state == "time_wait" else None
    rec["waited_s"] = waited
    seen: set[int] = set()
    for sock in ps.listeners + ps.connections:
        for pid in owners.get(sock.inode, []):
            if pid in seen:
                continue
            seen.add(pid)
            owner = holders.describe(pid)
            owner["address"] = sock.address
            owner["listening"] = sock.state == _ports.LISTEN
            facts = _procs.read_facts(pid)
            match = _procs.matches_patterns(facts, holders.patterns) if facts is not None else None
            in_scope = root.scope is None or scope_of(pid, [root.scope]) is not None
            owner["kill_target"] = bool(match) and in_scope and not owner["protected"]
            if match:
                owner["matches"] = match
            rec["owners"].append(owner)
    return rec


def overlay_names(items: list[Item], roots: list[Root]) -> set[str]:
    """Names of candidates on overlayfs (in whichever scope): their mappings show another inode."""
    devs = {dev for root in roots for dev, fstype in root.fstypes.items() if fstype == "overlay"}
    return {n for i in items if i.dev in devs for n in (i.tree_names if i.kind == "dirs" else {i.name})} if devs else set()
