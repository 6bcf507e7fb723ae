# Copyright (c) 2026, gpuops.clean_slate maintainers
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# Note: this plugin_util is PRIVATE to the collection; it may change without notice.

"""Reading Proxmox VE data: guest configs, GPU passthrough, addresses (pure functions, no I/O).

Job: turn what the API (or ``/etc/pve``) says about a guest into facts the inventory uses -
property strings, tags, the raw ``lxc.*`` list of an LXC config (kept ordered, with
duplicates), the GPU passthrough variants of proxmox-facts.md section 5 (``devN`` as PVE 8 and 9
write it, cgroup/mount raw keys, the NVIDIA hook style, QEMU ``hostpciN`` resolved through
``/nodes/{node}/hardware/pci`` or ``/cluster/mapping/pci``) and addresses. Nothing here talks
to the network; :mod:`._proxmox` fetches the data.
"""

from __future__ import annotations

import fnmatch
import ipaddress
import re
import typing as t
import urllib.parse
from dataclasses import dataclass, field

NVIDIA_VENDOR = "0x10de"
#: Character-device major of /dev/nvidia0..N (minor N), nvidiactl (255) and nvidia-modeset (254).
#: nvidia-uvm and nvidia-caps get dynamic majors, so a cgroup rule for them proves nothing.
NVIDIA_MAJOR = 195
DEFAULT_GPU_DEVICE_GLOBS = ("/dev/nvidia*", "/dev/nvidia-caps/*")

PASSTHROUGH_LXC_DEV = "lxc-dev"
PASSTHROUGH_LXC_RAW = "lxc-raw"
PASSTHROUGH_QEMU_HOSTPCI = "qemu-hostpci"

_DEV_KEY = re.compile(r"^dev(\d+)$")
_HOSTPCI_KEY = re.compile(r"^hostpci(\d+)$")
_NET_KEY = re.compile(r"^net(\d+)$")
_IPCONFIG_KEY = re.compile(r"^ipconfig(\d+)$")
# pve-container's parse_pct_config: lxc.* keys take ":" or "=".
_RAW_LXC_LINE = re.compile(r"^(lxc\.[a-z0-9_\-.]+)(:|\s*=)\s*(.*?)\s*$")
_CONF_LINE = re.compile(r"^([a-z][a-z0-9_\-]*):\s*(.*?)\s*$")
_CGROUP_RULE = re.compile(r"^(?P<type>[abc])(?:\s+(?P<major>\d+|\*):(?P<minor>\d+|\*))?(?:\s+(?P<access>[rwm]+))?$")
_SHORT_PCI = re.compile(r"^[0-9a-f]{2}:[0-9a-f]{2}(\.[0-7])?$")
_FULL_PCI = re.compile(r"^[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}(\.[0-7])?$")


# ---------------------------------------------------------------------- small parsers
def to_bool(value: t.Any) -> bool:
    """PVE booleans: 0/1 numbers, "0"/"1" strings, "" (unset), or real booleans."""
    if isinstance(value, str):
        return value.strip().lower() in ("1", "true", "yes", "on")
    return bool(value)


def parse_tags(value: t.Any) -> list[str]:
    """Tags as a list: PVE joins them with ``;`` (older data used ``,`` or spaces)."""
    if value is None:
        return []
    items = [str(v) for v in value] if isinstance(value, (list, tuple)) else re.split(r"[;,\s]+", str(value))
    out: list[str] = []
    for item in items:
        item = item.strip()
        if item and item not in out:
            out.append(item)
    return out


def parse_property_string(value: str, default_key: str | None = None) -> dict[str, str]:
    """Split a PVE property string (``a,b=c,d=e``); a leading bare value goes to ``default_key``."""
    out: dict[str, str] = {}
    for i, part in enumerate(str(value).split(",")):
        part = part.strip()
        if not part:
            continue
        key, eq, val = part.partition("=")
        if eq:
            out[key.strip()] = val.strip()
        elif i == 0 and default_key:
            out[default_key] = part
        else:
            out[part] = ""
    return out


