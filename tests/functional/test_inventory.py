"""The gpuops.clean_slate.proxmox inventory through real ansible-inventory / ansible-playbook, against pvesim.

Config files live in tests/functional/inventory/; the simulator's URL and credentials reach the
plugin through PROXMOX_* environment variables (or a templated url), as they would from AWX.
"""

from __future__ import annotations

import json
import re
import subprocess

import pytest
import yaml
from pvesim import PveSim, load_cluster
from support.ansible import ROOT, VENV, VENV_PYTHON, ansible_env, run_playbook
from support.proxmox import CLUSTER_SOURCE, INVENTORY_DIR, ansible_inventory, group_hosts, inventory_list, plain

from ansible_collections.gpuops.clean_slate.plugins.plugin_utils._proxmox import ProxmoxClient

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


# ---------------------------------------------------------------------- group_prefix and the pct_exec example
DOCS = ROOT / "docs" / "proxmox.md"


def doc_section(heading: str) -> str:
    """The text of the docs/proxmox.md section ``heading`` (a whole line), up to the next heading of its level or above."""
    text = DOCS.read_text()
    level = heading.split(" ", 1)[0]
    start = text.index(f"\n{heading}\n") + 1
    ends = [m.start() for m in re.finditer(rf"^#{{1,{len(level)}}} ", text[start + len(heading) :], re.M)]
    return text[start : start + len(heading) + ends[0]] if ends else text[start:]


def test_pct_exec_example_variables_exist_with_any_group_prefix(sim, tmp_path):
    # The documented example, as a user copies it: its task is run with debug in place of pct_exec (same arguments,
    # same delegate_to), so an undefined {{ proxmox_vmid }} or {{ proxmox_node_host }} fails the run.
    play = yaml.safe_load(doc_section("## `pct_exec`").split("```yaml\n", 1)[1].split("```", 1)[0])[0]
    task = play["tasks"][0]
    args = task.pop("gpuops.clean_slate.pct_exec")
    assert task["delegate_to"] == "{{ proxmox_node_host }}" and args["vmid"] == "{{ proxmox_vmid }}"
    task.pop("failed_when")
    task["ansible.builtin.debug"] = {"msg": {**args, "delegate_to": "{{ proxmox_node_host }}"}}
    for prefix in ("proxmox_", "pve_"):
        source = tmp_path / f"{prefix}prefix.proxmox.yml"
        source.write_text(f"plugin: gpuops.clean_slate.proxmox\nvalidate_certs: false\ngroup_prefix: {prefix}\n")
        run = run_playbook([{**play, "hosts": play["hosts"].replace("proxmox_", prefix)}], inventory=source, env=sim.env())
        assert run.rc == 0, run.output
        done = {r["host"]: r["result"]["msg"] for r in run.by_action("debug")}
        # every running GPU container of the example's host pattern, whatever the prefix
        assert set(done) == {"train-a", "train-b", "infer-hook", "old-raw", "train-a-204"}, prefix
        assert str(done["train-a"]["vmid"]) == "101"
        assert done["train-a"]["delegate_to"] == "10.10.0.11"
        assert done["train-a-204"]["delegate_to"] == "10.10.0.12"
        listed = inventory_list(source, sim.env())
        assert not [k for k in listed["_meta"]["hostvars"]["train-a"] if k.startswith("pve_")]


# ---------------------------------------------------------------------- community.proxmox migration table
def table_rows(section: str) -> list[list[str]]:
    """The body rows of the first markdown table in ``section``, as cell texts."""
    rows: list[str] = []
    for line in section.splitlines():
        if line.startswith("|"):
            rows.append(line)
        elif rows:
            break
    return [[c.strip() for c in row.strip("|").split("|")] for row in rows[2:]]


def names(cell: str) -> list[str]:
    return re.findall(r"`([^`]+)`", cell)


def pattern_hosts(inv: dict, pattern: str) -> set[str]:
    """Hosts of an Ansible host pattern over groups (``a:b`` union, ``:&c`` intersection, ``:!d`` exclusion)."""

    def members(group: str) -> set[str]:
        g = inv.get(group, {})
        out = set(g.get("hosts", []))
        for child in g.get("children", []):
            out |= members(child)
        return out

    union: set[str] = set()
    parts = pattern.split(":")
    for part in parts:
        if part and part[0] not in "&!":
            union |= members(part)
    for part in parts:
        if part.startswith("&"):
            union &= members(part[1:])
    for part in parts:
        if part.startswith("!"):
            union -= members(part[1:])
    return union


