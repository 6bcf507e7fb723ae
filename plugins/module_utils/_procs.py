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

Protection is applied after discovery and cannot be switched off for the
core cases: PID 1 of any namespace, kernel threads, this module, its
ancestors and the processes it started, every Ansible process on the host,
processes outside the container scope.

Two kinds of protection are tied to what a process *is*, not to the name it
gives itself (anyone can ``exec -a nvidia-persistenced`` or call
``prctl(PR_SET_NAME)``):

* Ansible's processes. Under ``async`` the module is detached from the
  controller, which is then no longer an ancestor; so the controller, its
  workers, ``ansible-connection``, async wrappers and other modules are
  recognised by how Ansible starts them (see :func:`ansible_process`).
* Protected daemons, by the basename of ``/proc/PID/exe`` (see
  :func:`protection`); comm and argv[0] count only when the executable cannot
  be read, which keeps such a process on the safe side.
"""

from __future__ import annotations

import fnmatch
import os
import re
import shlex
import typing as t
from dataclasses import dataclass, field

from ansible_collections.gpuops.clean_slate.plugins.module_utils import _proctable, _reasons, _scope
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

# Proxmox VE's daemons are Perl programs that name themselves through $0 ("pvedaemon worker"): their
# executable is perl, so for them (only) the name counts, and only when the executable is perl.
PERL_DAEMONS = frozenset({"pvedaemon*", "pveproxy*", "pvestatd", "pvescheduler", "pve-firewall", "pve-ha-*"})
_PERL = re.compile(r"^perl[0-9.]*$")
# Executables that run a script named on their command line: the script says what the process is.
_INTERPRETER = re.compile(r"^(?:python|pypy|perl|ruby|node|nodejs|bash|sh|dash|ksh|zsh|lua|php)[0-9.]*$")
_PYTHON = re.compile(r"^(?:python|pypy|platform-python)[0-9.]*$")
_SHELL = re.compile(r"^(?:sh|bash|dash|ksh|zsh)$")
# ansible, ansible-playbook, ansible-connection, ansible-runner, ... (and python -m ansible / ansible_runner).
_ANSIBLE_PROGRAM = re.compile(r"^ansible(?:[-_][a-z][a-z_-]*)?$")
# Words only Ansible puts on a command line: its module payloads (also under async_wrapper), its
# remote and local temporary directories, the marker of its become wrapper, and the default control
# path of its SSH connections (the clients and their ControlPersist master, "ssh: ~/.ansible/cp/... [mux]").
_ANSIBLE_MARKS = ("AnsiballZ_", "/ansible-tmp-", "/ansible-local-", "BECOME-SUCCESS-", "/.ansible/cp/")
_OPTIONS_WITH_VALUE = frozenset({"-W", "-X", "-o", "+o"})


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


def resolve_users(users: t.Sequence[t.Any]) -> set[int] | None:
    """User names or uids to uids (None when no filter)."""
    if not users:
        return None
    import pwd

    uids = set()
    for user in users:
        text = str(user)
        if text.isdigit():
            uid = int(text)
            # A typo in a uid would otherwise silently select nothing, and the run would look clean. But a
            # uid need not be in passwd to be real: an unprivileged LXC container's root is uid 100000 on
            # its Proxmox host, which has no passwd entry for it. So a uid counts when passwd knows it, a
            # subordinate id range (/etc/subuid) holds it, or a live process runs under it.
            if not _uid_known(uid):
                raise CleanSlateError(
                    f"users: no user with uid {text} on this host (not in passwd, not in /etc/subuid, and no process runs as it).",
                    reason=_reasons.BAD_ARGUMENTS,
                    option="users",
                )
            uids.add(uid)
            continue
        try:
            uids.add(pwd.getpwnam(text).pw_uid)
        except KeyError:
            raise CleanSlateError(f"users: no user named {text!r} on this host.", reason=_reasons.BAD_ARGUMENTS, option="users") from None
    return uids


def _uid_known(uid: int) -> bool:
    """Whether ``uid`` is a user of this host: in passwd, in a subordinate id range, or running a process."""
    import pwd

    try:
        pwd.getpwuid(uid)
        return True
    except (KeyError, OverflowError):
        pass
    try:
        with open("/etc/subuid", encoding="utf-8") as fh:
            for line in fh:
                parts = line.strip().split(":")
                if len(parts) == 3 and parts[1].isdigit() and parts[2].isdigit() and int(parts[1]) <= uid < int(parts[1]) + int(parts[2]):
                    return True
    except OSError:
        pass
    for pid in _proctable.pids():
        try:
            if os.stat(f"/proc/{pid}").st_uid == uid:
                return True
        except OSError:
            continue
    return False


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
    cmdline = words.replace(b"\0", b" ").decode("utf-8", "replace")
    return ProcFacts(
        argv=[w.decode("utf-8", "replace") for w in words.split(b"\0")] if words else [],
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


def exe_name(facts: ProcFacts) -> str | None:
    """The basename of the process's executable (/proc/PID/exe), or None when it cannot be read."""
    if not facts.exe:
        return None
    exe = facts.exe[: -len(" (deleted)")] if facts.exe.endswith(" (deleted)") else facts.exe
    return os.path.basename(exe)


