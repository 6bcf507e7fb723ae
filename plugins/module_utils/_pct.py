# Copyright (c) 2026, gpuops.clean_slate maintainers
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# Note: this module_util is PRIVATE to the collection; it may change without notice.

"""Proxmox VE's containers through ``pct``: run a command inside one (``pct exec``),
and find a container's init for the modules' ``containers`` scope.

The logic of the ``pct_exec`` module, kept free of ``AnsibleModule`` so it can
be unit-tested with a fake ``run_command`` (:data:`RunCommand`, the one shape
every command of the collection is run through):

* the command line is always a list handed to ``run_command`` (no host shell
  ever parses user input); pct's options come before ``--`` and the user's
  argv after it, because pct parses everything before ``--`` with Getopt and
  would take a user's ``-x`` for one of its own options;
* the container is checked with ``pct status`` first, and pct's own failures
  (which all exit 255, like a command that exits 255) are recognised by their
  exact messages instead of by the exit code;
* the timeout is enforced inside the container with coreutils ``timeout``,
  so a hung command is killed where it runs, not just abandoned on the host;
* a container named in ``containers`` (gpu_procs_kill, gpu_job_residue) is
  resolved here to its init and PID namespace (:func:`scopes`); which
  processes then belong to it is :mod:`._scope`'s pure judgement.
"""

from __future__ import annotations

import os
import re
import socket
import time
import typing as t

from ansible_collections.gpuops.clean_slate.plugins.module_utils import _checks, _proctable, _reasons
from ansible_collections.gpuops.clean_slate.plugins.module_utils._errors import CleanSlateError
from ansible_collections.gpuops.clean_slate.plugins.module_utils._scope import Scope

#: Exit codes of ``timeout``: 124 after SIGTERM, 128+9 after the SIGKILL of
#: ``-k``, 128+15 for busybox's timeout, which passes the child's status on.
TIMEOUT_EXIT_CODES = (124, 137, 143)

#: The in-container ``cd`` wrapper. The directory and the argv arrive as
#: positional parameters, so the shell never parses them as code.
CHDIR_SCRIPT = 'cd -- "$1" || exit 1; shift; exec "$@"'

_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_STATUS_LINE = re.compile(r"^status: (\S+)$", re.MULTILINE)
# PVE::AbstractConfig::load_config - also what pct says for a container of another cluster node.
_NO_CONFIG = re.compile(r"^Configuration file 'nodes/(?P<node>[^/']+)/lxc/(?P<vmid>\d+)\.conf' does not exist$")
# pct.pm since 2021; "Error: " prefix in older releases.
_NOT_RUNNING = re.compile(r"^(?:Error: )?container '(?P<vmid>\d+)' not running!$")
# PVE::Exception with code 400, followed by the command's short usage line.
_BAD_ARGS = re.compile(r"^400 (?P<msg>.+)$", re.MULTILINE)
_USAGE = re.compile(r"^pct \S+ .*$", re.MULTILINE)

#: ``run_command(argv, data, binary_data) -> (rc, stdout, stderr)``, as AnsibleModule.run_command; the one
#: shape every command of the collection is run through.
RunCommand = t.Callable[[t.List[str], t.Optional[str], bool], t.Tuple[int, str, str]]


class Host(t.Protocol):
    """What the helpers below need of an AnsibleModule."""

    params: dict[str, t.Any]
    check_mode: bool

    def get_bin_path(self, arg: str, required: bool = False, opt_dirs: list[str] | None = None) -> str | None: ...

    def run_command(self, args: t.Any, **kwargs: t.Any) -> tuple[int, str, str]: ...


def validate_vmid(vmid: t.Any) -> int:
    """Return ``vmid`` as an int in PVE's range, or raise ``bad_arguments`` (see :func:`._checks.vmid`)."""
    return _checks.vmid("vmid", vmid)


def env_assignments(env: t.Mapping[str, t.Any] | None) -> list[str]:
    """``NAME=value`` words for ``env(1)``; names are checked so none can pass for an option or a command."""
    out: list[str] = []
    for name, value in sorted((env or {}).items()):
        if not _ENV_NAME.match(str(name)):
            raise CleanSlateError(f"env: invalid environment variable name {name!r} (letters, digits and _ only)", reason=_reasons.BAD_ARGUMENTS, option="env")
        out.append(f"{name}={'' if value is None else value}")
    return out


