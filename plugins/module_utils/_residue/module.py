# Copyright (c) 2026, gpuops.clean_slate maintainers
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# Note: this module_util is PRIVATE to the collection; it may change without notice.

"""The gpu_job_residue module: its request and argument spec, and the run (walk, judge, remove, report).

:class:`ModuleRun` is the module's logic; :func:`run` is one whole run, check mode included.
"""

from __future__ import annotations

import gc
import os
import re
import time
import typing as t
from dataclasses import dataclass, field

from ansible_collections.gpuops.clean_slate.plugins.module_utils import _checks, _holders, _ports, _procs, _protection, _reasons, _scope
from ansible_collections.gpuops.clean_slate.plugins.module_utils._errors import CleanSlateError
from ansible_collections.gpuops.clean_slate.plugins.module_utils._residue import keep, owners, remove, report, walk

# Locks, caches and directories are only reported by default: a live compile's baton, a cached answer and a live
# torchelastic agent's log directory are not held open all the time, so "nothing holds it" does not prove the job is
# dead. Files (a rendezvous store, a daemon's marker) go when orphaned: their rules (keep_while) keep them while their
# server runs.
DEFAULT_REMOVE = ("shm", "sockets", "files")
# A file nothing holds is left alone while it is younger than this: a server starting beside the run makes its
# segments one after another and maps each within a millisecond (the H200's torch tree: every name it made was
# created and mapped in the same millisecond, server-facts 2026-12-02); a minute is that with four orders of
# magnitude to spare for a loaded or stopped starter, and short enough that what a crashed server made when it
# started (minutes or hours ago) goes in the run right after the crash. SGLang's own CI sweep waits 10 minutes.
DEFAULT_MIN_AGE = 60.0
FAIL_ON = ("listening", "connected", "time_wait")
#: The most entries one list of the result may be asked to hold.
MAX_LIST_LIMIT = 1_000_000


# ---------------------------------------------------------------------- request
@dataclass
class Request:
    """A validated request."""

    globs: list[walk.Glob]
    remove: set[str]
    users: list[str] = field(default_factory=list)
    scopes: list[_scope.Scope] = field(default_factory=list)
    ports: list[int] = field(default_factory=list)
    time_wait_timeout: float = 0.0
    patterns: list[re.Pattern[str]] = field(default_factory=list)
    protect: list[str] = field(default_factory=list)
    fail_on: set[str] = field(default_factory=lambda: {"listening"})
    list_limit: int = 200
    min_age: float = 0.0  # the module's default is DEFAULT_MIN_AGE (its argument spec); a bare Request keeps nothing for its age
    keep_while: list[keep.KeepWhile] = field(default_factory=list)
    server_ports: list[ServerPort] = field(default_factory=list)


@dataclass(frozen=True)
class ServerPort:
    """A port a server profile says its next start binds: checked by default, and a failure only when a process of
    that server (``patterns``: the kill's) still listens there."""

    port: int
    server: str
    name: str


#: A process as the handoff names it: pid and start time (clock ticks since boot), so a pid reused meanwhile is another.
Ident = t.Tuple[int, int]


@dataclass
class Handoff:
    """What the umbrella's kill hands the residue phase (the two run in one module process): who held each candidate
    before the kill (``before``, by device and inode) and the processes the kill ended (``ended``; in check mode, those
    it would end). A file whose holders were all ended by this run is orphaned at once, whatever its age: no server
    starting now holds it."""

    before: dict[walk.Key, frozenset[Ident]] = field(default_factory=dict)
    ended: frozenset[Ident] = frozenset()


def validate_ports(ports: t.Sequence[int], option: str = "ports") -> list[int]:
    """Distinct ports, each 1-65535."""
    out: list[int] = []
    for port in ports:
        if not 1 <= int(port) <= 65535:
            raise CleanSlateError(f"{option}: {port} is not a TCP port (1-65535).", reason=_reasons.BAD_ARGUMENTS, option=option)
        if int(port) not in out:
            out.append(int(port))
    return out