def parse_lxc_conf(text: str) -> dict[str, t.Any]:
    """Parse the text of ``/etc/pve/lxc/<vmid>.conf`` (or ``pct config``) into the API's config shape.

    Raw ``lxc.*`` lines (``:`` or ``=``) become the ordered ``lxc`` list of ``[key, value]`` pairs, duplicates kept;
    ``#`` lines form the description; the first ``[section]`` (snapshot, pending) ends the live config.
    """
    conf: dict[str, t.Any] = {}
    raw: list[list[str]] = []
    description: list[str] = []
    for line in text.splitlines():
        line = line.strip()
        if not line:
            continue
        if line.startswith("["):
            break
        if line.startswith("#"):
            description.append(urllib.parse.unquote(line[1:]))
            continue
        m = _RAW_LXC_LINE.match(line)
        if m:
            raw.append([m.group(1), m.group(3)])
            continue
        m = _CONF_LINE.match(line)
        if m:
            conf[m.group(1)] = m.group(2)
    if raw:
        conf["lxc"] = raw
    if description:
        conf["description"] = "\n".join(description) + "\n"
    return conf


def raw_lxc_pairs(config: t.Mapping[str, t.Any]) -> list[tuple[str, str]]:
    """The config's raw ``lxc`` entries as ``(key, value)`` pairs, in order, duplicates kept."""
    out: list[tuple[str, str]] = []
    for item in config.get("lxc") or []:
        if isinstance(item, (list, tuple)) and len(item) == 2:
            out.append((str(item[0]), str(item[1])))
    return out


def _matches(path: str, globs: t.Sequence[str]) -> bool:
    if any(fnmatch.fnmatchcase(path, g) for g in globs):
        return True
    # A directory bind mount (/dev/dri, /dev/nvidia-caps) covers the device globs below it.
    prefix = path.rstrip("/") + "/"
    return any(g.startswith(prefix) for g in globs)


def _numbered(config: t.Mapping[str, t.Any], pattern: re.Pattern[str]) -> list[tuple[str, t.Any]]:
    keys = [(int(m.group(1)), k) for k in config for m in [pattern.match(k)] if m]
    return [(k, config[k]) for _index, k in sorted(keys)]


def _cgroup_device(rule: str) -> tuple[int | None, str | None, bool]:
    """``c 195:0 rwm`` -> (195, "0", True). Majors/minors may be ``*``; the bool says the rule parsed."""
    m = _CGROUP_RULE.match(rule.strip())
    if not m or m.group("type") != "c" or m.group("major") in (None, "*"):
        return None, None, bool(m)
    return int(m.group("major")), m.group("minor"), True


def _nvidia_minor_path(minor: str) -> str | None:
    if not minor.isdigit():
        return None
    n = int(minor)
    if n == 255:
        return "/dev/nvidiactl"
    if n == 254:
        return "/dev/nvidia-modeset"
    return f"/dev/nvidia{n}"


def _visible_devices_set(assignment: str) -> bool:
    name, _sep, value = assignment.partition("=")
    return name.strip() == "NVIDIA_VISIBLE_DEVICES" and value.strip().lower() not in ("", "void", "none")


# ---------------------------------------------------------------------- GPU detection
@dataclass
class GpuInfo:
    """What a guest's config says about GPU passthrough."""

    passthrough: str | None = None
    devices: list[str] = field(default_factory=list)
    evidence: list[str] = field(default_factory=list)
    unresolved: list[str] = field(default_factory=list)

    @property
    def is_gpu(self) -> bool:
        return self.passthrough is not None

    def add_device(self, path: str) -> None:
        if path not in self.devices:
            self.devices.append(path)


