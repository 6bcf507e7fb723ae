"""Unit tests for plugins/plugin_utils/_proxmox.py.

The parsers run on the recorded API fixtures of shared/research/pve-fixtures and on hand-written
configs for every GPU passthrough variant; the client runs over real HTTP(S) against pvesim.
"""

from __future__ import annotations

import ssl
import time

import pytest
from ansible.parsing.dataloader import DataLoader
from ansible.template import Templar, trust_as_template
from pvesim import PveSim, load_cluster, recorded

from ansible_collections.gpuops.clean_slate.plugins.plugin_utils import _proxmox as px


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


# ---------------------------------------------------------------------- client
def test_token_header_forms():
    assert px.token_header("root@pam!inv", "s3cret") == "PVEAPIToken=root@pam!inv=s3cret"
    assert px.token_header(" inv ", " s3cret\n", user="ops@pve") == "PVEAPIToken=ops@pve!inv=s3cret"
    with pytest.raises(ValueError, match="realm"):
        px.token_header("root!inv", "s")
    with pytest.raises(ValueError, match="user@realm!tokenid"):
        px.token_header("inv", "s")


@pytest.fixture(scope="module")
def sim():
    with PveSim(load_cluster("gpu3")) as s:
        yield s


def client_for(sim: PveSim, **kw) -> px.ProxmoxClient:
    token_id, secret = sim.token
    kw.setdefault("token_id", token_id)
    kw.setdefault("token_secret", secret)
    return px.ProxmoxClient(sim.url, **kw)


def test_client_reads_data_and_counts_requests(sim):
    sim.reset_counter()
    client = client_for(sim)
    status = client.get("/cluster/status")
    assert [r["name"] for r in status if r["type"] == "node"] == ["pve1", "pve2", "pve3"]
    assert client.request_count == sim.request_count == 1


def test_bad_token_error_names_url_status_message_and_hint_but_not_the_secret(sim):
    client = client_for(sim, token_secret="wrong-secret-123")
    with pytest.raises(px.ProxmoxApiError) as exc:
        client.get("/cluster/status")
    text = str(exc.value)
    assert exc.value.status == 401
    assert f"{sim.url}/api2/json/cluster/status" in text
    assert "401 invalid token value!" in text
    assert "authentication failure: check token_id/token_secret" in text
    assert "wrong-secret-123" not in text
    assert "wrong-secret-123" not in repr(client)


def test_unknown_token_id_message_comes_from_pve(sim):
    with pytest.raises(px.ProxmoxApiError, match="no such token 'nope' for user 'root@pam'"):
        client_for(sim, token_id="root@pam!nope").get("/cluster/status")


@pytest.mark.parametrize(
    ("path", "status", "message"),
    [
        ("/nodes/pve3/lxc/301/config", 595, "Errors during connection establishment"),
        ("/nodes/pve1/lxc/999/config", 500, "Configuration file 'nodes/pve1/lxc/999.conf' does not exist"),
        ("/pools/a/b", 501, "Method 'GET /pools/a/b' not implemented"),
    ],
)
def test_http_errors_carry_status_and_reason_phrase(sim, path, status, message):
    with pytest.raises(px.ProxmoxApiError) as exc:
        client_for(sim).get(path)
    assert exc.value.status == status
    assert message in str(exc.value)
    assert exc.value.unreachable is (status == 595)


def test_message_field_of_newer_servers_is_preferred_and_param_errors_are_listed():
    desc = {"pve_version": "9.0.3", "nodes": [{"name": "pve"}]}
    with PveSim(desc) as s:
        s.add_response("/nodes/pve/qemu/100/agent/network-get-interfaces", status=500, message="QEMU guest agent is not running")
        s.add_response("/cluster/nextid", status=400, message="Parameter verification failed.", errors={"vmid": "VM 200 already exists"})
        client = client_for(s)
        with pytest.raises(px.ProxmoxApiError) as agent:
            client.get("/nodes/pve/qemu/100/agent/network-get-interfaces")
        with pytest.raises(px.ProxmoxApiError) as param:
            client.get("/cluster/nextid")
    assert agent.value.message == "QEMU guest agent is not running"
    assert param.value.errors == {"vmid": "VM 200 already exists"}
    assert "vmid: VM 200 already exists" in str(param.value)


