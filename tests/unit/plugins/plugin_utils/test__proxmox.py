"""Unit tests for plugins/plugin_utils/_proxmox.py (the Proxmox VE API client).

The client runs over real HTTP(S) against pvesim; parsing what it fetches is
test__proxmox_config.py's subject.
"""

from __future__ import annotations

import ssl
import time

import pytest
from ansible.parsing.dataloader import DataLoader
from ansible.template import Templar, trust_as_template
from pvesim import PveSim, load_cluster

from ansible_collections.gpuops.clean_slate.plugins.plugin_utils import _proxmox as px


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
    # Each answer takes 250 ms, so that requests overlap even when a loaded machine is slow to schedule the
    # second thread (with 60 ms, a run beside another test suite once saw one request at a time).
    with PveSim(desc, latency_ms=250) as s:
        paths = [f"/nodes/pve1/lxc/{v}/config" for v in (101, 102, 103, 104, 105, 106, 108, 109)] + ["/nodes/pve3/lxc/301/config"]
        answers = px.fetch_all(client_for(s), paths, max_workers=3)
        assert 1 < s.max_in_flight <= 3, s.max_in_flight
        assert s.request_count == len(paths), s.requests
    assert isinstance(answers["/nodes/pve3/lxc/301/config"], px.ProxmoxApiError)
    assert answers["/nodes/pve1/lxc/102/config"]["hostname"] == "train-b"


def test_fetch_all_logs_in_once_for_password_auth():
    with PveSim(load_cluster("gpu3"), users={"root@pam": "pw"}) as s:
        client = px.ProxmoxClient(s.url, user="root@pam", password="pw")
        px.fetch_all(client, [f"/nodes/pve1/lxc/{v}/config" for v in (101, 102, 103, 104)], max_workers=4)
        assert [m for m, _unused in s.requests].count("POST") == 1


def test_make_unsafe_keeps_values_equal_and_never_templated():
    text = {"a": ["{{ marker }}", "{% if true %}X{% endif %}"], "b": 1, "c": {"d": "{{ marker }}"}}
    # The strings carry Ansible's template trust, as strings parsed from a trusted source do: without the
    # marking they would be evaluated (ansible-core >= 2.19 templates only trusted strings, so untrusted
    # input would prove nothing).
    value = {"a": [trust_as_template(x) for x in text["a"]], "b": 1, "c": {"d": trust_as_template("{{ marker }}")}}
    templar = Templar(loader=DataLoader(), variables={"marker": "EVALUATED"})
    # Control: unmarked, they are evaluated (so the check below can fail)...
    assert templar.template(value) == {"a": ["EVALUATED", "X"], "b": 1, "c": {"d": "EVALUATED"}}
    marked = px.make_unsafe(value)
    assert marked == text
    # ...while what the inventory marks stays text, however deep it sits.
    assert templar.template(marked) == text


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
