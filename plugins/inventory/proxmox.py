# Copyright (c) 2026, gpuops.clean_slate maintainers
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

from __future__ import annotations

DOCUMENTATION = r"""
name: proxmox
short_description: Proxmox VE nodes and guests, GPU-aware, from a few API calls
version_added: 0.1.0
author:
  - gpuops.clean_slate maintainers (@gpuops)
description:
  - Builds an inventory of a Proxmox VE cluster's nodes, LXC containers and QEMU virtual machines, and finds the guests
    that use a GPU. The group O(gpu_group) (C(gpu_nodes)) holds every GPU guest and every node that hosts one or has
    GPUs itself; it is the group the clean-slate playbook is limited to.
  - Discovery takes two requests (C(/cluster/status) and C(/cluster/resources?type=vm)). Then only the guests left after
    O(filters), O(include_types) and O(exclude_templates) have their configuration read, O(max_concurrency) at a time,
    with C(current=1), which gives the configuration the guest runs with, not changes pending until its next start.
    Running GPU containers also get C(/interfaces) (O(want_interfaces)), and a node's C(/hardware/pci) is read only
    when one of its VMs passes a PCI device through.
  - "Requests per run: 2 + [1 login, password auth only] + one config per selected guest on an online node + one
    C(/interfaces) per running GPU container + one C(/hardware/pci) per node with C(hostpciN) VMs (every online node
    with O(scan_node_gpus)) + [1 C(/cluster/mapping/pci) when a VM uses C(mapping=)]. With O(cache), a second run
    makes none."
  - "GPU passthrough recognised in LXC configs: C(devN: /dev/nvidia0,gid=44) (Proxmox VE 8.1+, V(lxc-dev); also as Proxmox
    VE 9 rewrites a hot-plugged device, C(/dev/nvidia0,deny-write=0,gid=44)); raw keys
    (V(lxc-raw)): C(lxc.mount.entry) of a GPU device, C(lxc.cgroup2.devices.allow)/C(lxc.cgroup.devices.allow) for
    NVIDIA's major 195, the NVIDIA LXC hook, C(NVIDIA_VISIBLE_DEVICES) in the environment; both C(:) and C(=)
    separators, repeated keys kept. In VM configs: C(hostpciN) whose vendor, looked up in the node's PCI list or the
    cluster's PCI mappings, is NVIDIA (V(0x10de)) (V(qemu-hostpci))."
  - Nodes get C(ansible_host) from C(/cluster/status). Containers get C(ansible_host) from their interfaces when running
    and reachable, else from a static C(ip=) in their config, and always C(proxmox_node_host), their node's address,
    to reach them with M(gpuops.clean_slate.pct_exec). With O(pct_remote), containers are reached through their node
    with the C(community.proxmox.proxmox_pct_remote) connection instead.
  - Host variables are always named C(proxmox_*), whatever O(group_prefix) says; O(filters), O(compose), O(groups) and
    O(keyed_groups) all see these names.
  - Guests with the same name are all kept; the one with the lowest vmid keeps the name, the others get C(-<vmid>)
    appended, with a warning. Guests of an offline node are kept with C(proxmox_status=unknown) in the
    C(proxmox_unreachable) group. A guest whose config cannot be read is kept with C(proxmox_config_error) and a
    warning; only a failed discovery fails the source.
extends_documentation_fragment:
  - constructed
  - inventory_cache
options:
  plugin:
    description: The name of this plugin; the file must be named C(*.proxmox.yml) or C(*.proxmox.yaml).
    required: true
    type: str
    choices: [gpuops.clean_slate.proxmox]
  url:
    description:
      - Base URL of the Proxmox VE API, without C(/api2/json). May be a template.
    type: str
    default: https://localhost:8006
    env:
      - name: PROXMOX_URL
  user:
    description:
      - User as C(user@realm), for password authentication, or the owner of a bare O(token_id).
    type: str
    env:
      - name: PROXMOX_USER
  password:
    description:
      - Password of O(user); the plugin logs in for a ticket. Prefer an API token.
    type: str
    env:
      - name: PROXMOX_PASSWORD
  token_id:
    description:
      - API token ID, in full (C(user@realm!tokenid)) or only C(tokenid) with O(user) set.
    type: str
    env:
      - name: PROXMOX_TOKEN_ID
  token_secret:
    description:
      - Secret (UUID) of the API token. Never logged.
    type: str
    env:
      - name: PROXMOX_TOKEN_SECRET
  validate_certs:
    description:
      - Verify the API's TLS certificate.
    type: bool
    default: true
    env:
      - name: PROXMOX_VALIDATE_CERTS
  ca_path:
    description:
      - CA certificate (PEM) to verify the API's certificate with, for example a cluster's C(/etc/pve/pve-root-ca.pem).
    type: path
    env:
      - name: PROXMOX_CA_PATH
  api_timeout:
    description: Seconds to wait for each API answer.
    type: int
    default: 10
  max_concurrency:
    description: Most API requests in flight at once, for the per-guest requests.
    type: int
    default: 8
  include_types:
    description: Guest types to include.
    type: list
    elements: str
    choices: [lxc, qemu]
    default: [lxc, qemu]
  exclude_templates:
    description: Leave templates out (they never run).
    type: bool
    default: true
  filters:
    description:
      - Jinja2 conditionals; a guest is kept only when all are true. They are evaluated before any per-guest request,
        against C(proxmox_vmid), C(proxmox_name), C(proxmox_node), C(proxmox_type), C(proxmox_status), C(proxmox_tags),
        C(proxmox_pool) and C(proxmox_template).
    type: list
    elements: str
    default: []
  want_interfaces:
    description:
      - Read C(/nodes/{node}/lxc/{vmid}/interfaces) of running GPU containers for their C(ansible_host).
    type: bool
    default: true
  want_config:
    description:
      - Also set C(proxmox_config), the guest's whole configuration as the API returns it (raw C(lxc) list included).
    type: bool
    default: false
  scan_node_gpus:
    description:
      - Read C(/nodes/{node}/hardware/pci) of every online node, so that nodes with NVIDIA GPUs but no GPU guest join
        O(gpu_group) too. One more request per node.
    type: bool
    default: false
  gpu_device_globs:
    description:
      - Device paths (shell patterns) that make an LXC container a GPU guest.
      - Add V(/dev/dri/*) to count Intel and AMD GPUs passed through C(/dev/dri).
    type: list
    elements: str
    default: ["/dev/nvidia*", "/dev/nvidia-caps/*"]
  group_prefix:
    description:
      - Prefix of the groups this plugin creates (except O(gpu_group)).
      - It renames groups only. Host variables keep their C(proxmox_) names, which the clean-slate role,
        M(gpuops.clean_slate.pct_exec) examples and the C(community.proxmox.proxmox_pct_remote) connection read.
    type: str
    default: proxmox_
  exclude_nodes:
    description:
      - Leave the Proxmox VE nodes out of the inventory (no node hosts, no C(<group_prefix>hypervisors) group), like
        community.proxmox's option of the same name. Guests still get C(proxmox_node) and C(proxmox_node_host).
    type: bool
    default: false
  compat_groups:
    description:
      - Also create the groups community.proxmox 2.0 creates, with its names, beside this plugin's own, so that
        playbooks written for it keep their host patterns.
      - "With the default prefix: C(proxmox_all_lxc), C(proxmox_all_qemu) (guests by type, templates excluded),
        C(proxmox_all_running), C(proxmox_all_stopped) and C(proxmox_all_<status>) for any other status
        (for example C(proxmox_all_unknown)), C(proxmox_all_templates), C(proxmox_nodes) (unless O(exclude_nodes)),
        C(proxmox_<node>_lxc) and C(proxmox_<node>_qemu). Names are lower-cased and every character but letters,
        digits and C(_) becomes C(_), as community.proxmox does. C(proxmox_pool_<pool>) exists either way."
      - docs/proxmox.md maps every group, variable and option of community.proxmox to this plugin's.
    type: bool
    default: false
  want_facts:
    description:
      - Also set every key of a guest's configuration as a host variable C(proxmox_<key>), shaped as community.proxmox's
        O(want_facts) shapes it - a value made only of C(key=value) pairs becomes a dictionary (C(proxmox_net0.ip)),
        disks get C(disk_image=) in front, C(proxmox_tags_parsed) lists the tags - except the raw C(lxc) list, which
        stays a list of C([key, value]) pairs with repeated keys kept.
      - The variables this plugin always sets keep their meaning; a configuration key of the same name
        (C(tags), C(name), C(template)) does not replace them.
      - Costs no request (configurations are read anyway), but only guests whose configuration was read get them.
    type: bool
    default: false
  pct_remote:
    description:
      - Reach LXC containers through their Proxmox VE node with community.proxmox's C(proxmox_pct_remote) connection
        (SSH to the node, then C(pct exec) into the container).
      - V(never) sets nothing. V(no_address) does it for containers that got no C(ansible_host). V(always) does it for
        every container.
      - Such a container gets C(ansible_connection=community.proxmox.proxmox_pct_remote) and C(ansible_host) set to its
        node's address (C(proxmox_node_host)); the connection takes the container from C(proxmox_vmid). O(compose)
        runs after and can override both (for example C(ansible_user) for the node).
      - The collection community.proxmox and the Python library paramiko must be installed on the controller.
    type: str
    choices: [never, no_address, always]
    default: never
  gpu_group:
    description: Name of the group of GPU guests and GPU nodes.
    type: str
    default: gpu_nodes
notes:
  - The API user or token needs C(Sys.Audit) on C(/) and C(VM.Audit) on the guests (the C(PVEAuditor) role).
  - "Host variables (always C(proxmox_*)): C(proxmox_vmid), C(proxmox_node), C(proxmox_type) (V(lxc), V(qemu), V(node)),
    C(proxmox_status), C(proxmox_name), C(proxmox_tags), C(proxmox_pool), C(proxmox_template),
    C(proxmox_node_host), C(proxmox_gpu_devices), C(proxmox_gpu_passthrough) (V(lxc-dev), V(lxc-raw),
    V(qemu-hostpci) or null), C(proxmox_gpu_evidence) (the config lines that made it a GPU guest);
    nodes have C(proxmox_gpu_guests) and, when their PCI list was read, C(proxmox_node_gpus)."
  - "Groups (with the default prefix): C(proxmox_hypervisors), C(proxmox_containers), C(proxmox_vms),
    C(proxmox_<node>) (the node's guests), C(proxmox_running), C(proxmox_stopped), C(proxmox_unreachable),
    C(proxmox_templates), C(proxmox_tag_<tag>), C(proxmox_pool_<pool>), and O(gpu_group); with O(compat_groups),
    community.proxmox's as well."
seealso:
  - module: gpuops.clean_slate.pct_exec
"""

