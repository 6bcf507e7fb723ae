# Copyright (c) 2026, gpuops.clean_slate maintainers
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# Note: this module_util is PRIVATE to the collection; it may change without notice.

"""Container scope on a Proxmox VE hypervisor: which host processes belong to
the LXC containers an operator named.

A container is identified two ways, so that either signal alone suffices:
its PID namespace (the namespace of its init process) and its cgroup path
(``/lxc/<vmid>/`` on Proxmox). Processes in nested namespaces (Docker in
LXC) still sit under the container's cgroup.

This part is pure: it judges membership from facts the caller read. Finding
a container's init (``pct status <vmid> --verbose`` or ``lxc-info``) is
Proxmox's business and lives beside the pct runner (:func:`._pct.scopes`),
so that discovery does not depend on it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Scope:
    """One container to limit targets to."""

    vmid: int
    init_pid: int
    pidns: int | None


def member_of(scopes: list[Scope], pidns: int | None, container: int | None) -> Scope | None:
    """The scope a process belongs to, by its PID namespace inode or by the container id of its cgroup path."""
    for scope in scopes:
        if pidns is not None and scope.pidns is not None and pidns == scope.pidns:
            return scope
        if container is not None and container == scope.vmid:
            return scope
    return None


def label(scopes: list[Scope]) -> str:
    """The containers of a scope, for messages: ``129, 130``."""
    return ", ".join(str(s.vmid) for s in scopes)
