"""Fidelity of the Proxmox VE API simulator (pvesim).

* the recorded answers in pvesim/fixtures are served byte-for-byte as the JSON they hold, and the
  reference client proxmoxer reads them;
* answers the simulator generates from a cluster description have the recorded answers' shapes
  (same keys, same JSON types) for every endpoint the fixtures cover;
* PVE's error behaviour: 401 without body for bad tokens/tickets, 501 for unknown paths, 595 for an
  offline node, the body ``message`` field only from PVE 9, ``errors`` on 400s;
* latency injection, the request counter, TLS and the CLI.
"""

from __future__ import annotations

import json
import os
import signal
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import proxmoxer
import pytest
from pvesim import DEFAULT_TOKEN_ID, DEFAULT_TOKEN_SECRET, Cluster, PveSim, load_cluster, parse_conf, recorded
from pvesim.generate import benchmark_cluster, gpu_guests

pytestmark = pytest.mark.host_safe

RESEARCH = Path(__file__).resolve().parents[4] / "shared" / "research" / "pve-fixtures"
AUTH = {"Authorization": f"PVEAPIToken={DEFAULT_TOKEN_ID}={DEFAULT_TOKEN_SECRET}"}


def get(sim: PveSim, path: str, headers: dict[str, str] | None = None, method: str = "GET", data: bytes | None = None):
    """(status, reason, raw body) of one request."""
    req = urllib.request.Request(sim.url + "/api2/json" + path, headers=AUTH if headers is None else headers, method=method, data=data)
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, resp.reason, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.reason, exc.read()


def shape(value):
    """JSON types of a value, recursively; list items merged (keys of all rows)."""
    if isinstance(value, dict):
        return {k: shape(v) for k, v in value.items()}
    if isinstance(value, list):
        merged: dict = {}
        kinds = set()
        for item in value:
            s = shape(item)
            if isinstance(s, dict):
                merged.update(s)
            else:
                kinds.add(s if isinstance(s, str) else "list")
        return [merged] if merged else sorted(kinds)
    return {bool: "bool", int: "int", float: "number", str: "str", type(None): "null"}[type(value)]


# ---------------------------------------------------------------------- recorded fixtures, verbatim
@pytest.fixture(scope="module")
def fixture_sim():
    with PveSim(recorded.fixture_cluster(), tls=True) as sim:
        yield sim


def test_in_repo_fixtures_are_the_research_copies():
    if not RESEARCH.is_dir():
        pytest.skip(f"research folder {RESEARCH} not present (clean checkout)")
    for name in recorded.ENDPOINTS:
        assert (recorded.FIXTURES / name).read_bytes() == (RESEARCH / name).read_bytes(), name


@pytest.mark.parametrize("name", sorted(recorded.ENDPOINTS))
def test_every_fixture_is_served_as_it_is(fixture_sim, name):
    method, path, status, wrapped, reason = recorded.ENDPOINTS[name]
    req = urllib.request.Request(fixture_sim.url + "/api2/json" + path, headers=AUTH, method=method, data=b"" if method == "POST" else None)
    ctx = ssl.create_default_context(cafile=fixture_sim.ca_path)
    try:
        with urllib.request.urlopen(req, context=ctx, timeout=10) as resp:
            got_status, got_reason, body = resp.status, resp.reason, resp.read()
    except urllib.error.HTTPError as exc:
        got_status, got_reason, body = exc.code, exc.reason, exc.read()
    doc = recorded.load(name)
    assert got_status == status
    assert got_reason == reason
    assert json.loads(body) == (doc if wrapped else {"data": doc})