EXAMPLES = r"""
---
# gpu.proxmox.yml: token from the environment (PROXMOX_URL, PROXMOX_TOKEN_ID, PROXMOX_TOKEN_SECRET)
plugin: gpuops.clean_slate.proxmox

---
# cluster.proxmox.yml: explicit token, cluster CA, only tagged or running guests, cached for 10 minutes
plugin: gpuops.clean_slate.proxmox
url: https://pve1.example.com:8006
token_id: inventory@pve!clean-slate
token_secret: "{{ lookup('ansible.builtin.env', 'PVE_TOKEN_SECRET') }}"
ca_path: /etc/ansible/pve-root-ca.pem
filters:
  - proxmox_status == 'running' or 'gpu' in proxmox_tags
max_concurrency: 16
cache: true
cache_plugin: ansible.builtin.jsonfile
cache_connection: /var/cache/ansible/proxmox
cache_timeout: 600
keyed_groups:
  - key: proxmox_gpu_passthrough
    prefix: passthrough
compose:
  ansible_user: "'root'"

---
# migrated.proxmox.yml: a community.proxmox user's playbooks keep working (its group names, config facts, no nodes);
# containers without an address are reached through their node with community.proxmox.proxmox_pct_remote
plugin: gpuops.clean_slate.proxmox
compat_groups: true
want_facts: true
exclude_nodes: true
pct_remote: no_address
compose:
  ansible_user: "'root'"
"""

