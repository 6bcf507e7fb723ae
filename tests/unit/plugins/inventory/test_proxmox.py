"""Unit tests for the gpuops.clean_slate.proxmox inventory plugin, in-process against pvesim.

The plugin runs on real ``InventoryData`` with its documented option defaults; the API is the
simulator over real HTTP. Expected results come from the cluster description's ``meta`` ground
truth and from the request-count formula computed from the description, not from the plugin.
"""

from __future__ import annotations

import typing as t

import pytest
import yaml
from ansible.inventory.data import InventoryData
from ansible.parsing.dataloader import DataLoader
from ansible.template import trust_as_template
from pvesim import PveSim, load_cluster

from ansible_collections.gpuops.clean_slate.plugins.inventory import proxmox
from ansible_collections.gpuops.clean_slate.plugins.plugin_utils._proxmox import ProxmoxApiError, ProxmoxClient
from ansible_collections.gpuops.clean_slate.plugins.plugin_utils._proxmox_config import parse_hostpci

# Defaults of the constructed and inventory_cache fragments, which the plugin's own DOCUMENTATION extends.
FRAGMENT_DEFAULTS = {"strict": False, "compose": {}, "groups": {}, "keyed_groups": [], "use_extra_vars": False, "cache": False}


def documented_defaults() -> dict[str, t.Any]:
    options = yaml.safe_load(proxmox.DOCUMENTATION)["options"]
    return {**FRAGMENT_DEFAULTS, **{name: spec.get("default") for name, spec in options.items()}}


class Run:
    """One inventory run: the plugin, its inventory, warnings and the simulator's request log."""

    def __init__(self, sim: PveSim, **options: t.Any) -> None:
        self.sim = sim
        opts = documented_defaults()
        opts.update(options)
        plugin = proxmox.InventoryModule()
        plugin.inventory = InventoryData()
        plugin.loader = DataLoader()
        plugin.get_option = lambda name: opts[name]  # type: ignore[method-assign]
        plugin._warnings = []
        plugin._prefix = opts["group_prefix"]
        token_id, secret = sim.token
        creds = {"user": opts.get("user"), "password": opts.get("password")} if opts.get("password") else {"token_id": token_id, "token_secret": secret}
        client = ProxmoxClient(sim.url, **creds)
        sim.reset_counter()
        plugin._populate(client)
        self.plugin = plugin
        self.inventory = plugin.inventory
        self.warnings: list[str] = plugin._warnings
        self.requests = sim.requests

    def group(self, name: str) -> set[str]:
        g = self.inventory.groups.get(name)
        return {h.name for h in g.get_hosts()} if g else set()

    def vars(self, host: str) -> dict[str, t.Any]:
        return self.inventory.get_host(host).get_vars()

    def paths(self) -> list[str]:
        return [p.replace("/api2/json", "", 1) for _unused, p in self.requests]


@pytest.fixture
def desc() -> dict[str, t.Any]:
    return load_cluster("gpu3")


@pytest.fixture
def sim(desc):
    with PveSim(desc) as s:
        yield s


def expected_name(g: dict[str, t.Any]) -> str:
    return g.get("meta", {}).get("inventory_name") or g["name"]


def expected_requests(desc: dict[str, t.Any], selected: t.Callable[[dict], bool] = lambda g: True, want_interfaces: bool = True) -> set[str]:
    """The formula of the plugin's documentation, evaluated on the description alone."""
    online = {n["name"] for n in desc["nodes"] if n.get("online", True)}
    guests = [g for g in desc["guests"] if g.get("type", "lxc") in ("lxc", "qemu") and not g.get("template") and selected(g)]
    paths = {"/cluster/status", "/cluster/resources?type=vm"}
    pci_nodes, mapping = set(), False
    for g in guests:
        if g["node"] not in online:
            continue
        paths.add(f"/nodes/{g['node']}/{g.get('type', 'lxc')}/{g['vmid']}/config?current=1")
        hostpci = [line.split(":", 1)[1].strip() for line in g.get("conf", "").splitlines() if line.startswith("hostpci")]
        for value in hostpci:
            hp = parse_hostpci("hostpci0", value)
            if hp.hosts:
                pci_nodes.add(g["node"])
            mapping = mapping or bool(hp.mapping)
        running = g.get("status", "running") == "running" and g.get("rrd", True)
        if want_interfaces and g.get("type", "lxc") == "lxc" and g.get("meta", {}).get("gpu") is True and running:
            paths.add(f"/nodes/{g['node']}/lxc/{g['vmid']}/interfaces")
    paths |= {f"/nodes/{n}/hardware/pci" for n in pci_nodes}
    if mapping:
        paths.add("/cluster/mapping/pci")
    return paths