def test_migration_table_matches_the_plugin(sim, tmp_path):
    community = json.loads((INVENTORY_DIR / "community_proxmox_2.0.0.json").read_text())
    compat = tmp_path / "compat.proxmox.yml"
    compat.write_text("plugin: gpuops.clean_slate.proxmox\nvalidate_certs: false\ncompat_groups: true\nexclude_templates: false\n")
    facts = tmp_path / "facts.proxmox.yml"
    facts.write_text("plugin: gpuops.clean_slate.proxmox\nvalidate_certs: false\nwant_facts: true\n")
    inv = inventory_list(compat, sim.env())
    with_facts = inventory_list(facts, sim.env())["_meta"]["hostvars"]
    plain_vars = inventory_list(CLUSTER_SOURCE, sim.env())["_meta"]["hostvars"]
    section = doc_section("## Coming from community.proxmox")

    # Groups: each left-hand group (compat_groups) holds exactly the hosts of the right-hand pattern.
    hv = inv["_meta"]["hostvars"]
    nodes = sorted(pattern_hosts(inv, "proxmox_hypervisors"))
    statuses = sorted({v["proxmox_status"] for v in hv.values() if v["proxmox_type"] != "node"} - {"running", "stopped"})
    pools = sorted({v["proxmox_pool"] for v in hv.values() if v.get("proxmox_pool")})
    assert (nodes, statuses, pools) == (["pve1", "pve2", "pve3"], ["unknown"], ["ml"])
    group_rows = table_rows(section.split("### Groups", 1)[1])
    seen_groups: list[str] = []
    for left, right, _notes in group_rows:
        seen_groups += names(left)
        for template in names(left):
            for values in [{"node": n, "status": st, "pool": pl} for n in nodes for st in statuses for pl in pools]:
                group = template.replace("<node>", values["node"]).replace("<status>", values["status"]).replace("<pool>", values["pool"])
                if right == "—":
                    assert group not in inv, group
                    continue
                want = pattern_hosts(inv, names(right)[0].replace("<node>", values["node"]).replace("<pool>", values["pool"]))
                # ansible-inventory --list leaves empty groups out (pve1 has no VM)
                assert group in inv or not want, group
                assert pattern_hosts(inv, group) == want, (group, right)
    assert sorted(seen_groups) == sorted(community["groups"])
    assert pattern_hosts(inv, "proxmox_all_templates") == {"tmpl-debian"}  # the comparison is not vacuous
    assert pattern_hosts(inv, "proxmox_pve1_lxc") and pattern_hosts(inv, "proxmox_all_unknown")

    # Host variables: "always" on every guest, "want_facts" only with want_facts, "—" nowhere.
    guests = [h for h, v in plain_vars.items() if v["proxmox_type"] != "node"]
    var_rows = table_rows(section.split("### Host variables", 1)[1])
    seen_vars: list[str] = []
    for left, right, when, _notes in var_rows:
        seen_vars += names(left)
        if right == "—":
            for hostvars in (plain_vars, with_facts):
                assert not [h for h, v in hostvars.items() if names(left)[0] in v], left
            continue
        var = names(right)[0]
        if var == "proxmox_<config key>":
            config = ProxmoxClient(sim.url, token_id=sim.token[0], token_secret=sim.token[1]).get("/nodes/pve2/qemu/202/config?current=1")
            assert {f"proxmox_{k}" for k in config} <= set(with_facts["vm-nic"])
            assert "proxmox_agent" not in plain_vars["vm-nic"]
        elif when == "always":
            assert all(var in plain_vars[h] for h in guests), var
        elif when == "nodes":
            assert all(var in plain_vars[h] for h in nodes), var
        elif when == "want_facts":
            assert any(var in v for v in with_facts.values()) and not any(var in v for v in plain_vars.values()), var
        else:
            pytest.fail(f"unknown 'when' {when!r} in the host variables table")
    assert sorted(seen_vars) == sorted(community["variables"])

    # Options: every right-hand option exists (ansible-doc of the installed plugin), every "—" does not.
    doc = subprocess.run(
        [str(VENV / "bin" / "ansible-doc"), "-t", "inventory", "-j", "gpuops.clean_slate.proxmox"],
        env=ansible_env({}),
        capture_output=True,
        text=True,
        check=True,
        cwd=str(ROOT),
    )
    ours = set(json.loads(doc.stdout)["gpuops.clean_slate.proxmox"]["doc"]["options"])
    seen_options: list[str] = []
    for left, right, _notes in table_rows(section.split("### Options", 1)[1]):
        seen_options += names(left)
        if right == "—":
            assert not set(names(left)) & ours, left
        else:
            assert set(names(right)) <= ours, right
    assert sorted(seen_options) == sorted(community["options"])


# ---------------------------------------------------------------------- exclude_nodes, pct_remote through ansible-inventory
def test_exclude_nodes_and_pct_remote_through_ansible_inventory(sim, tmp_path):
    source = tmp_path / "remote.proxmox.yml"
    source.write_text(
        "plugin: gpuops.clean_slate.proxmox\nvalidate_certs: false\nexclude_nodes: true\npct_remote: no_address\ncompose:\n  ansible_user: \"'ansible'\"\n"
    )
    inv = inventory_list(source, sim.env())
    hv = inv["_meta"]["hostvars"]
    assert not {"pve1", "pve2", "pve3"} & set(hv)
    assert "proxmox_hypervisors" not in inv
    remote = {h for h, v in hv.items() if v.get("ansible_connection") == "community.proxmox.proxmox_pct_remote"}
    assert remote == {"dri-box", "rrd-gap", "train-a-106", "lxc-301"}
    for host in remote:
        assert hv[host]["ansible_host"] == hv[host]["proxmox_node_host"]
        assert hv[host]["ansible_user"] == "ansible"
        assert isinstance(hv[host]["proxmox_vmid"], int)
    assert hv["train-b"]["ansible_host"] == "10.20.0.102" and "ansible_connection" not in hv["train-b"]
    # Ansible itself picks the connection for the host: without community.proxmox installed here, it says that
    # plugin is missing for dri-box, while train-b (its own address, default connection) runs.
    adhoc = ["-m", "ansible.builtin.debug", "-a", '{"msg": "{{ ansible_host }} {{ proxmox_vmid }}"}']
    proc = subprocess.run(
        [str(VENV / "bin" / "ansible"), "-i", str(source), "dri-box:train-b", *adhoc],
        env=ansible_env(sim.env()),
        capture_output=True,
        text=True,
        check=False,
        cwd=str(ROOT),
    )
    out = " ".join((proc.stdout + proc.stderr).split())
    assert "dri-box | FAILED!" in out and "the connection plugin 'community.proxmox.proxmox_pct_remote' was not found" in out, out
    assert '"msg": "10.20.0.102 102"' in out, out