def validate_server_ports(entries: t.Sequence[t.Mapping[str, t.Any]], ports: t.Sequence[int]) -> list[ServerPort]:
    """The ``server_ports`` entries, each port 1-65535; a port also in ``ports`` is checked as ``ports`` says (once)."""
    out: list[ServerPort] = []
    for e in entries:
        port = e["port"]
        validate_ports([port], "server_ports")
        if port not in ports and all(p.port != port for p in out):
            out.append(ServerPort(port=int(port), server=str(e["server"]), name=str(e.get("name") or "")))
    return out


def parse_keep_while(entries: t.Sequence[t.Mapping[str, t.Any]]) -> list[keep.KeepWhile]:
    """The ``keep_while`` rules: each path glob checked as a residue glob, each pattern compiled."""
    out = []
    for e in entries:
        globs = [walk.parse_glob("files", str(g)) for g in e["paths"]]
        for g in globs:
            g.option = "keep_while"
        if not e["patterns"]:
            raise CleanSlateError(
                f"keep_while: the rule for {e['server']!r} names no patterns: nothing could ever keep its files.",
                reason=_reasons.BAD_ARGUMENTS,
                option="keep_while",
            )
        out.append(keep.KeepWhile(server=str(e["server"]), globs=globs, patterns=_procs.compile_patterns(e["patterns"], option="keep_while")))
    return out


# ---------------------------------------------------------------------- the whole run
def run(req: Request, check_mode: bool, handoff: Handoff | None = None) -> dict[str, t.Any]:
    """Find, judge and (unless check mode) remove residue; classify ports; report zombies. ``handoff``: what this run's
    kill ended, and who held each candidate before it (:class:`Handoff`)."""
    return _scoped(req, lambda roots, walkers, notes: _run(req, check_mode, roots, walkers, notes, handoff or Handoff()))


def holders_before(req: Request) -> dict[walk.Key, frozenset[Ident]]:
    """Who holds each candidate now (pid and start time), by device and inode: what the umbrella reads before its kill,
    so that the residue phase can tell a file this run's kill released. Removes nothing, checks no port."""
    return _scoped(req, lambda roots, walkers, notes: _holders_now(req, roots, walkers, notes))


_T = t.TypeVar("_T")


def _scoped(req: Request, body: t.Callable[[list[walk.Root], list[walk.Walker], list[str]], _T]) -> _T:
    """Run ``body`` with the scopes' roots open, closing every directory fd after."""
    notes: list[str] = []
    roots = walk.open_roots(req.scopes)
    walkers: list[walk.Walker] = []
    # A full /dev/shm makes tens of thousands of small objects and no reference cycles: the cyclic collector
    # would run a few dozen times, the older generations over the whole heap (Ansible's modules included), for
    # nothing: 10-40 ms of a 0.3 s run (tools/bench/residue.py).
    collecting = gc.isenabled()
    gc.disable()
    try:
        return body(roots, walkers, notes)
    finally:
        if collecting:
            gc.enable()
        for w in walkers:
            w.close()
        for r in roots:
            os.close(r.fd)


def _holders_now(req: Request, roots: list[walk.Root], walkers: list[walk.Walker], notes: list[str]) -> dict[walk.Key, frozenset[Ident]]:
    items, found_walkers = walk.collect(req.globs, roots, notes)
    walkers.extend(found_walkers)
    judged = [i for i in items if i.verdict != "skipped"]
    holders = owners.Holders(req.protect, req.patterns)
    _judge(judged, walkers, roots, set(), holders)
    return {i.key: frozenset(holders.ident(pid) for pid in i.holder_pids) for i in judged if i.verdict == "held"}