# ---------------------------------------------------------------------- the all-variants cluster
def test_gpu_guests_groups_and_vars_match_the_ground_truth(sim, desc):
    run = Run(sim)
    gpu_nodes = run.group("gpu_nodes")
    for g in desc["guests"]:
        meta = g.get("meta", {})
        name = expected_name(g) if g["node"] != "pve3" else meta["inventory_name"]
        if meta.get("template"):
            assert name not in run.inventory.hosts
            continue
        hostvars = run.vars(name)
        assert hostvars["proxmox_vmid"] == g["vmid"]
        assert hostvars["proxmox_node"] == g["node"]
        assert hostvars["proxmox_type"] == g.get("type", "lxc")
        if meta.get("gpu") is True:
            assert name in gpu_nodes, name
            assert hostvars["proxmox_gpu_passthrough"] == meta["passthrough"], name
            assert hostvars["proxmox_gpu_devices"] == meta["devices"], name
            assert hostvars["proxmox_gpu_evidence"], name
        else:
            assert name not in gpu_nodes, name
            assert hostvars["proxmox_gpu_passthrough"] is None
            assert hostvars["proxmox_gpu_devices"] == []
    # nodes hosting GPU guests join too; the offline node does not (its guests' configs are unknown)
    assert {"pve1", "pve2"} <= gpu_nodes
    assert "pve3" not in gpu_nodes
    assert sorted(run.vars("pve1")["proxmox_gpu_guests"]) == ["infer-hook", "old-raw", "train-a", "train-a-106", "train-b"]


def test_standard_groups(sim):
    run = Run(sim)
    assert run.group("proxmox_hypervisors") == {"pve1", "pve2", "pve3"}
    assert run.group("proxmox_vms") == {"vm-gpu", "vm-nic", "vm-plain", "vm-mapped", "qemu-302"}
    assert run.group("proxmox_pve2") == {"vm-gpu", "vm-nic", "vm-plain", "train-a-204", "vm-mapped"}
    assert run.group("proxmox_running") == {"train-a", "train-b", "infer-hook", "web", "old-raw", "vm-gpu", "vm-nic", "train-a-204"}
    assert run.group("proxmox_stopped") == {"dri-box", "train-a-106", "vm-plain", "vm-mapped"}
    assert run.group("proxmox_tag_gpu") == {"train-a", "train-b", "train-a-106", "vm-gpu", "train-a-204", "lxc-301"}
    assert run.group("proxmox_pool_ml") == {"train-a", "train-b"}
    assert run.group("proxmox_unreachable") == {"lxc-301", "qemu-302", "pve3"}
    assert "tmpl-debian" not in run.inventory.hosts


def test_duplicate_names_keep_the_lowest_vmid_and_warn(sim):
    run = Run(sim)
    assert run.vars("train-a")["proxmox_vmid"] == 101
    assert run.vars("train-a-106")["proxmox_vmid"] == 106
    assert run.vars("train-a-204")["proxmox_vmid"] == 204
    assert all(run.vars(h)["proxmox_name"] == "train-a" for h in ("train-a", "train-a-106", "train-a-204"))
    assert sum("'train-a' is already taken" in w for w in run.warnings) == 2


def test_offline_node_guests_are_kept_unknown_and_not_requested(sim):
    run = Run(sim)
    for host, vmid in (("lxc-301", 301), ("qemu-302", 302)):
        hv = run.vars(host)
        assert (hv["proxmox_status"], hv["proxmox_vmid"], hv["proxmox_node"]) == ("unknown", vmid, "pve3")
    assert run.vars("lxc-301")["proxmox_tags"] == ["gpu"]
    assert run.vars("pve3")["proxmox_status"] == "offline"
    assert not [p for p in run.paths() if p.startswith("/nodes/pve3/")]


def test_row_without_rrd_data_is_named_from_its_config(sim):
    run = Run(sim)
    hv = run.vars("rrd-gap")
    assert (hv["proxmox_vmid"], hv["proxmox_name"], hv["proxmox_status"]) == (108, None, "unknown")