# validate-modules wants DOCUMENTATION and EXAMPLES before any import.
import typing as t  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402

from ansible.errors import AnsibleError, AnsibleParserError  # noqa: E402
from ansible.plugins.inventory import BaseInventoryPlugin, Cacheable, Constructable  # noqa: E402

from ansible_collections.gpuops.clean_slate.plugins.plugin_utils._proxmox import (  # noqa: E402
    ProxmoxApiError,
    ProxmoxClient,
    fetch_all,
    make_unsafe,
)
from ansible_collections.gpuops.clean_slate.plugins.plugin_utils._proxmox_config import (  # noqa: E402
    GpuInfo,
    HostPci,
    address_from_interfaces,
    config_facts,
    lxc_gpu,
    mapping_devices,
    parse_tags,
    pci_vendors,
    qemu_gpu,
    qemu_hostpci,
    safe_name,
    static_address,
    to_bool,
)

#: The connection plugin that O(pct_remote) selects, and the variables it reads (community.proxmox 2.0.0:
#: remote_addr from ansible_host, vmid from proxmox_vmid).
PCT_REMOTE_CONNECTION = "community.proxmox.proxmox_pct_remote"
#: Host variables always carry this prefix (group_prefix renames groups only): the role, the pct_exec examples and
#: community.proxmox's proxmox_pct_remote connection read these names.
VAR_PREFIX = "proxmox_"