def lxc_gpu(config: t.Mapping[str, t.Any], globs: t.Sequence[str] = DEFAULT_GPU_DEVICE_GLOBS) -> GpuInfo:
    """GPU passthrough of an LXC config.

    ``lxc-dev``: a ``devN`` entry (PVE >= 8.1) names a GPU device. ``lxc-raw``: raw keys do it instead - a
    ``lxc.mount.entry`` of a GPU device, a ``lxc.cgroup2.devices.allow``/``lxc.cgroup.devices.allow`` rule for
    NVIDIA's major 195, the NVIDIA LXC hook, or ``NVIDIA_VISIBLE_DEVICES`` in the container's environment.
    ``devices`` lists the device paths that can be named (a ``195:*`` rule names none).
    """
    info = GpuInfo()
    for key, value in _numbered(config, _DEV_KEY):
        path = parse_property_string(str(value), default_key="path").get("path", "")
        if path and _matches(path, globs):
            info.passthrough = PASSTHROUGH_LXC_DEV
            info.add_device(path)
            info.evidence.append(f"{key}: {value}")
    raw_found = False
    nvidia_globbed = any(_matches(p, globs) for p in ("/dev/nvidia0", "/dev/nvidiactl"))
    for key, value in raw_lxc_pairs(config):
        if key == "lxc.mount.entry":
            fields = value.split()
            if fields and _matches(fields[0], globs):
                raw_found = True
                info.add_device(fields[0])
                info.evidence.append(f"{key}: {value}")
        elif key in ("lxc.cgroup2.devices.allow", "lxc.cgroup.devices.allow"):
            major, minor, _parsed = _cgroup_device(value)
            if major == NVIDIA_MAJOR and nvidia_globbed:
                raw_found = True
                info.evidence.append(f"{key}: {value}")
                device = _nvidia_minor_path(minor or "*")
                if device:
                    info.add_device(device)
        elif nvidia_globbed and ((key.startswith("lxc.hook.") and "nvidia" in value.lower()) or (key == "lxc.environment" and _visible_devices_set(value))):
            # The NVIDIA hook style: no mount entries, the hook (or the container toolkit) creates the devices.
            raw_found = True
            info.evidence.append(f"{key}: {value}")
    # lxc.environment.runtime lines arrive as the NUL-separated "env" key on newer PVE.
    for assignment in str(config.get("env") or "").split("\0"):
        if _visible_devices_set(assignment) and nvidia_globbed:
            raw_found = True
            info.evidence.append(f"env: {assignment}")
    if raw_found and info.passthrough is None:
        info.passthrough = PASSTHROUGH_LXC_RAW
    return info


@dataclass
class HostPci:
    """One ``hostpciN`` entry: host addresses (normalised, maybe without function) or a mapping name."""

    key: str
    value: str
    hosts: list[str]
    mapping: str | None
    options: dict[str, str]


def normalize_pci(address: str) -> str:
    """``41:00.0`` -> ``0000:41:00.0``; lower case; a missing function stays missing (all functions)."""
    a = address.strip().lower()
    if _SHORT_PCI.match(a):
        a = "0000:" + a
    return a


def parse_hostpci(key: str, value: str) -> HostPci:
    """Parse ``[[host=]<id[;id...]>][,mapping=<name>][,pcie=1]...`` (qm.conf ``hostpci[n]``)."""
    props = parse_property_string(value, default_key="host")
    hosts = [normalize_pci(h) for h in props.pop("host", "").split(";") if h.strip()]
    mapping = props.pop("mapping", None) or None
    return HostPci(key=key, value=value, hosts=hosts, mapping=mapping, options=props)


def qemu_hostpci(config: t.Mapping[str, t.Any]) -> list[HostPci]:
    """All ``hostpciN`` entries of a QEMU config, in index order."""
    return [parse_hostpci(k, str(v)) for k, v in _numbered(config, _HOSTPCI_KEY)]


def pci_vendors(rows: t.Iterable[t.Mapping[str, t.Any]]) -> dict[str, str]:
    """``/nodes/{node}/hardware/pci`` rows -> ``{address: vendor}`` (``0x10de`` is NVIDIA)."""
    return {normalize_pci(str(r["id"])): str(r.get("vendor", "")).lower() for r in rows if r.get("id")}


def mapping_devices(rows: t.Iterable[t.Mapping[str, t.Any]]) -> dict[tuple[str, str], list[tuple[str, str | None]]]:
    """``/cluster/mapping/pci`` rows -> ``{(mapping id, node): [(address, vendor), ...]}``."""
    out: dict[tuple[str, str], list[tuple[str, str | None]]] = {}
    for row in rows:
        for entry in row.get("map") or []:
            props = parse_property_string(str(entry))
            node, path, ident = props.get("node"), props.get("path"), props.get("id", "")
            if not node or not path:
                continue
            vendor = "0x" + ident.split(":")[0].lower() if ":" in ident else None
            for address in path.split(";"):
                out.setdefault((str(row.get("id")), node), []).append((normalize_pci(address), vendor))
    return out


