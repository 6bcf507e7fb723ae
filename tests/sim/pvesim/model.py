"""Cluster description -> Proxmox VE API answers.

Everything here is pure data work (no sockets), so the server stays a thin
router and the shapes can be unit-tested. The shapes follow PVE 8.x/9.x as
recorded in ``shared/research/proxmox-facts.md`` §4 and the fixtures beside
it: ``vmid`` integers (strings on the old ``/nodes/{n}/lxc`` when asked),
booleans as 0/1, tags joined with ``;``, the raw ``lxc.*`` keys of an LXC
config as an ordered list of ``[key, value]`` pairs with duplicates.

The LXC/QEMU ``conf`` text of a guest is parsed here with pve-container's
rules (``key: value``; ``lxc.*`` keys accept ``:`` or ``=``; ``#`` lines are
the description; the first ``[section]`` ends the live config). This parser
is deliberately separate from the inventory plugin's own, so a test that runs
the plugin against the simulator checks one implementation against another.
"""

from __future__ import annotations

import copy
import hashlib
import re
import urllib.parse
from dataclasses import dataclass, field
from typing import Any, Callable

# pve-container: ^(lxc\.[a-z0-9_\-\.]+)(:|\s*=)\s*(.*?)\s*$
_RAW_LXC = re.compile(r"^(lxc\.[a-z0-9_\-.]+)(:|\s*=)\s*(.*?)\s*$")
_KEY_VALUE = re.compile(r"^([a-z][a-z_]*\d*):\s*(.*?)\s*$")

# Keys the API returns as JSON numbers (the rest are strings).
_LXC_INT_KEYS = {"cores", "memory", "swap", "onboot", "unprivileged", "tty", "console", "cpuunits", "protection", "template", "debug"}
_QEMU_INT_KEYS = {"cores", "memory", "sockets", "balloon", "onboot", "protection", "template", "numa", "kvm", "acpi", "tablet", "vcpus", "cpuunits"}

DEFAULT_PCI_CLASS_BLACKLIST = ("05", "06", "0b")


class ApiError(Exception):
    """An error answer: HTTP status, PVE message (reason phrase) and optional ``errors`` map."""

    def __init__(self, status: int, message: str, errors: dict[str, str] | None = None, body: bool = True) -> None:
        super().__init__(f"{status} {message}")
        self.status = status
        self.message = message
        self.errors = errors
        # 401s and proxy failures come back without a JSON body on real PVE.
        self.body = body


def parse_conf(text: str, kind: str) -> dict[str, Any]:
    """Parse an ``/etc/pve/{lxc,qemu-server}/<vmid>.conf`` text into the API's config shape."""
    conf: dict[str, Any] = {}
    description: list[str] = []
    raw: list[list[str]] = []
    env: list[str] = []
    int_keys = _LXC_INT_KEYS if kind == "lxc" else _QEMU_INT_KEYS
    for line in text.splitlines():
        stripped = line.strip()
        if not stripped:
            continue
        if stripped.startswith("["):
            break  # snapshot or pending section: not part of the live config
        if stripped.startswith("#"):
            description.append(urllib.parse.unquote(stripped[1:]))
            continue
        if kind == "lxc":
            m = _RAW_LXC.match(stripped)
            if m:
                key, value = m.group(1), m.group(3)
                if key == "lxc.environment.runtime":
                    env.append(value)
                else:
                    raw.append([key, value])
                continue
        m = _KEY_VALUE.match(stripped)
        if not m:
            raise ValueError(f"unparsable config line: {line!r}")
        key, value = m.group(1), m.group(2)
        conf[key] = int(value) if key in int_keys and re.fullmatch(r"-?\d+", value) else value
    if description:
        conf["description"] = "\n".join(description) + "\n"
    if raw:
        conf["lxc"] = raw
    if env:
        conf["env"] = "\0".join(env)
    conf["digest"] = hashlib.sha1(text.encode()).hexdigest()
    return conf