@dataclass
class _Node:
    name: str
    ip: str | None
    online: bool
    nodeid: int | None = None
    gpus: list[str] | None = None
    gpu_guests: list[str] = field(default_factory=list)


@dataclass
class _Guest:
    vmid: int
    kind: str
    node: str
    name: str | None
    status: str
    template: bool
    tags: list[str]
    pool: str | None
    config: dict[str, t.Any] | None = None
    config_error: str | None = None
    unreachable: bool = False
    hostpci: list[HostPci] = field(default_factory=list)
    gpu: GpuInfo = field(default_factory=GpuInfo)
    address: str | None = None
    inventory_name: str = ""

    def base_vars(self) -> dict[str, t.Any]:
        """The variables known before any per-guest request: what O(filters) sees, and every guest's host vars."""
        p = VAR_PREFIX
        return {
            f"{p}vmid": self.vmid,
            f"{p}name": self.name,
            f"{p}node": self.node,
            f"{p}type": self.kind,
            f"{p}status": self.status,
            f"{p}tags": self.tags,
            f"{p}pool": self.pool,
            f"{p}template": self.template,
        }


class InventoryModule(BaseInventoryPlugin, Constructable, Cacheable):
    """Proxmox VE inventory with GPU awareness."""

    NAME = "gpuops.clean_slate.proxmox"

    def verify_file(self, path: str) -> bool:
        return bool(super().verify_file(path)) and path.endswith(("proxmox.yml", "proxmox.yaml"))

    # ------------------------------------------------------------------ options
    def _templated(self, name: str) -> t.Any:
        value = self.get_option(name)
        if isinstance(value, str) and self.templar.is_template(value):
            value = self.templar.template(value)
        return value

    def _client(self, cached: t.Mapping[str, t.Any] | None) -> ProxmoxClient:
        try:
            return ProxmoxClient(
                str(self._templated("url")),
                token_id=self._templated("token_id"),
                token_secret=self._templated("token_secret"),
                user=self._templated("user"),
                password=self._templated("password"),
                validate_certs=bool(self.get_option("validate_certs")),
                ca_path=self.get_option("ca_path"),
                timeout=int(self.get_option("api_timeout")),
                cached=cached,
            )
        except ValueError as exc:
            raise AnsibleParserError(f"{self.NAME}: {exc}") from None

    # ------------------------------------------------------------------ entry point
    def parse(self, inventory: t.Any, loader: t.Any, path: str, cache: bool = True) -> None:
        super().parse(inventory, loader, path, cache)
        self._read_config_data(path)
        self._warnings: list[str] = []
        self._prefix = str(self.get_option("group_prefix"))
        cache_key = self.get_cache_key(path)
        use_cache = bool(self.get_option("cache")) and cache
        update_cache = bool(self.get_option("cache")) and not cache
        cached: dict[str, t.Any] | None = None
        if use_cache:
            try:
                cached = self._cache[cache_key]
            except KeyError:
                update_cache = True
        client = self._client(cached)
        try:
            self._populate(client)
        except ProxmoxApiError as exc:
            raise AnsibleParserError(f"{self.NAME}: {exc}") from None
        if update_cache:
            self._cache[cache_key] = client.responses
        for warning in self._warnings:
            self.display.warning(warning)
        self.display.vv(f"{self.NAME}: {client.request_count} API requests")

    # ------------------------------------------------------------------ discovery
    def _populate(self, client: ProxmoxClient) -> None:
        status = client.get("/cluster/status")
        resources = client.get("/cluster/resources?type=vm")
        nodes = self._nodes(status, resources)
        guests = self._select([self._guest(row) for row in resources or [] if isinstance(row, dict) and row.get("type") in ("lxc", "qemu")])
        max_workers = int(self.get_option("max_concurrency"))

        # Configs of the selected guests on online nodes.
        paths: dict[str, _Guest] = {}
        for g in guests:
            node = nodes.get(g.node)
            if node is not None and not node.online:
                g.unreachable = True
                g.status = "unknown"
                continue
            # current=1: the configuration the guest runs with. Without it PVE merges changes pending until the next
            # start (load_current_config), so a running container whose devN removal is pending would look GPU-free
            # while it still holds the GPU (pending edits are routine on PVE 9, which hot-plugs only new devices).
            paths[f"/nodes/{g.node}/{g.kind}/{g.vmid}/config?current=1"] = g
        for path, answer in fetch_all(client, list(paths), max_workers).items():
            g = paths[path]
            if isinstance(answer, ProxmoxApiError):
                self._guest_failed(g, answer)
            elif isinstance(answer, dict):
                g.config = answer
            else:
                g.config_error = f"unexpected answer for {path}"
                self._warnings.append(f"{self.NAME}: guest {g.vmid}: {g.config_error}")

        # GPU parsing, then the follow-up requests it calls for, all in one concurrent batch.
        globs = list(self.get_option("gpu_device_globs"))
        pci_nodes: set[str] = {n.name for n in nodes.values() if n.online} if self.get_option("scan_node_gpus") else set()
        want_mapping = False
        for g in guests:
            if g.config is None:
                continue
            if g.kind == "lxc":
                g.gpu = lxc_gpu(g.config, globs)
            else:
                g.hostpci = qemu_hostpci(g.config)
                if any(hp.hosts for hp in g.hostpci):
                    pci_nodes.add(g.node)
                want_mapping = want_mapping or any(hp.mapping for hp in g.hostpci)
        follow: list[str] = [f"/nodes/{n}/hardware/pci" for n in sorted(pci_nodes)]
        if want_mapping:
            follow.append("/cluster/mapping/pci")
        iface_paths: dict[str, _Guest] = {}
        if self.get_option("want_interfaces"):
            for g in guests:
                if g.kind == "lxc" and g.gpu.is_gpu and g.status == "running":
                    iface_paths[f"/nodes/{g.node}/lxc/{g.vmid}/interfaces"] = g
        answers = fetch_all(client, follow + list(iface_paths), max_workers)

        vendors: dict[str, dict[str, str] | None] = {}
        for name in pci_nodes:
            rows = answers.get(f"/nodes/{name}/hardware/pci")
            if isinstance(rows, ProxmoxApiError) or not isinstance(rows, list):
                vendors[name] = None
                self._warnings.append(f"{self.NAME}: cannot read the PCI devices of node {name}, VMs' hostpci vendors unresolved: {rows}")
                continue
            vendors[name] = pci_vendors(rows)
            if name in nodes:
                nodes[name].gpus = sorted(a for a, v in vendors[name].items() if v == "0x10de")  # type: ignore[union-attr]
        mappings = None
        if want_mapping:
            rows = answers.get("/cluster/mapping/pci")
            if isinstance(rows, list):
                mappings = mapping_devices(rows)
            else:
                self._warnings.append(f"{self.NAME}: cannot read the cluster's PCI mappings: {rows}")
        for g in guests:
            if g.kind == "qemu" and g.hostpci:
                g.gpu = qemu_gpu(g.hostpci, vendors.get(g.node), mappings, g.node)
                if g.gpu.unresolved:
                    self._warnings.append(f"{self.NAME}: VM {g.vmid}: vendor of {', '.join(g.gpu.unresolved)} unknown, counted as a GPU")
            if g.config is not None:
                g.address = static_address(g.config, g.kind)
        for path, g in iface_paths.items():
            rows = answers.get(path)
            if isinstance(rows, list):
                g.address = address_from_interfaces(rows) or g.address
            elif isinstance(rows, ProxmoxApiError) and rows.unreachable:
                g.unreachable = True

        self._name_guests(guests, nodes)
        self._add_all(nodes, guests)

    def _nodes(self, status: t.Any, resources: t.Any) -> dict[str, _Node]:
        nodes: dict[str, _Node] = {}
        for row in status or []:
            if isinstance(row, dict) and row.get("type") == "node" and row.get("name"):
                nodeid = row.get("nodeid")
                nodes[str(row["name"])] = _Node(
                    str(row["name"]), row.get("ip") or None, to_bool(row.get("online", 1)), int(nodeid) if nodeid is not None else None
                )
        for row in resources or []:
            # A guest on a node /cluster/status did not list (should not happen): assume it online, let its config tell.
            name = row.get("node") if isinstance(row, dict) else None
            if name and name not in nodes:
                nodes[str(name)] = _Node(str(name), None, True)
        return nodes

    def _guest(self, row: dict[str, t.Any]) -> _Guest:
        return _Guest(
            vmid=int(row["vmid"]),
            kind=str(row["type"]),
            node=str(row.get("node", "")),
            # Rows without RRD data carry no name (and status "unknown").
            name=str(row["name"]) if row.get("name") else None,
            status=str(row.get("status") or "unknown"),
            template=to_bool(row.get("template", 0)),
            tags=parse_tags(row.get("tags")),
            pool=str(row["pool"]) if row.get("pool") else None,
        )

    def _select(self, guests: list[_Guest]) -> list[_Guest]:
        types = set(self.get_option("include_types"))
        filters = list(self.get_option("filters"))
        strict = bool(self.get_option("strict"))
        out = []
        for g in sorted(guests, key=lambda g: g.vmid):
            if g.kind not in types or (g.template and self.get_option("exclude_templates")):
                continue
            keep = True
            for expr in filters:
                try:
                    keep = bool(self._compose(expr, make_unsafe(g.base_vars())))
                except Exception as exc:  # any templating error; strict decides
                    if strict:
                        raise AnsibleError(f"{self.NAME}: cannot evaluate filter {expr!r} for guest {g.vmid}: {exc}") from exc
                    self._warnings.append(f"{self.NAME}: filter {expr!r} ignored for guest {g.vmid}: {exc}")
                    keep = True
                if not keep:
                    break
            if keep:
                out.append(g)
        return out

    def _guest_failed(self, g: _Guest, exc: ProxmoxApiError) -> None:
        g.config_error = str(exc)
        if exc.unreachable:
            g.unreachable = True
            g.status = "unknown"
        self._warnings.append(f"{self.NAME}: guest {g.vmid} on {g.node} kept without its configuration: {exc}")

    def _name_guests(self, guests: list[_Guest], nodes: dict[str, _Node]) -> None:
        # Node names are taken only when the nodes are inventory hosts themselves.
        taken: set[str] = set() if self.get_option("exclude_nodes") else set(nodes)
        for g in sorted(guests, key=lambda g: g.vmid):
            cfg = g.config or {}
            base = g.name or cfg.get("hostname" if g.kind == "lxc" else "name") or f"{g.kind}-{g.vmid}"
            name = str(base)
            if name in taken:
                name = f"{base}-{g.vmid}"
                self._warnings.append(f"{self.NAME}: the name {base!r} is already taken; guest {g.vmid} on {g.node} is in the inventory as {name!r}")
            taken.add(name)
            g.inventory_name = name

    # ------------------------------------------------------------------ inventory
    def _group(self, name: str) -> str:
        return str(self.inventory.add_group(self._sanitize_group_name(name)))

    def _member(self, group: str, host: str) -> None:
        self.inventory.add_child(self._group(group), host)

    def _construct(self, host: str) -> None:
        strict = bool(self.get_option("strict"))
        hostvars = self.inventory.get_host(host).get_vars()
        self._set_composite_vars(self.get_option("compose"), hostvars, host, strict=strict)
        self._add_host_to_composed_groups(self.get_option("groups"), hostvars, host, strict=strict)
        self._add_host_to_keyed_groups(self.get_option("keyed_groups"), hostvars, host, strict=strict)

    def _compat_group(self, name: str) -> str:
        """A community.proxmox group name: prefix + lower-cased name through its to_safe."""
        return str(self.inventory.add_group(safe_name(f"{self._prefix}{name.lower()}")))

    def _add_all(self, nodes: dict[str, _Node], guests: list[_Guest]) -> None:
        p = self._prefix
        v = VAR_PREFIX
        gpu_group = self._group(str(self.get_option("gpu_group")))
        exclude_nodes = bool(self.get_option("exclude_nodes"))
        compat = bool(self.get_option("compat_groups"))
        want_facts = bool(self.get_option("want_facts"))
        want_config = bool(self.get_option("want_config"))
        pct_remote = str(self.get_option("pct_remote"))
        for name in (() if exclude_nodes else ("hypervisors",)) + ("containers", "vms", "running", "stopped", "unreachable"):
            self._group(p + name)
        if compat:
            # community.proxmox creates these even when empty, and <node>_lxc/_qemu for every online node. It drops an
            # offline node's guests; this plugin keeps them (status unknown), so their node's groups exist too.
            for name in ("all_lxc", "all_qemu", "all_running", "all_stopped", "all_templates") + (() if exclude_nodes else ("nodes",)):
                self._compat_group(name)
            for node_name in nodes:
                self._compat_group(f"{node_name}_lxc")
                self._compat_group(f"{node_name}_qemu")
        for g in guests:
            host = g.inventory_name
            self.inventory.add_host(host)
            node = nodes.get(g.node)
            node_host = node.ip if node and node.ip else g.node
            hostvars: dict[str, t.Any] = {}
            if want_facts and g.config is not None:
                # Set first, so that the variables below (documented, always present) win over config keys of the
                # same name (tags, name, template).
                hostvars.update(config_facts(g.config, v))
            hostvars.update(g.base_vars())
            hostvars.update(
                {
                    f"{v}node_host": node_host,
                    f"{v}gpu_devices": g.gpu.devices,
                    f"{v}gpu_passthrough": g.gpu.passthrough,
                    f"{v}gpu_evidence": g.gpu.evidence,
                }
            )
            if g.config_error:
                hostvars[f"{v}config_error"] = g.config_error
            if want_config and g.config is not None:
                hostvars[f"{v}config"] = g.config
            if g.address:
                hostvars["ansible_host"] = g.address
            if g.kind == "lxc" and (pct_remote == "always" or (pct_remote == "no_address" and not g.address)):
                # proxmox_pct_remote SSHes to remote_addr (ansible_host) and runs pct exec <proxmox_vmid> there.
                hostvars["ansible_host"] = node_host
                hostvars["ansible_connection"] = PCT_REMOTE_CONNECTION
            for k, val in hostvars.items():
                self.inventory.set_variable(host, k, make_unsafe(val))
            self._member(p + ("containers" if g.kind == "lxc" else "vms"), host)
            self._member(p + g.node, host)
            if g.status in ("running", "stopped"):
                self._member(p + g.status, host)
            if g.unreachable:
                self._member(p + "unreachable", host)
            if g.template:
                self._member(p + "templates", host)
            for tag in g.tags:
                self._member(f"{p}tag_{tag}", host)
            if g.pool:
                self._member(f"{p}pool_{g.pool}", host)
            if compat:
                # community.proxmox 2.0: a template is only in all_templates; other guests by type, node_type, status.
                if g.template:
                    self.inventory.add_child(self._compat_group("all_templates"), host)
                else:
                    self.inventory.add_child(self._compat_group(f"all_{g.kind}"), host)
                    self.inventory.add_child(self._compat_group(f"{g.node}_{g.kind}"), host)
                    self.inventory.add_child(self._compat_group(f"all_{g.status}"), host)
            if g.gpu.is_gpu:
                self.inventory.add_child(gpu_group, host)
                if node is not None:
                    node.gpu_guests.append(host)
            self._construct(host)
        if exclude_nodes:
            return
        for node in nodes.values():
            host = node.name
            self.inventory.add_host(host)
            hostvars = {
                f"{v}node": node.name,
                f"{v}type": "node",
                f"{v}status": "online" if node.online else "offline",
                f"{v}nodeid": node.nodeid,
                f"{v}node_host": node.ip or node.name,
                f"{v}gpu_guests": sorted(node.gpu_guests),
            }
            if node.gpus is not None:
                hostvars[f"{v}node_gpus"] = node.gpus
            if node.ip:
                hostvars["ansible_host"] = node.ip
            for k, val in hostvars.items():
                self.inventory.set_variable(host, k, make_unsafe(val))
            self._member(p + "hypervisors", host)
            if compat:
                self.inventory.add_child(self._compat_group("nodes"), host)
            if not node.online:
                self._member(p + "unreachable", host)
            if node.gpu_guests or node.gpus:
                self.inventory.add_child(gpu_group, host)
            self._construct(host)