def test_connection_vars(sim):
    run = Run(sim)
    assert run.vars("pve1")["ansible_host"] == "10.10.0.11"
    # running GPU container: address from /interfaces (dhcp in its config, so only the interfaces know it)
    assert run.vars("train-b")["ansible_host"] == "10.20.0.102"
    # non-GPU container: no /interfaces request, static ip= from its config
    assert run.vars("web")["ansible_host"] == "10.20.1.104"
    assert run.vars("vm-nic")["ansible_host"] == "10.20.2.202"
    # stopped dhcp container: no address known
    assert "ansible_host" not in run.vars("dri-box")
    for host in ("train-a", "train-a-204", "web", "vm-gpu"):
        node = run.vars(host)["proxmox_node"]
        assert run.vars(host)["proxmox_node_host"] == run.vars(node)["ansible_host"]


def test_request_count_follows_the_documented_formula(sim, desc):
    run = Run(sim)
    paths = run.paths()
    assert len(paths) == len(set(paths)), "no path is requested twice"
    assert set(paths) == expected_requests(desc)
    assert paths[:2] == ["/cluster/status", "/cluster/resources?type=vm"]
    assert len(paths) == 22


def test_request_count_is_two_plus_configs_without_follow_ups(sim, desc):
    run = Run(sim, include_types=["lxc"], want_interfaces=False)
    configs = [p for p in run.paths() if p.endswith("/config?current=1")]
    assert len(run.paths()) == 2 + len(configs)
    assert set(run.paths()) == expected_requests(desc, lambda g: g.get("type", "lxc") == "lxc", want_interfaces=False)
    assert run.group("proxmox_vms") == set()


def test_filters_run_before_any_per_guest_request(sim, desc):
    run = Run(sim, filters=[trust_as_template("proxmox_status == 'running'"), trust_as_template("'web' not in proxmox_tags")])
    assert set(run.paths()) == expected_requests(
        desc, lambda g: g.get("status", "running") == "running" and "web" not in g.get("tags", []) and g.get("rrd", True)
    )
    assert "web" not in run.inventory.hosts
    assert "dri-box" not in run.inventory.hosts
    assert "train-a" in run.inventory.hosts


def test_templates_can_be_included(sim):
    run = Run(sim, exclude_templates=False)
    assert run.group("proxmox_templates") == {"tmpl-debian"}
    assert "/nodes/pve1/lxc/107/config?current=1" in run.paths()


def test_dri_globs_make_the_igpu_container_a_gpu_guest(sim):
    run = Run(sim, gpu_device_globs=["/dev/nvidia*", "/dev/nvidia-caps/*", "/dev/dri/*"])
    assert "dri-box" in run.group("gpu_nodes")
    assert run.vars("dri-box")["proxmox_gpu_devices"] == ["/dev/dri"]


def test_want_config_exposes_the_raw_lxc_list_in_order(sim):
    run = Run(sim, want_config=True)
    raw = run.vars("train-b")["proxmox_config"]["lxc"]
    assert [k for k, _unused in raw] == ["lxc.cgroup2.devices.allow"] * 3 + ["lxc.mount.entry"] * 6


def test_a_failing_guest_config_does_not_abort_the_source(sim):
    sim.add_response("/nodes/pve1/lxc/102/config", status=500, message="got timeout")
    run = Run(sim)
    hv = run.vars("train-b")
    assert "got timeout" in hv["proxmox_config_error"]
    assert "/nodes/pve1/lxc/102/config" in hv["proxmox_config_error"]
    assert "train-b" not in run.group("gpu_nodes")
    assert "train-a" in run.group("gpu_nodes")
    assert any("guest 102" in w for w in run.warnings)


def test_unreadable_pci_list_counts_hostpci_as_gpu_with_a_warning(sim):
    sim.add_response("/nodes/pve2/hardware/pci", status=403, message="Permission check failed (/nodes/pve2, Sys.Audit)")
    run = Run(sim)
    assert "vm-nic" in run.group("gpu_nodes")  # unknown vendor: a false positive beats a dirty GPU
    assert any("VM 202" in w and "unknown" in w for w in run.warnings)
    assert any("Permission check failed" in w for w in run.warnings)


