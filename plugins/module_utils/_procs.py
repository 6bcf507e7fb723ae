# Copyright (c) 2026, gpuops.clean_slate maintainers
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# Note: this module_util is PRIVATE to the collection; it may change without notice.

"""Find the processes holding NVIDIA GPUs, and decide which may be ended.

Discovery combines three sources, because each alone misses real holders
(it is not a plain union: an NVML entry must be corroborated, see below):

* NVML's process lists (compute, graphics, MPS). NVML keeps listing a dead
  parent whose forked child holds the memory, and after driver/binding skew
  can list garbage, so every NVML pid is validated (it must exist here, not be
  a zombie, keep its identity while inspected) and, when the device files are
  in use and the process's fds are readable, must hold that GPU's device file;
  otherwise it goes to ``ignored`` with the reason.
* Holders of ``/dev/nvidia<minor>`` through /proc/*/fd and /proc/*/maps: finds
  forked children NVML never lists.
* Name patterns over cmdline, comm and exe: finds renamed workers
  (``sglang::scheduler_TP0``) and the processes around them.

Discovery runs in named phases over one census of the host
(:func:`take_census`: every process, what is guarded, NVML's listing, the
device files' holders): :func:`from_nvml`, :func:`from_device_files`,
:func:`from_patterns`, :func:`widen` (children, process groups), then
:func:`protect_and_filter`.

Protection is applied after discovery (:func:`protect_and_filter`), so no
option can select a protected process; the rules, and why each exists, are
:mod:`._protection`'s.

``users`` means, in a container scope, the container's users
(:func:`resolve_users`).
"""

from __future__ import annotations

import os
import re
import typing as t
from dataclasses import dataclass, field

from ansible_collections.gpuops.clean_slate.plugins.module_utils import _proctable, _protection, _reasons, _scope, _trees
from ansible_collections.gpuops.clean_slate.plugins.module_utils._errors import CleanSlateError

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


@dataclass
class ProcFacts:
    """What discovery needs to know of one process."""

    pid: int
    comm: str
    cmdline: str
    exe: str | None
    uid: int | None
    ppid: int
    pgid: int
    starttime: int
    state: str
    kernel: bool
    sid: int = 0
    threads: int = 1
    argv: list[str] = field(default_factory=list)


@dataclass
class Candidate:
    """A process selected for ending, with the reasons it was selected."""

    facts: ProcFacts
    gpus: set[int] = field(default_factory=set)
    used_mib: int | None = None
    nvml_listed: bool = False
    reasons: list[str] = field(default_factory=list)
    user: str | None = None
    container: int | None = None
    pidns: int | None = None
    nspid: list[int] = field(default_factory=list)
    holding: _proctable.Holding | None = None
    identity: tuple[t.Any, ...] | None = None

    @property
    def pid(self) -> int:
        return self.facts.pid

    @property
    def holds_gpu_memory(self) -> bool:
        """Listed by NVML on a GPU, or mapping a GPU's device file (as CUDA contexts do)."""
        return bool(self.gpus) and (self.nvml_listed or bool(self.holding is not None and self.holding.gpu_maps))

    def record(self) -> dict[str, t.Any]:
        """The record users see (and filter with ``where``)."""
        return {
            "pid": self.pid,
            "name": self.facts.comm,
            "cmdline": self.facts.cmdline,
            "user": self.user,
            "gpus": sorted(self.gpus),
            "used_mib": self.used_mib,
            "container": self.container,
            "reasons": list(self.reasons),
        }


