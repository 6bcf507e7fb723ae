"""Unit tests for plugins/plugin_utils/_proxmox_config.py (the pure PVE data readers).

The parsers run on the recorded API fixtures of shared/research/pve-fixtures and on hand-written
configs for every GPU passthrough variant, as PVE 8 and PVE 9 write them.
"""

from __future__ import annotations

import pytest
from pvesim import recorded

from ansible_collections.gpuops.clean_slate.plugins.plugin_utils import _proxmox_config as px


def fixture(name: str):
    """A recorded answer's data, without PVE's envelope."""
    return recorded.served_body(name)["data"]


# ---------------------------------------------------------------------- small parsers
@pytest.mark.parametrize(
    ("value", "tags"),
    [
        ("gpu;train", ["gpu", "train"]),
        ("one, two, three", ["one", "two", "three"]),
        ("a;a;b", ["a", "b"]),
        ("", []),
        (None, []),
        (["x", "y"], ["x", "y"]),
    ],
)
def test_parse_tags(value, tags):
    assert px.parse_tags(value) == tags


@pytest.mark.parametrize(("value", "expected"), [(1, True), (0, False), ("", False), ("1", True), ("0", False), (True, True), (None, False)])
def test_to_bool(value, expected):
    assert px.to_bool(value) is expected


def test_parse_property_string_default_key():
    assert px.parse_property_string("/dev/nvidia0,gid=44,mode=0666", default_key="path") == {"path": "/dev/nvidia0", "gid": "44", "mode": "0666"}
    assert px.parse_property_string("path=/dev/nvidia0,uid=0", default_key="path") == {"path": "/dev/nvidia0", "uid": "0"}


def test_parse_lxc_conf_keeps_raw_keys_ordered_with_duplicates_and_both_separators():
    text = """#GPU box
#second%20line
arch: amd64
dev0: /dev/nvidia0,gid=44
lxc.cgroup2.devices.allow: c 195:* rwm
lxc.cgroup2.devices.allow = c 508:* rwm
lxc.mount.entry: /dev/nvidia0 dev/nvidia0 none bind,optional,create=file 0 0
lxc.mount.entry=/dev/nvidiactl dev/nvidiactl none bind,optional,create=file

[snap1]
dev0: /dev/nvidia7
lxc.mount.entry: /dev/nvidia7 dev/nvidia7 none bind,optional,create=file
"""
    conf = px.parse_lxc_conf(text)
    assert conf["description"] == "GPU box\nsecond line\n"
    assert conf["dev0"] == "/dev/nvidia0,gid=44"
    assert conf["lxc"] == [
        ["lxc.cgroup2.devices.allow", "c 195:* rwm"],
        ["lxc.cgroup2.devices.allow", "c 508:* rwm"],
        ["lxc.mount.entry", "/dev/nvidia0 dev/nvidia0 none bind,optional,create=file 0 0"],
        ["lxc.mount.entry", "/dev/nvidiactl dev/nvidiactl none bind,optional,create=file"],
    ]


def test_parse_lxc_conf_matches_the_recorded_api_list():
    recorded = fixture("lxc_config_raw_lxc_keys.json")
    text = "".join(f"{k}: {v}\n" for k, v in recorded["lxc"])
    assert px.parse_lxc_conf(text)["lxc"] == recorded["lxc"]


# ---------------------------------------------------------------------- LXC GPU detection
def test_recorded_dri_container_is_not_an_nvidia_gpu_guest_but_is_with_dri_globs():
    config = fixture("lxc_config_raw_lxc_keys.json")
    assert not px.lxc_gpu(config).is_gpu
    info = px.lxc_gpu(config, [*px.DEFAULT_GPU_DEVICE_GLOBS, "/dev/dri/*"])
    assert info.passthrough == "lxc-raw"
    assert info.devices == ["/dev/dri"]
    assert info.evidence == ["lxc.mount.entry: /dev/dri dev/dri none bind,optional,create=dir"]


