# Copyright (c) 2026, gpuops.clean_slate maintainers
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# Note: this module_util is PRIVATE to the collection; it may change without notice.

"""Find the processes holding NVIDIA GPUs, and decide which may be ended.

Discovery is a union, because each source alone misses real holders:

* NVML's process lists (compute, graphics, MPS). NVML keeps listing a dead
  parent whose forked child holds the memory, and after driver/binding skew
  can list garbage, so every NVML pid is validated and must be corroborated by
  the device-file scan before it is trusted.
* Holders of ``/dev/nvidia<minor>`` through /proc/*/fd and /proc/*/maps: finds
  forked children NVML never lists.
* Name patterns over cmdline, comm and exe: finds renamed workers
  (``sglang::scheduler_TP0``) and the processes around them.

Protection is applied after discovery and cannot be switched off for the
core cases: PID 1 of any namespace, kernel threads, this module and all its
ancestors, processes outside the container scope.
"""

from __future__ import annotations

import fnmatch
import os
import re
import typing as t
from dataclasses import dataclass, field

from ansible_collections.gpuops.clean_slate.plugins.module_utils import _proctable, _scope
from ansible_collections.gpuops.clean_slate.plugins.module_utils._errors import CleanSlateError

# Protected unless the user removes a name explicitly with `unprotect`.
DEFAULT_PROTECT = (
    # NVIDIA management daemons: SIGKILLing them can wedge the GPU until reboot (dcgm-exporter#84).
    "nvidia-persistenced",
    "nv-hostengine",
    "dcgm-exporter",
    "nvidia-dcgm",
    "nvidia-fabricmanager",
    "nv-fabricmanager",
    "nvidia-imex",
    "nvidia-device-plugin",
    "gpu-feature-discovery",
    # Display servers hold the GPU on purpose.
    "Xorg",
    "X",
    "Xwayland",
    "gnome-shell",
    "kwin_wayland",
    "kwin_x11",
    "gdm*",
    "sddm",
    "lightdm",
    # The system itself, so that no pattern can take the host or its Proxmox services down.
    "init",
    "systemd",
    "systemd-*",
    "sshd",
    "sshd-session",
    "sshd-auth",
    "dbus-daemon",
    "dbus-broker",
    "cron",
    "agetty",
    "containerd",
    "dockerd",
    "lxc-start",
    "lxcfs",
    "pmxcfs",
    "pvedaemon*",
    "pveproxy*",
    "pvestatd",
    "pvescheduler",
    "pve-firewall",
    "pve-ha-*",
    "qmeventd",
    "corosync",
    "kvm",
    "qemu-system-*",
)


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
    users: set[int] | None = None
    include_children: bool = False
    process_group: bool = False
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


def compile_patterns(patterns: t.Sequence[str], option: str = "patterns") -> list[re.Pattern[str]]:
    """Compile regexes, naming the option and the bad pattern on error."""
    compiled = []
    for pattern in patterns:
        try:
            compiled.append(re.compile(pattern))
        except re.error as exc:
            raise CleanSlateError(f"{option}: {pattern!r} is not a valid regular expression ({exc}); fix or quote it.", reason="bad_arguments") from None
    return compiled


def resolve_users(users: t.Sequence[t.Any]) -> set[int] | None:
    """User names or uids to uids (None when no filter)."""
    if not users:
        return None
    import pwd

    uids = set()
    for user in users:
        text = str(user)
        if text.isdigit():
            uids.add(int(text))
            continue
        try:
            uids.add(pwd.getpwnam(text).pw_uid)
        except KeyError:
            raise CleanSlateError(f"users: no user named {text!r} on this host.", reason="bad_arguments") from None
    return uids


def read_facts(pid: int) -> ProcFacts | None:
    """Cheap facts from /proc; None if the process is gone."""
    st = _proctable.read_stat(pid)
    command = _proctable.read_command(pid)
    if st is None or command is None:
        return None
    raw, exe, uid = command
    cmdline = raw.rstrip(b"\0").replace(b"\0", b" ").decode("utf-8", "replace")
    return ProcFacts(
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
        kernel=bool(st["flags"] & _proctable.PF_KTHREAD),
    )


def _names(facts: ProcFacts) -> list[str]:
    names = [facts.comm]
    if facts.exe:
        names.append(os.path.basename(facts.exe.replace(" (deleted)", "")))
    if facts.cmdline:
        names.append(os.path.basename(facts.cmdline.split(" ", 1)[0]))
    return names


def protected_name(facts: ProcFacts, protect: t.Sequence[str]) -> str | None:
    """The protect-list entry this process matches, if any.

    comm is truncated to 15 characters by the kernel, so a 15-character comm
    also matches a longer name it is the prefix of.
    """
    names = _names(facts)
    for entry in protect:
        for name in names:
            if fnmatch.fnmatchcase(name, entry):
                return entry
        if len(facts.comm) == 15 and fnmatch.fnmatchcase(facts.comm, entry[:15]):
            return entry
    return None