@dataclass
class Request:
    """The discovery request, already validated."""

    gpus: list[t.Any]  # _nvml.Gpu of the selected GPUs
    all_gpus: bool
    nvml_processes: dict[int, list[t.Any]]  # GPU index -> [_nvml.GpuProcess], every GPU
    every_gpu: list[t.Any] = field(default_factory=list)  # _nvml.Gpu of every GPU
    use_nvml: bool = True
    use_device_files: bool = True
    patterns: list[re.Pattern[str]] = field(default_factory=list)
    users: dict[int | None, set[int]] | None = None  # uids per container scope (None: the host), from users_by_scope
    include_children: bool = False
    process_group: bool = False
    trees: bool = False  # the sessions and process groups of the targets (_trees)
    scopes: list[_scope.Scope] = field(default_factory=list)
    device_dir: str = "/dev"
    protect: list[str] = field(default_factory=list)
    kill_management_clients: bool = False
    where: t.Any = None  # compiled JMESPath expression


@dataclass
class Plan:
    """Outcome of discovery: what to end, what is protected and why, what was ignored."""

    targets: list[Candidate] = field(default_factory=list)
    protected: list[dict[str, t.Any]] = field(default_factory=list)
    ignored: list[dict[str, t.Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    unreadable: int = 0  # processes whose file descriptors could not be read (permission)


def compile_patterns(patterns: t.Sequence[str], option: str = "patterns") -> list[re.Pattern[str]]:
    """Compile regexes, naming the option and the bad pattern on error."""
    compiled = []
    for pattern in patterns:
        if pattern == "":
            # re.search("") matches every process: an empty item (a stray comma in a survey, an unset
            # variable) must not turn into "end everything".
            raise CleanSlateError(
                f"{option}: an empty pattern matches every process; remove it, or write '.*' if every process is really meant.",
                reason=_reasons.BAD_ARGUMENTS,
                option=option,
            )
        try:
            compiled.append(re.compile(pattern))
        except re.error as exc:
            raise CleanSlateError(
                f"{option}: {pattern!r} is not a valid regular expression ({exc}); fix or quote it.", reason=_reasons.BAD_ARGUMENTS, option=option
            ) from None
    return compiled


def resolve_users(users: t.Sequence[t.Any], scope: _scope.Scope | None = None, owners: t.Callable[[], t.AbstractSet[int]] | None = None) -> set[int] | None:
    """The uids, as this host sees them, of the users ``users`` names (names or uids) in one scope; None when no filter.

    ``users`` means what a user of that scope means by it. On the host (``scope`` None) a name comes from the
    host's user database and a uid must be one the host knows: in its passwd, in a subordinate id range
    (/etc/subuid: an unprivileged LXC container's root is uid 100000 on its Proxmox host, with no passwd entry) or
    running a live process. In a container a name comes from the container's own /etc/passwd (read through
    ``/proc/<init>/root``, never following a symbolic link) and a uid must be in that passwd or run a live process;
    each is then mapped to the host's uid through the init's uid_map (an unprivileged container's ``root`` is the
    host's 100000, its uid 1000 the host's 101000). ``owners`` gives the host uids owning what the caller looks
    at (the residue's candidates: a dead job's files outlive its processes); a uid among them is known too.

    Anything else is refused with ``bad_arguments``: a typo would select nothing, and the run would look clean.
    """
    if not users:
        return None
    if scope is None:
        return {_host_uid(str(user), owners) for user in users}
    names = _container_passwd(scope.init_pid)
    mapping = _uid_map(scope.init_pid)
    out = set()
    for user in users:
        text = str(user)
        if text.isdigit():
            uid = int(text)
        elif text in names:
            uid = names[text]
        else:
            raise CleanSlateError(f"users: no user named {text!r} in container {scope.vmid}.", reason=_reasons.BAD_ARGUMENTS, option="users")
        host_uid = _map_uid(uid, mapping)
        if host_uid is None:
            raise CleanSlateError(
                f"users: uid {uid} of container {scope.vmid} has no uid on this host (outside the container's uid_map).",
                reason=_reasons.BAD_ARGUMENTS,
                option="users",
            )
        if text.isdigit() and uid not in names.values() and not _uid_running(host_uid) and not (owners is not None and host_uid in owners()):
            raise CleanSlateError(
                f"users: no user with uid {text} in container {scope.vmid} (not in its passwd, no process runs as it{_AND_OWNS if owners else ''}).",
                reason=_reasons.BAD_ARGUMENTS,
                option="users",
            )
        out.add(host_uid)
    return out


def users_by_scope(users: t.Sequence[t.Any], scopes: t.Sequence[_scope.Scope]) -> dict[int | None, set[int]] | None:
    """:func:`resolve_users` for each container scope (by vmid), or for the host (key None) without one."""
    if not users:
        return None
    if not scopes:
        return {None: t.cast(t.Set[int], resolve_users(users))}
    return {scope.vmid: t.cast(t.Set[int], resolve_users(users, scope)) for scope in scopes}


_AND_OWNS = ", and it owns nothing this module looks at"


def _host_uid(text: str, owners: t.Callable[[], t.AbstractSet[int]] | None) -> int:
    import pwd

    if not text.isdigit():
        try:
            return pwd.getpwnam(text).pw_uid
        except KeyError:
            raise CleanSlateError(f"users: no user named {text!r} on this host.", reason=_reasons.BAD_ARGUMENTS, option="users") from None
    uid = int(text)
    try:
        pwd.getpwuid(uid)
        return uid
    except (KeyError, OverflowError):
        pass
    if _in_subuid(uid) or _uid_running(uid) or (owners is not None and uid in owners()):
        return uid
    raise CleanSlateError(
        f"users: no user with uid {text} on this host (not in passwd, not in /etc/subuid, no process runs as it{_AND_OWNS if owners else ''}).",
        reason=_reasons.BAD_ARGUMENTS,
        option="users",
    )


def _in_subuid(uid: int) -> bool:
    try:
        with open("/etc/subuid", encoding="utf-8") as fh:
            for line in fh:
                parts = line.strip().split(":")
                if len(parts) == 3 and parts[1].isdigit() and parts[2].isdigit() and int(parts[1]) <= uid < int(parts[1]) + int(parts[2]):
                    return True
    except OSError:
        pass
    return False


def _uid_running(uid: int) -> bool:
    """Whether a live process runs under ``uid`` (as this host sees it)."""
    for pid in _proctable.pids():
        try:
            if os.stat(f"/proc/{pid}").st_uid == uid:
                return True
        except OSError:
            continue
    return False


def _container_passwd(init_pid: int) -> dict[str, int]:
    """User names of a container: its /etc/passwd read through its init's root, never following a symlink."""
    users: dict[str, int] = {}
    try:
        root = os.open(f"/proc/{init_pid}/root", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return users
    try:
        etc = os.open("etc", _DIR_FLAGS, dir_fd=root)
    except OSError:
        os.close(root)
        return users
    try:
        fd = os.open("passwd", os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=etc)
        with os.fdopen(fd, encoding="utf-8", errors="replace") as fh:
            for line in fh:
                fields = line.split(":")
                if len(fields) >= 3 and fields[2].isdigit():
                    users.setdefault(fields[0], int(fields[2]))
    except OSError:
        pass
    finally:
        os.close(etc)
        os.close(root)
    return users


def _uid_map(pid: int) -> list[tuple[int, int, int]]:
    try:
        with open(f"/proc/{pid}/uid_map", encoding="ascii") as fh:
            return [(int(a), int(b), int(c)) for a, b, c in (line.split() for line in fh if line.strip())]
    except (OSError, ValueError):
        return []


def _map_uid(uid: int, mapping: list[tuple[int, int, int]]) -> int | None:
    """A container's uid as the host sees it (no map: the same uid); None when the map has no place for it."""
    if not mapping:
        return uid
    for inside, outside, count in mapping:
        if inside <= uid < inside + count:
            return outside + (uid - inside)
    return None


def read_facts(pid: int) -> ProcFacts | None:
    """Cheap facts from /proc; None if the process is gone."""
    st = _proctable.read_stat(pid)
    if st is None:
        return None
    command = _proctable.read_command(pid, st["state"])
    if command is None:
        return None
    raw, exe, uid = command
    words = raw.rstrip(b"\0")
    cmdline = words.replace(b"\0", b" ").decode("utf-8", "backslashreplace")
    return ProcFacts(
        argv=[w.decode("utf-8", "backslashreplace") for w in words.split(b"\0")] if words else [],
        pid=pid,
        comm=st["comm"],
        cmdline=cmdline,
        exe=exe,
        uid=uid,
        ppid=st["ppid"],
        pgid=st["pgid"],
        sid=st["sid"],
        starttime=st["starttime"],
        state=st["state"],
        threads=st.get("threads", 1),
        kernel=bool(st["flags"] & _proctable.PF_KTHREAD),
    )


def matches_patterns(facts: ProcFacts, patterns: t.Sequence[re.Pattern[str]]) -> str | None:
    """The first pattern matching cmdline, comm or exe."""
    for pattern in patterns:
        for value in (facts.cmdline, facts.comm, facts.exe or ""):
            if value and pattern.search(value):
                return pattern.pattern
    return None


def _validated_nvml_pid(pid: int, maxpid: int, facts: dict[int, ProcFacts]) -> str | None:
    """Why an NVML pid cannot be trusted, or None when it can."""
    if pid <= 0 or pid > maxpid:
        return f"NVML reported pid {pid}, outside 1..{maxpid} (driver/binding struct mismatch)"
    first = facts.get(pid)
    if first is None:
        return "listed by NVML but does not exist here (a dead parent whose forked child holds the memory, or a process in another PID namespace)"
    again = _proctable.read_stat(pid)
    if again is None or again["starttime"] != first.starttime:
        return "exited or was replaced while being inspected"
    if _proctable.exited(first.state, first.threads):
        return "a zombie: it holds no GPU memory"
    return None


@dataclass
class Census:
    """What one discovery read of the host, shared by its phases, and the candidates they gather."""

    req: Request
    facts: dict[int, ProcFacts]  # every process, by pid
    guarded: dict[int, str]  # pids never to signal whatever else is said of them, with why
    minor_to_index: dict[int, int]  # device minor -> GPU index, every GPU
    selected: set[int]  # device minors of the selected GPUs
    nvml_minors: dict[int, set[int]]  # pid -> minors of the GPUs NVML lists it on (every GPU): its word wins
    holders: dict[int, _proctable.Holding]  # holders of the GPU device files
    unreadable: set[int]  # processes whose file descriptors could not be read
    cands: dict[int, Candidate] = field(default_factory=dict)

    def cand(self, pid: int) -> Candidate:
        """The candidate record of ``pid``, made on first use."""
        if pid not in self.cands:
            self.cands[pid] = Candidate(facts=self.facts[pid])
        return self.cands[pid]


def discover(req: Request) -> Plan:
    """Build the plan: candidates from every source, then protection, scope, users and ``where``."""
    plan = Plan()
    census = take_census(req, plan)
    from_nvml(census, plan)
    from_device_files(census)
    from_patterns(census)
    plan.ignored.extend(widen(census))
    protect_and_filter(census, plan)
    return plan


def take_census(req: Request, plan: Plan) -> Census:
    """Read every process, what must never be signalled, where NVML lists each pid, and the device files' holders."""
    minor_to_index = {g.minor: g.index for g in (req.every_gpu or req.gpus) if g.minor is not None}
    holders: dict[int, _proctable.Holding] = {}
    unreadable: set[int] = set()
    if req.use_device_files:
        holders, unreadable_list = _proctable.scan_device_holders(req.device_dir)
        unreadable = set(unreadable_list)
        plan.unreadable = len(unreadable)
        if unreadable:
            plan.notes.append(f"{len(unreadable)} process(es) could not be inspected for device files (permission); run with become: true.")
    # The facts after the holders: a process that execs between the two reads (a launcher's fork becoming a worker,
    # or anything becoming a protected daemon) is then judged and named by what it runs now, not by what it ran before
    # its exec (a CI run once reported a new worker under its launcher's name and command line).
    facts = {pid: f for pid in _proctable.pids() if (f := read_facts(pid)) is not None}
    return Census(
        req=req,
        facts=facts,
        guarded=_protection.guards(facts),
        minor_to_index=minor_to_index,
        selected={g.minor for g in req.gpus if g.minor is not None},
        nvml_minors=nvml_listing(req, minor_to_index) if req.use_nvml else {},
        holders=holders,
        unreadable=unreadable,
    )


def nvml_listing(req: Request, minor_to_index: dict[int, int]) -> dict[int, set[int]]:
    """Where NVML lists each process, over every GPU, by device minor."""
    index_to_minor = {i: m for m, i in minor_to_index.items()}
    out: dict[int, set[int]] = {}
    for index, procs in req.nvml_processes.items():
        for proc in procs:
            if index in index_to_minor:
                out.setdefault(proc.pid, set()).add(index_to_minor[index])
    return out


def from_nvml(census: Census, plan: Plan) -> None:
    """NVML's entries on the selected GPUs, each pid validated and corroborated by the device files."""
    req = census.req
    if not req.use_nvml:
        return
    maxpid = _proctable.pid_max()
    for gpu in req.gpus:
        for proc in req.nvml_processes.get(gpu.index, []):
            why = _validated_nvml_pid(proc.pid, maxpid, census.facts)
            holding = census.holders.get(proc.pid)
            # A CUDA process always holds its GPU's device file; an NVML pid that does not is not trusted.
            corroborated = holding is not None and (gpu.minor is None or gpu.minor in holding.minors)
            if why is None and req.use_device_files and proc.pid not in census.unreadable and not corroborated:
                why = f"listed by NVML but does not hold nvidia{gpu.minor} here (a stale entry, or a pid from another PID namespace)"
            if why:
                plan.ignored.append({"pid": proc.pid, "gpu": gpu.index, "why": why})
                continue
            c = census.cand(proc.pid)
            c.nvml_listed = True
            c.gpus.add(gpu.index)
            if proc.used_mib is not None:
                c.used_mib = (c.used_mib or 0) + proc.used_mib
            c.reasons.append(f"listed by NVML on GPU {gpu.index}" + (f" ({proc.used_mib} MiB)" if proc.used_mib is not None else ""))


def stale_owners(census: Census) -> dict[int, set[int]]:
    """Pids NVML lists that are not a live process here, per device minor (every GPU).

    Memory that no visible process owns: the mark of a forked child holding a dead parent's context.
    """
    index_to_minor = {i: m for m, i in census.minor_to_index.items()}
    stale: dict[int, set[int]] = {}
    for index, procs in census.req.nvml_processes.items():
        for proc in procs:
            f = census.facts.get(proc.pid)
            if index in index_to_minor and (f is None or _proctable.exited(f.state, f.threads)):
                stale.setdefault(index_to_minor[index], set()).add(proc.pid)
    return stale


def from_device_files(census: Census) -> None:
    """Holders of the selected GPUs' device files, each tied to the GPUs it really uses."""
    req, facts = census.req, census.facts
    stale_pids = stale_owners(census)
    stale_minors = set(stale_pids) & census.selected

    def linked(f: ProcFacts) -> set[int]:
        """GPUs whose dead NVML-listed owner led this process's group or session: its parent's job."""
        return {m for m, dead in stale_pids.items() if f.pgid in dead or f.sid in dead}

    # A GPU with a holder linked to its dead owner is that holder's; other unlisted holders are not tied to it.
    claimed = {m for pid in census.holders if pid in facts and not census.nvml_minors.get(pid) for m in linked(facts[pid])}
    for pid, holding in census.holders.items():
        if pid not in facts:
            continue
        listed = census.nvml_minors.get(pid)
        mine = _proctable.attribute(holding, listed) & holding.minors & census.selected
        if not listed and not req.all_gpus:
            # The CUDA driver maps every GPU's device file, so a process NVML does not list is tied to a
            # selected GPU only where NVML shows memory that no visible process owns: through its dead
            # parent when that parent led its process group or session (another tenant's forked child,
            # in a container on the same node, maps this GPU's file too), else by elimination.
            ties = linked(facts[pid])
            mine &= ties if ties else stale_minors - claimed
        if mine:
            c = census.cand(pid)
            c.holding = holding
            c.gpus.update(census.minor_to_index[m] for m in mine)
            c.reasons.extend(holding.describe(mine))
        elif not holding.minors and req.all_gpus:
            # Only nvidiactl / nvidia-uvm: cannot be tied to one GPU, so counts only when all are selected.
            c = census.cand(pid)
            c.holding = holding
            c.reasons.extend(holding.describe())


def from_patterns(census: Census) -> None:
    """Processes whose command line, name or executable match a pattern (with a GPU subset, only candidates already found)."""
    req = census.req
    if not req.patterns:
        return
    for pid, f in census.facts.items():
        if f.kernel:
            continue
        pattern = matches_patterns(f, req.patterns)
        if pattern is None:
            continue
        if not req.all_gpus and pid not in census.cands:
            continue
        census.cand(pid).reasons.append(f"matches pattern {pattern!r}")


def widen(census: Census) -> list[dict[str, t.Any]]:
    """Add the descendants (``include_children``), the process group members (``process_group``) and the server
    trees (``trees``: sessions and groups, :mod:`._trees`) of the candidates; returns the members left out, with why."""
    req, facts, guarded, cands = census.req, census.facts, census.guarded, census.cands
    if not (req.include_children or req.process_group or req.trees):
        return []
    children: dict[int, list[int]] = {}
    groups: dict[int, list[int]] = {}
    for pid, f in facts.items():
        children.setdefault(f.ppid, []).append(pid)
        groups.setdefault(f.pgid, []).append(pid)
    # Only a process that may itself be ended lends its tree or group: a match on this module's
    # ancestors (Ansible's own command line, sshd), on an init or on a protected daemon must not
    # pull in their other children (Ansible's other workers, other SSH sessions).
    roots = [pid for pid in cands if pid not in guarded and pid > 1 and not facts[pid].kernel and not _protection.protected_name(facts[pid], req.protect)]
    if req.include_children:
        stack = [(pid, pid) for pid in roots]
        while stack:
            parent, root = stack.pop()
            for child in children.get(parent, []):
                if child not in cands and child not in guarded:
                    census.cand(child).reasons.append(f"descendant of PID {root}")
                    stack.append((child, root))
    if req.process_group:
        for pid in roots:
            pgid = facts[pid].pgid
            members = groups.get(pgid, [])
            # Never widen into a group that holds this module or its ancestors.
            if any(m in guarded for m in members):
                continue
            for member in members:
                if member not in cands:
                    census.cand(member).reasons.append(f"in process group {pgid} of PID {pid}")
    left_out: list[dict[str, t.Any]] = []
    if req.trees:
        # A management client (device files open, none mapped) that protection will spare lends nothing either.
        lenders = [
            pid
            for pid in roots
            if not (not req.kill_management_clients and not cands[pid].nvml_listed and pid in census.holders and not census.holders[pid].has_mmaps)
        ]
        added, left_out = _trees.members(facts, lenders, guarded, lambda pid: foreign_gpu(census, pid))
        for pid, why in added.items():
            if pid not in cands:
                census.cand(pid).reasons.append(why)
    return left_out


def foreign_gpu(census: Census, pid: int) -> str | None:
    """A GPU ``pid`` holds (a device file it maps or has open, or NVML's listing) outside the selected ones, or None."""
    if census.req.all_gpus:
        return None
    holding = census.holders.get(pid)
    minors = (holding.minors if holding is not None else set()) | census.nvml_minors.get(pid, set())
    other = sorted(census.minor_to_index.get(m, m) for m in minors - census.selected)
    return f"GPU {other[0]}" if other else None


def protect_and_filter(census: Census, plan: Plan) -> None:
    """Apply protection, scope, users and ``where`` to the candidates, in that order: what is left are the targets."""
    req = census.req
    survivors: list[Candidate] = []
    denied = 0
    for pid in sorted(census.cands):
        c = census.cands[pid]
        f = c.facts
        c.nspid = _proctable.nspids(pid)
        c.pidns = _proctable.pidns_inode(pid)
        c.container = _proctable.container_of(pid)
        if _proctable.exited(f.state, f.threads) and not (pid <= 1 or (c.nspid and c.nspid[-1] == 1)):
            # It has exited already (a zombie holds no memory and no file); only its parent's wait is missing.
            # Judged first: its executable can no longer be read, so it would pass for a daemon by its name.
            plan.ignored.append({"pid": pid, "why": "a zombie: it has exited already and holds nothing; its parent has not reaped it yet"})
            continue
        why = _protection.protection_reason(
            pid,
            f,
            c.nspid,
            census.guarded,
            req.protect,
            scopes=req.scopes,
            pidns=c.pidns,
            container=c.container,
            nvml_listed=c.nvml_listed,
            holding=census.holders.get(pid),
            kill_management_clients=req.kill_management_clients,
        )
        if why:
            record = {"pid": pid, "name": f.comm, "cmdline": f.cmdline, "why": why, "container": c.container}
            if c.holds_gpu_memory:
                # Protection wins, so this GPU cannot come clean: say so where the operator looks.
                record.update(gpus=sorted(c.gpus), used_mib=c.used_mib, holds_gpu_memory=True)
            plan.protected.append(record)
            continue
        if req.users is not None and f.uid not in req.users.get(_scope_vmid(req, c), ()):
            plan.ignored.append({"pid": pid, "why": f"owned by uid {f.uid}, not one of users"})
            continue
        if not _proctable.may_signal(pid):
            # Refused before anything is sent: the kernel would answer EPERM.
            plan.ignored.append({"pid": pid, "why": f"owned by uid {f.uid}: this module runs as uid {os.geteuid()} and may not signal it"})
            denied += 1
            continue
        c.user = _username(f.uid)
        c.identity = _proctable.identity(pid)
        if c.identity is None or c.identity[0] != f.starttime:
            plan.ignored.append({"pid": pid, "why": "exited while being inspected"})
            continue
        survivors.append(c)
    if denied:
        plan.notes.append(f"{denied} process(es) holding the selected GPUs belong to other users and were left alone; run with become: true to end them.")
    plan.targets = apply_where(req, plan, survivors)


def _scope_vmid(req: Request, c: Candidate) -> int | None:
    """The vmid of the container scope a candidate is in (None without a scope): the key of its ``users``."""
    if not req.scopes:
        return None
    scope = _scope.member_of(req.scopes, c.pidns, c.container)
    return scope.vmid if scope is not None else None


def apply_where(req: Request, plan: Plan, survivors: list[Candidate]) -> list[Candidate]:
    """The candidates the ``where`` expression keeps (all when there is none); the others go to ``ignored``."""
    if req.where is None or not survivors:
        return survivors
    records = [c.record() for c in survivors]
    try:
        selected = req.where.search(records)
    except (ValueError, TypeError) as exc:  # jmespath's errors derive from ValueError
        raise CleanSlateError(f"where: the expression failed on the candidate records: {exc}", reason=_reasons.BAD_ARGUMENTS, option="where") from None
    if not isinstance(selected, list) or not all(isinstance(x, dict) and "pid" in x for x in selected):
        raise CleanSlateError(
            "where: the expression must return a list of candidate records (filter the list, for example [?used_mib > `1024`]).",
            reason=_reasons.BAD_ARGUMENTS,
            option="where",
        )
    keep = {x["pid"] for x in selected}
    for c in survivors:
        if c.pid not in keep:
            plan.ignored.append({"pid": c.pid, "why": "filtered out by where"})
    return [c for c in survivors if c.pid in keep]


def _username(uid: int | None) -> str | None:
    if uid is None:
        return None
    try:
        import pwd

        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)
