"""pvesim: a simulated Proxmox VE API for tests and benchmarks (stdlib only).

A real HTTP(S) server on 127.0.0.1 (``ThreadingHTTPServer``, optional
self-signed TLS) that answers the API paths an inventory needs, with PVE's
shapes: ``{"data": ...}`` envelopes, integer ``vmid``, 0/1 booleans, ``;``
tags, the ordered raw ``lxc`` key list, error bodies with and without the
``message`` field, 401 for bad tokens and tickets, 501 for unknown paths, 595
for an offline node. Every request is counted; latency can be injected.

Python API::

    from pvesim import PveSim, load_cluster
    with PveSim(load_cluster("gpu3"), tls=True, latency_ms=20) as sim:
        sim.url, sim.port, sim.ca_path, sim.env()      # where and how to connect
        sim.requests, sim.request_count                # [(method, path?query)], count
        sim.reset_counter()

CLI::

    python -m pvesim --cluster tests/sim/pvesim/clusters/gpu3.yml --port 8006 [--tls] [--latency-ms 20]

Cluster description (YAML or JSON file, or a dict)::

    name: gpu-lab              # /cluster/status "cluster" row; omit for a standalone node
    pve_version: "8.2.4"       # < 8.1: LXC /interfaces answers 501; >= 9.0: error bodies carry "message"
    error_message_field: false # force the "message" field on or off
    lxc_vmid_as_string: false  # old pve-container: vmid as a string in /nodes/{n}/lxc
    auth:
      tokens: {"root@pam!inventory": "secret-uuid"}   # full token id -> secret
      users: {"root@pam": "password"}                 # for POST /access/ticket
    nodes:
      - name: pve1
        ip: 10.0.0.11          # /cluster/status ip
        online: true           # false: every /nodes/pve1/... answers 595
        pci:                   # /nodes/pve1/hardware/pci rows (PVE field names)
          - {id: "0000:41:00.0", class: "0x030200", vendor: "0x10de", device: "0x2330",
             vendor_name: NVIDIA Corporation, device_name: "GH100 [H100 SXM5 80GB]", iommugroup: 40}
    guests:
      - vmid: 101
        node: pve1
        type: lxc              # lxc | qemu
        name: train-a          # may be omitted (rows without RRD data have no name)
        status: running        # running | stopped
        tags: [gpu, train]     # or "gpu;train"
        pool: ml
        template: false
        rrd: true              # false: the /cluster/resources row has only id/vmid/node/type, status unknown
        conf: |                # the raw /etc/pve/lxc/101.conf, parsed as pve-container does
          dev0: /dev/nvidia0,gid=44
          lxc.mount.entry: /dev/nvidia0 dev/nvidia0 none bind,optional,create=file
          [pve:pending]        # optional: changes waiting for the next start; GET .../config merges
          delete: dev0         # them in unless ?current=1 (as load_current_config does)
        config: {cores: 8}     # API config keys, merged last
        interfaces: [...]      # LXC /interfaces answer (default: lo + eth0)
        agent_running: true    # QEMU agent network-get-interfaces answers (if agent=1 and running)
        pid: 12345             # init pid shown by status/current
        meta: {gpu: true}      # free-form, ignored by the server (ground truth for tests)
    mappings:
      pci: [{id: h100-b, map: ["node=pve2,path=0000:81:00.0,id=10de:2330,iommugroup=81"]}]
    responses:                 # exact answers that win over the model (fixtures, faults)
      - {path: /nodes/pve1/lxc/105/config, status: 500, message: "simulated failure"}
      - {path: "/cluster/resources?type=vm", data: [...]}   # served as {"data": ...}
      - {path: /cluster/status, body: {...}}                 # served verbatim

Only the paths above (plus /version, /nodes, /cluster/resources without a
type, /pools, snapshots, status/current, /nodes/{n}/network) are answered;
anything else is a 501, as on a real server.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from . import recorded
from .model import ApiError, Cluster, parse_conf
from .server import DEFAULT_PASSWORD, DEFAULT_TOKEN_ID, DEFAULT_TOKEN_SECRET, DEFAULT_USER, PveSim

CLUSTERS = Path(__file__).resolve().parent / "clusters"

__all__ = [
    "CLUSTERS",
    "DEFAULT_PASSWORD",
    "DEFAULT_TOKEN_ID",
    "DEFAULT_TOKEN_SECRET",
    "DEFAULT_USER",
    "ApiError",
    "Cluster",
    "PveSim",
    "load_cluster",
    "parse_conf",
    "recorded",
]


def load_cluster(name_or_path: str | Path) -> dict[str, Any]:
    """Load a cluster description: a bundled name (``"gpu3"``) or a ``.yml``/``.yaml``/``.json`` path.

    YAML needs PyYAML (present wherever Ansible is installed); JSON needs nothing.
    """
    path = Path(name_or_path)
    if not path.suffix and not path.exists():
        for ext in (".yml", ".yaml", ".json"):
            candidate = CLUSTERS / f"{name_or_path}{ext}"
            if candidate.exists():
                path = candidate
                break
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".json":
        data = json.loads(text)
    else:
        try:
            import yaml
        except ImportError as exc:  # pragma: no cover - PyYAML comes with Ansible
            raise RuntimeError(f"{path}: reading YAML needs PyYAML; write the description as JSON instead") from exc
        data = yaml.safe_load(text)
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a cluster description is a mapping")
    return data
