# Copyright (c) 2026, gpuops.clean_slate maintainers
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# Note: this module_util is PRIVATE to the collection; it may change without notice.

"""Container scope on a Proxmox VE hypervisor: which host processes belong to
the LXC containers an operator named.

A container is identified two ways, so that either signal alone suffices:
its PID namespace (the namespace of its init process, found with
``pct status <vmid> --verbose`` or ``lxc-info``) and its cgroup path
(``/lxc/<vmid>/`` on Proxmox). Processes in nested namespaces (Docker in
LXC) still sit under the container's cgroup.
"""

from __future__ import annotations

import os
import re
import typing as t
from dataclasses import dataclass

from ansible_collections.gpuops.clean_slate.plugins.module_utils import _proctable
from ansible_collections.gpuops.clean_slate.plugins.module_utils._errors import CleanSlateError
from ansible_collections.gpuops.clean_slate.plugins.module_utils._pct import PctExec

RunCommand = t.Callable[[t.List[str], t.Optional[str], bool], t.Tuple[int, str, str]]


@dataclass
class Scope:
    """One container to limit targets to."""

    vmid: int
    init_pid: int
    pidns: int | None


def _parse_kv(text: str) -> dict[str, str]:
    out = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            out[key.strip().lower()] = value.strip()
    return out


def resolve(vmids: t.Sequence[int], run: RunCommand, pct: str | None, lxc_info: str | None) -> list[Scope]:
    """Resolve container ids to their init pid and PID namespace, or raise a clear error.

    ``run`` takes ``(argv, data, binary_data)`` and returns ``(rc, stdout, stderr)``.
    """
    scopes = []
    for vmid in vmids:
        if pct:
            try:
                info = PctExec(pct, run).status_verbose(vmid)
            except CleanSlateError as exc:
                raise CleanSlateError(f"containers: {exc.msg}", reason=exc.reason, vmid=vmid) from None
            status, pid_text = info.get("status", "unknown"), info.get("pid", "")
        elif lxc_info:
            rc, out, err = run([lxc_info, "-n", str(vmid), "-s", "-p"], None, False)
            if rc != 0:
                detail = err.strip() or "lxc-info failed"
                raise CleanSlateError(f"containers: container {vmid} does not exist here ({detail}).", reason="no_such_container", vmid=vmid)
            info = _parse_kv(out)
            status, pid_text = info.get("state", "unknown").lower(), info.get("pid", "")
        else:
            raise CleanSlateError(
                "containers: neither pct nor lxc-info was found; container scope works on a Proxmox VE (or LXC) host only.", reason="bad_arguments"
            )
        if status != "running":
            raise CleanSlateError(
                f"containers: container {vmid} is not running (status: {status}); there is nothing of it to clean.", reason="not_running", vmid=vmid
            )
        if not re.fullmatch(r"\d+", pid_text or ""):
            raise CleanSlateError(f"containers: could not find the init process of container {vmid}.", reason="not_running", vmid=vmid)
        pid = int(pid_text)
        if not os.path.exists(f"/proc/{pid}"):
            raise CleanSlateError(
                f"containers: the init process {pid} of container {vmid} is not visible here; run the task on the hypervisor itself.",
                reason="not_running",
                vmid=vmid,
            )
        scopes.append(Scope(vmid=vmid, init_pid=pid, pidns=_proctable.pidns_inode(pid)))
    return scopes


def member_of(pid: int, scopes: list[Scope], pidns: int | None, container: int | None) -> Scope | None:
    """The scope ``pid`` belongs to, by PID namespace or by cgroup path."""
    for scope in scopes:
        if pidns is not None and scope.pidns is not None and pidns == scope.pidns:
            return scope
        if container is not None and container == scope.vmid:
            return scope
    return None
