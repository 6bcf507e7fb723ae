# Copyright (c) 2026, gpuops.clean_slate maintainers
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# Note: this plugin_util is PRIVATE to the collection; it may change without notice.

"""Server profiles, on the controller: the role's own (``roles/clean_slate/profiles/<name>.yml``) and the user's
(``clean_slate_profile_definitions``), checked and turned into the modules' options.

A profile is data a user reads and copies (sglang.yml says what each key means and where each fact comes from)::

    description: str
    processes: {roots: [regex], members: [regex]}
    stop: {grace: seconds}
    ports: [{name, port: int|null} | {name, from: <port name>, offset: int}]
    residue: {shm|sockets|files|locks|dirs|caches: [glob], dirs_holding: [{dir, files}], keep_while_running: [glob]}

:func:`problems` says what is wrong with one (each a sentence naming where: the role's ``role_refusals`` refuses the host
with them, ``bad_variable``); :func:`resolve` turns the profiles a host applies into the options of the kill
(``patterns``, ``servers``) and of the residue phase (the globs of each kind, ``dirs_holding``, ``keep_while``,
``server_ports``), leaving out whatever :func:`problems` refuses (the refusal stops the host before anything runs; the
options must still template). The modules check the options again (``bad_arguments``) for direct users.
"""

from __future__ import annotations

import functools
import json
import os
import re
import typing as t

import yaml  # type: ignore[import-untyped]  # no stubs installed

from ansible_collections.gpuops.clean_slate.plugins.module_utils import _checks
from ansible_collections.gpuops.clean_slate.plugins.module_utils._errors import CleanSlateError
from ansible_collections.gpuops.clean_slate.plugins.module_utils._residue import walk

#: The role's own profiles, under its directory.
DIRECTORY = "profiles"
KEYS = ("description", "processes", "stop", "ports", "residue")
PROCESS_KEYS = ("roots", "members")
STOP_KEYS = ("grace",)
PORT_KEYS = ("name", "port", "from", "offset")
RESIDUE_LISTS = walk.KINDS  # shm, sockets, locks, dirs, files, caches
RESIDUE_KEYS = (*RESIDUE_LISTS, "dirs_holding", "keep_while_running")
#: Where the role documents profiles, for the sentences.
GUIDE = "the guide's 'Server profiles'"
_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")