def key_values(text: str) -> dict[str, str]:
    """``key: value`` lines (``pct status --verbose``, ``lxc-info``) as a dict with lower-case keys."""
    out = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            out[key.strip().lower()] = value.strip()
    return out


def split_lines(text: str) -> list[str]:
    """``stdout_lines`` as Ansible's command module builds them."""
    return text.splitlines()


def local_node_name(pve_local: str = "/etc/pve/local") -> str:
    """This node's name as PVE knows it: ``/etc/pve/local`` links to ``nodes/<name>``; else the short hostname."""
    try:
        return os.path.basename(os.readlink(pve_local).rstrip("/"))
    except OSError:
        return socket.gethostname().split(".")[0]


def classify_pct_error(stderr: str, vmid: int) -> tuple[str, str, str | None] | None:
    """Recognise one of pct's own failures in ``stderr``; ``(reason, message, node)`` or None.

    pct dies before the command starts, so its stderr is only its message; a
    command that happens to print the same line among others is not mistaken for it.
    """
    text = stderr.strip()
    m = _NO_CONFIG.match(text)
    if m:
        node = m.group("node")
        return (
            _reasons.NO_SUCH_CONTAINER,
            f"container {vmid} does not exist on node {node}: pct only sees the containers whose configuration is on the node it runs on; "
            'if the container lives on another cluster node, run the task there (for example delegate_to: "{{ proxmox_node_host }}")',
            node,
        )
    if _NOT_RUNNING.match(text):
        return _reasons.NOT_RUNNING, f"container {vmid} is not running", None
    m = _BAD_ARGS.search(text)
    if m and _USAGE.search(text):
        msg = f"pct rejected the arguments: {m.group('msg')}"
        if "Unknown option: keep-env" in text:
            msg += " (this pct has no --keep-env, which came with Proxmox VE 8.2; upgrade the node)"
        return _reasons.BAD_ARGUMENTS, f"{msg}\n{text}", None
    return None