def test_proxmoxer_reads_the_fixtures(fixture_sim, monkeypatch):
    # requests would replace verify= with these bundles (proxmox-facts.md §8)
    monkeypatch.delenv("REQUESTS_CA_BUNDLE", raising=False)
    monkeypatch.delenv("CURL_CA_BUNDLE", raising=False)
    user, token = DEFAULT_TOKEN_ID.split("!")
    api = proxmoxer.ProxmoxAPI(f"127.0.0.1:{fixture_sim.port}", user=user, token_name=token, token_value=DEFAULT_TOKEN_SECRET, verify_ssl=fixture_sim.ca_path)
    assert api.cluster.status.get() == recorded.load("cluster_status.json")["data"]
    assert api.cluster.resources.get(type="vm") == recorded.load("cluster_resources_type_vm.json")
    assert api.nodes.get() == recorded.load("nodes.json")
    assert api.nodes("pve2").lxc.get() == recorded.load("nodes_node_lxc.json")
    assert api.nodes("pve").qemu.get() == recorded.load("nodes_node_qemu.json")
    assert api.nodes("pve").lxc(100).status.current.get() == recorded.load("lxc_status_current.json")
    assert api.nodes("pve").qemu(103).status.current.get()["qmpstatus"] == "paused"
    raw = api.nodes("pve").lxc(101).config.get()
    assert raw["lxc"] == recorded.load("lxc_config_raw_lxc_keys.json")["data"]["lxc"]
    assert api.nodes("pve").qemu(101).config.get()["hostpci0"] == "0000:01:00.0"
    assert api.nodes("pve").lxc(102).interfaces.get()[1]["inet"] == "192.168.3.95/22"
    with pytest.raises(proxmoxer.ResourceException) as exc:
        api.nodes("pve").qemu(100).agent("network-get-interfaces").get()
    assert exc.value.status_code == 500
    assert exc.value.content == "QEMU guest agent is not running"
    with pytest.raises(proxmoxer.ResourceException) as exc:
        api.cluster.nextid.get(vmid=200)
    assert exc.value.status_code == 400
    assert "VM 200 already exists" in str(exc.value.errors)


# ---------------------------------------------------------------------- generated answers have the recorded shapes
@pytest.fixture(scope="module")
def gpu3():
    with PveSim(load_cluster("gpu3")) as sim:
        yield sim


def data(sim: PveSim, path: str):
    status, reason, body = get(sim, path)
    assert status == 200, (path, status, reason)
    return json.loads(body)["data"]


@pytest.mark.parametrize(
    ("fixture", "path"),
    [
        ("cluster_status.json", "/cluster/status"),
        ("cluster_resources_type_vm.json", "/cluster/resources?type=vm"),
        ("nodes.json", "/nodes"),
        ("nodes_node_qemu.json", "/nodes/pve2/qemu"),
        ("lxc_status_current.json", "/nodes/pve1/lxc/101/status/current"),
        ("qemu_status_current.json", "/nodes/pve2/qemu/201/status/current"),
        ("lxc_interfaces.json", "/nodes/pve1/lxc/101/interfaces"),
    ],
)
def test_generated_answers_have_the_recorded_keys_and_types(gpu3, fixture, path):
    want = shape(recorded.served_body(fixture)["data"])
    got = shape(data(gpu3, path))
    if isinstance(want, list):
        want, got = want[0], got[0]
    # Every recorded key is present with the recorded JSON type (the simulator may add keys: newer PVE does).
    missing = {k: v for k, v in want.items() if k not in got}
    assert not missing, f"keys the recording has and the simulator lacks: {missing}"

    # JSON has one number type: Perl prints 0 as an integer and 0.17 as a float, so int and number agree.
    # "cpus" is a string in one recording (PVE 6.2) and a number in newer releases: accept both there.
    # Nested objects (the "ha" state) only need to be objects: their keys depend on the guest's HA setup.
    def agree(key: str, a, b) -> bool:
        if isinstance(a, dict) or isinstance(b, dict):
            return isinstance(a, dict) and isinstance(b, dict)
        return a == b or {a, b} <= {"int", "number"} or (key == "cpus" and b == "int")

    wrong = {k: (want[k], got[k]) for k in want if not agree(k, want[k], got[k])}
    assert not wrong, wrong


