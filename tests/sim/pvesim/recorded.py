"""Serve the recorded API answers in ``fixtures/`` exactly as they are.

:func:`fixture_cluster` builds a cluster description whose ``responses``
pin each recorded file to its endpoint, so a real client (proxmoxer, the
inventory plugin) can read them over HTTP. Wrapped files are sent verbatim;
inner files get the ``{"data": ...}`` envelope they were stripped of.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

FIXTURES = Path(__file__).resolve().parent / "fixtures"

#: file -> (method, path, HTTP status, wrapped?, reason phrase for errors)
ENDPOINTS: dict[str, tuple[str, str, int, bool, str]] = {
    "nodes.json": ("GET", "/nodes", 200, False, "OK"),
    "cluster_status.json": ("GET", "/cluster/status", 200, True, "OK"),
    "cluster_resources_type_vm.json": ("GET", "/cluster/resources?type=vm", 200, False, "OK"),
    "nodes_node_lxc.json": ("GET", "/nodes/pve2/lxc", 200, False, "OK"),
    "nodes_node_qemu.json": ("GET", "/nodes/pve/qemu", 200, False, "OK"),
    "lxc_status_current.json": ("GET", "/nodes/pve/lxc/100/status/current", 200, False, "OK"),
    "qemu_status_current.json": ("GET", "/nodes/pve/qemu/103/status/current", 200, False, "OK"),
    "lxc_config_static_ip.json": ("GET", "/nodes/pve/lxc/100/config", 200, False, "OK"),
    "lxc_config_raw_lxc_keys.json": ("GET", "/nodes/pve/lxc/101/config", 200, True, "OK"),
    "lxc_interfaces.json": ("GET", "/nodes/pve/lxc/102/interfaces", 200, True, "OK"),
    "qemu_config_hostpci.json": ("GET", "/nodes/pve/qemu/101/config", 200, True, "OK"),
    "access_ticket_post.json": ("POST", "/access/ticket", 200, True, "OK"),
    "error_400_param.json": ("GET", "/cluster/nextid?vmid=200", 400, True, "Parameter verification failed."),
    "error_500_empty_body.json": ("GET", "/nodes/pve/lxc/999/config", 500, True, "Configuration file 'nodes/pve/lxc/999.conf' does not exist"),
    "error_500_message_pve9.json": ("GET", "/nodes/pve/qemu/100/agent/network-get-interfaces", 500, True, "QEMU guest agent is not running"),
}


def load(name: str) -> Any:
    """A fixture file's JSON."""
    return json.loads((FIXTURES / name).read_text(encoding="utf-8"))


def served_body(name: str) -> Any:
    """The JSON document the simulator sends for fixture ``name``."""
    _unused, _unused, _unused, wrapped, _unused = ENDPOINTS[name]
    doc = load(name)
    return doc if wrapped else {"data": doc}


def fixture_cluster() -> dict[str, Any]:
    """A description serving every fixture at its endpoint (nodes pve and pve2, as in the recordings)."""
    responses = []
    for name, (method, path, status, _wrapped, reason) in ENDPOINTS.items():
        entry: dict[str, Any] = {"method": method, "path": path, "status": status, "body": served_body(name)}
        if status >= 400:
            entry["message"] = reason
        else:
            entry["reason"] = reason
        responses.append(entry)
    return {"name": "clustername", "nodes": [{"name": "pve"}, {"name": "pve2"}], "responses": responses}
