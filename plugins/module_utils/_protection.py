# Copyright (c) 2026, gpuops.clean_slate maintainers
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# Note: this module_util is PRIVATE to the collection; it may change without notice.

"""The protection policy: which processes are never signalled, and why. Every rule is here.

A process is never signalled, whatever selected it (NVML, the device files, a
pattern, a tree, a group) and whatever the options say, when it is (in this
order; :func:`protection_reason`):

1. PID 1 of any PID namespace (the host's init, a container's init);
2. a kernel thread (``PF_KTHREAD``);
3. guarded (:func:`guards`): this module, its ancestors (its interpreter,
   Ansible, sshd, the become chain), every process it started, every Ansible
   process on the host (recognised by how Ansible starts them,
   :func:`ansible_process`, since under ``async`` the controller is no longer
   the module's ancestor) and the ancestors of those;
4. a protected daemon (:func:`protection`: ``DEFAULT_PROTECT`` plus ``protect``
   minus ``unprotect``), recognised by its executable, never by the name it
   gives itself;

and, for the kill's candidates:

5. outside the container scope, when containers are named;
6. a management client (holds GPU device files but maps none, as NVML
   monitoring does), unless ``kill_management_clients`` is set.

Rules 1 to 4 cannot be switched off (:func:`never_signal`); ``unprotect`` can
only remove entries of the default daemon list, by name. Discovery
(:mod:`._procs`) applies the rules after it has gathered its candidates, so
that no option can select a protected process; the residue module uses rules
1 to 4 to mark the holders it reports.
"""

from __future__ import annotations

import fnmatch
import os
import re
import shlex
import typing as t

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


class Facts(t.Protocol):
    """What the rules read of a process (``_procs.ProcFacts`` is one)."""

    comm: str
    argv: list[str]
    exe: str | None
    ppid: int
    kernel: bool


def exe_name(facts: Facts) -> str | None:
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


def protection(facts: Facts, protect: t.Sequence[str]) -> tuple[str | None, str]:
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


def protected_name(facts: Facts, protect: t.Sequence[str]) -> str | None:
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


def lineage(self_pid: int) -> dict[int, str]:
    """This module and its ancestors (its interpreter, Ansible, sshd, the become chain), with why."""
    guarded = {self_pid: "this module's own process"}
    for pid in _proctable.ancestors(self_pid):
        guarded.setdefault(pid, "an ancestor of this module (its interpreter, Ansible, sshd or the become chain)")
    return guarded


def guards(facts: t.Mapping[int, Facts]) -> dict[int, str]:
    """This module, its ancestors, every Ansible process on the host and what the module started, with why."""
    self_pid = os.getpid()
    guarded = lineage(self_pid)
    guard_ansible_and_own(facts, self_pid, guarded)
    return guarded


def guard_ansible_and_own(facts: t.Mapping[int, Facts], self_pid: int, guarded: dict[int, str]) -> None:
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


def never_signal(pid: int, facts: Facts, nspid: t.Sequence[int], guarded: t.Mapping[int, str], protect: t.Sequence[str]) -> str | None:
    """Why a process may never be signalled whatever the options say (rules 1-4), or None.

    ``nspid`` is the process's pid in each nested PID namespace (``NSpid``), ``guarded`` what :func:`guards` found
    (or a subset of it), ``protect`` the daemon list (:func:`protect_list`).
    """
    if pid <= 1 or (nspid and nspid[-1] == 1):
        return "PID 1 of its namespace (an init)"
    if facts.kernel:
        return "kernel thread"
    if pid in guarded:
        return guarded[pid]
    name, how = protection(facts, protect)
    if name:
        return f"protected daemon ({name}{', ' + how if how else ''})"
    return None


def protection_reason(
    pid: int,
    facts: Facts,
    nspid: t.Sequence[int],
    guarded: t.Mapping[int, str],
    protect: t.Sequence[str],
    *,
    scopes: t.Sequence[_scope.Scope] = (),
    pidns: int | None = None,
    container: int | None = None,
    nvml_listed: bool = False,
    holding: _proctable.Holding | None = None,
    kill_management_clients: bool = False,
) -> str | None:
    """Why a kill candidate must not be signalled (rules 1-6), or None.

    ``scopes``, ``pidns`` and ``container`` place it against the containers named; ``nvml_listed`` and ``holding``
    (its GPU device files) tell a management client, spared unless ``kill_management_clients``.
    """
    why = never_signal(pid, facts, nspid, guarded, protect)
    if why:
        return why
    if scopes and _scope.member_of(list(scopes), pidns, container) is None:
        return f"outside the container scope ({_scope.label(list(scopes))})"
    if not kill_management_clients and not nvml_listed and holding is not None and not holding.has_mmaps:
        return "management client (holds device files but maps none); set kill_management_clients: true to end it"
    return None
