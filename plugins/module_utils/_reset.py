# Copyright (c) 2026, gpuops.clean_slate maintainers
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# Note: this module_util is PRIVATE to the collection; it may change without notice.

"""An advisory reset plan: when a GPU's fix is a reset, which GPUs go together, from where, what holds them, and the
commands in order. Nothing here resets a GPU, stops a daemon or signals a process: the collection never does.

What a reset needs (nvidia-smi's manual for ``-r``; NVIDIA/NVSentinel's GPU reset, design 019; notes in
docs/validation.md, "Round 4"): no process may hold the GPU, the NVML clients included (nv-hostengine/DCGM,
dcgm-exporter, nvidia-persistenced), or nvidia-smi answers "In use by another client"; so they are stopped first and
started again after. ``nvidia-smi -r -i <GPUs>`` runs on the host whose driver owns the GPU, never inside a container
(the reset needs CAP_SYS_ADMIN in the host's namespace, and the host's NVML clients hold the GPU). From Ampere on a GPU
is reset alone, with one exception (:data:`TOGETHER`); nvidia-smi refuses an incomplete set and names the GPUs it needs.
Fabric Manager stays running: an Ampere NVSwitch system needs it to reset GPUs one at a time.
"""

from __future__ import annotations

import os
import re
import typing as t

from ansible_collections.gpuops.clean_slate.plugins.module_utils import _health, _proctable

#: The NVML clients that keep the GPUs open, by the names their processes carry, and the service that runs each;
#: stopped in this order before a reset and started in the reverse order after it.
DAEMONS = (
    ("dcgm-exporter", "dcgm-exporter"),
    ("nv-hostengine", "nvidia-dcgm"),
    ("nvidia-persistenced", "nvidia-persistenced"),
)
#: Fabric Manager, which an Ampere NVSwitch system needs running to reset a GPU alone.
FABRICMANAGER = ("nv-fabricmanager", "nvidia-fabricmanager")
#: When the GPUs go in one command: nvidia-smi's rule for an Ampere NVSwitch system without Fabric Manager.
TOGETHER = (
    "an Ampere NVSwitch system without nvidia-fabricmanager running resets every GPU of its NVLink fabric in the same"
    " command (with Fabric Manager running, or from Hopper on, each GPU alone)"
)
_AMPERE_NVSWITCH = re.compile(r"\bA(100|800)\b")


def in_container() -> bool:
    """Whether this process runs inside a container (LXC and systemd say so in PID 1's environment, or /run/systemd/container)."""
    if os.path.exists("/run/systemd/container"):
        return True
    try:
        with open("/proc/1/environ", "rb") as fh:
            return any(item.startswith(b"container=") for item in fh.read().split(b"\0"))
    except OSError:
        return False


def group(wanted: t.Iterable[int], gpus: t.Sequence[t.Mapping[str, t.Any]], fabricmanager: bool = True) -> list[int]:
    """The GPUs to reset in one command: those wanted; on an Ampere NVSwitch system (an A100 or A800 with an NVLink fabric)
    without Fabric Manager running, every GPU of the same fabric too (nvidia-smi's rule; it names any it still needs)."""
    wanted = set(wanted)
    out = set(wanted)
    if fabricmanager:
        return sorted(out)
    fabric = {
        g["index"]: g["fabric"]
        for g in gpus
        if (g.get("fabric") or {}).get("state") not in (None, "not_supported") and _AMPERE_NVSWITCH.search(str(g.get("name") or ""))
    }
    for index in wanted & set(fabric):
        key = (fabric[index].get("cluster_uuid"), fabric[index].get("clique_id"))
        out |= {i for i, f in fabric.items() if (f.get("cluster_uuid"), f.get("clique_id")) == key}
    return sorted(out)


def _comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm", encoding="utf-8", errors="backslashreplace") as fh:
            return fh.read().strip()
    except OSError:
        return "?"


def holders(device_dir: str, minors: t.Collection[int]) -> list[dict[str, t.Any]]:
    """The processes that hold the GPUs' device files now (the same /proc reading as the kill's), each with its name
    and the GPU files it holds; ``nvidiactl`` or ``nvidia-uvm`` alone (a process that holds every GPU through them) counts."""
    found, _unreadable = _proctable.scan_device_holders(device_dir)
    out = []
    for pid, h in sorted(found.items()):
        mine = sorted(h.minors & set(minors))
        if not mine and not (h.other_fds or h.other_maps):
            continue
        if pid == os.getpid():
            continue
        out.append({"pid": pid, "name": _comm(pid), "minors": mine})
    return out