def script_name(argv: t.Sequence[str]) -> str | None:
    """The script an interpreter runs, by basename: its first argument that is not an option.

    ``-m mod`` gives the module name; inline code (``-c``, ``-e``) and a bare
    interpreter reading its program from stdin give None.
    """
    words = list(argv[1:])
    i = 0
    while i < len(words):
        word = words[i]
        if word == "--":
            return os.path.basename(words[i + 1]) if i + 1 < len(words) else None
        if word in ("-c", "-e", "-E"):
            return None
        if word == "-m":
            return words[i + 1] if i + 1 < len(words) else None
        if word in _OPTIONS_WITH_VALUE:
            i += 2
            continue
        if word.startswith(("-", "+")):
            i += 1
            continue
        return os.path.basename(word)
    return None


def protection(facts: ProcFacts, protect: t.Sequence[str]) -> tuple[str | None, str]:
    """(the protect-list entry this process is, how it was told) - (None, "") when it is none.

    A process is what its executable is: an entry matches the basename of
    /proc/PID/exe and, when that executable is an interpreter, the script it
    runs. Neither comm nor argv[0] counts, since any process can set both.
    Proxmox's Perl daemons are the exception: perl running under one of their
    names. When the executable cannot be read (a zombie, or another user's
    process without privileges, which this module could not signal anyway),
    comm, argv[0] and a 15-character comm cut from a longer name count, so
    that a daemon is never ended for want of a readable link.
    """
    own = [facts.comm] + ([os.path.basename(facts.argv[0])] if facts.argv and facts.argv[0] else [])
    exe = exe_name(facts)
    if exe is None:
        for entry in protect:
            if any(fnmatch.fnmatchcase(n, entry) for n in own) or (len(facts.comm) == 15 and fnmatch.fnmatchcase(facts.comm, entry[:15])):
                return entry, "by name, its executable cannot be read"
        return None, ""
    names = [exe]
    if _INTERPRETER.match(exe):
        script = script_name(facts.argv)
        if script:
            names.append(script)
    perl = bool(_PERL.match(exe))
    for entry in protect:
        if entry in PERL_DAEMONS:
            if perl and any(fnmatch.fnmatchcase(n, entry) for n in own):
                return entry, ""
        elif any(fnmatch.fnmatchcase(n, entry) for n in names):
            return entry, ""
    return None, ""


def protected_name(facts: ProcFacts, protect: t.Sequence[str]) -> str | None:
    """The protect-list entry this process is, if any (see :func:`protection`)."""
    return protection(facts, protect)[0]