class PctExec:
    """Builds pct command lines and runs them through a ``run_command`` callable.

    :param pct: path of the ``pct`` binary.
    :param run_command: ``(argv, data, binary_data) -> (rc, stdout, stderr)``.
    :param sudo: prefix when not root, for example ``["sudo", "-n"]`` (``-n``: never prompt, fail instead).
    :param node: this node's name, for results and messages.
    :param clock: monotonic clock (seconds), replaceable in tests.
    """

    def __init__(
        self,
        pct: str,
        run_command: RunCommand,
        sudo: list[str] | None = None,
        node: str | None = None,
        clock: t.Callable[[], float] = time.monotonic,
    ) -> None:
        self.pct = pct
        self.run_command = run_command
        self.sudo = list(sudo or [])
        self.node = node
        self.clock = clock

    # ------------------------------------------------------------------ command lines
    def status_argv(self, vmid: int) -> list[str]:
        """``pct status <vmid>``."""
        return [*self.sudo, self.pct, "status", str(validate_vmid(vmid))]

    def exec_argv(
        self,
        vmid: int,
        argv: list[str],
        keep_env: bool = False,
        timeout: int | None = None,
        kill_after: int = 5,
        env: t.Mapping[str, t.Any] | None = None,
        chdir: str | None = None,
    ) -> list[str]:
        """The full ``pct exec`` argv: pct's options, ``--``, then the in-container command.

        In the container the command runs as ``timeout -k K T env NAME=V ... /bin/sh -c <cd wrapper> DIR argv...``,
        each part present only when asked for.
        """
        vmid = validate_vmid(vmid)
        if not argv or not argv[0]:
            raise CleanSlateError("the command is empty", reason=_reasons.BAD_ARGUMENTS, vmid=vmid)
        inner: list[str] = []
        if timeout is not None:
            if timeout <= 0:
                raise CleanSlateError(f"timeout must be a positive number of seconds, got {timeout}", reason=_reasons.BAD_ARGUMENTS, vmid=vmid)
            if kill_after < 0:
                raise CleanSlateError(f"kill_after must be 0 or more seconds, got {kill_after}", reason=_reasons.BAD_ARGUMENTS, vmid=vmid)
            # -k is coreutils' --kill-after in its short form, which busybox's timeout also knows.
            inner += ["timeout", "-k", str(kill_after), str(timeout)]
        assignments = env_assignments(env)
        if assignments:
            if "=" in argv[0] and chdir is None:
                # env(1) would take such a word for one more assignment, not for the command.
                raise CleanSlateError(f"a command named {argv[0]!r} cannot be combined with env", reason=_reasons.BAD_ARGUMENTS, vmid=vmid)
            inner += ["env", *assignments]
        if chdir is not None:
            if not chdir:
                raise CleanSlateError("chdir is empty", reason=_reasons.BAD_ARGUMENTS, vmid=vmid)
            inner += ["/bin/sh", "-c", CHDIR_SCRIPT, "pct_exec", chdir]
        return [*self.sudo, self.pct, "exec", str(vmid), "--keep-env", "1" if keep_env else "0", "--", *inner, *argv]

    # ------------------------------------------------------------------ runs
    def _fail(self, reason: str, msg: str, vmid: int, **details: t.Any) -> CleanSlateError:
        return CleanSlateError(msg, reason=reason, vmid=vmid, node=self.node, **details)

    def status(self, vmid: int) -> str:
        """The container's state from ``pct status``; raises for pct failures (absent container, sudo refused...)."""
        return self.status_verbose(vmid, verbose=False)["status"]

    def status_verbose(self, vmid: int, verbose: bool = True) -> dict[str, str]:
        """``pct status <vmid> [--verbose]`` as a dict: ``status``, and with ``verbose`` ``pid``, ``name``...

        Raises for pct's own failures (absent container, sudo refused...).
        """
        argv = self.status_argv(vmid) + (["--verbose"] if verbose else [])
        rc, out, err = self.run_command(argv, None, False)
        if rc != 0:
            known = classify_pct_error(err, vmid)
            if known:
                reason, msg, node = known
                if node:
                    self.node = node
                raise self._fail(reason, msg, vmid, rc=rc, stdout=out, stderr=err, cmd=argv)
            hint = ""
            if err.lstrip().startswith("sudo:"):
                hint = " (pct needs root: give this user passwordless sudo for pct, or connect as root)"
            raise self._fail(
                _reasons.PCT_FAILED, f"pct status {vmid} failed with rc {rc}{hint}: {err.strip() or out.strip()}", vmid, rc=rc, stdout=out, stderr=err, cmd=argv
            )
        m = _STATUS_LINE.search(out)
        if not m:
            raise self._fail(
                _reasons.PCT_FAILED, f"cannot read the state of container {vmid} from pct status: {out.strip()!r}", vmid, rc=rc, stdout=out, stderr=err
            )
        info = key_values(out)
        info["status"] = m.group(1)
        return info

    def path_exists(self, vmid: int, path: str, keep_env: bool = False) -> bool:
        """Whether ``path`` exists inside the container (``test -e``), for ``creates``/``removes``."""
        argv = self.exec_argv(vmid, ["test", "-e", path], keep_env=keep_env)
        rc, out, err = self.run_command(argv, None, False)
        if rc in (0, 1):
            return rc == 0
        known = classify_pct_error(err, vmid) if rc == 255 else None
        if known:
            raise self._fail(known[0], known[1], vmid, rc=rc, stdout=out, stderr=err, cmd=argv)
        raise self._fail(
            _reasons.PCT_FAILED, f"cannot test {path!r} in container {vmid} (rc {rc}): {err.strip()}", vmid, rc=rc, stdout=out, stderr=err, cmd=argv
        )

    def run(
        self,
        vmid: int,
        argv: list[str],
        stdin: str | None = None,
        stdin_add_newline: bool = True,
        creates: str | None = None,
        removes: str | None = None,
        check_mode: bool = False,
        **exec_options: t.Any,
    ) -> dict[str, t.Any]:
        """Check the container, then run the command; a dict for ``exit_json`` or a raised :class:`CleanSlateError`.

        ``exec_options`` are :meth:`exec_argv`'s (``keep_env``, ``timeout``, ``kill_after``, ``env``, ``chdir``).
        """
        vmid = validate_vmid(vmid)
        cmd = self.exec_argv(vmid, argv, **exec_options)
        keep_env, timeout = bool(exec_options.get("keep_env")), exec_options.get("timeout")
        state = self.status(vmid)
        if state != "running":
            raise self._fail(_reasons.NOT_RUNNING, f"container {vmid} on node {self.node} is not running (pct status: {state})", vmid, cmd=cmd)
        if creates is not None and self.path_exists(vmid, creates, keep_env):
            return self._skipped(vmid, cmd, f"skipped, since {creates} exists in container {vmid}")
        if removes is not None and not self.path_exists(vmid, removes, keep_env):
            return self._skipped(vmid, cmd, f"skipped, since {removes} does not exist in container {vmid}")
        if check_mode:
            return {"changed": True, "vmid": vmid, "node": self.node, "cmd": cmd, "msg": "Command would have run if not in check mode"}

        started = self.clock()
        # Without binary_data, run_command appends the newline a shell user would type.
        rc, out, err = self.run_command(cmd, stdin, not stdin_add_newline)
        elapsed = round(self.clock() - started, 3)
        result: dict[str, t.Any] = {
            "changed": True,
            "rc": rc,
            "stdout": out,
            "stderr": err,
            "stdout_lines": split_lines(out),
            "stderr_lines": split_lines(err),
            "vmid": vmid,
            "node": self.node,
            "elapsed_s": elapsed,
            "cmd": cmd,
        }
        if rc == 255:
            known = classify_pct_error(err, vmid)
            if known:
                reason, msg, node = known
                if node:
                    self.node = result["node"] = node
                raise CleanSlateError(msg, reason=reason, **result)
        if timeout is not None and rc in TIMEOUT_EXIT_CODES and elapsed >= timeout:
            raise CleanSlateError(f"the command timed out after {timeout} s in container {vmid} and was killed there", reason=_reasons.TIMEOUT, **result)
        if rc != 0:
            raise CleanSlateError(f"the command exited with rc {rc} in container {vmid}", reason=_reasons.COMMAND_FAILED, **result)
        return result

    def _skipped(self, vmid: int, cmd: list[str], msg: str) -> dict[str, t.Any]:
        return {
            "changed": False,
            "rc": 0,
            "stdout": "",
            "stderr": "",
            "stdout_lines": [],
            "stderr_lines": [],
            "vmid": vmid,
            "node": self.node,
            "cmd": cmd,
            "msg": msg,
        }