def _judge(
    judged: list[walk.Item], walkers: list[walk.Walker], roots: list[walk.Root], port_inodes: set[int], holders: owners.Holders
) -> tuple[_holders.Scan, dict[walk.Key, list[walk.Item]]]:
    """One pass over /proc for every candidate: each is held (with its holders) or left ``remove``."""
    sock_keys, sock_names = owners.socket_files(judged)
    watch = _holders.Watch(sockets=None if sock_keys else port_inodes, netns=bool(sock_keys))
    # In bulk: a full /dev/shm is ten thousand items, and a set made per item costs more than the rest of this.
    files = [i for i in judged if i.kind != "dirs"]
    watch.keys.update([(i.dev, i.ino) for i in files])
    # Another name for a file may be the one a process opened.
    watch.any_name = any(i.st is not None and i.st.st_nlink > 1 for i in files)
    for item in judged:
        if item.kind == "dirs":
            watch.keys |= item.tree
            watch.names |= item.tree_names
            watch.cwd_keys |= item.tree_dirs
    for walker in walkers:
        watch.names |= walker.names  # every matched name, the files' own included
    watch.name_only = owners.overlay_names(judged, roots)
    # A compile lock is held too by a process working in its directory (torch's ninja builds in the baton's).
    lock_dirs = keep.lock_directories(judged)
    watch.cwd_keys |= lock_dirs.keys()
    scan = _holders.scan(watch)
    locks = _holders.read_locks(watch.keys)
    bound, unbound_names = owners.bound_sockets(scan, sock_keys, sock_names)
    owners.judge(judged, scan, locks, bound, unbound_names, holders)
    keep.worked_in(lock_dirs, scan, holders)
    return scan, lock_dirs


def release(judged: list[walk.Item], handoff: Handoff, holders: owners.Holders) -> None:
    """Mark what this run's kill released: an item whose holders before the kill are all processes the kill ended goes
    at once, whatever its age (``keep.apply``). In check mode nothing was ended, so such an item is still held (and
    listed there, as before), with ``released_by`` and why: the run removes it right after its kill."""
    if not handoff.ended:
        return
    for item in judged:
        if item.verdict == "held":
            now = {holders.ident(pid) for pid in item.holder_pids}
            if now and now <= handoff.ended:
                item.released = sorted(pid for pid, _start in now)
                item.why = "held only by processes this run's kill ends: the run removes it right after the kill, whatever its age"
        elif item.verdict == "remove":
            before = handoff.before.get(item.key)
            if before and before <= handoff.ended:
                item.released = sorted(pid for pid, _start in before)