def parse_pending(text: str, kind: str) -> dict[str, Any]:
    """The ``[pve:pending]`` section of a config text: changes waiting for the guest's next start.

    Keys as ``parse_conf`` reads them, plus ``delete`` (comma-separated keys, ``!`` = force) as written by
    pve-guest-common's AbstractConfig. Empty when there is no such section.
    """
    lines: list[str] = []
    inside = False
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("["):
            inside = stripped == "[pve:pending]"
            continue
        if inside:
            lines.append(line)
    if not lines:
        return {}
    pending = parse_conf("\n".join(lines), kind)
    pending.pop("digest", None)
    return pending


def _tags(value: Any) -> str | None:
    if value is None or value == "" or value == []:
        return None
    if isinstance(value, str):
        return value
    return ";".join(str(v) for v in value)


def _mac(vmid: int, index: int = 0) -> str:
    return f"BC:24:11:{(vmid >> 8) & 0xFF:02X}:{vmid & 0xFF:02X}:{index:02X}"


@dataclass
class Node:
    name: str
    ip: str
    nodeid: int
    online: bool = True
    pci: list[dict[str, Any]] = field(default_factory=list)
    maxcpu: int = 64
    maxmem: int = 512 * 2**30


@dataclass
class Guest:
    vmid: int
    node: str
    type: str
    name: str | None
    status: str = "running"
    tags: str | None = None
    pool: str | None = None
    template: bool = False
    lock: str | None = None
    rrd: bool = True
    config: dict[str, Any] = field(default_factory=dict)
    #: The LXC /interfaces answer, or a callable that makes it (the lab reads the container's namespace).
    interfaces: list[dict[str, Any]] | Callable[[], list[dict[str, Any]]] | None = None
    agent_running: bool = True
    snapshots: list[dict[str, Any]] = field(default_factory=list)
    pid: int | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    #: The [pve:pending] section: served merged into the config unless the client asks for current=1.
    pending: dict[str, Any] = field(default_factory=dict)

    @property
    def running(self) -> bool:
        return self.status == "running"


def _default_lxc_config(g: Guest) -> dict[str, Any]:
    return {
        "arch": "amd64",
        "cores": 2,
        "hostname": g.name or f"ct{g.vmid}",
        "memory": 2048,
        "net0": f"name=eth0,bridge=vmbr0,hwaddr={_mac(g.vmid)},ip=dhcp,type=veth",
        "ostype": "debian",
        "rootfs": f"local-lvm:vm-{g.vmid}-disk-0,size=8G",
        "swap": 512,
        "unprivileged": 1,
    }


def _default_qemu_config(g: Guest) -> dict[str, Any]:
    return {
        "boot": "order=scsi0;net0",
        "cores": 4,
        "memory": 8192,
        "name": g.name or f"vm{g.vmid}",
        "net0": f"virtio={_mac(g.vmid)},bridge=vmbr0",
        "ostype": "l26",
        "scsi0": f"local-lvm:vm-{g.vmid}-disk-0,size=32G",
        "scsihw": "virtio-scsi-single",
        "smbios1": f"uuid=00000000-0000-4000-8000-{g.vmid:012d}",
        "sockets": 1,
        "vmgenid": f"11111111-0000-4000-8000-{g.vmid:012d}",
    }