# ---------------------------------------------------------------------- containers as kill and residue scopes
def scopes(vmids: t.Sequence[int], run: RunCommand, pct: str | None, lxc_info: str | None) -> list[Scope]:
    """Resolve container ids to their init pid and PID namespace (``containers``), or raise a clear error.

    ``pct status <vmid> --verbose`` names the init on Proxmox VE; ``lxc-info`` on a plain LXC host.
    """
    out = []
    for vmid in vmids:
        status, pid_text = _init_of(vmid, run, pct, lxc_info)
        if status != "running":
            raise CleanSlateError(
                f"containers: container {vmid} is not running (status: {status}); there is nothing of it to clean.", reason=_reasons.NOT_RUNNING, vmid=vmid
            )
        if not re.fullmatch(r"\d+", pid_text or ""):
            raise CleanSlateError(f"containers: could not find the init process of container {vmid}.", reason=_reasons.NOT_RUNNING, vmid=vmid)
        pid = int(pid_text)
        if not os.path.exists(f"/proc/{pid}"):
            raise CleanSlateError(
                f"containers: the init process {pid} of container {vmid} is not visible here; run the task on the hypervisor itself.",
                reason=_reasons.NOT_RUNNING,
                vmid=vmid,
            )
        out.append(Scope(vmid=vmid, init_pid=pid, pidns=_proctable.pidns_inode(pid)))
    return out


