# Copyright (c) 2026, gpuops.clean_slate maintainers
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# Note: this module_util is PRIVATE to the collection; it may change without notice.

"""The result of a residue run: lists, counts and sizes, the one-line message, the failures, the diff."""

from __future__ import annotations

import typing as t

from ansible_collections.gpuops.clean_slate.plugins.module_utils import _holders, _reasons
from ansible_collections.gpuops.clean_slate.plugins.module_utils._errors import CleanSlateError
from ansible_collections.gpuops.clean_slate.plugins.module_utils._residue.walk import KINDS, Item


def human(nbytes: int) -> str:
    """Bytes for people: 512 B, 4.0 KiB, 3.1 GiB."""
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{int(value)} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{nbytes} B"


_NOUNS = {
    "shm": ("segment", "segments"),
    "sockets": ("socket", "sockets"),
    "locks": ("lock", "locks"),
    "dirs": ("directory", "directories"),
    "files": ("file", "files"),
    "caches": ("cache file", "cache files"),
}


def _counted(counts: dict[str, int]) -> str:
    words = [f"{n} {_NOUNS[k][0] if n == 1 else _NOUNS[k][1]}" for k, n in counts.items() if n]
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " and " + words[-1]


def message(summary: dict[str, t.Any], ports: list[dict[str, t.Any]], check_mode: bool) -> str:
    """One line: "12 stale segments (3.1 GiB) removed, port 30000 free"."""
    parts = []
    kinds = summary["kinds"]
    removed = {k: v["removed"] for k, v in kinds.items()}
    if summary["removed"]:
        counted = _counted(removed)
        counted = counted.replace(" ", " stale ", 1)
        parts.append(f"{counted} ({human(summary['removed_bytes'])}) {'would be removed' if check_mode else 'removed'}")
    else:
        parts.append("no stale residue")
    if summary["held"]:
        parts.append(f"{summary['held']} held by live processes (kept)")
    if check_mode and summary.get("released"):
        parts.append(f"{summary['released']} of them held only by what the kill ends (removed after it)")
    if summary["kept"]:
        parts.append(f"{summary['kept']} unheld but kept (a live creator, or younger than min_age)")
    if summary["stale"]:
        parts.append(f"{_counted({k: v['stale'] for k, v in kinds.items()}).replace(' ', ' stale ', 1)} reported (removal not enabled)")
    if summary["errors"]:
        parts.append(f"{summary['errors']} could not be removed")
    by_state: dict[str, list[str]] = {}
    bindable = 0
    for p in ports:
        label = str(p["port"]) if p["container"] is None else f"{p['port']} (ct {p['container']})"
        if "server" in p:
            label += f" ({p['server']} {p['name']})" if p.get("name") else f" ({p['server']})"
            if p["state"] != "listening":
                bindable += 1  # both servers set SO_REUSEADDR: TIME_WAIT and connections do not stop their bind
                continue
        if p["state"] == "listening":
            owners = [o for o in p["owners"] if o.get("listening")]
            who = f"{owners[0]['pid']} {owners[0]['name']}" if owners else "owner not visible"
            parts.append(f"port {label} listening (PID {who})" if owners else f"port {label} listening ({who})")
        elif p["state"] == "time_wait":
            left = f", ~{p['remaining_s']:.0f} s left" if p["remaining_s"] is not None else ""
            parts.append(f"port {label} in TIME_WAIT ({p['time_wait']} socket(s){left})")
        elif p["state"] == "connected":
            parts.append(f"port {label} still has {p['connections']} connection(s)")
        else:
            by_state.setdefault("free", []).append(label)
    if by_state.get("free"):
        free = by_state["free"]
        parts.append(f"port {free[0]} free" if len(free) == 1 else f"ports {', '.join(free)} free")
    if bindable:
        parts.append(f"{bindable} server port{'s' if bindable > 1 else ''} free for the next start")
    if summary["zombies"]:
        parts.append(f"{summary['zombies']} zombie(s) under {len(summary['non_reaping'])} non-reaping parent(s)")
    return ", ".join(parts)