def test_scan_node_gpus_adds_gpu_nodes_without_gpu_guests(desc):
    desc["nodes"].append({"name": "pve4", "ip": "10.10.0.14", "pci": [{"id": "0000:c1:00.0", "class": "0x030200", "vendor": "0x10de", "device": "0x2330"}]})
    desc["guests"].append({"vmid": 401, "node": "pve4", "type": "lxc", "name": "cpu-only"})
    with PveSim(desc) as s:
        plain = Run(s)
        scanned = Run(s, scan_node_gpus=True)
    assert "pve4" not in plain.group("gpu_nodes")
    assert "pve4" in scanned.group("gpu_nodes")
    assert scanned.vars("pve4")["proxmox_node_gpus"] == ["0000:c1:00.0"]
    assert scanned.vars("pve1")["proxmox_node_gpus"] == ["0000:17:00.0", "0000:31:00.0"]
    # every online node's PCI list (pve3 is offline), instead of only pve2's (it has hostpci VMs)
    assert {p for p in plain.paths() if p.endswith("/hardware/pci")} == {"/nodes/pve2/hardware/pci"}
    assert {p for p in scanned.paths() if p.endswith("/hardware/pci")} == {f"/nodes/{n}/hardware/pci" for n in ("pve1", "pve2", "pve4")}
    assert len(scanned.paths()) == len(plain.paths()) + 2


def test_password_auth_costs_one_login(desc):
    with PveSim(desc, users={"ops@pve": "pw"}) as s:
        run = Run(s, user="ops@pve", password="pw")
    assert run.requests[0] == ("POST", "/api2/json/access/ticket")
    assert len(run.requests) == 1 + len(expected_requests(desc))


def test_constructed_features(sim):
    run = Run(
        sim,
        keyed_groups=[{"key": trust_as_template("proxmox_gpu_passthrough"), "prefix": "passthrough", "separator": "_"}],
        groups={"big_gpu": trust_as_template("proxmox_gpu_devices | length > 3")},
        compose={"gpu_count": trust_as_template("proxmox_gpu_devices | select('match', '/dev/nvidia[0-9]+$') | list | length")},
    )
    assert run.group("passthrough_lxc_dev") == {"train-a", "train-a-106", "train-a-204"}
    assert run.group("passthrough_qemu_hostpci") == {"vm-gpu", "vm-mapped"}
    assert run.group("big_gpu") == {"train-a", "train-b"}
    assert run.vars("train-a")["gpu_count"] == 1


def test_standalone_node_without_cluster_row():
    desc = {
        "pve_version": "8.2.4",
        "nodes": [{"name": "solo", "ip": "192.0.2.5"}],
        "guests": [{"vmid": 100, "node": "solo", "type": "lxc", "name": "ct", "conf": "dev0: /dev/nvidia0\n"}],
    }
    with PveSim(desc) as s:
        run = Run(s)
    assert run.group("gpu_nodes") == {"ct", "solo"}
    assert run.vars("solo")["ansible_host"] == "192.0.2.5"


def test_discovery_failure_raises(sim):
    sim.add_response("/cluster/resources", status=403, message="Permission check failed (/, Sys.Audit)")
    with pytest.raises(ProxmoxApiError) as exc:
        Run(sim)
    assert exc.value.status == 403
    assert "privilege" in str(exc.value)


def test_verify_file_wants_the_proxmox_suffix(tmp_path):
    good = tmp_path / "lab.proxmox.yml"
    good.write_text("plugin: gpuops.clean_slate.proxmox\n")
    other = tmp_path / "lab.yml"
    other.write_text("plugin: gpuops.clean_slate.proxmox\n")
    plugin = proxmox.InventoryModule()
    assert plugin.verify_file(str(good)) is True
    assert plugin.verify_file(str(other)) is False
    assert plugin.verify_file(str(tmp_path / "absent.proxmox.yml")) is False


# ---------------------------------------------------------------------- group_prefix renames groups only
def test_group_prefix_renames_groups_only_and_every_expression_sees_the_proxmox_names(sim):
    run = Run(
        sim,
        group_prefix="pve_",
        filters=[trust_as_template("proxmox_type == 'qemu' or 'gpu' in proxmox_tags")],
        compose={"ct_ref": trust_as_template("proxmox_node ~ '/' ~ proxmox_vmid")},
        keyed_groups=[{"key": trust_as_template("proxmox_gpu_passthrough"), "prefix": "passthrough", "separator": "_"}],
        groups={"pct_targets": trust_as_template("proxmox_type == 'lxc' and proxmox_node_host is defined")},
    )
    groups = set(run.inventory.groups)
    assert {"pve_hypervisors", "pve_containers", "pve_vms", "pve_running", "pve_pve1", "pve_tag_gpu"} <= groups
    assert not {g for g in groups if g.startswith("proxmox_")}
    assert run.group("pve_containers") == {"train-a", "train-b", "train-a-106", "train-a-204", "lxc-301"}
    for host in run.group("pve_containers") | run.group("pve_vms"):
        hv = run.vars(host)
        assert not [k for k in hv if k.startswith("pve_")], host
        assert hv["ct_ref"] == f"{hv['proxmox_node']}/{hv['proxmox_vmid']}"
    assert run.group("pct_targets") == run.group("pve_containers")
    assert run.group("passthrough_lxc_dev") == {"train-a", "train-a-106", "train-a-204"}
    # the filter read proxmox_type/proxmox_tags too: non-GPU containers are gone, VMs stay
    assert "web" not in run.inventory.hosts and "vm-plain" in run.inventory.hosts