def matches_patterns(facts: ProcFacts, patterns: t.Sequence[re.Pattern[str]]) -> str | None:
    """The first pattern matching cmdline, comm or exe."""
    for pattern in patterns:
        for value in (facts.cmdline, facts.comm, facts.exe or ""):
            if value and pattern.search(value):
                return pattern.pattern
    return None


def protect_list(extra: t.Sequence[str], unprotect: t.Sequence[str]) -> list[str]:
    """Default protect list plus ``protect``, minus names removed explicitly with ``unprotect``."""
    removed = set(unprotect)
    unknown = removed - set(DEFAULT_PROTECT)
    if unknown:
        raise CleanSlateError(
            f"unprotect: {', '.join(sorted(unknown))} is not in the default protect list; only default entries can be removed"
            f" (defaults: {', '.join(DEFAULT_PROTECT)}).",
            reason="bad_arguments",
        )
    return [n for n in DEFAULT_PROTECT if n not in removed] + [n for n in extra if n not in DEFAULT_PROTECT]


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
    if first.state in ("Z", "X"):
        return "a zombie: it holds no GPU memory"
    return None


def discover(req: Request) -> Plan:
    """Build the plan: candidates from every source, then protection, scope, users and ``where``."""
    plan = Plan()
    self_pid = os.getpid()
    guarded = {self_pid: "this module's own process"}
    for pid in _proctable.ancestors(self_pid):
        guarded.setdefault(pid, "an ancestor of this module (its interpreter, Ansible, sshd or the become chain)")
    maxpid = _proctable.pid_max()
    facts = {pid: f for pid in _proctable.pids() if (f := read_facts(pid)) is not None}
    minor_to_index = {g.minor: g.index for g in (req.every_gpu or req.gpus) if g.minor is not None}
    selected = {g.minor for g in req.gpus if g.minor is not None}
    # Where NVML lists each process, over every GPU: its word on which GPUs a process uses wins.
    index_to_minor = {i: m for m, i in minor_to_index.items()}
    nvml_minors: dict[int, set[int]] = {}
    if req.use_nvml:
        for index, procs in req.nvml_processes.items():
            for proc in procs:
                if index in index_to_minor:
                    nvml_minors.setdefault(proc.pid, set()).add(index_to_minor[index])

    holders: dict[int, _proctable.Holding] = {}
    unreadable: set[int] = set()
    if req.use_device_files:
        holders, unreadable_list = _proctable.scan_device_holders(req.device_dir)
        unreadable = set(unreadable_list)
        if unreadable:
            plan.notes.append(f"{len(unreadable)} process(es) could not be inspected for device files (permission); run with become: true.")

    cands: dict[int, Candidate] = {}

    def cand(pid: int) -> Candidate:
        if pid not in cands:
            cands[pid] = Candidate(facts=facts[pid])
        return cands[pid]

    # NVML, each pid validated and corroborated by the device files.
    if req.use_nvml:
        for gpu in req.gpus:
            for proc in req.nvml_processes.get(gpu.index, []):
                why = _validated_nvml_pid(proc.pid, maxpid, facts)
                holding = holders.get(proc.pid)
                # A CUDA process always holds its GPU's device file; an NVML pid that does not is not trusted.
                corroborated = holding is not None and (gpu.minor is None or gpu.minor in holding.minors)
                if why is None and req.use_device_files and proc.pid not in unreadable and not corroborated:
                    why = f"listed by NVML but does not hold nvidia{gpu.minor} here (a stale entry, or a pid from another PID namespace)"
                if why:
                    plan.ignored.append({"pid": proc.pid, "gpu": gpu.index, "why": why})
                    continue
                c = cand(proc.pid)
                c.nvml_listed = True
                c.gpus.add(gpu.index)
                if proc.used_mib is not None:
                    c.used_mib = (c.used_mib or 0) + proc.used_mib
                c.reasons.append(f"listed by NVML on GPU {gpu.index}" + (f" ({proc.used_mib} MiB)" if proc.used_mib is not None else ""))

    # Device-file holders.
    # Pids NVML lists that are not a live process here, per GPU (every GPU): memory that no visible
    # process owns, the mark of a forked child holding a dead parent's context.
    stale_pids: dict[int, set[int]] = {}
    for index, procs in req.nvml_processes.items():
        for proc in procs:
            f = facts.get(proc.pid)
            if index in index_to_minor and (f is None or f.state in ("Z", "X")):
                stale_pids.setdefault(index_to_minor[index], set()).add(proc.pid)
    stale_minors = set(stale_pids) & selected

    def linked(f: ProcFacts) -> set[int]:
        """GPUs whose dead NVML-listed owner led this process's group or session: its parent's job."""
        return {m for m, dead in stale_pids.items() if f.pgid in dead or f.sid in dead}

    # A GPU with a holder linked to its dead owner is that holder's; other unlisted holders are not tied to it.
    claimed = {m for pid, holding in holders.items() if pid in facts and not nvml_minors.get(pid) for m in linked(facts[pid])}
    for pid, holding in holders.items():
        if pid not in facts:
            continue
        listed = nvml_minors.get(pid)
        mine = _proctable.attribute(holding, listed) & holding.minors & selected
        if not listed and not req.all_gpus:
            # The CUDA driver maps every GPU's device file, so a process NVML does not list is tied to a
            # selected GPU only where NVML shows memory that no visible process owns: through its dead
            # parent when that parent led its process group or session (another tenant's forked child,
            # in a container on the same node, maps this GPU's file too), else by elimination.
            ties = linked(facts[pid])
            mine &= ties if ties else stale_minors - claimed
        if mine:
            c = cand(pid)
            c.holding = holding
            c.gpus.update(minor_to_index[m] for m in mine)
            c.reasons.extend(holding.describe(mine))
        elif not holding.minors and req.all_gpus:
            # Only nvidiactl / nvidia-uvm: cannot be tied to one GPU, so counts only when all are selected.
            c = cand(pid)
            c.holding = holding
            c.reasons.extend(holding.describe())

    # Name patterns.
    if req.patterns:
        for pid, f in facts.items():
            if f.kernel:
                continue
            pattern = matches_patterns(f, req.patterns)
            if pattern is None:
                continue
            if not req.all_gpus and pid not in cands:
                continue
            cand(pid).reasons.append(f"matches pattern {pattern!r}")

    # Process tree and process group expansion.
    if req.include_children or req.process_group:
        children: dict[int, list[int]] = {}
        groups: dict[int, list[int]] = {}
        for pid, f in facts.items():
            children.setdefault(f.ppid, []).append(pid)
            groups.setdefault(f.pgid, []).append(pid)
        # Only a process that may itself be ended lends its tree or group: a match on this module's
        # ancestors (Ansible's own command line, sshd), on an init or on a protected daemon must not
        # pull in their other children (Ansible's other workers, other SSH sessions).
        roots = [pid for pid in cands if pid not in guarded and pid > 1 and not facts[pid].kernel and not protected_name(facts[pid], req.protect)]
        if req.include_children:
            stack = [(pid, pid) for pid in roots]
            while stack:
                parent, root = stack.pop()
                for child in children.get(parent, []):
                    if child not in cands and child not in guarded:
                        cand(child).reasons.append(f"descendant of PID {root}")
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
                        cand(member).reasons.append(f"in process group {pgid} of PID {pid}")

    _protect_and_filter(req, plan, cands, guarded, holders)
    return plan


