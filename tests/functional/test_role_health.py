"""The clean_slate role's health verdict on simulated nodes, through real ansible-playbook: in the summary line,
set_stats and the JSON report; a host at or above clean_slate_health_fail_on is red with the advice, through the
role's one failure path; check mode reports it without failing."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
from gpusim import Node
from prometheus_client.parser import text_string_to_metric_families
from support.ansible import local_inventory, run_playbook

ROLE = "gpuops.clean_slate.clean_slate"


def host(node: Node, **extra: Any) -> dict[str, Any]:
    return {
        "clean_slate_grace_period": 1,
        "clean_slate_verify_timeout": 3,
        "clean_slate_device_dir": str(node.dev_dir),
        "clean_slate_health_kernel_log": str(node.kernel_log),
        "gpusim_state": str(node.state_dir),
        **extra,
    }


PLAY = [
    {
        "name": "Clean slate",
        "hosts": "gpu_nodes",
        "gather_facts": False,
        "environment": {"GPUSIM_STATE": "{{ gpusim_state }}"},
        "roles": [{"role": ROLE}],
    }
]


@pytest.fixture
def nodes():
    with Node(gpus=2, seed="h1") as n1, Node(gpus=2, seed="h2") as n2, Node(gpus=2, seed="h3") as n3:
        sb = n1.sandbox()
        try:
            yield n1, n2, n3, sb
        finally:
            sb.stop()


def entries(run) -> dict[str, dict[str, Any]]:
    return run.stats["custom"]["_run"]["clean_slate"]


def summary(run, name: str) -> str:
    return run.summary(name)


def test_the_verdict_is_in_every_record_and_a_host_at_the_threshold_is_red(nodes, tmp_path: Path) -> None:
    n1, n2, n3, sb = nodes
    n2.set_health(1, remap_uncorrectable=1, remap_pending=1)
    since = time.time()
    n3.xid(0, 13, pid=4242, name="python3")  # the job's own crash: an application error
    workers = [n2.spawn_worker(gpus=[0], mib=8000, sandbox=sb)]
    reports, metrics = tmp_path / "reports", tmp_path / "metrics"
    metrics.mkdir()
    inv = local_inventory(
        tmp_path / "hosts.yml",
        {"healthy": host(n1), "remap": host(n2), "app_xid": host(n3, clean_slate_health_since=str(since - 1))},
    )
    run = run_playbook(
        PLAY,
        inventory=inv,
        env=n1.env(),
        extra_vars={"clean_slate_report_dir": str(reports), "clean_slate_metrics_dir": str(metrics)},
        wrapper=sb.nsenter_prefix(),
    )
    assert run.rc == 2, run.output
    assert not any(w.alive() for w in workers)
    e = entries(run)

    assert e["healthy"]["clean"] is True and e["healthy"]["health"] == {"verdict": "ok", "evidence": [], "findings": []}
    assert "; health:" not in summary(run, "healthy")

    # Below the threshold: green, and the summary line says what to look at.
    assert e["app_xid"]["clean"] is True and e["app_xid"]["health"]["verdict"] == "restart_app"
    assert "Xid 13" in e["app_xid"]["health"]["evidence"][0]
    assert "; health: restart_app" in summary(run, "app_xid") and "FAILED" not in summary(run, "app_xid")

    # At the threshold: red through the one failure path, with the advice, on every record.
    red = e["remap"]
    assert (red["clean"], red["phase"], red["reason"]) == (False, "verify", "unhealthy"), red
    assert red["health"]["verdict"] == "reset_gpu" and "row remapping is pending" in red["health"]["evidence"][0]
    assert "nvidia-smi -r -i" in red["msg"] and red["failure"] == red["msg"]
    # The advisory reset plan reaches every record: set_stats' entry, the JSON report (below) and the metrics.
    assert [g["index"] for g in red["reset_plan"]["gpus"]] == [1] and red["reset_plan"]["where"] == "this host"
    line = summary(run, "remap")
    assert line == red["summary"] and "; health: reset_gpu - FAILED in verify (unhealthy): " in line
    assert run.stats["stats"]["remap"]["failures"] == 1
    report = json.loads((reports / "remap.json").read_text())
    assert report["reason"] == "unhealthy" and report["health"] == red["health"] and report["reset_plan"] == red["reset_plan"]
    assert json.loads((reports / "app_xid.json").read_text())["health"]["verdict"] == "restart_app"
    # node_exporter metrics, parsed as Prometheus parses them: the verdict by its rank, labelled with its name.
    for name, verdict, rank in (("healthy", "ok", 0), ("app_xid", "restart_app", 1), ("remap", "reset_gpu", 3)):
        fams = {f.name: f for f in text_string_to_metric_families((metrics / f"clean_slate_{name}.prom").read_text())}
        [sample] = fams["clean_slate_last_run_health"].samples
        assert (sample.labels, sample.value) == ({"host": name, "verdict": verdict}, rank)
        advised = fams["clean_slate_gpu_reset_advised"].samples
        assert [(s.labels["gpu"], s.labels["why"]) for s in advised] == ([("1", "row_remap_pending")] if name == "remap" else [])


def test_check_mode_and_a_raised_threshold_report_without_failing(nodes, tmp_path: Path) -> None:
    n1, n2, _n3, sb = nodes
    n1.set_health(0, remap_pending=1)
    inv = local_inventory(tmp_path / "hosts.yml", {"checked": host(n1), "tolerant": host(n2, clean_slate_health_fail_on="reboot")})
    n2.set_health(0, remap_pending=1)
    run = run_playbook(PLAY, inventory=inv, env=n1.env(), check=True, wrapper=sb.nsenter_prefix())
    assert run.rc == 0, run.output
    e = entries(run)
    # Check mode: red (not proven fit) but not failed.
    assert (e["checked"]["clean"], e["checked"]["reason"], e["checked"]["failure"]) == (False, "unhealthy", "")
    assert summary(run, "checked").endswith("; health: reset_gpu - NOT CLEAN (unhealthy)")
    # Below a raised threshold: green, the verdict still on record.
    assert e["tolerant"]["clean"] is True and e["tolerant"]["health"]["verdict"] == "reset_gpu"
    run = run_playbook(PLAY, inventory=inv, env=n1.env(), extra_vars={"clean_slate_health": False}, wrapper=sb.nsenter_prefix())
    assert run.rc == 0, run.output
    assert entries(run)["checked"]["clean"] is True and entries(run)["checked"]["health"] is None


def test_restore_puts_back_the_mode_and_stops_mps_before_the_verdict(nodes, tmp_path: Path) -> None:
    n1, n2, n3, sb = nodes
    for n in (n1, n2, n3):
        n.set_compute_mode(1, "exclusive_process")
    mps1 = n1.spawn_daemon("nvidia-cuda-mps-control", sandbox=sb)
    hosts = {"restored": host(n1, clean_slate_restore={"compute_mode": "default", "mps": "stopped"}), "left": host(n2)}
    # As an AWX survey or `-e clean_slate_restore=compute_mode=default` gives it: text, read as the spec's dictionary.
    hosts["as_text"] = host(n3, clean_slate_restore="compute_mode=default")
    inv = local_inventory(tmp_path / "hosts.yml", hosts)
    run = run_playbook(PLAY, inventory=inv, env=n1.env(), wrapper=sb.nsenter_prefix())
    assert run.rc == 0, run.output
    e = entries(run)
    assert e["restored"]["clean"] is True and e["restored"]["health"]["verdict"] == "ok", e["restored"]
    assert n1.compute_mode(1) == 0 and not mps1.alive()
    assert "; restored compute mode default on GPU 1 and MPS stopped" in summary(run, "restored")
    # Without clean_slate_restore the leftover stays, and the verdict says so (below the default threshold).
    assert n2.compute_mode(1) == 3
    assert e["left"]["clean"] is True and e["left"]["health"]["verdict"] == "restart_app"
    assert summary(run, "left").endswith("; health: restart_app")
    # (Its verdict is not asserted: the hosts share one sandbox, so it may still see n1's MPS daemon running.)
    assert n3.compute_mode(1) == 0 and e["as_text"]["clean"] is True, e["as_text"]
    assert "; restored compute mode default on GPU 1" in summary(run, "as_text")