def daemons() -> tuple[list[dict[str, t.Any]], bool]:
    """The NVML clients running here, each with its pids and service, in the order they are stopped; and whether
    Fabric Manager runs."""
    running = _health.find_processes(tuple(name for name, _unit in DAEMONS) + FABRICMANAGER)
    out: list[dict[str, t.Any]] = []
    for name, unit in DAEMONS:
        if running.get(name):
            out.append({"name": name, "service": unit, "pids": running[name]})
    return out, any(running.get(name) for name in FABRICMANAGER)


def plan(
    wanted: t.Mapping[int, t.Sequence[str]],
    gpus: t.Sequence[t.Mapping[str, t.Any]],
    device_dir: str,
    containers: t.Sequence[int],
    host_label: str = "",
) -> dict[str, t.Any] | None:
    """The plan for the GPUs ``wanted`` (index -> the findings that ask for a reset), None when none is wanted.

    ``gpus`` are the verification's GPU reports (index, uuid, pci_bus_id, minor, name; ``fabric`` from the health
    readings). ``containers`` is the container scope (a container cleaned from its node: the node resets, by its own
    bus IDs).
    """
    if not wanted:
        return None
    by_index = {g["index"]: g for g in gpus}
    running, fabricmanager = daemons()
    members = group(wanted, gpus, fabricmanager)
    inside = not containers and in_container()
    if containers:
        where = f"this node (container {containers[0]}'s GPUs, by this node's bus IDs)"
    elif inside:
        where = "the host that runs this container: a container cannot reset its GPUs (the bus IDs are the host's, the same as here)"
    else:
        where = "this host"
    minors = [by_index[i]["minor"] for i in members if by_index.get(i, {}).get("minor") is not None]
    held = [] if inside else holders(device_dir, minors)
    daemon_pids = {pid for d in running for pid in d["pids"]}
    others = [h for h in held if h["pid"] not in daemon_pids]
    services = [d["service"] for d in running]
    ids = [str(by_index[i].get("pci_bus_id") or by_index[i].get("uuid") or i) for i in members if i in by_index]
    commands: list[str] = []
    if services:
        commands.append("systemctl stop " + " ".join(services))
    for h in others:
        commands.append(f"kill {h['pid']}  # {h['name']}: it holds the GPUs' device files; end it through its service where it has one")
    devices = " ".join(f"{device_dir.rstrip('/')}/nvidia{m}" for m in minors)
    commands.append(f"fuser -v {devices}  # must list no process")
    commands.append(f"nvidia-smi -r -i {','.join(ids)}  # if it names other GPUs that must go with them, add them")
    if services:
        commands.append("systemctl start " + " ".join(reversed(services)))
    commands.append("nvidia-smi -q -d ECC,ROW_REMAPPER,PAGE_RETIREMENT  # then run the clean slate again: it proves the GPUs clean and startable")
    return {
        "advisory": True,
        "gpus": [{"index": i, "uuid": by_index[i].get("uuid"), "pci_bus_id": by_index[i].get("pci_bus_id"), "why": list(wanted.get(i, []))} for i in members],
        "together": TOGETHER if len(members) > len(wanted) else "",
        "where": where,
        "host": host_label,
        "daemons": running,
        "fabricmanager": fabricmanager,
        "holders": others,
        "commands": commands,
    }


def lines(p: t.Mapping[str, t.Any]) -> list[str]:
    """The plan in a few lines of the message."""
    members = _health.gpu_list(g["index"] for g in p["gpus"])
    together = f" ({p['together']})" if p.get("together") else ""
    held = ", ".join(f"PID {h['pid']} {h['name']}" for h in p.get("holders") or [])
    daemon_text = ", ".join(f"{d['name']} (PID {', '.join(map(str, d['pids']))})" for d in p.get("daemons") or [])
    holding = "; ".join(x for x in (daemon_text, held) if x) or "no process"
    return [
        f"Reset plan (advisory: nothing was reset): reset {members}{together}, on {p['where']}; holding them now: {holding}.",
        "Commands, in order: " + "; ".join(c.split("  #")[0] for c in p["commands"]) + ".",
    ]