def _run(req: Request, check_mode: bool, roots: list[walk.Root], walkers: list[walk.Walker], notes: list[str], handoff: Handoff) -> dict[str, t.Any]:
    items, found_walkers = walk.collect(req.globs, roots, notes)
    walkers.extend(found_walkers)
    for root in roots:
        uids = _procs.resolve_users(req.users, root.scope, owners=_owners_of(items, root))
        if uids is None:
            continue
        for item in items:
            if item.vmid != root.vmid:
                continue
            st = item.stat()
            if st is None:
                item.verdict, item.why = "skipped", "gone while it was being judged"
            elif st.st_uid not in uids:
                item.verdict, item.why = "skipped", f"owned by uid {st.st_uid}, not one of users"
    judged = [i for i in items if i.verdict != "skipped"]

    # Ports first: their socket inodes are looked up in the same pass over /proc.
    wanted_ports = [*req.ports, *(p.port for p in req.server_ports)]
    port_socks: list[tuple[walk.Root, list[_ports.Sock]]] = [(root, _ports.read_tcp(root.netdir, set(wanted_ports))) for root in roots] if wanted_ports else []
    port_inodes = {s.inode for _root, socks in port_socks for s in socks if s.inode}
    holders = owners.Holders(req.protect, req.patterns)
    scan, _lock_dirs = _judge(judged, walkers, roots, port_inodes, holders)
    release(judged, handoff, holders)
    # Unheld is not unused while its named creator lives, while its server runs (keep_while), or while it is younger
    # than min_age unless this run's kill released it (check mode too).
    keep.apply(judged, {root.vmid: root for root in roots}, req.min_age, keep_while=req.keep_while)

    for item in judged:
        if item.verdict == "remove" and item.kind not in req.remove:
            item.verdict, item.why = "stale", f"orphaned; removal of {item.kind} is not enabled"
    orphans = [i for i in judged if i.verdict == "remove"]
    incomplete = bool(scan.unreadable) and bool(orphans)
    if incomplete:
        why = (
            f"{len(scan.unreadable)} process(es) could not be inspected (permission), so nothing can be proven orphaned"
            f" (pid {_holders.describe_unreadable(scan.unreadable)})"
        )
        for item in orphans:
            item.verdict, item.why = "skipped", why
        notes.append(why + "; run the module as root (become: true).")
    else:
        remove.remove_all(orphans, check_mode)

    ports_out: list[dict[str, t.Any]] = []
    for root, socks in port_socks:
        states = {p: _ports.classify(p, socks) for p in req.ports}
        waited = _ports.wait_closing(root.netdir, states, req.time_wait_timeout) if req.time_wait_timeout > 0 else 0.0
        if any(s.state != "free" for s in states.values()) and waited:
            # A listener may have appeared while waiting: look up owners of the sockets seen now.
            fresh = {s.inode for ps in states.values() for s in ps.listeners + ps.connections if s.inode not in scan.socket_owners}
            if fresh:
                scan.socket_owners.update(_holders.scan(_holders.Watch(sockets=fresh, zombies=False)).socket_owners)
        for port in req.ports:
            ports_out.append(owners.port_record(states[port], root, holders, scan.socket_owners, waited))
        for sp in req.server_ports:
            ports_out.append(owners.port_record(_ports.classify(sp.port, socks), root, holders, scan.socket_owners, 0.0, server=(sp.server, sp.name)))
    zombie_list, non_reaping = owners.zombies(scan, roots, holders)
    return report.report(check_mode, items, ports_out, zombie_list, non_reaping, notes, scan, incomplete, req.fail_on, req.list_limit)


def _owners_of(items: list[walk.Item], root: walk.Root) -> t.Callable[[], set[int]]:
    """The owners of a root's candidates, stat'ed when first asked: a dead job's uid owns its residue."""
    found: list[set[int]] = []

    def owners() -> set[int]:
        if not found:
            found.append({st.st_uid for item in items if item.vmid == root.vmid and (st := item.stat()) is not None})
        return found[0]

    return owners


# ---------------------------------------------------------------------- the gpu_job_residue module
def build_request(p: t.Mapping[str, t.Any], scopes_of: t.Callable[[], list[_scope.Scope]]) -> Request:
    """Validate every option; raises before anything is looked at or removed.

    ``scopes_of`` resolves the ``containers`` option (through pct), once the rest is known good.
    """
    globs = [walk.parse_glob(kind, pattern) for kind in walk.KINDS for pattern in p[kind]]
    globs += [walk.parse_holding("dirs_holding", entry) for entry in p.get("dirs_holding") or []]
    keep_while = parse_keep_while(p.get("keep_while") or [])
    walk.check_roots(globs + [g for rule in keep_while for g in rule.globs], walk.parse_roots(p["roots"]))
    _checks.number("min_age", p["min_age"], 0, _checks.MAX_SECONDS, unit="seconds")
    _checks.number("time_wait_timeout", p["time_wait_timeout"], 0, _checks.MAX_SECONDS, unit="seconds")
    _checks.number("list_limit", p["list_limit"], 0, MAX_LIST_LIMIT)
    for vmid in p["containers"]:
        _checks.vmid("containers", vmid)
    _checks.executable("pct_path", p["pct_path"])
    ports = validate_ports(p["ports"])
    server_ports = validate_server_ports(p.get("server_ports") or [], ports)
    patterns = _procs.compile_patterns(p["patterns"])
    protect = _protection.protect_list(p["protect"], [])
    return Request(
        globs=globs,
        remove=set(p["remove"]),
        users=p["users"],
        scopes=scopes_of(),
        ports=ports,
        time_wait_timeout=p["time_wait_timeout"],
        patterns=patterns,
        protect=protect,
        fail_on=set(p["fail_on"]),
        list_limit=p["list_limit"],
        min_age=p["min_age"],
        keep_while=keep_while,
        server_ports=server_ports,
    )