def test_password_login_then_ticket_cookie_and_bad_password():
    with PveSim(load_cluster("gpu3"), users={"ops@pve": "pw-1"}) as s:
        client = px.ProxmoxClient(s.url, user="ops@pve", password="pw-1")
        assert client.get("/cluster/resources?type=vm")
        assert [m for m, _unused in s.requests] == ["POST", "GET"]
        with pytest.raises(px.ProxmoxApiError) as exc:
            px.ProxmoxClient(s.url, user="ops@pve", password="nope").get("/cluster/status")
    assert "401 authentication failure" in str(exc.value)
    assert "check user/password" in str(exc.value)
    assert "nope" not in str(exc.value)


def test_tls_verification_on_with_ca_off_and_failing_without():
    with PveSim(load_cluster("gpu3"), tls=True) as s:
        assert client_for(s, ca_path=s.ca_path).get("/version")["version"] == "8.2.4"
        assert client_for(s, validate_certs=False).get("/version")["release"] == "8.2"
        with pytest.raises(px.ProxmoxApiError) as exc:
            client_for(s).get("/version")
    assert exc.value.status is None
    assert "not trusted" in str(exc.value)


def test_connection_refused_is_an_api_error():
    with PveSim(load_cluster("gpu3")) as s:
        url = s.url
    with pytest.raises(px.ProxmoxApiError, match="cannot connect"):
        px.ProxmoxClient(url, token_id="root@pam!x", token_secret="y", timeout=2).get("/version")


def test_cached_paths_make_no_request_and_uncached_ones_do(sim):
    first = client_for(sim)
    first.get("/cluster/status")
    sim.reset_counter()
    second = client_for(sim, cached=first.responses)
    assert second.get("/cluster/status") == first.responses["/cluster/status"]
    assert sim.request_count == 0
    second.get("/version")
    assert sim.request_count == 1
    assert set(second.responses) == {"/cluster/status", "/version"}


def test_fetch_all_bounds_concurrency_and_returns_errors_per_path():
    desc = load_cluster("gpu3")
    with PveSim(desc, latency_ms=60) as s:
        paths = [f"/nodes/pve1/lxc/{v}/config" for v in (101, 102, 103, 104, 105, 106, 108, 109)] + ["/nodes/pve3/lxc/301/config"]
        answers = px.fetch_all(client_for(s), paths, max_workers=3)
        assert 1 < s.max_in_flight <= 3
        assert s.request_count == len(paths)
    assert isinstance(answers["/nodes/pve3/lxc/301/config"], px.ProxmoxApiError)
    assert answers["/nodes/pve1/lxc/102/config"]["hostname"] == "train-b"


def test_fetch_all_logs_in_once_for_password_auth():
    with PveSim(load_cluster("gpu3"), users={"root@pam": "pw"}) as s:
        client = px.ProxmoxClient(s.url, user="root@pam", password="pw")
        px.fetch_all(client, [f"/nodes/pve1/lxc/{v}/config" for v in (101, 102, 103, 104)], max_workers=4)
        assert [m for m, _unused in s.requests].count("POST") == 1


def test_make_unsafe_keeps_values_equal_and_never_templated():
    value = {"a": ["{{ marker }}", "{% if true %}X{% endif %}"], "b": 1, "c": {"d": "{{ marker }}"}}
    marked = px.make_unsafe(value)
    assert marked == value
    templar = Templar(loader=DataLoader(), variables={"marker": "EVALUATED"})
    # Control: the same text, trusted as a template, is evaluated (so the check below can fail)...
    assert templar.template(trust_as_template("{{ marker }}")) == "EVALUATED"
    # ...while what the inventory marks stays text, however deep it sits.
    assert templar.template(marked) == value


def test_the_committed_fallback_certificate_still_serves_verified_tls(monkeypatch):
    """Where the openssl CLI is missing the simulator serves the pair committed in pvesim/certs:
    prove that pair still verifies (key matches, SAN, usages) and has years left, rather than
    discover it the day it is needed."""
    from pvesim import tls

    monkeypatch.setattr(tls.shutil, "which", lambda _name: None)
    with PveSim(load_cluster("gpu3"), tls=True) as s:
        assert s.ca_path == str(tls.FALLBACK_CERT)
        assert client_for(s, ca_path=s.ca_path).get("/version")["version"] == "8.2.4"
    not_after = ssl._ssl._test_decode_cert(str(tls.FALLBACK_CERT))["notAfter"]  # type: ignore[attr-defined]
    assert ssl.cert_time_to_seconds(not_after) > time.time() + 5 * 365 * 86400, not_after