class Cluster:
    """A cluster description, loaded into nodes and guests, answering API paths."""

    def __init__(self, desc: dict[str, Any]) -> None:
        self.desc = copy.deepcopy(desc)
        self.name: str | None = self.desc.get("name")
        self.version: str = str(self.desc.get("pve_version", "8.2.4"))
        major, minor = (int(x) for x in self.version.split(".")[:2])
        self._ver = (major, minor)
        # libpve-http-server-perl >= 5.2.0 (PVE 9 era) adds "message" to error bodies.
        self.error_message_field: bool = bool(self.desc.get("error_message_field", self._ver >= (9, 0)))
        # pve-container before 81aa4bd (Dec 2023) returned vmid as a string in /nodes/{n}/lxc.
        self.lxc_vmid_as_string: bool = bool(self.desc.get("lxc_vmid_as_string", False))
        self.nodes: dict[str, Node] = {}
        for i, n in enumerate(self.desc.get("nodes", []), start=1):
            node = Node(
                name=n["name"],
                ip=n.get("ip", f"10.0.0.{10 + i}"),
                nodeid=int(n.get("nodeid", i)),
                online=bool(n.get("online", True)),
                pci=list(n.get("pci", [])),
                maxcpu=int(n.get("maxcpu", 64)),
            )
            self.nodes[node.name] = node
        self.guests: dict[int, Guest] = {}
        for gd in self.desc.get("guests", []):
            self.add_guest(gd)
        self.mappings: dict[str, list[dict[str, Any]]] = {k: list(v) for k, v in (self.desc.get("mappings") or {}).items()}
        self.pools: dict[str, str] = {p["poolid"]: p.get("comment", "") for p in self.desc.get("pools", [])}
        for g in self.guests.values():
            if g.pool and g.pool not in self.pools:
                self.pools[g.pool] = ""

    # ------------------------------------------------------------------ loading
    def add_guest(self, gd: dict[str, Any]) -> Guest:
        vmid = int(gd["vmid"])
        if vmid in self.guests:
            raise ValueError(f"duplicate vmid {vmid}")
        kind = gd.get("type", "lxc")
        if kind not in ("lxc", "qemu"):
            raise ValueError(f"guest {vmid}: type must be lxc or qemu")
        if gd["node"] not in self.nodes:
            raise ValueError(f"guest {vmid}: unknown node {gd['node']!r}")
        g = Guest(
            vmid=vmid,
            node=gd["node"],
            type=kind,
            name=gd.get("name"),
            status=gd.get("status", "running"),
            tags=_tags(gd.get("tags")),
            pool=gd.get("pool"),
            template=bool(gd.get("template", False)),
            lock=gd.get("lock"),
            rrd=bool(gd.get("rrd", True)),
            interfaces=gd.get("interfaces"),
            agent_running=bool(gd.get("agent_running", True)),
            snapshots=list(gd.get("snapshots", [])),
            pid=gd.get("pid"),
            meta=dict(gd.get("meta", {})),
        )
        if g.template:
            g.status = "stopped"
        self._configure(g, gd.get("conf"), bool(gd.get("conf_only")), gd.get("config", {}))
        self.guests[vmid] = g
        return g

    def _configure(self, g: Guest, conf: str | None, conf_only: bool, extra: dict[str, Any]) -> None:
        config = _default_lxc_config(g) if g.type == "lxc" else _default_qemu_config(g)
        g.pending = {}
        if conf is not None:
            parsed = parse_conf(conf, g.type)
            if conf_only:
                config = parsed
            else:
                config.update(parsed)
            g.pending = parse_pending(conf, g.type)
        config.update(extra)
        if g.tags:
            config.setdefault("tags", g.tags)
        if g.template:
            config["template"] = 1
        if "digest" not in config:
            config["digest"] = hashlib.sha1(repr(sorted(config.items())).encode()).hexdigest()
        g.config = config

    def set_conf(self, vmid: int, text: str) -> None:
        """Serve ``text`` (a whole ``<vmid>.conf``) as guest ``vmid``'s configuration from now on, as if the
        file had been written on the cluster file system (the multi-host lab reads its real files)."""
        self._configure(self.guests[int(vmid)], text, True, {})

    # ------------------------------------------------------------------ helpers
    def node(self, name: str) -> Node:
        node = self.nodes.get(name)
        if node is None:
            raise ApiError(596, f"no such cluster node '{name}'", body=False)
        if not node.online:
            raise ApiError(595, "Errors during connection establishment, proxy handshake: No route to host", body=False)
        return node

    def guest_on(self, node: str, kind: str, vmid: str) -> Guest:
        """The guest ``vmid`` as node ``node`` sees it: only its local configs exist there."""
        self.node(node)
        try:
            g = self.guests[int(vmid)]
        except (KeyError, ValueError):
            g = None
        if g is None or g.node != node or g.type != kind:
            sub = "lxc" if kind == "lxc" else "qemu-server"
            raise ApiError(500, f"Configuration file 'nodes/{node}/{sub}/{vmid}.conf' does not exist")
        return g

    def _uptime(self, g: Guest) -> int:
        return 3600 + g.vmid if g.running else 0

    def _usage(self, g: Guest) -> dict[str, Any]:
        cfg = g.config
        maxmem = int(cfg.get("memory", 2048)) * 2**20
        return {
            "cpu": 0.0123 if g.running else 0,
            "disk": 1234567890 if g.type == "lxc" and g.running else 0,
            "diskread": 1048576 if g.running else 0,
            "diskwrite": 524288 if g.running else 0,
            "maxdisk": 8 * 2**30 if g.type == "lxc" else 32 * 2**30,
            "maxmem": maxmem,
            "mem": maxmem // 4 if g.running else 0,
            "netin": 4096 if g.running else 0,
            "netout": 2048 if g.running else 0,
            "uptime": self._uptime(g),
        }

    # ------------------------------------------------------------------ endpoints
    def version_info(self) -> dict[str, Any]:
        return {"release": ".".join(self.version.split(".")[:2]), "repoid": "5b3c0ffee0dd", "version": self.version}

    def cluster_status(self) -> list[dict[str, Any]]:
        rows: list[dict[str, Any]] = []
        if self.name:
            online = sum(1 for n in self.nodes.values() if n.online)
            rows.append(
                {"type": "cluster", "id": "cluster", "name": self.name, "nodes": len(self.nodes), "quorate": int(online * 2 > len(self.nodes)), "version": 7}
            )
        for i, n in enumerate(self.nodes.values()):
            rows.append(
                {
                    "type": "node",
                    "id": f"node/{n.name}",
                    "name": n.name,
                    "nodeid": n.nodeid,
                    "ip": n.ip,
                    "online": int(n.online),
                    "local": int(i == 0),
                    "level": "",
                }
            )
        return rows

    def _guest_resource(self, g: Guest) -> dict[str, Any]:
        node_online = self.nodes[g.node].online
        row: dict[str, Any] = {"id": f"{g.type}/{g.vmid}", "vmid": g.vmid, "node": g.node, "type": g.type}
        if not node_online or not g.rrd:
            # No RRD data for the guest: PVE knows only id/vmid/node/type.
            row["status"] = "unknown"
        else:
            row.update(self._usage(g))
            row.update({"maxcpu": int(g.config.get("cores", 1)), "name": g.name or "", "status": g.status, "template": int(g.template)})
        if g.tags:
            row["tags"] = g.tags
        if g.pool:
            row["pool"] = g.pool
        if g.lock:
            row["lock"] = g.lock
        return row

    def _node_resource(self, n: Node) -> dict[str, Any]:
        row: dict[str, Any] = {"id": f"node/{n.name}", "type": "node", "node": n.name, "status": "online" if n.online else "offline", "level": ""}
        if n.online:
            row.update(
                {"cpu": 0.05, "maxcpu": n.maxcpu, "mem": n.maxmem // 8, "maxmem": n.maxmem, "disk": 10 * 2**30, "maxdisk": 100 * 2**30, "uptime": 864000}
            )
        return row

    def cluster_resources(self, rtype: str | None) -> list[dict[str, Any]]:
        if rtype not in (None, "vm", "node", "storage", "sdn"):
            raise ApiError(
                400, "Parameter verification failed.", {"type": f"value '{rtype}' does not have a value in the enumeration 'vm, storage, node, sdn'"}
            )
        rows: list[dict[str, Any]] = []
        if rtype in (None, "node"):
            rows += [self._node_resource(n) for n in self.nodes.values()]
        if rtype in (None, "vm"):
            rows += [self._guest_resource(g) for g in sorted(self.guests.values(), key=lambda g: g.vmid)]
        return rows

    def nodes_list(self) -> list[dict[str, Any]]:
        out = []
        for n in self.nodes.values():
            row = self._node_resource(n)
            row["ssl_fingerprint"] = ""
            out.append(row)
        return out

    def node_guests(self, node: str, kind: str) -> list[dict[str, Any]]:
        self.node(node)
        rows = []
        for g in sorted(self.guests.values(), key=lambda g: g.vmid):
            if g.node != node or g.type != kind:
                continue
            row: dict[str, Any] = {"vmid": str(g.vmid) if kind == "lxc" and self.lxc_vmid_as_string else g.vmid, "name": g.name or "", "status": g.status}
            row.update(self._usage(g))
            row["cpus"] = int(g.config.get("cores", 1))
            if kind == "lxc":
                row["type"] = "lxc"
                row["maxswap"] = int(g.config.get("swap", 0)) * 2**20
                row["swap"] = 0
            if g.running:
                row["pid"] = g.pid or 100000 + g.vmid
            if g.tags:
                row["tags"] = g.tags
            if g.template:
                row["template"] = 1
            if g.lock:
                row["lock"] = g.lock
            rows.append(row)
        return rows

    def guest_config(self, node: str, kind: str, vmid: str, current: str | None = None) -> dict[str, Any]:
        """``GET .../config``: pending changes merged in unless ``current`` is true (AbstractConfig::load_current_config)."""
        g = self.guest_on(node, kind, vmid)
        config = copy.deepcopy(g.config)
        if current not in ("1", "true", "yes", "on") and g.pending:
            for key, value in g.pending.items():
                if key != "delete":
                    config[key] = copy.deepcopy(value)
            for key in re.split(r"[,;\s]+", str(g.pending.get("delete", ""))):
                config.pop(key.lstrip("!"), None)
        return config

    def guest_status(self, node: str, kind: str, vmid: str) -> dict[str, Any]:
        g = self.guest_on(node, kind, vmid)
        out: dict[str, Any] = {"vmid": g.vmid, "name": g.name or "", "status": g.status, "ha": {"managed": 0}}
        out.update(self._usage(g))
        out["cpus"] = int(g.config.get("cores", 1))
        if kind == "lxc":
            out["type"] = "lxc"
            out["maxswap"] = int(g.config.get("swap", 0)) * 2**20
            out["swap"] = 0
        else:
            out["qmpstatus"] = g.status
            if str(g.config.get("agent", "0")).split(",", maxsplit=1)[0] in ("1", "enabled=1"):
                out["agent"] = 1
        if g.running:
            out["pid"] = g.pid or 100000 + g.vmid
        if g.tags:
            out["tags"] = g.tags
        if g.template:
            out["template"] = 1
        return out

    def _static_ip(self, g: Guest) -> str | None:
        for key in ("net0", "ipconfig0"):
            for part in str(g.config.get(key, "")).split(","):
                if part.startswith("ip=") and part[3:] not in ("dhcp", "manual", ""):
                    return part[3:]
        return None

    def _guest_ip(self, g: Guest) -> str:
        ip = self._static_ip(g)
        if ip:
            return ip
        return f"10.{20 + list(self.nodes).index(g.node)}.{(g.vmid >> 8) & 0xFF}.{g.vmid & 0xFF or 1}/16"

    def lxc_interfaces(self, node: str, vmid: str) -> list[dict[str, Any]]:
        g = self.guest_on(node, "lxc", vmid)
        if self._ver < (8, 1):
            raise ApiError(501, f"Method 'GET /nodes/{node}/lxc/{vmid}/interfaces' not implemented")
        if not g.running:
            raise ApiError(500, f"CT {vmid} not running")
        if callable(g.interfaces):
            return g.interfaces()  # what the container's network namespace has now (the lab)
        if g.interfaces is not None:
            return copy.deepcopy(g.interfaces)
        mac = _mac(g.vmid).lower()
        return [
            {"hwaddr": "00:00:00:00:00:00", "inet": "127.0.0.1/8", "inet6": "::1/128", "name": "lo"},
            {"hwaddr": mac, "inet": self._guest_ip(g), "inet6": f"fe80::be24:11ff:fe{mac[9:11]}:{mac[12:14]}{mac[15:17]}/64", "name": "eth0"},
        ]

    def agent_interfaces(self, node: str, vmid: str) -> dict[str, Any]:
        g = self.guest_on(node, "qemu", vmid)
        if str(g.config.get("agent", "0")).split(",", maxsplit=1)[0] not in ("1", "enabled=1"):
            raise ApiError(500, "No QEMU guest agent configured")
        if not g.running:
            raise ApiError(500, f"VM {vmid} is not running")
        if not g.agent_running:
            raise ApiError(500, "QEMU guest agent is not running")
        ip, _unused, prefix = self._guest_ip(g).partition("/")
        return {
            "result": [
                {"name": "lo", "hardware-address": "00:00:00:00:00:00", "ip-addresses": [{"ip-address": "127.0.0.1", "ip-address-type": "ipv4", "prefix": 8}]},
                {
                    "name": "eth0",
                    "hardware-address": _mac(g.vmid).lower(),
                    "ip-addresses": [{"ip-address": ip, "ip-address-type": "ipv4", "prefix": int(prefix or 24)}],
                    "statistics": {
                        "rx-bytes": 4096,
                        "rx-dropped": 0,
                        "rx-errs": 0,
                        "rx-packets": 40,
                        "tx-bytes": 2048,
                        "tx-dropped": 0,
                        "tx-errs": 0,
                        "tx-packets": 20,
                    },
                },
            ]
        }

    def snapshots(self, node: str, kind: str, vmid: str) -> list[dict[str, Any]]:
        g = self.guest_on(node, kind, vmid)
        out = copy.deepcopy(g.snapshots)
        current: dict[str, Any] = {"name": "current", "description": "You are here!", "digest": g.config.get("digest", "")}
        if g.running:
            current["running"] = 1
        if out:
            current["parent"] = out[-1]["name"]
        return [*out, current]

    def hardware_pci(self, node: str, blacklist: str | None) -> list[dict[str, Any]]:
        n = self.node(node)
        prefixes = tuple(p for p in (blacklist.split(";") if blacklist is not None else DEFAULT_PCI_CLASS_BLACKLIST) if p)
        out = []
        for dev in n.pci:
            cls = str(dev.get("class", "0x030000"))
            if prefixes and cls[2:].startswith(prefixes):
                continue
            row = {"iommugroup": -1, "subsystem_vendor": dev.get("vendor"), "subsystem_device": "0x0000"}
            row.update(dev)
            out.append(row)
        return out

    def node_network(self, node: str) -> list[dict[str, Any]]:
        n = self.node(node)
        return [
            {"iface": "lo", "type": "loopback", "method": "loopback", "families": ["inet"], "active": 1, "autostart": 1, "priority": 1},
            {
                "iface": "vmbr0",
                "type": "bridge",
                "method": "static",
                "families": ["inet"],
                "active": 1,
                "autostart": 1,
                "address": n.ip,
                "netmask": "24",
                "cidr": f"{n.ip}/24",
                "gateway": n.ip.rsplit(".", 1)[0] + ".1",
                "bridge_ports": "eno1",
                "bridge_stp": "off",
                "bridge_fd": "0",
                "priority": 3,
            },
        ]

    def pool_list(self, poolid: str | None = None) -> list[dict[str, Any]]:
        if poolid is not None:
            if poolid not in self.pools:
                raise ApiError(500, f"pool '{poolid}' does not exist")
            return [{"poolid": poolid, "comment": self.pools[poolid], "members": self.pool_members(poolid)}]
        return [{"poolid": p, "comment": c} for p, c in sorted(self.pools.items())]

    def pool_members(self, poolid: str) -> list[dict[str, Any]]:
        return [self._guest_resource(g) for g in sorted(self.guests.values(), key=lambda g: g.vmid) if g.pool == poolid]

    def pool(self, poolid: str) -> dict[str, Any]:
        if poolid not in self.pools:
            raise ApiError(500, f"pool '{poolid}' does not exist")
        return {"comment": self.pools[poolid], "members": self.pool_members(poolid)}

    def mapping(self, kind: str) -> list[dict[str, Any]]:
        return copy.deepcopy(self.mappings.get(kind, []))