def test_recorded_static_ip_container_has_no_gpu_and_a_static_address():
    config = fixture("lxc_config_static_ip.json")
    assert px.lxc_gpu(config).passthrough is None
    assert px.static_address(config, "lxc") == "10.1.1.3"
    assert px.parse_tags(config["tags"]) == ["one", "two", "three"]


def test_dev_entries_in_index_order_path_forms_and_non_gpu_devices():
    config = {
        "dev10": "/dev/nvidia-caps/nvidia-cap2",
        "dev2": "path=/dev/nvidia-uvm,mode=0666",
        "dev0": "/dev/nvidia0,gid=44",
        "dev1": "/dev/net/tun",
        "dev3": "/dev/nvidiactl,deny-write=0,uid=0",
    }
    info = px.lxc_gpu(config)
    assert info.passthrough == "lxc-dev"
    assert info.devices == ["/dev/nvidia0", "/dev/nvidia-uvm", "/dev/nvidiactl", "/dev/nvidia-caps/nvidia-cap2"]
    assert "dev1: /dev/net/tun" not in info.evidence


def test_dev_entries_win_over_raw_keys_and_both_contribute_devices():
    config = {"dev0": "/dev/nvidia0", "lxc": [["lxc.mount.entry", "/dev/nvidia1 dev/nvidia1 none bind,optional,create=file"]]}
    info = px.lxc_gpu(config)
    assert info.passthrough == "lxc-dev"
    assert info.devices == ["/dev/nvidia0", "/dev/nvidia1"]


@pytest.mark.parametrize(
    ("pairs", "devices"),
    [
        ([("lxc.cgroup2.devices.allow", "c 195:* rwm")], []),
        ([("lxc.cgroup.devices.allow", "c 195:3 rwm")], ["/dev/nvidia3"]),
        ([("lxc.cgroup2.devices.allow", "c 195:255 rwm"), ("lxc.cgroup2.devices.allow", "c 195:254 rwm")], ["/dev/nvidiactl", "/dev/nvidia-modeset"]),
        ([("lxc.mount.entry", "/dev/nvidia-caps dev/nvidia-caps none bind,optional,create=dir")], ["/dev/nvidia-caps"]),
        ([("lxc.mount.entry", "/dev/nvidia-uvm-tools dev/nvidia-uvm-tools none bind,optional,create=file 0 0")], ["/dev/nvidia-uvm-tools"]),
        ([("lxc.hook.mount", "/usr/share/lxc/hooks/nvidia")], []),
        ([("lxc.hook.pre-start", "sh -c '/usr/bin/nvidia-modprobe -c0 -u'")], []),
        ([("lxc.environment", "NVIDIA_VISIBLE_DEVICES=all")], []),
    ],
)
def test_raw_variants_are_lxc_raw(pairs, devices):
    info = px.lxc_gpu({"lxc": [list(p) for p in pairs]})
    assert info.passthrough == "lxc-raw"
    assert info.devices == devices
    assert info.evidence == [f"{k}: {v}" for k, v in pairs]


@pytest.mark.parametrize(
    "pairs",
    [
        [("lxc.cgroup2.devices.allow", "a")],
        [("lxc.cgroup2.devices.allow", "c 508:* rwm")],  # nvidia-uvm's major is dynamic: proves nothing alone
        [("lxc.cgroup2.devices.allow", "b 195:0 rwm")],
        [("lxc.cgroup2.devices.allow", "c 226:128 rwm")],
        [("lxc.mount.entry", "/srv/data srv/data none bind,create=dir 0 0")],
        [("lxc.environment", "NVIDIA_VISIBLE_DEVICES=void")],
        [("lxc.hook.mount", "/usr/share/lxc/hooks/mountcgroups")],
        [("lxc.apparmor.profile", "unconfined")],
    ],
)
def test_non_gpu_raw_keys_are_not_gpu(pairs):
    assert px.lxc_gpu({"lxc": [list(p) for p in pairs]}).passthrough is None


