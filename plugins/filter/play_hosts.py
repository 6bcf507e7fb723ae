# Copyright (c) 2026, gpuops.clean_slate maintainers
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

"""The play_hosts filter: a play's host pattern, refused when it targets no host.

Ansible skips a play whose pattern matches nothing ("skipping: no hosts matched") and exits 0,
also when an inventory source failed to parse or a --limit excludes every host of the pattern.
For a job whose green status starts inference servers, that is a false green. The
gpuops.clean_slate.clean_slate playbook templates its ``hosts`` through this filter, which runs
before any host is chosen (so it holds for the FQCN playbook, import_playbook and ansible-runner),
and stops ansible-playbook there with a message naming the pattern, the groups that exist and the fix.
"""

from __future__ import annotations

import multiprocessing
import typing as t
from collections.abc import Mapping, Sequence

from ansible import context
from ansible.errors import AnsibleFilterError
from ansible.utils.display import Display

# The implicit localhost is never in ansible_play_hosts_all, but a play on it runs when no limit is given.
LOCALHOST = frozenset({"localhost", "127.0.0.1", "::1"})
SHOWN = 5


def listing_only() -> bool:
    """True for ansible-playbook --syntax-check, --list-tasks and --list-tags, which run no host
    (ansible-lint's syntax check among them): the pattern is not judged there."""
    args = context.CLIARGS
    return bool(args.get("syntax") or args.get("listtasks") or args.get("listtags"))


def no_host_message(pattern: str, matched: Sequence[str], groups: Mapping[str, Sequence[str]], limit: str | None) -> str:
    """Why ``pattern`` targets no host, and what to do, in one message."""
    named = ", ".join(sorted(name for name, members in groups.items() if name != "all" and members)) or "none"
    if not groups.get("all"):
        return (
            "gpuops.clean_slate: nothing to clean: the inventory has no hosts. An inventory source failed to parse or gave no host"
            " (see the warnings above; for the gpuops.clean_slate.proxmox inventory check PROXMOX_URL, the API token and the CA),"
            " or no inventory was given (-i). Nothing was done."
        )
    if not matched:
        return (
            f"gpuops.clean_slate: the host pattern '{pattern}' matches no host of the inventory. Groups with hosts: {named}."
            " Put the GPU hosts in a group gpu_nodes (or gpu-nodes), or name them with -e clean_slate_hosts=<group or pattern>."
            " Nothing was done."
        )
    shown = ", ".join(list(matched)[:SHOWN]) + (", ..." if len(matched) > SHOWN else "")
    return (
        f"gpuops.clean_slate: --limit '{limit or ''}' leaves none of the {len(matched)} host(s) of '{pattern}' ({shown})."
        f" Groups with hosts: {named}. Limit to hosts or groups inside '{pattern}', or name the hosts with"
        " -e clean_slate_hosts=<group or pattern>. Nothing was done."
    )


def refuse(message: str) -> t.NoReturn:
    """Stop ansible-playbook with ``message`` as its one error and exit status 1 (ansible-runner and AWX: ``failed``).

    An exception raised by a filter in a play's ``hosts`` reaches the user wrapped twice by Ansible ("Error processing
    keyword 'hosts': The filter plugin ... failed: ...") with an excerpt of the playbook's source, which reads like a
    crash of the playbook rather than a refusal of the run. So the message is displayed as Ansible displays its own
    errors, and the process exits as ansible-playbook itself does for "no hosts to target" (status 1); nothing has run
    yet (a play's hosts are templated before any host is chosen), and the ``finally`` blocks of Ansible's executor still
    run on the way out. In a worker process (the filter used in a task's template, where exiting would only end the
    worker) it raises instead.
    """
    if multiprocessing.parent_process() is not None:
        raise AnsibleFilterError(message)
    Display().error(message)
    raise SystemExit(1)


def play_hosts(
    pattern: str,
    matched: Sequence[str],
    limited: Sequence[str],
    groups: Mapping[str, Sequence[str]],
    limit: str | None = None,
) -> str:
    """``pattern`` itself when, after --limit, it targets at least one host; else an error.

    ``matched``: the hosts of the pattern (the ansible.builtin.inventory_hostnames lookup);
    ``limited``: every host --limit leaves (ansible_play_hosts_all while the play's hosts are
    templated); ``groups``: the groups magic variable; ``limit``: ansible_limit. The error stops the run
    (:func:`refuse`).
    """
    if not isinstance(pattern, str) or not pattern.strip():
        refuse(f"gpuops.clean_slate: the host pattern must be a non-empty string, got {pattern!r} (clean_slate_hosts). Nothing was done.")
    if listing_only():
        return pattern
    if pattern in LOCALHOST and not limit:
        return pattern
    if set(matched or []) & set(limited or []):
        return pattern
    refuse(no_host_message(pattern, list(matched or []), groups or {}, limit))


class FilterModule:
    """The collection's filters."""

    def filters(self) -> dict[str, t.Callable[..., t.Any]]:
        return {"play_hosts": play_hosts}