def _init_of(vmid: int, run: RunCommand, pct: str | None, lxc_info: str | None) -> tuple[str, str]:
    """(state, init pid as text) of one container, from pct or lxc-info."""
    if pct:
        try:
            info = PctExec(pct, run).status_verbose(vmid)
        except CleanSlateError as exc:
            raise CleanSlateError(f"containers: {exc.msg}", reason=exc.reason, vmid=vmid) from None
        return info.get("status", "unknown"), info.get("pid", "")
    if lxc_info:
        rc, out, err = run([lxc_info, "-n", str(vmid), "-s", "-p"], None, False)
        if rc != 0:
            detail = err.strip() or "lxc-info failed"
            raise CleanSlateError(f"containers: container {vmid} does not exist here ({detail}).", reason=_reasons.NO_SUCH_CONTAINER, vmid=vmid)
        info = key_values(out)
        return info.get("state", "unknown").lower(), info.get("pid", "")
    raise CleanSlateError(
        "containers: neither pct nor lxc-info was found; container scope works on a Proxmox VE (or LXC) host only.",
        reason=_reasons.BAD_ARGUMENTS,
        option="containers",
    )


# ---------------------------------------------------------------------- what the modules share
def runner(module: Host) -> RunCommand:
    """The module's ``run_command`` as a :data:`RunCommand` that expands nothing.

    ``run_command`` expands ``$VAR`` and ``~`` in every word by default, with the node's environment: the
    words must reach pct (and the container) as written, and a returned ``cmd`` must be what ran.
    """

    def run(argv: list[str], data: str | None, binary_data: bool) -> tuple[int, str, str]:
        rc, out, err = module.run_command(argv, data=data, binary_data=binary_data, expand_user_and_vars=False)
        return rc, out, err

    return run


def find_pct(module: Host, pct_path: str | None) -> str | None:
    """``pct_path`` when given (already checked to be executable), else pct from PATH or /usr/sbin."""
    return pct_path or module.get_bin_path("pct", opt_dirs=["/usr/sbin"])


#: The argument spec of a module's ``containers`` scope (documented by the ``_containers`` doc fragment and each module).
SCOPE_OPTIONS: dict[str, dict[str, t.Any]] = {"containers": {"type": "list", "elements": "int", "default": []}, "pct_path": {"type": "path"}}


def scopes_of(module: Host) -> t.Callable[[], list[Scope]]:
    """The lookup of the module's ``containers`` option, to be run once every other option is known good."""
    return lambda: container_scopes(module, module.params["containers"], module.params["pct_path"])


def container_scopes(module: Host, vmids: t.Sequence[int], pct_path: str | None) -> list[Scope]:
    """The ``containers`` option of a module, resolved (empty when it is empty); pct first, else lxc-info."""
    if not vmids:
        return []
    pct = find_pct(module, pct_path)
    lxc_info = None if pct else module.get_bin_path("lxc-info", opt_dirs=["/usr/bin", "/usr/sbin"])
    return scopes(vmids, runner(module), pct, lxc_info)


def execute(module: Host) -> dict[str, t.Any]:
    """The pct_exec module: check every option before anything runs on the node, then run the command."""
    p = module.params
    vmid = validate_vmid(p["vmid"])
    _checks.number("timeout", p["timeout"], 1, _checks.MAX_SECONDS, unit="seconds")
    _checks.number("kill_after", p["kill_after"], 0, 3600, unit="seconds")
    _checks.executable("pct_path", p["pct_path"])
    argv: list[str] = list(p["argv"]) if p["argv"] is not None else ["/bin/sh", "-c", p["command"]]
    pct = find_pct(module, p["pct_path"])
    if not pct:
        raise CleanSlateError("pct not found in PATH or /usr/sbin: is this a Proxmox VE node? (set pct_path otherwise)", reason=_reasons.PCT_FAILED, vmid=vmid)
    sudo: list[str] = []
    if os.geteuid() != 0:
        found = module.get_bin_path("sudo")
        if not found:
            raise CleanSlateError(
                "pct needs root, and this user is not root and there is no sudo; connect as root or install sudo.", reason=_reasons.PCT_FAILED, vmid=vmid
            )
        sudo = [found, "-n"]
    result = PctExec(pct, runner(module), sudo=sudo, node=p["node"] or local_node_name()).run(
        vmid,
        argv,
        keep_env=p["keep_env"],
        timeout=p["timeout"],
        kill_after=p["kill_after"],
        env=p["env"],
        chdir=p["chdir"],
        stdin=p["stdin"],
        stdin_add_newline=p["stdin_add_newline"],
        creates=p["creates"],
        removes=p["removes"],
        check_mode=module.check_mode,
    )
    result.setdefault("msg", "" if result.get("rc") is None else f"the command exited with rc {result['rc']} in container {vmid}")
    return result