def argument_spec() -> dict[str, dict[str, t.Any]]:
    """The options of gpu_job_residue, without the containers scope (``_pct.SCOPE_OPTIONS``): one source for it and the umbrella's residue phase."""
    return {
        "shm": {"type": "list", "elements": "str", "default": list(walk.DEFAULT_SHM)},
        "sockets": {"type": "list", "elements": "str", "default": list(walk.DEFAULT_SOCKETS)},
        "locks": {"type": "list", "elements": "str", "default": list(walk.DEFAULT_LOCKS)},
        "dirs": {"type": "list", "elements": "str", "default": list(walk.DEFAULT_DIRS)},
        "files": {"type": "list", "elements": "str", "default": list(walk.DEFAULT_FILES)},
        "caches": {"type": "list", "elements": "str", "default": list(walk.DEFAULT_CACHES)},
        "dirs_holding": {
            "type": "list",
            "elements": "dict",
            "default": [],
            "options": {"dir": {"type": "str", "required": True}, "files": {"type": "str", "required": True}},
        },
        "keep_while": {
            "type": "list",
            "elements": "dict",
            "default": [],
            "options": {
                "server": {"type": "str", "required": True},
                "paths": {"type": "list", "elements": "str", "required": True},
                "patterns": {"type": "list", "elements": "str", "required": True},
            },
        },
        "roots": {"type": "list", "elements": "str", "default": list(walk.DEFAULT_ROOTS)},
        "remove": {"type": "list", "elements": "str", "choices": list(walk.KINDS), "default": list(DEFAULT_REMOVE)},
        "min_age": {"type": "float", "default": DEFAULT_MIN_AGE},
        "users": {"type": "list", "elements": "str", "default": []},
        "ports": {"type": "list", "elements": "int", "default": []},
        "server_ports": {
            "type": "list",
            "elements": "dict",
            "default": [],
            "options": {"port": {"type": "int", "required": True}, "server": {"type": "str", "required": True}, "name": {"type": "str"}},
        },
        "time_wait_timeout": {"type": "float", "default": 0},
        "patterns": {"type": "list", "elements": "str", "default": []},
        "protect": {"type": "list", "elements": "str", "default": []},
        "fail_on": {"type": "list", "elements": "str", "choices": list(FAIL_ON), "default": ["listening"]},
        "list_limit": {"type": "int", "default": 200},
    }


class ModuleRun:
    """One run of the gpu_job_residue module; every failure carries ``summary`` and ``elapsed_s``.

    :param scopes_of: resolves the ``containers`` option (through pct, which this file does not need to know).
    """

    def __init__(self, scopes_of: t.Callable[[], list[_scope.Scope]], clock: t.Callable[[], float] = time.monotonic, handoff: Handoff | None = None) -> None:
        self.scopes_of = scopes_of
        self.clock = clock
        self.start = clock()
        self.handoff = handoff

    def details(self, _reason: str) -> dict[str, t.Any]:
        return {"summary": {}, "elapsed_s": round(self.clock() - self.start, 4)}

    def __call__(self, module: t.Any) -> dict[str, t.Any]:
        result = run(build_request(module.params, self.scopes_of), module.check_mode, self.handoff)
        result["elapsed_s"] = round(self.clock() - self.start, 4)
        if module._diff:  # pylint: disable=protected-access
            result["diff"] = report.diff(result, module.check_mode)
        return result