# ---------------------------------------------------------------------- community.proxmox habits
def test_exclude_nodes_leaves_nodes_out_but_keeps_their_addresses_on_guests(sim):
    run = Run(sim, exclude_nodes=True, compat_groups=True)
    assert not {"pve1", "pve2", "pve3"} & set(run.inventory.hosts)
    assert "proxmox_hypervisors" not in run.inventory.groups
    assert "proxmox_nodes" not in run.inventory.groups
    assert run.group("gpu_nodes") == {"train-a", "train-b", "infer-hook", "train-a-106", "old-raw", "vm-gpu", "train-a-204", "vm-mapped"}
    assert run.vars("train-a")["proxmox_node_host"] == "10.10.0.11"
    assert run.vars("train-a")["proxmox_node"] == "pve1"


def test_compat_groups_are_community_proxmox_names_for_the_same_members(sim):
    plain_run = Run(sim)
    run = Run(sim, compat_groups=True, exclude_templates=False)
    assert not {g for g in plain_run.inventory.groups if g.startswith("proxmox_all_") or g.endswith(("_lxc", "_qemu"))}
    templates = {"tmpl-debian"}
    assert run.group("proxmox_all_lxc") == run.group("proxmox_containers") - templates
    assert run.group("proxmox_all_qemu") == run.group("proxmox_vms")
    assert run.group("proxmox_all_templates") == templates == run.group("proxmox_templates")
    assert run.group("proxmox_all_running") == run.group("proxmox_running")
    assert run.group("proxmox_all_stopped") == run.group("proxmox_stopped") - templates
    assert run.group("proxmox_all_unknown") == {"rrd-gap", "lxc-301", "qemu-302"}
    assert run.group("proxmox_nodes") == run.group("proxmox_hypervisors")
    for node in ("pve1", "pve2", "pve3"):
        for kind, ours in (("lxc", "proxmox_containers"), ("qemu", "proxmox_vms")):
            assert run.group(f"proxmox_{node}_{kind}") == (run.group(f"proxmox_{node}") & run.group(ours)) - templates
    # community.proxmox drops an offline node's guests; they are kept here, in their node's groups too
    assert run.group("proxmox_pve3_lxc") == {"lxc-301"}


def test_compat_group_names_follow_community_proxmox_to_safe():
    desc = {"nodes": [{"name": "PVE-East.1", "ip": "192.0.2.9"}], "guests": [{"vmid": 100, "node": "PVE-East.1", "type": "lxc", "name": "ct"}]}
    with PveSim(desc) as s:
        run = Run(s, compat_groups=True, group_prefix="Lab ")
    # community.proxmox: to_safe(prefix + name.lower()) - spaces dropped, other characters to "_"
    assert run.group("Labpve_east_1_lxc") == {"ct"}
    assert "Labpve_east_1_qemu" in run.inventory.groups
    assert run.group("Laball_lxc") == {"ct"}


def test_want_facts_sets_config_keys_in_community_shapes_without_replacing_ours(sim):
    run = Run(sim, want_facts=True)
    hv = run.vars("train-a")
    assert hv["proxmox_net0"] == {"name": "eth0", "bridge": "vmbr0", "hwaddr": "BC:24:11:00:01:01", "ip": "10.20.1.101/16", "gw": "10.20.0.1", "type": "veth"}
    assert hv["proxmox_rootfs"] == {"disk_image": "local-lvm:vm-101-disk-0", "size": "64G"}
    assert hv["proxmox_dev4"] == {"path": "/dev/nvidia-caps/nvidia-cap1", "mode": "0666", "uid": "0"}
    assert hv["proxmox_dev0"] == "/dev/nvidia0,gid=44"  # not all k=v: stays a string, as in community.proxmox
    assert hv["proxmox_description"] == "Training container, PVE 8.1+ device passthrough\n"
    assert hv["proxmox_tags_parsed"] == ["gpu", "train"]
    # our variables keep their meaning: tags a list (config "gpu;train"), template a bool
    assert hv["proxmox_tags"] == ["gpu", "train"] and hv["proxmox_template"] is False
    # the raw lxc list keeps repeated keys (community.proxmox folds it into a dict, keeping the last)
    assert [k for k, _unused in run.vars("train-b")["proxmox_lxc"]] == ["lxc.cgroup2.devices.allow"] * 3 + ["lxc.mount.entry"] * 6
    assert run.vars("vm-nic")["proxmox_ipconfig0"] == {"ip": "10.20.2.202/16", "gw": "10.20.0.1"}
    # no config read, no config facts; and no extra request for any of it
    assert "proxmox_net0" not in run.vars("lxc-301")
    assert set(run.paths()) == expected_requests(load_cluster("gpu3"))
    assert "proxmox_net0" not in Run(sim).vars("train-a")