def test_lxc_config_keeps_raw_keys_like_the_recording(gpu3):
    config = data(gpu3, "/nodes/pve1/lxc/102/config")
    recorded_cfg = recorded.served_body("lxc_config_raw_lxc_keys.json")["data"]
    assert shape(config["lxc"]) == shape(recorded_cfg["lxc"]) == ["list"]
    assert [k for k, _unused in config["lxc"]].count("lxc.mount.entry") == 6
    # ints stay ints, 0/1 booleans are numbers, tags are ';'-joined, digest is 40 hex
    assert (config["memory"], config["unprivileged"], config["tags"]) == (32768, 0, "gpu;train")
    assert len(config["digest"]) == 40
    # the "=" separator line arrives like the ":" ones
    assert ["lxc.cgroup2.devices.allow", "c 237:* rwm"] in config["lxc"]


def test_conf_parser_stops_at_snapshot_sections_and_keeps_description():
    conf = parse_conf("#hello%20world\ndev0: /dev/nvidia0\n\n[snap]\ndev0: /dev/nvidia7\n", "lxc")
    assert conf["dev0"] == "/dev/nvidia0"
    assert conf["description"] == "hello world\n"


def test_old_pve_container_returns_vmid_as_string_like_the_recording():
    desc = load_cluster("gpu3")
    desc["lxc_vmid_as_string"] = True
    with PveSim(desc) as sim:
        rows = data(sim, "/nodes/pve1/lxc")
    assert {type(r["vmid"]) for r in rows} == {str}
    assert shape(rows)[0]["vmid"] == shape(recorded.load("nodes_node_lxc.json"))[0]["vmid"] == "str"


def test_resources_rows_of_an_offline_node_and_rrd_gaps_have_no_name(gpu3):
    rows = {r["vmid"]: r for r in data(gpu3, "/cluster/resources?type=vm")}
    assert rows[301] == {"id": "lxc/301", "vmid": 301, "node": "pve3", "type": "lxc", "status": "unknown", "tags": "gpu"}
    assert "name" not in rows[108]
    assert rows[101]["template"] == 0
    assert rows[107]["template"] == 1


# ---------------------------------------------------------------------- errors and auth
def test_errors_follow_pve(gpu3):
    status, reason, body = get(gpu3, "/nodes/pve3/lxc/301/config")
    assert (status, body) == (595, b"")
    assert "No route to host" in reason
    status, reason, body = get(gpu3, "/nodes/pve1/lxc/201/config")  # 201 lives on pve2
    assert (status, reason, json.loads(body)) == (500, "Configuration file 'nodes/pve1/lxc/201.conf' does not exist", {"data": None})
    status, reason, _unused = get(gpu3, "/cluster/tasks")
    assert (status, reason) == (501, "Method 'GET /cluster/tasks' not implemented")
    status, reason, body = get(gpu3, "/cluster/resources?type=bogus")
    assert status == 400
    assert "type" in json.loads(body)["errors"]


def test_message_field_only_from_pve_9():
    for version, has_message in (("8.2.4", False), ("9.0.3", True)):
        with PveSim({"pve_version": version, "nodes": [{"name": "pve"}]}) as sim:
            _unused, _unused, body = get(sim, "/nodes/pve/lxc/100/config")
        doc = json.loads(body)
        assert ("message" in doc) is has_message
        if has_message:
            assert doc["message"] == "Configuration file 'nodes/pve/lxc/100.conf' does not exist\n"


def test_interfaces_endpoint_is_501_before_pve_8_1():
    desc = load_cluster("gpu3")
    desc["pve_version"] = "7.4.3"
    with PveSim(desc) as sim:
        status, _unused, _unused = get(sim, "/nodes/pve1/lxc/101/interfaces")
    assert status == 501