def report(
    check_mode: bool,
    items: list[Item],
    ports: list[dict[str, t.Any]],
    zombie_list: list[dict[str, t.Any]],
    non_reaping: list[dict[str, t.Any]],
    notes: list[str],
    scan: _holders.Scan,
    incomplete: bool,
    fail_on: t.AbstractSet[str],
    list_limit: int,
) -> dict[str, t.Any]:
    """The module result; raises CleanSlateError (carrying the result) for a failure (as ``fail_on`` asks, for ports)."""
    gone = ("remove", "removed") if check_mode else ("removed",)
    lists: dict[str, list[Item]] = {"removed": [], "held": [], "kept": [], "stale": [], "ignored": [], "errors": []}
    for item in items:
        if item.verdict in gone:
            lists["removed"].append(item)
        elif item.verdict == "held":
            lists["held"].append(item)
        elif item.verdict == "kept":
            lists["kept"].append(item)
        elif item.verdict == "stale":
            lists["stale"].append(item)
        elif item.verdict == "error":
            lists["errors"].append(item)
        elif item.verdict in ("skipped", "vanished"):
            lists["ignored"].append(item)
    for item in lists["removed"]:
        item.stat()  # in check mode, items found by their directory entry get their size here
    kinds = {k: {"removed": 0, "bytes": 0, "held": 0, "kept": 0, "stale": 0} for k in KINDS}
    for name in ("removed", "held", "kept", "stale"):
        for item in lists[name]:
            kinds[item.kind][name] += 1
            if name == "removed":
                kinds[item.kind]["bytes"] += item.nbytes
    limit = list_limit
    summary: dict[str, t.Any] = {
        "removed": len(lists["removed"]),
        "removed_bytes": sum(i.nbytes for i in lists["removed"]),
        "held": len(lists["held"]),
        "kept": len(lists["kept"]),
        "stale": len(lists["stale"]),
        "ignored": len(lists["ignored"]),
        "errors": len(lists["errors"]),
        "kinds": kinds,
        "ports": {(str(p["port"]) if p["container"] is None else f"{p['container']}:{p['port']}"): p["state"] for p in ports if "server" not in p},
        "server_ports": {(str(p["port"]) if p["container"] is None else f"{p['container']}:{p['port']}"): p["state"] for p in ports if "server" in p},
        # What this run's kill released (removed whatever its age; in check mode still held, listed with released_by).
        "released": sum(1 for i in items if i.released and i.verdict in ("remove", "removed", "held")),
        "zombies": len(zombie_list),
        "non_reaping": [p["why"] for p in non_reaping],
        "paths": {
            "removed": [i.path for i in lists["removed"][:limit]],
            "held": [f"{i.path} ({', '.join(str(h['pid']) + ' ' + str(h['name']) for h in i.holders[:3])})" for i in lists["held"][:limit]],
            "kept": [f"{i.path} ({i.why})" for i in lists["kept"][:limit]],
            "stale": [i.path for i in lists["stale"][:limit]],
        },
    }
    summary["msg"] = message(summary, ports, check_mode)
    result: dict[str, t.Any] = {
        "changed": bool(lists["removed"]),
        "msg": summary["msg"],
        "summary": summary,
        "removed": [i.record() for i in lists["removed"][:limit]],
        "held": [i.record() for i in lists["held"][:limit]],
        "kept": [i.record() for i in lists["kept"][:limit]],
        "stale": [i.record() for i in lists["stale"][:limit]],
        "ignored": [i.record() for i in lists["ignored"][:limit]],
        "errors": [i.record() for i in lists["errors"][:limit]],
        "truncated": any(len(v) > limit for v in lists.values()),
        "ports": ports,
        "zombies": zombie_list[:limit],
        "non_reaping": non_reaping,
        "processes": scan.processes,
        "notes": notes,
    }
    failures = problems(fail_on, lists["errors"], incomplete, notes, ports)
    if failures:
        reason, msg = failures[0]
        if len(failures) > 1:
            msg += f" ({len(failures) - 1} more problem(s) in the result.)"
        details = {k: v for k, v in result.items() if k not in ("msg",)}
        raise CleanSlateError(msg, reason=reason, **details)
    return result


def problems(fail_on: t.AbstractSet[str], errors: list[Item], incomplete: bool, notes: list[str], ports: list[dict[str, t.Any]]) -> list[tuple[str, str]]:
    """(reason, sentence) of everything that fails the run, most serious first: removals that failed, a scan that
    could not prove anything orphaned, then each port the next server could not bind (as ``fail_on`` asks)."""
    failures = []
    if errors:
        e = errors[0]
        failures.append(
            (
                _reasons.REMOVE_FAILED,
                f"{len(errors)} orphaned item(s) could not be removed (first: {e.path}: {e.why}); remove them by hand or fix the file system.",
            )
        )
    if incomplete:
        failures.append((_reasons.SCAN_INCOMPLETE, f"{notes[-1]} Nothing was removed."))
    for p in ports:
        label = f"port {p['port']}" + (f" in container {p['container']}" if p["container"] is not None else "")
        if "server" in p:
            # A port a server profile names: the next start of that server binds it with SO_REUSEADDR (TIME_WAIT and
            # connections do not stop it), and a listener stops it only when it is that server's own (one that
            # survived, or shares the port with SO_REUSEPORT); another service there is reported, not failed.
            servers = [o for o in p["owners"] if o.get("listening") and o.get("matches")]
            if p["state"] == "listening" and "listening" in fail_on and servers:
                who = ", ".join(f"PID {o['pid']} ({o['name']})" for o in servers)
                failures.append(
                    (
                        _reasons.PORT_IN_USE,
                        f"{label} ({p['server']} {p['name'] or 'port'}) is still listened on by {who}, a process of the server: the next start"
                        " cannot bind it, or shares it with SO_REUSEPORT and loses requests to it. End it (it matches the kill patterns: run the"
                        " kill phase first) and run again.",
                    )
                )
            continue
        if p["state"] == "listening" and "listening" in fail_on:
            owners = [o for o in p["owners"] if o.get("listening")]
            who = ", ".join(f"PID {o['pid']} ({o['name']})" for o in owners) or "a process this host cannot see"
            hint = (
                "it matches the kill patterns: run the kill phase (gpu_procs_kill) first"
                if any(o.get("kill_target") for o in owners)
                else "stop that service or add a pattern that matches it"
            )
            failures.append((_reasons.PORT_IN_USE, f"{label} is still listened on by {who}; the next server cannot bind it: {hint}."))
        elif p["state"] == "connected" and "connected" in fail_on:
            failures.append((_reasons.PORT_CONNECTED, f"{label} still has {p['connections']} live connection(s); end their owners before starting the server."))
        elif p["state"] == "time_wait" and "time_wait" in fail_on:
            failures.append(
                (
                    _reasons.PORT_TIME_WAIT,
                    f"{label} is still in TIME_WAIT (about {p['remaining_s']} s left); wait, raise time_wait_timeout, or use SO_REUSEADDR.",
                )
            )
    return failures


def diff(result: dict[str, t.Any], check_mode: bool) -> dict[str, str]:
    """The orphaned items before, and those still there after (none in check mode, which only predicts)."""
    gone = [r["path"] for r in result["removed"]]
    left = [] if check_mode else [r["path"] for r in result["errors"]]
    return {"before": "".join(p + "\n" for p in gone + left), "after": "" if check_mode else "".join(p + "\n" for p in left)}