def _protect_and_filter(req: Request, plan: Plan, cands: dict[int, Candidate], guarded: dict[int, str], holders: dict[int, _proctable.Holding]) -> None:
    """Apply protection, scope, users and ``where`` to the candidates, in that order."""
    survivors: list[Candidate] = []
    denied = 0
    for pid in sorted(cands):
        c = cands[pid]
        f = c.facts
        c.nspid = _proctable.nspids(pid)
        c.pidns = _proctable.pidns_inode(pid)
        c.container = _proctable.container_of(pid)
        why = None
        if pid <= 1 or (c.nspid and c.nspid[-1] == 1):
            why = "PID 1 of its namespace (an init)"
        elif f.kernel:
            why = "kernel thread"
        elif pid in guarded:
            why = guarded[pid]
        else:
            name = protected_name(f, req.protect)
            if name:
                why = f"protected daemon ({name})"
            elif req.scopes and _scope.member_of(pid, req.scopes, c.pidns, c.container) is None:
                why = "outside the container scope (" + ", ".join(str(s.vmid) for s in req.scopes) + ")"
            elif not req.kill_management_clients and not c.nvml_listed and pid in holders and not holders[pid].has_mmaps:
                why = "management client (holds device files but maps none); set kill_management_clients: true to end it"
        if why:
            plan.protected.append({"pid": pid, "name": f.comm, "cmdline": f.cmdline, "why": why, "container": c.container})
            continue
        if req.users is not None and f.uid not in req.users:
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
    if req.where is not None and survivors:
        records = [c.record() for c in survivors]
        try:
            selected = req.where.search(records)
        except (ValueError, TypeError) as exc:  # jmespath's errors derive from ValueError
            raise CleanSlateError(f"where: the expression failed on the candidate records: {exc}", reason="bad_arguments") from None
        if not isinstance(selected, list) or not all(isinstance(x, dict) and "pid" in x for x in selected):
            raise CleanSlateError(
                "where: the expression must return a list of candidate records (filter the list, for example [?used_mib > `1024`]).",
                reason="bad_arguments",
            )
        keep = {x["pid"] for x in selected}
        for c in survivors:
            if c.pid not in keep:
                plan.ignored.append({"pid": c.pid, "why": "filtered out by where"})
        survivors = [c for c in survivors if c.pid in keep]
    plan.targets = survivors


def _username(uid: int | None) -> str | None:
    if uid is None:
        return None
    try:
        import pwd

        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)