@pytest.mark.parametrize(
    ("headers", "reason"),
    [
        ({}, "No ticket"),
        ({"Authorization": f"PVEAPIToken={DEFAULT_TOKEN_ID}=wrong"}, "invalid token value!"),
        ({"Authorization": "PVEAPIToken=root@pam!other=x"}, "no such token 'other' for user 'root@pam'"),
        ({"Cookie": "PVEAuthCookie=PVE:root@pam:0000::forged"}, "permission denied - invalid PVE ticket"),
    ],
)
def test_auth_failures_are_401_without_body(gpu3, headers, reason):
    assert get(gpu3, "/cluster/status", headers=headers) == (401, reason, b"")


def test_ticket_login_with_proxmoxer(monkeypatch):
    monkeypatch.delenv("REQUESTS_CA_BUNDLE", raising=False)
    monkeypatch.delenv("CURL_CA_BUNDLE", raising=False)
    with PveSim(load_cluster("gpu3"), tls=True, users={"ops@pve": "s3cret"}) as sim:
        api = proxmoxer.ProxmoxAPI(f"127.0.0.1:{sim.port}", user="ops@pve", password="s3cret", verify_ssl=False)
        assert [n["node"] for n in api.nodes.get()] == ["pve1", "pve2", "pve3"]
        with pytest.raises(proxmoxer.AuthenticationError):
            proxmoxer.ProxmoxAPI(f"127.0.0.1:{sim.port}", user="ops@pve", password="bad", verify_ssl=False)
        assert sim.requests[0] == ("POST", "/api2/json/access/ticket")


# ---------------------------------------------------------------------- counter, latency, concurrency
def test_counter_and_reset(gpu3):
    gpu3.reset_counter()
    get(gpu3, "/version")
    get(gpu3, "/cluster/resources?type=vm")
    assert gpu3.request_count == 2
    assert gpu3.requests == [("GET", "/api2/json/version"), ("GET", "/api2/json/cluster/resources?type=vm")]
    gpu3.reset_counter()
    assert gpu3.request_count == 0


def test_latency_is_per_request_and_requests_run_in_parallel():
    import concurrent.futures

    with PveSim(load_cluster("gpu3"), latency_ms=200) as sim:
        start = time.monotonic()
        get(sim, "/version")
        one = time.monotonic() - start
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            list(pool.map(lambda _unused: get(sim, "/version"), range(8)))
        # Concurrent, not serialised: several requests were inside the server at once (its own
        # count, whatever the load; how long eight take is a benchmark's business).
        assert sim.max_in_flight > 1
    assert one >= 0.2  # the latency is served (a lower bound)


def test_generated_benchmark_cluster():
    desc = benchmark_cluster(nodes=3, guests_per_node=300)
    cluster = Cluster(desc)
    assert len(cluster.guests) == 900
    truth = gpu_guests(desc)
    assert 60 < len(truth) < 200
    kinds = {cluster.guests[v].type for v in truth}
    assert kinds == {"lxc", "qemu"}
    # deterministic for a seed
    assert gpu_guests(benchmark_cluster(nodes=3, guests_per_node=300)) == truth


# ---------------------------------------------------------------------- CLI
def test_cli_serves_until_interrupted(tmp_path):
    sim_dir = Path(__file__).resolve().parents[1]
    port_probe = PveSim(load_cluster("gpu3")).start()
    port = port_probe.port
    port_probe.stop()
    proc = subprocess.Popen(
        [sys.executable, "-m", "pvesim", "--cluster", "gpu3", "--port", str(port), "--latency-ms", "1"],
        cwd=sim_dir,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(sim_dir)),
    )
    try:
        first = proc.stdout.readline()
        assert f"http://127.0.0.1:{port}" in first
        req = urllib.request.Request(f"http://127.0.0.1:{port}/api2/json/version", headers=AUTH)
        with urllib.request.urlopen(req, timeout=10) as resp:
            assert json.loads(resp.read())["data"]["version"] == "8.2.4"
    finally:
        proc.send_signal(signal.SIGTERM)
        _unused, err = proc.communicate(timeout=10)
    assert proc.returncode == 0
    assert "1 requests served" in err