@functools.lru_cache(maxsize=8)
def _builtin(directory: str, stamp: tuple[tuple[str, float], ...]) -> dict[str, t.Any]:
    out: dict[str, t.Any] = {}
    for name, _mtime in stamp:
        with open(os.path.join(directory, f"{name}.yml"), encoding="utf-8") as f:
            out[name] = yaml.load(f, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    return out


def builtin(role_path: str) -> dict[str, t.Any]:
    """The role's own profiles by name (each file read once per process, again when it changed)."""
    directory = os.path.join(role_path, DIRECTORY)
    try:
        names = sorted(n[:-4] for n in os.listdir(directory) if n.endswith(".yml"))
        stamp = tuple((n, os.stat(os.path.join(directory, f"{n}.yml")).st_mtime) for n in names)
    except OSError:
        return {}
    return _builtin(directory, stamp)


def catalog(role_path: str, definitions: t.Any) -> dict[str, t.Any]:
    """Every profile a host may apply: the role's own, then the user's (a name of the role's own replaces it)."""
    out = dict(builtin(role_path))
    if isinstance(definitions, dict):
        out.update({str(k): v for k, v in definitions.items()})
    return out


# ---------------------------------------------------------------------- checks
def _is_int(value: t.Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _strings(where: str, value: t.Any, out: list[str]) -> list[str]:
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(x, str) and x for x in value):
        out.append(f"{where} must be a list of non-empty strings, got {json.dumps(value, default=str)}.")
        return []
    return list(value)


def _unknown(where: str, value: t.Any, known: t.Sequence[str], out: list[str]) -> dict[str, t.Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        out.append(f"{where} must be a dictionary, got {json.dumps(value, default=str)}.")
        return {}
    extra = sorted(str(k) for k in value if k not in known)
    if extra:
        out.append(f"{where} has unknown key(s) {', '.join(extra)} (known: {', '.join(known)}; {GUIDE}).")
    return value


def _regexes(where: str, values: list[str], out: list[str]) -> None:
    for value in values:
        try:
            re.compile(value)
        except re.error as exc:
            out.append(f"{where}: {value!r} is not a valid regular expression ({exc}).")


def problems(name: str, profile: t.Any, roots: t.Sequence[str], where: str) -> list[str]:
    """What is wrong with one profile, one sentence each, each naming ``where`` (the variable and the path in it)."""
    out: list[str] = []
    if not _NAME.match(name):
        out.append(f"{where}: {name!r} is not a profile name (letters, digits, '_', '.' and '-').")
    p = _unknown(f"{where}.{name}", profile, KEYS, out)
    if profile is not None and not isinstance(profile, dict):
        return out
    if "description" in p and not isinstance(p["description"], str):
        out.append(f"{where}.{name}.description must be text.")
    procs = _unknown(f"{where}.{name}.processes", p.get("processes"), PROCESS_KEYS, out)
    for key in PROCESS_KEYS:
        _regexes(f"{where}.{name}.processes.{key}", _strings(f"{where}.{name}.processes.{key}", procs.get(key), out), out)
    stop = _unknown(f"{where}.{name}.stop", p.get("stop"), STOP_KEYS, out)
    if "grace" in stop:
        try:
            _checks.number(f"{where}.{name}.stop.grace", stop["grace"], 0, _checks.MAX_SECONDS, unit="seconds")
        except CleanSlateError as exc:
            out.append(exc.msg)
    out.extend(_port_problems(f"{where}.{name}.ports", p.get("ports")))
    out.extend(_residue_problems(f"{where}.{name}.residue", p.get("residue"), roots))
    return out


def _port_problems(where: str, ports: t.Any) -> list[str]:
    out: list[str] = []
    if ports is None:
        return out
    if not isinstance(ports, list):
        return [f"{where} must be a list of ports ({{name, port}} or {{name, from, offset}}), got {json.dumps(ports, default=str)}."]
    names = [p.get("name") for p in ports if isinstance(p, dict)]
    for i, port in enumerate(ports):
        at = f"{where}[{i}]"
        entry = _unknown(at, port, PORT_KEYS, out)
        if not isinstance(port, dict):
            continue
        if not isinstance(entry.get("name"), str) or not entry["name"]:
            out.append(f"{at} needs a name.")
        elif names.count(entry["name"]) > 1:
            out.append(f"{at}: the name {entry['name']!r} is used twice.")
        if "from" in entry:
            if "port" in entry:
                out.append(f"{at} gives both port and from: a port is a number or derived, not both.")
            if entry["from"] not in names or entry["from"] == entry.get("name"):
                out.append(f"{at}.from: {entry['from']!r} is not another port of this table.")
            if not _is_int(entry.get("offset")):
                out.append(f"{at}.offset must be an integer (the distance from {entry['from']!r}).")
        elif "port" not in entry:
            out.append(f"{at} needs a port (a number, or ~ when the server picks it) or from and offset.")
        elif entry["port"] is not None and not (_is_int(entry["port"]) and 1 <= entry["port"] <= 65535):
            out.append(f"{at}.port: {json.dumps(entry['port'], default=str)} is not a TCP port (1-65535).")
    return out


def _residue_problems(where: str, residue: t.Any, roots: t.Sequence[str]) -> list[str]:
    out: list[str] = []
    r = _unknown(where, residue, RESIDUE_KEYS, out)
    parsed_roots = _roots(roots)
    for kind in RESIDUE_LISTS:
        for glob in _strings(f"{where}.{kind}", r.get(kind), out):
            out.extend(_glob_problems(f"{where}.{kind}", functools.partial(walk.parse_glob, kind, glob), parsed_roots))
    holding = r.get("dirs_holding")
    if holding is not None and not isinstance(holding, list):
        out.append(f"{where}.dirs_holding must be a list of {{dir, files}}.")
    for i, entry in enumerate(holding if isinstance(holding, list) else []):
        at = f"{where}.dirs_holding[{i}]"
        e = _unknown(at, entry, ("dir", "files"), out)
        if isinstance(entry, dict):
            out.extend(_glob_problems(at, functools.partial(walk.parse_holding, at, e), parsed_roots))
    for glob in _strings(f"{where}.keep_while_running", r.get("keep_while_running"), out):
        out.extend(_glob_problems(f"{where}.keep_while_running", functools.partial(walk.parse_glob, "files", glob), parsed_roots))
    return out


def _roots(roots: t.Sequence[str]) -> list[tuple[str, ...]]:
    try:
        return walk.parse_roots([str(r) for r in roots])
    except CleanSlateError:
        return walk.parse_roots(walk.DEFAULT_ROOTS)  # clean_slate_residue_roots is refused on its own


def documented(roots: t.Any) -> list[str]:
    """Where a profile's globs may point: the documented roots (/dev/shm, /tmp, /var/tmp, /root, /home) and those the
    user adds in clean_slate_residue_roots. A glob outside them is refused; one outside a narrower
    clean_slate_residue_roots is left out, as the roots say (:func:`resolve`)."""
    given = [str(r) for r in roots] if isinstance(roots, list) else []
    return [*walk.DEFAULT_ROOTS, *(r for r in given if r not in walk.DEFAULT_ROOTS)]


def _glob_problems(where: str, parse: t.Callable[[], walk.Glob], roots: list[tuple[str, ...]]) -> list[str]:
    try:
        glob = parse()
        walk.check_roots([glob], roots)
    except CleanSlateError as exc:
        # The module's words, with the place in the profile instead of the module's option.
        return [f"{where}: {exc.msg.split(': ', 1)[1] if ': ' in exc.msg else exc.msg}"]
    return []


def _port_table(name: str, profile: dict[str, t.Any], override: t.Any) -> list[tuple[str, int | None]]:
    """(port name, number) of a valid profile's table, with the user's numbers (clean_slate_server_ports) applied."""
    given = override if isinstance(override, dict) else ({"http": override} if _is_int(override) else {})
    entries = [p for p in profile.get("ports") or [] if isinstance(p, dict)]
    numbers: dict[str, int | None] = {}
    for entry in entries:
        if "from" not in entry:
            numbers[entry["name"]] = given.get(entry["name"], entry.get("port"))
    for _round in entries:  # derived ports follow the ports they come from, in any order
        for entry in entries:
            if "from" in entry and entry["name"] not in numbers and entry["from"] in numbers:
                base = numbers[entry["from"]]
                numbers[entry["name"]] = given.get(entry["name"], None if base is None else base + int(entry["offset"]))
    return [(e["name"], numbers.get(e["name"])) for e in entries]


def port_override_problems(overrides: t.Any, profiles: dict[str, t.Any], applied: t.Sequence[str]) -> list[str]:
    """What is wrong with clean_slate_server_ports: a profile not applied, a port its table does not name, a number
    outside 1-65535."""
    out: list[str] = []
    if not isinstance(overrides, dict):
        return [f"clean_slate_server_ports must map profile names to a port or to {{port name: port}}, got {json.dumps(overrides, default=str)}."]
    for name, value in overrides.items():
        where = f"clean_slate_server_ports.{name}"
        if name not in applied:
            out.append(f"{where}: {name!r} is not a profile this host applies (clean_slate_profiles: {', '.join(applied) or 'none'}).")
            continue
        table = {p.get("name") for p in (profiles[name] or {}).get("ports") or [] if isinstance(p, dict)}
        given = value if isinstance(value, dict) else {"http": value}
        for port_name, number in given.items():
            if port_name not in table:
                out.append(f"{where}: the profile has no port named {port_name!r} (its ports: {', '.join(sorted(map(str, table))) or 'none'}).")
            elif not (_is_int(number) and 1 <= number <= 65535):
                out.append(f"{where}.{port_name}: {json.dumps(number, default=str)} is not a TCP port (1-65535).")
    # A derived port pushed past 65535 is left out (SGLang then derives below the port instead, which a table does not say).
    return out


def names_of(value: t.Any) -> list[str]:
    """clean_slate_profiles as a list of names: a list, or text (a survey answer: ``sglang,vllm``, ``[sglang, vllm]``)."""
    if isinstance(value, list):
        return [str(v) for v in value]
    if isinstance(value, str):
        text = value.strip()
        if text.startswith("["):
            try:
                parsed = yaml.safe_load(text)
            except yaml.YAMLError:
                parsed = None
            if isinstance(parsed, list):
                return [str(v) for v in parsed]
        return [p.strip() for p in text.split(",") if p.strip()]
    return []


def refusals(given: t.Mapping[str, t.Any], role_path: str) -> list[str]:
    """The role's refusals of its profile variables (clean_slate_profiles, clean_slate_profile_definitions,
    clean_slate_server_ports), one sentence each; the argument spec has checked their types."""
    definitions = given.get("clean_slate_profile_definitions") or {}
    names = names_of(given.get("clean_slate_profiles", ["sglang", "vllm"]))
    roots = documented(given.get("clean_slate_residue_roots"))
    out: list[str] = []
    if isinstance(definitions, dict):
        for name, profile in definitions.items():
            out.extend(problems(str(name), profile, roots, "clean_slate_profile_definitions"))
    profiles = catalog(role_path, definitions)
    unknown = [str(n) for n in names if str(n) not in profiles]
    if unknown:
        out.append(
            f"clean_slate_profiles names {', '.join(map(repr, unknown))}, which no profile is (known: {', '.join(sorted(profiles)) or 'none'}):"
            " define it in clean_slate_profile_definitions or remove it."
        )
    applied = [str(n) for n in names if str(n) in profiles]
    if given.get("clean_slate_server_ports"):
        out.extend(port_override_problems(given["clean_slate_server_ports"], profiles, applied))
    return out


# ---------------------------------------------------------------------- resolution
def _valid(name: str, profile: t.Any, roots: t.Sequence[str]) -> bool:
    return isinstance(profile, dict) and not problems(name, profile, roots, "profile")


def _within(globs: t.Iterable[str], roots: list[tuple[str, ...]], kind: str) -> list[str]:
    """The globs that lie under the roots (the role's own profiles name /root and /home: with narrower roots those are
    left out, as the roots say, rather than refused)."""
    out = []
    for glob in globs:
        try:
            walk.check_roots([walk.parse_glob(kind, glob)], roots)
        except CleanSlateError:
            continue
        out.append(glob)
    return out


def resolve(names: t.Any, role_path: str, definitions: t.Any = None, ports: t.Any = None, roots: t.Any = None) -> dict[str, t.Any]:
    """The options the profiles ``names`` (in order) add to the kill and residue phases. A profile :func:`problems`
    refuses, or one that does not exist, adds nothing (the role refuses the host for it before anything runs)."""
    names = names_of(names)
    root_list = documented(roots)
    parsed_roots = _roots(roots if isinstance(roots, list) else walk.DEFAULT_ROOTS)
    profiles = catalog(role_path, definitions)
    overrides = ports if isinstance(ports, dict) else {}
    out: dict[str, t.Any] = {
        "patterns": [],
        "servers": [],
        **{kind: [] for kind in RESIDUE_LISTS},
        "dirs_holding": [],
        "keep_while": [],
        "ports": [],
    }

    def add(key: str, values: t.Iterable[t.Any]) -> None:
        for v in values:
            if v not in out[key]:
                out[key].append(v)

    for raw in names:
        name = str(raw)
        profile = profiles.get(name)
        if not _valid(name, profile, root_list) or not isinstance(profile, dict):
            continue
        procs = profile.get("processes") or {}
        roots_rx, members = list(procs.get("roots") or []), list(procs.get("members") or [])
        add("patterns", roots_rx + members)
        if roots_rx:
            stop = profile.get("stop") or {}
            out["servers"].append({"name": name, "roots": roots_rx, **({"grace": float(stop["grace"])} if "grace" in stop else {})})
        residue = profile.get("residue") or {}
        for kind in RESIDUE_LISTS:
            add(kind, _within(residue.get(kind) or [], parsed_roots, kind))
        for entry in residue.get("dirs_holding") or []:
            if _within([entry["dir"]], parsed_roots, "dirs"):
                add("dirs_holding", [{"dir": entry["dir"], "files": entry["files"]}])
        keep = _within(residue.get("keep_while_running") or [], parsed_roots, "files")
        if keep and roots_rx + members:
            out["keep_while"].append({"server": name, "paths": keep, "patterns": roots_rx + members})
        if not port_override_problems({name: overrides[name]} if name in overrides else {}, profiles, [name]):
            table = _port_table(name, profile, overrides.get(name))
        else:
            table = _port_table(name, profile, None)
        for port_name, number in table:
            if number is not None and 1 <= number <= 65535 and all(p["port"] != number for p in out["ports"]):
                out["ports"].append({"port": number, "server": name, "name": port_name})
    return out