def test_runtime_environment_key_counts():
    assert px.lxc_gpu({"env": "FOO=1\0NVIDIA_VISIBLE_DEVICES=0,1"}).passthrough == "lxc-raw"
    assert px.lxc_gpu({"env": "FOO=1\0NVIDIA_VISIBLE_DEVICES=none"}).passthrough is None


# ---------------------------------------------------------------------- QEMU hostpci
def test_recorded_hostpci_vm_resolves_through_the_node_pci_list():
    config = fixture("qemu_config_hostpci.json")
    entries = px.qemu_hostpci(config)
    assert [(e.key, e.hosts) for e in entries] == [("hostpci0", ["0000:01:00.0"])]
    nvidia = px.qemu_gpu(entries, {"0000:01:00.0": "0x10de"}, None, "pve")
    assert (nvidia.passthrough, nvidia.devices, nvidia.unresolved) == ("qemu-hostpci", ["0000:01:00.0"], [])
    intel = px.qemu_gpu(entries, {"0000:01:00.0": "0x8086"}, None, "pve")
    assert intel.passthrough is None


def test_hostpci_without_function_means_all_functions_and_short_addresses_get_a_domain():
    entries = px.qemu_hostpci({"hostpci1": "41:00,pcie=1,x-vga=1", "hostpci0": "host=02:00.0;03:00.0"})
    assert [e.hosts for e in entries] == [["0000:02:00.0", "0000:03:00.0"], ["0000:41:00"]]
    vendors = px.pci_vendors(
        [
            {"id": "0000:41:00.0", "vendor": "0x10de"},
            {"id": "0000:41:00.1", "vendor": "0x10de"},
            {"id": "0000:02:00.0", "vendor": "0x8086"},
            {"id": "0000:03:00.0", "vendor": "0x10DE"},
        ]
    )
    info = px.qemu_gpu(entries, vendors, None, "pve2")
    assert info.devices == ["0000:03:00.0", "0000:41:00.0", "0000:41:00.1"]
    assert info.evidence == ["hostpci0: host=02:00.0;03:00.0", "hostpci1: 41:00,pcie=1,x-vga=1"]


def test_hostpci_mapping_resolves_per_node_and_unknown_vendors_count_as_gpus():
    mappings = px.mapping_devices(
        [{"id": "h100", "map": ["node=pve1,path=0000:17:00.0,id=10de:2330,iommugroup=17", "node=pve2,path=0000:81:00.0,id=10de:2330"]}]
    )
    entries = px.qemu_hostpci({"hostpci0": "mapping=h100,pcie=1"})
    assert px.qemu_gpu(entries, None, mappings, "pve2").devices == ["0000:81:00.0"]
    unknown = px.qemu_gpu(entries, None, mappings, "pve9")
    assert unknown.passthrough == "qemu-hostpci"
    assert unknown.unresolved == ["hostpci0: mapping=h100,pcie=1"]
    unreadable = px.qemu_gpu(px.qemu_hostpci({"hostpci0": "0000:01:00.0"}), None, None, "pve1")
    assert unreadable.unresolved == ["hostpci0: 0000:01:00.0"]


# ---------------------------------------------------------------------- addresses
def test_address_from_recorded_interfaces_skips_loopback():
    assert px.address_from_interfaces(fixture("lxc_interfaces.json")) == "192.168.3.95"


def test_address_from_new_style_interfaces_and_link_local_only():
    rows = [
        {
            "name": "eth0",
            "hardware-address": "bc:24:11:00:00:01",
            "ip-addresses": [{"ip-address": "fd00::5", "prefix": 64}, {"ip-address": "10.9.8.7", "prefix": 24}],
        }
    ]
    assert px.address_from_interfaces(rows) == "10.9.8.7"
    assert px.address_from_interfaces([{"name": "eth0", "inet6": "fe80::1/64"}]) is None


def test_static_address_ignores_dhcp_and_reads_cloud_init():
    assert px.static_address({"net0": "name=eth0,ip=dhcp,ip6=auto"}, "lxc") is None
    assert px.static_address({"ipconfig0": "ip=192.168.1.10/24,gw=192.168.1.1"}, "qemu") == "192.168.1.10"