@pytest.mark.parametrize(
    ("mode", "via_node"),
    [
        ("never", set()),
        # containers with no address: dri-box (stopped, dhcp), rrd-gap (not a GPU guest: no /interfaces, dhcp),
        # train-a-106 (stopped, no network), lxc-301 (offline node)
        ("no_address", {"dri-box", "rrd-gap", "train-a-106", "lxc-301"}),
        ("always", {"train-a", "train-b", "infer-hook", "web", "dri-box", "train-a-106", "rrd-gap", "old-raw", "train-a-204", "lxc-301"}),
    ],
)
def test_pct_remote_sets_the_connection_and_the_node_address(sim, mode, via_node):
    run = Run(sim, pct_remote=mode)
    got = {h for h in run.group("proxmox_containers") if run.vars(h).get("ansible_connection") == proxmox.PCT_REMOTE_CONNECTION}
    assert got == via_node
    for host in got:
        hv = run.vars(host)
        # what proxmox_pct_remote reads: remote_addr <- ansible_host (the node), vmid <- proxmox_vmid
        assert hv["ansible_host"] == hv["proxmox_node_host"] == {"pve1": "10.10.0.11", "pve2": "10.10.0.12", "pve3": "10.10.0.13"}[hv["proxmox_node"]]
        assert isinstance(hv["proxmox_vmid"], int)
    assert not [h for h in run.group("proxmox_vms") if "ansible_connection" in run.vars(h)]
    if mode == "no_address":
        default = Run(sim)
        assert got == {h for h in default.group("proxmox_containers") if "ansible_host" not in default.vars(h)}
        assert run.vars("train-b")["ansible_host"] == "10.20.0.102"  # it has its own address: untouched


# ---------------------------------------------------------------------- Proxmox VE 9
@pytest.fixture
def pve9():
    with PveSim(load_cluster("pve9")) as s:
        yield s


def test_pve9_configs_match_the_ground_truth(pve9):
    desc = load_cluster("pve9")
    run = Run(pve9)
    for g in desc["guests"]:
        meta, hv = g["meta"], run.vars(g["name"])
        assert (g["name"] in run.group("gpu_nodes")) is meta["gpu"], g["name"]
        if meta["gpu"]:
            assert hv["proxmox_gpu_passthrough"] == meta["passthrough"], g["name"]
            assert hv["proxmox_gpu_devices"] == meta["devices"], g["name"]
    assert run.vars("hot-gpu")["proxmox_gpu_evidence"][3] == "dev3: /dev/nvidia-caps/nvidia-cap1,deny-write=1,mode=0444"
    assert run.vars("pve9a")["proxmox_gpu_guests"] == ["hot-gpu", "oci-vllm", "pending-unplug", "v1-keys", "vm-unplug"]


def test_pending_removals_do_not_hide_a_gpu_the_running_guest_still_holds(pve9):
    # The API without current=1 merges the pending deletions: this is what a plain /config read sees.
    client = ProxmoxClient(pve9.url, token_id=pve9.token[0], token_secret=pve9.token[1])
    assert "dev0" not in client.get("/nodes/pve9a/lxc/902/config")
    assert "hostpci0" not in client.get("/nodes/pve9a/qemu/906/config")
    assert client.get("/nodes/pve9a/lxc/903/config")["dev0"] == "/dev/nvidia2,gid=44"
    run = Run(pve9)
    assert {"pending-unplug", "vm-unplug"} <= run.group("gpu_nodes")
    assert "pending-plug" not in run.group("gpu_nodes")
    assert all(p.endswith("?current=1") for p in run.paths() if "/config" in p)
