"""The gpuops.clean_slate.proxmox inventory through real ansible-inventory / ansible-playbook, against pvesim.

Config files live in tests/functional/inventory/; the simulator's URL and credentials reach the
plugin through PROXMOX_* environment variables (or a templated url), as they would from AWX.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from conftest_proxmox import CLUSTER_SOURCE, INVENTORY_DIR, ansible_inventory, group_hosts, inventory_list, plain
from pvesim import PveSim, load_cluster
from support.ansible import VENV_PYTHON, run_playbook

GPU_GUESTS = {"train-a", "train-b", "infer-hook", "train-a-106", "old-raw", "vm-gpu", "train-a-204", "vm-mapped"}


@pytest.fixture
def sim():
    with PveSim(load_cluster("gpu3")) as s:
        yield s


def test_graph_shows_gpu_nodes(sim):
    proc = ansible_inventory(CLUSTER_SOURCE, sim.env(), "--graph", "gpu_nodes")
    assert proc.returncode == 0, proc.stderr
    lines = [line.strip().lstrip("|-").lstrip("-") for line in proc.stdout.splitlines()]
    assert lines[0] == "@gpu_nodes:"
    assert set(lines[1:]) == GPU_GUESTS | {"pve1", "pve2"}
    full = ansible_inventory(CLUSTER_SOURCE, sim.env(), "--graph")
    assert "@gpu_nodes:" in full.stdout
    assert "@proxmox_unreachable:" in full.stdout


def test_list_groups_and_host_vars(sim):
    inv = inventory_list(CLUSTER_SOURCE, sim.env())
    hv = inv["_meta"]["hostvars"]
    assert group_hosts(inv, "gpu_nodes") == GPU_GUESTS | {"pve1", "pve2"}
    assert group_hosts(inv, "proxmox_hypervisors") == {"pve1", "pve2", "pve3"}
    assert group_hosts(inv, "proxmox_unreachable") == {"lxc-301", "qemu-302", "pve3"}
    assert hv["train-b"]["proxmox_gpu_passthrough"] == "lxc-raw"
    assert hv["train-b"]["proxmox_gpu_devices"][0] == "/dev/nvidia1"
    assert hv["vm-gpu"]["proxmox_gpu_devices"] == ["0000:41:00.0", "0000:41:00.1"]
    assert hv["train-a"]["proxmox_node_host"] == hv["pve1"]["ansible_host"] == "10.10.0.11"
    assert hv["lxc-301"]["proxmox_status"] == "unknown"
    assert hv["train-a-204"]["proxmox_vmid"] == 204
    # warnings name the collisions
    stderr = ansible_inventory(CLUSTER_SOURCE, sim.env(), "--list").stderr
    assert "guest 106 on pve1 is in the inventory as 'train-a-106'" in " ".join(stderr.split())


def test_request_count_is_two_plus_configs_fetched(sim, tmp_path):
    source = tmp_path / "lxc-only.proxmox.yml"
    source.write_text("plugin: gpuops.clean_slate.proxmox\ninclude_types: [lxc]\nwant_interfaces: false\n")
    sim.reset_counter()
    inv = inventory_list(source, sim.env())
    paths = [p for _unused, p in sim.requests]
    configs = [p for p in paths if p.endswith("/config?current=1")]
    assert sim.request_count == 2 + len(configs)
    # one config per selected container on an online node: pve1's eight non-template ones and 204 on pve2
    assert len(configs) == 9
    assert group_hosts(inv, "proxmox_vms") == set()


def test_full_request_count_formula(sim):
    sim.reset_counter()
    inventory_list(CLUSTER_SOURCE, sim.env())
    paths = [p.replace("/api2/json", "") for _unused, p in sim.requests]
    configs = sum(p.endswith("/config?current=1") for p in paths)
    interfaces = sum(p.endswith("/interfaces") for p in paths)
    pci = sum(p.endswith("/hardware/pci") for p in paths)
    mapping = paths.count("/cluster/mapping/pci")
    assert (configs, interfaces, pci, mapping) == (13, 5, 1, 1)
    assert sim.request_count == 2 + configs + interfaces + pci + mapping == 22


def test_bad_token_fails_with_a_clear_message_and_never_shows_the_secret(sim):
    env = {**sim.env(), "PROXMOX_TOKEN_SECRET": "not-the-secret-0000"}
    proc = ansible_inventory(CLUSTER_SOURCE, env, "--list", "-vvvv")
    output = proc.stdout + proc.stderr
    text = " ".join(output.split())
    assert "401 invalid token value!" in text
    assert "authentication failure: check token_id/token_secret" in text
    assert f"{sim.url}/api2/json/cluster/status" in text
    assert "not-the-secret-0000" not in output
    # the source failed, so no Proxmox host made it into the inventory
    listed = json.loads(proc.stdout) if proc.stdout.strip().startswith("{") else {}
    assert "gpu_nodes" not in listed


def test_good_token_never_appears_in_verbose_output(sim):
    _unused, secret = sim.token
    proc = ansible_inventory(CLUSTER_SOURCE, sim.env(), "--list", "-vvvv")
    assert proc.returncode == 0, proc.stderr
    assert secret not in proc.stdout + proc.stderr


def test_password_auth_from_the_environment(tmp_path):
    with PveSim(load_cluster("gpu3"), users={"inventory@pve": "pw-123"}) as s:
        env = {"PROXMOX_URL": s.url, "PROXMOX_USER": "inventory@pve", "PROXMOX_PASSWORD": "pw-123"}
        inv = inventory_list(CLUSTER_SOURCE, env)
        assert s.requests[0] == ("POST", "/api2/json/access/ticket")
        bad = ansible_inventory(CLUSTER_SOURCE, {**env, "PROXMOX_PASSWORD": "wrong-pw"}, "--list")
    assert group_hosts(inv, "gpu_nodes") == GPU_GUESTS | {"pve1", "pve2"}
    assert "401 authentication failure" in " ".join(bad.stderr.split())
    assert "check user/password" in bad.stderr
    assert "wrong-pw" not in bad.stdout + bad.stderr


def test_tls_verification_on_and_off(tmp_path):
    strict = tmp_path / "strict.proxmox.yml"
    strict.write_text("plugin: gpuops.clean_slate.proxmox\n")  # validate_certs defaults to true
    with PveSim(load_cluster("gpu3"), tls=True) as s:
        untrusted = ansible_inventory(strict, s.env(), "--list")
        trusted = inventory_list(strict, {**s.env(), "PROXMOX_CA_PATH": s.ca_path})
        insecure = inventory_list(strict, {**s.env(), "PROXMOX_VALIDATE_CERTS": "false"})
        skipped = inventory_list(CLUSTER_SOURCE, s.env())  # validate_certs: false in the file
    assert "not trusted" in untrusted.stderr
    assert "gpu_nodes" not in (json.loads(untrusted.stdout) if untrusted.stdout.strip() else {})
    for inv in (trusted, insecure, skipped):
        assert group_hosts(inv, "gpu_nodes") == GPU_GUESTS | {"pve1", "pve2"}


def test_templated_url(sim):
    inv = inventory_list(INVENTORY_DIR / "templated.proxmox.yml", {**sim.env(), "PROXMOX_URL": "", "PVESIM_URL": sim.url})
    assert "pve1" in group_hosts(inv, "gpu_nodes")


def test_cache_second_run_makes_no_request(sim, tmp_path):
    source = tmp_path / "cached.proxmox.yml"
    source.write_text(
        "plugin: gpuops.clean_slate.proxmox\nvalidate_certs: false\ncache: true\n"
        f"cache_plugin: ansible.builtin.jsonfile\ncache_connection: {tmp_path / 'cache'}\ncache_timeout: 600\n"
    )
    sim.reset_counter()
    first = inventory_list(source, sim.env())
    assert sim.request_count == 22
    sim.reset_counter()
    second = inventory_list(source, sim.env())
    assert sim.request_count == 0
    assert second == first
    flushed = inventory_list(source, sim.env(), "--flush-cache")
    assert sim.request_count == 22
    assert flushed == first


def test_offline_node_and_failing_guest_do_not_abort(sim):
    sim.add_response("/nodes/pve1/lxc/101/config", status=500, message="unable to open file '/etc/pve/nodes/pve1/lxc/101.conf.tmp' - Input/output error")
    proc = ansible_inventory(CLUSTER_SOURCE, sim.env(), "--list")
    assert proc.returncode == 0, proc.stderr
    inv = plain(json.loads(proc.stdout))
    assert "Input/output error" in inv["_meta"]["hostvars"]["train-a"]["proxmox_config_error"]
    assert "train-a" not in group_hosts(inv, "gpu_nodes")
    assert group_hosts(inv, "proxmox_unreachable") == {"lxc-301", "qemu-302", "pve3"}
    assert "kept without its configuration" in " ".join(proc.stderr.split())


def test_playbook_limited_to_gpu_nodes(sim):
    playbook = [
        {
            "name": "Clean-slate targets",
            "hosts": "gpu_nodes",
            "gather_facts": False,
            "connection": "local",
            "vars": {"ansible_python_interpreter": VENV_PYTHON},
            "tasks": [{"name": "Report", "ansible.builtin.debug": {"msg": "{{ proxmox_type }} {{ proxmox_gpu_passthrough | default('host', true) }}"}}],
        }
    ]
    run = run_playbook(playbook, inventory=CLUSTER_SOURCE, env=sim.env(), limit="gpu_nodes")
    assert run.rc == 0, run.output
    reported = {r["host"]: r["result"]["msg"] for r in run.by_action("debug")}
    assert set(reported) == GPU_GUESTS | {"pve1", "pve2"}
    assert reported["vm-gpu"] == "qemu qemu-hostpci"
    assert reported["pve2"] == "node host"