# ---------------------------------------------------------------------- Proxmox VE 9
@pytest.mark.parametrize(
    ("value", "path"),
    [
        # PVE 8 as typed by people and scripts (pct set -dev0 ...): any order, path= allowed
        ("path=/dev/nvidia0,gid=44", "/dev/nvidia0"),
        ("/dev/nvidia0,uid=0,gid=44,mode=0666", "/dev/nvidia0"),
        # PVE 9 after a hot-plug: print_device -> path bare and first, then options sorted by name
        ("/dev/nvidia0,deny-write=0,gid=44,mode=0666,uid=0", "/dev/nvidia0"),
        ("/dev/nvidia-caps/nvidia-cap1,deny-write=1,mode=0444", "/dev/nvidia-caps/nvidia-cap1"),
        ("/dev/nvidiactl", "/dev/nvidiactl"),
    ],
)
def test_dev_entries_as_pve8_and_pve9_write_them(value, path):
    info = px.lxc_gpu({"dev7": value})
    assert (info.passthrough, info.devices, info.evidence) == ("lxc-dev", [path], [f"dev7: {value}"])


def test_parse_lxc_conf_stops_before_the_pending_section():
    text = "dev0: /dev/nvidia1,gid=44\nhostname: ct\n\n[pve:pending]\ndelete: dev0\ndev1: /dev/nvidia2\n"
    conf = px.parse_lxc_conf(text)
    assert conf == {"dev0": "/dev/nvidia1,gid=44", "hostname": "ct"}
    assert px.lxc_gpu(conf).devices == ["/dev/nvidia1"]


# ---------------------------------------------------------------------- raw config as host variables
def test_config_facts_shapes_like_community_proxmox():
    config = {
        "net0": "name=eth0,bridge=vmbr0,ip=10.0.0.5/24",
        "rootfs": "local-lvm:vm-100-disk-0,size=8G",
        "scsi0": "local-lvm:vm-100-disk-1,size=32G",
        "dev0": "/dev/nvidia0,gid=44",
        "hostname": "ct",
        "cores": 4,
        "tags": "gpu;train",
        "description": "a=b,c=d\n",
        "features": "nesting=1,keyctl=1",
        "lxc": [["lxc.mount.entry", "/dev/nvidia0 dev/nvidia0 none bind"], ["lxc.mount.entry", "/dev/nvidia1 dev/nvidia1 none bind"]],
        "mp0": "",
    }
    facts = px.config_facts(config)
    assert facts["proxmox_net0"] == {"name": "eth0", "bridge": "vmbr0", "ip": "10.0.0.5/24"}
    assert facts["proxmox_rootfs"] == {"disk_image": "local-lvm:vm-100-disk-0", "size": "8G"}
    assert facts["proxmox_scsi0"] == {"disk_image": "local-lvm:vm-100-disk-1", "size": "32G"}
    assert facts["proxmox_dev0"] == "/dev/nvidia0,gid=44"
    assert facts["proxmox_cores"] == 4 and facts["proxmox_hostname"] == "ct"
    assert facts["proxmox_tags"] == "gpu;train"
    assert facts["proxmox_tags_parsed"] == ["gpu", "train"]
    assert facts["proxmox_description"] == "a=b,c=d\n"
    assert facts["proxmox_features"] == {"nesting": "1", "keyctl": "1"}
    assert facts["proxmox_lxc"] == [["lxc.mount.entry", "/dev/nvidia0 dev/nvidia0 none bind"], ["lxc.mount.entry", "/dev/nvidia1 dev/nvidia1 none bind"]]
    assert facts["proxmox_mp0"] == ""
    assert set(px.config_facts({"cores": 1}, prefix="pve_")) == {"pve_cores"}


@pytest.mark.parametrize(("word", "safe"), [("proxmox_pve-1_lxc", "proxmox_pve_1_lxc"), ("lab pve.east", "labpve_east"), ("ok_1", "ok_1")])
def test_safe_name_is_community_proxmox_to_safe(word, safe):
    assert px.safe_name(word) == safe