def qemu_gpu(
    entries: t.Sequence[HostPci],
    vendors: t.Mapping[str, str] | None,
    mappings: t.Mapping[tuple[str, str], list[tuple[str, str | None]]] | None,
    node: str,
) -> GpuInfo:
    """GPU passthrough of a VM: ``hostpciN`` devices whose vendor is NVIDIA.

    ``vendors`` is the node's ``address -> vendor`` map (None when it could not be read); an address without a
    function stands for all its functions. A device whose vendor cannot be resolved counts as a GPU and is listed in
    ``unresolved``: for a clean-slate job a false positive costs a check, a false negative leaves a GPU dirty.
    """
    info = GpuInfo()
    for hp in entries:
        line = f"{hp.key}: {hp.value}"
        # (address, vendor); vendor None = could not be resolved
        found: list[tuple[str, str | None]] = []
        if hp.mapping:
            found += mappings.get((hp.mapping, node), [(f"mapping={hp.mapping}", None)]) if mappings is not None else [(f"mapping={hp.mapping}", None)]
        for host in hp.hosts:
            if vendors is None:
                found.append((host, None))
            elif host in vendors:
                found.append((host, vendors[host]))
            else:
                functions = sorted(a for a in vendors if a.startswith(host + "."))
                found += [(a, vendors[a]) for a in functions] or [(host, None)]
        for address, vendor in found:
            if vendor is None and line not in info.unresolved:
                info.unresolved.append(line)
            if vendor is None or vendor == NVIDIA_VENDOR:
                info.passthrough = PASSTHROUGH_QEMU_HOSTPCI
                info.add_device(address)
                if line not in info.evidence:
                    info.evidence.append(line)
    return info


# ---------------------------------------------------------------------- addresses
def _usable_ip(cidr: str) -> str | None:
    address = cidr.split("/")[0].strip()
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return None
    if ip.is_loopback or ip.is_link_local or ip.is_unspecified:
        return None
    return address


def address_from_interfaces(rows: t.Iterable[t.Mapping[str, t.Any]]) -> str | None:
    """The first usable IPv4 (else IPv6) address of ``/nodes/{n}/lxc/{id}/interfaces``, without prefix."""
    v4: list[str] = []
    v6: list[str] = []
    for row in rows:
        if row.get("name") == "lo":
            continue
        candidates = [str(row.get("inet") or ""), str(row.get("inet6") or "")]
        candidates += [str(a.get("ip-address", "")) for a in row.get("ip-addresses") or [] if isinstance(a, dict)]
        for c in candidates:
            ip = _usable_ip(c) if c else None
            if ip:
                (v6 if ":" in ip else v4).append(ip)
    found = v4 or v6
    return found[0] if found else None


def static_address(config: t.Mapping[str, t.Any], kind: str) -> str | None:
    """A static ``ip=`` from an LXC ``netN`` or a QEMU cloud-init ``ipconfigN`` (not ``dhcp``/``manual``)."""
    pattern = _NET_KEY if kind == "lxc" else _IPCONFIG_KEY
    for _key, value in _numbered(config, pattern):
        ip = parse_property_string(str(value)).get("ip", "")
        if ip and ip not in ("dhcp", "manual", "auto"):
            usable = _usable_ip(ip)
            if usable:
                return usable
    return None


# ---------------------------------------------------------------------- raw config as host variables
_UNSAFE_NAME = re.compile(r"[^A-Za-z0-9_]")
_DISK_KEY = re.compile(r"^(rootfs|virtio\d*|sata\d*|ide\d*|scsi\d*)$")


def safe_name(word: str) -> str:
    """community.proxmox's ``to_safe``: spaces dropped, every other character but ``[A-Za-z0-9_]`` becomes ``_``."""
    return _UNSAFE_NAME.sub("_", word.replace(" ", ""))


def config_facts(config: t.Mapping[str, t.Any], prefix: str = "proxmox_") -> dict[str, t.Any]:
    """A guest's config as ``<prefix><key>`` variables, in the shapes community.proxmox's ``want_facts`` gives them.

    So that its users' ``compose`` expressions keep working (``proxmox_net0.ip``, ``proxmox_rootfs.size``): a value
    made only of ``k=v`` parts becomes a dict, disks get a ``disk_image=`` part first, ``description`` stays text, and
    ``<prefix>tags_parsed`` lists the tags. One deliberate difference: the raw ``lxc`` list stays a list of
    ``[key, value]`` pairs in order, because folding it into a dict (as community.proxmox does) keeps only the last of
    repeated keys, and a container's GPU bind mounts are exactly such repeated keys.
    """
    out: dict[str, t.Any] = {}
    for key, value in config.items():
        name = safe_name(f"{prefix}{str(key).lower()}")
        if key == "lxc":
            out[name] = [list(pair) for pair in raw_lxc_pairs(config)]
            continue
        if key == "tags":
            out[f"{name}_parsed"] = parse_tags(value)
        if isinstance(value, str) and _DISK_KEY.match(str(key)):
            value = f"disk_image={value}"
        if key != "description" and isinstance(value, str) and value and all("=" in part for part in value.split(",")):
            value = dict(part.split("=", 1) for part in value.split(","))
        out[name] = value
    return out