def _runs_bare_interpreter(command: str) -> bool:
    """Whether a shell command line only starts an interpreter that reads its program from stdin.

    That is how Ansible runs a pipelined module: ``/bin/sh -c '/usr/bin/python3'``, possibly
    nested in a second ``/bin/sh -c`` (local connection) and followed by ``&& sleep 0``.
    """
    try:
        words = shlex.split(command)
    except ValueError:
        return False
    if words[-3:] == ["&&", "sleep", "0"]:
        words = words[:-3]
    if words[:1] == ["echo"] and len(words) > 1 and words[1].startswith("BECOME-SUCCESS-"):
        # The become wrapper: "echo BECOME-SUCCESS-<id> ; /usr/bin/python3".
        words = words[3:] if len(words) > 2 and words[2] == ";" else words[2:]
    if len(words) == 3 and _SHELL.match(os.path.basename(words[0])) and words[1] == "-c":
        return _runs_bare_interpreter(words[2])
    return len(words) == 1 and bool(_PYTHON.match(os.path.basename(words[0])))


def _is_pipeline_shell(argv: t.Sequence[str]) -> bool:
    return len(argv) == 3 and bool(_SHELL.match(os.path.basename(argv[0]))) and argv[1] == "-c" and _runs_bare_interpreter(argv[2])


def ansible_process(argv: t.Sequence[str], parent_argv: t.Sequence[str] | None = None) -> str | None:
    """What Ansible process this command line is, or None.

    Recognised, whatever the host and connection: the controller and its forked
    workers, ``ansible-connection`` and every other ``ansible*`` program (also
    under ``python -m``); module payloads (``AnsiballZ_*.py``), async wrappers,
    scripts and become wrappers, by the words Ansible puts on their command
    lines (its temporary directories, ``BECOME-SUCCESS-``); and a pipelined
    module: the shell Ansible starts with only an interpreter to run, and that
    bare interpreter, which reads the module from its stdin.
    """
    if not argv:
        return None
    text = " ".join(argv)
    if any(mark in text for mark in _ANSIBLE_MARKS):
        return "an Ansible module, async wrapper, become wrapper or SSH connection"
    prog = os.path.basename(argv[0])
    names = [prog]
    if _PYTHON.match(prog):
        script = script_name(argv)
        if script:
            names.append(os.path.basename(script))
    for name in names:
        if _ANSIBLE_PROGRAM.match(name):
            return f"an Ansible program ({name}: the controller, its workers, ansible-connection, ansible-runner)"
    if _is_pipeline_shell(argv):
        return "Ansible's shell for a pipelined module"
    if len(argv) == 1 and _PYTHON.match(prog) and parent_argv and _is_pipeline_shell(parent_argv):
        return "a pipelined Ansible module"
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
            reason=_reasons.BAD_ARGUMENTS,
            option="unprotect",
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


def guard_ansible_and_own(facts: dict[int, ProcFacts], self_pid: int, guarded: dict[int, str]) -> None:
    """Add to ``guarded`` every Ansible process on the host and every process this module started.

    Ancestors alone do not cover Ansible: under ``async`` the module runs under
    a detached async wrapper, so the controller and its workers are no longer
    its ancestors, and other hosts' workers and other tasks' modules never were.
    """
    children: dict[int, list[int]] = {}
    found = []
    for pid, f in facts.items():
        children.setdefault(f.ppid, []).append(pid)
        if pid not in guarded:
            parent = facts.get(f.ppid)
            what = ansible_process(f.argv, parent.argv if parent else None)
            if what:
                guarded[pid] = what
                found.append(pid)
    # What started Ansible is as vital to it as the module's own ancestors are to the module: ending
    # the shell, timeout, sudo or CI runner above a controller ends or orphans the run.
    for pid in found:
        current = facts[pid].ppid
        while current > 0 and current in facts and current not in guarded:
            guarded[current] = "an ancestor of an Ansible process (what started the controller or a module: a shell, sudo, sshd, a CI runner)"
            current = facts[current].ppid
    stack = list(children.get(self_pid, []))
    while stack:
        pid = stack.pop()
        guarded.setdefault(pid, "started by this module")
        stack.extend(children.get(pid, []))


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
    widen(census)
    protect_and_filter(census, plan)
    return plan


