# Copyright (c) 2026, gpuops.clean_slate maintainers
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# Note: this module_util is PRIVATE to the collection; it may change without notice.

"""Run a command inside a Proxmox VE LXC container with ``pct exec``.

The logic of the ``pct_exec`` module, kept free of ``AnsibleModule`` so it can
be unit-tested with a fake ``run_command``:

* the command line is always a list handed to ``run_command`` (no host shell
  ever parses user input); pct's options come before ``--`` and the user's
  argv after it, because pct parses everything before ``--`` with Getopt and
  would take a user's ``-x`` for one of its own options;
* the container is checked with ``pct status`` first, and pct's own failures
  (which all exit 255, like a command that exits 255) are recognised by their
  exact messages instead of by the exit code;
* the timeout is enforced inside the container with coreutils ``timeout``,
  so a hung command is killed where it runs, not just abandoned on the host.
"""

from __future__ import annotations

import os
import re
import socket
import time
import typing as t

from ansible_collections.gpuops.clean_slate.plugins.module_utils._errors import CleanSlateError

VMID_MIN = 100
VMID_MAX = 999_999_999

#: ``reason`` values the module reports on failure.
REASONS = ("not_running", "no_such_container", "bad_arguments", "timeout", "command_failed", "pct_failed")

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

# run_command(argv, data, binary_data) -> (rc, stdout, stderr), as AnsibleModule.run_command.
RunCommand = t.Callable[[t.List[str], t.Optional[str], bool], t.Tuple[int, str, str]]


def validate_vmid(vmid: t.Any) -> int:
    """Return ``vmid`` as an int in PVE's range 100-999999999, or raise ``bad_arguments``."""
    if isinstance(vmid, bool) or not isinstance(vmid, int):
        raise CleanSlateError(f"vmid must be an integer, got {vmid!r}", reason="bad_arguments")
    if not VMID_MIN <= vmid <= VMID_MAX:
        raise CleanSlateError(f"vmid {vmid} is outside Proxmox VE's range {VMID_MIN}-{VMID_MAX}", reason="bad_arguments", vmid=vmid)
    return vmid


def env_assignments(env: t.Mapping[str, t.Any] | None) -> list[str]:
    """``NAME=value`` words for ``env(1)``; names are checked so none can pass for an option or a command."""
    out: list[str] = []
    for name, value in sorted((env or {}).items()):
        if not _ENV_NAME.match(str(name)):
            raise CleanSlateError(f"invalid environment variable name {name!r} (letters, digits and _ only)", reason="bad_arguments")
        out.append(f"{name}={'' if value is None else value}")
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
            "no_such_container",
            f"container {vmid} does not exist on node {node}: pct only sees the containers whose configuration is on the node it runs on; "
            'if the container lives on another cluster node, run the task there (for example delegate_to: "{{ proxmox_node_host }}")',
            node,
        )
    if _NOT_RUNNING.match(text):
        return "not_running", f"container {vmid} is not running", None
    m = _BAD_ARGS.search(text)
    if m and _USAGE.search(text):
        msg = f"pct rejected the arguments: {m.group('msg')}"
        if "Unknown option: keep-env" in text:
            msg += " (this pct has no --keep-env, which came with Proxmox VE 8.2; upgrade the node)"
        return "bad_arguments", f"{msg}\n{text}", None
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
            raise CleanSlateError("the command is empty", reason="bad_arguments", vmid=vmid)
        inner: list[str] = []
        if timeout is not None:
            if timeout <= 0:
                raise CleanSlateError(f"timeout must be a positive number of seconds, got {timeout}", reason="bad_arguments", vmid=vmid)
            if kill_after < 0:
                raise CleanSlateError(f"kill_after must be 0 or more seconds, got {kill_after}", reason="bad_arguments", vmid=vmid)
            # -k is coreutils' --kill-after in its short form, which busybox's timeout also knows.
            inner += ["timeout", "-k", str(kill_after), str(timeout)]
        assignments = env_assignments(env)
        if assignments:
            if "=" in argv[0] and chdir is None:
                # env(1) would take such a word for one more assignment, not for the command.
                raise CleanSlateError(f"a command named {argv[0]!r} cannot be combined with env", reason="bad_arguments", vmid=vmid)
            inner += ["env", *assignments]
        if chdir is not None:
            if not chdir:
                raise CleanSlateError("chdir is empty", reason="bad_arguments", vmid=vmid)
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
                "pct_failed", f"pct status {vmid} failed with rc {rc}{hint}: {err.strip() or out.strip()}", vmid, rc=rc, stdout=out, stderr=err, cmd=argv
            )
        m = _STATUS_LINE.search(out)
        if not m:
            raise self._fail("pct_failed", f"cannot read the state of container {vmid} from pct status: {out.strip()!r}", vmid, rc=rc, stdout=out, stderr=err)
        info = {}
        for line in out.splitlines():
            key, sep, value = line.partition(":")
            if sep:
                info[key.strip().lower()] = value.strip()
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
        raise self._fail("pct_failed", f"cannot test {path!r} in container {vmid} (rc {rc}): {err.strip()}", vmid, rc=rc, stdout=out, stderr=err, cmd=argv)

    def run(
        self,
        vmid: int,
        argv: list[str],
        keep_env: bool = False,
        timeout: int | None = None,
        kill_after: int = 5,
        env: t.Mapping[str, t.Any] | None = None,
        chdir: str | None = None,
        stdin: str | None = None,
        stdin_add_newline: bool = True,
        creates: str | None = None,
        removes: str | None = None,
        check_mode: bool = False,
    ) -> dict[str, t.Any]:
        """Check the container, then run the command; a dict for ``exit_json`` or a raised :class:`CleanSlateError`."""
        vmid = validate_vmid(vmid)
        cmd = self.exec_argv(vmid, argv, keep_env=keep_env, timeout=timeout, kill_after=kill_after, env=env, chdir=chdir)
        state = self.status(vmid)
        if state != "running":
            raise self._fail("not_running", f"container {vmid} on node {self.node} is not running (pct status: {state})", vmid, cmd=cmd)
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
            raise CleanSlateError(f"the command timed out after {timeout} s in container {vmid} and was killed there", reason="timeout", **result)
        if rc != 0:
            raise CleanSlateError(f"the command exited with rc {rc} in container {vmid}", reason="command_failed", **result)
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