def take_census(req: Request, plan: Plan) -> Census:
    """Read every process, what must never be signalled, where NVML lists each pid, and the device files' holders."""
    facts = {pid: f for pid in _proctable.pids() if (f := read_facts(pid)) is not None}
    minor_to_index = {g.minor: g.index for g in (req.every_gpu or req.gpus) if g.minor is not None}
    holders: dict[int, _proctable.Holding] = {}
    unreadable: set[int] = set()
    if req.use_device_files:
        holders, unreadable_list = _proctable.scan_device_holders(req.device_dir)
        unreadable = set(unreadable_list)
        plan.unreadable = len(unreadable)
        if unreadable:
            plan.notes.append(f"{len(unreadable)} process(es) could not be inspected for device files (permission); run with become: true.")
    return Census(
        req=req,
        facts=facts,
        guarded=guards(facts),
        minor_to_index=minor_to_index,
        selected={g.minor for g in req.gpus if g.minor is not None},
        nvml_minors=nvml_listing(req, minor_to_index) if req.use_nvml else {},
        holders=holders,
        unreadable=unreadable,
    )


def guards(facts: dict[int, ProcFacts]) -> dict[int, str]:
    """This module, its ancestors, every Ansible process on the host and what the module started, with why."""
    self_pid = os.getpid()
    guarded = {self_pid: "this module's own process"}
    for pid in _proctable.ancestors(self_pid):
        guarded.setdefault(pid, "an ancestor of this module (its interpreter, Ansible, sshd or the become chain)")
    guard_ansible_and_own(facts, self_pid, guarded)
    return guarded


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
            if index in index_to_minor and (f is None or f.state in ("Z", "X")):
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


def widen(census: Census) -> None:
    """Add the descendants (``include_children``) and process group members (``process_group``) of the candidates."""
    req, facts, guarded, cands = census.req, census.facts, census.guarded, census.cands
    if not (req.include_children or req.process_group):
        return
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
        if f.state in ("Z", "X") and not (pid <= 1 or (c.nspid and c.nspid[-1] == 1)):
            # It has exited already (a zombie holds no memory and no file); only its parent's wait is missing.
            # Judged first: its executable can no longer be read, so it would pass for a daemon by its name.
            plan.ignored.append({"pid": pid, "why": "a zombie: it has exited already and holds nothing; its parent has not reaped it yet"})
            continue
        why = protection_reason(req, c, census.guarded, census.holders)
        if why:
            record = {"pid": pid, "name": f.comm, "cmdline": f.cmdline, "why": why, "container": c.container}
            if c.holds_gpu_memory:
                # Protection wins, so this GPU cannot come clean: say so where the operator looks.
                record.update(gpus=sorted(c.gpus), used_mib=c.used_mib, holds_gpu_memory=True)
            plan.protected.append(record)
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
    plan.targets = apply_where(req, plan, survivors)


def protection_reason(req: Request, c: Candidate, guarded: dict[int, str], holders: dict[int, _proctable.Holding]) -> str | None:
    """Why a candidate must not be signalled, or None: init, kernel thread, guarded, daemon, out of scope, management client."""
    pid, f = c.pid, c.facts
    if pid <= 1 or (c.nspid and c.nspid[-1] == 1):
        return "PID 1 of its namespace (an init)"
    if f.kernel:
        return "kernel thread"
    if pid in guarded:
        return guarded[pid]
    name, how = protection(f, req.protect)
    if name:
        return f"protected daemon ({name}{', ' + how if how else ''})"
    if req.scopes and _scope.member_of(req.scopes, c.pidns, c.container) is None:
        return f"outside the container scope ({_scope.label(req.scopes)})"
    if not req.kill_management_clients and not c.nvml_listed and pid in holders and not holders[pid].has_mmaps:
        return "management client (holds device files but maps none); set kill_management_clients: true to end it"
    return None


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
