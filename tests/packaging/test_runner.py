"""AWX / Automation Controller run playbooks through ansible-runner: the
playbook from the installed artifact, a project wrapper as a job template would
use it, survey-style extra vars (numbers and booleans as strings), and the job
artifacts AWX reads (set_stats data, events, exit status). A job that targets no
host (a limit or a group that matches nothing, an inventory that failed to parse)
and a host that fails are red, with the failed host's artifact."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml
from gpusim import Node
from pvesim import PveSim, load_cluster
from support.ansible import VENV, VENV_PYTHON

SURVEY = {
    # What an AWX survey passes: text for every number and boolean.
    "clean_slate_grace_period": "2",
    "clean_slate_kill_timeout": "5",
    "clean_slate_expected_gpus": "2",
    "clean_slate_verify_timeout": "1.5",
    "clean_slate_require_no_processes": "true",
    "clean_slate_install_dependencies": "false",
    "clean_slate_mode": "auto",
}


def private_data_dir(tmp: Path, installed: Path, node: Node, group: str = "gpu_nodes") -> Path:
    pdd = tmp / "job"
    (pdd / "project").mkdir(parents=True)
    (pdd / "inventory").mkdir()
    (pdd / "env").mkdir()
    (pdd / "project" / "clean_slate.yml").write_text("---\n- name: Clean slate\n  ansible.builtin.import_playbook: gpuops.clean_slate.clean_slate\n")
    inventory = {
        group: {
            "hosts": {
                "node1": {
                    "ansible_connection": "local",
                    "ansible_python_interpreter": VENV_PYTHON,
                    "clean_slate_device_dir": str(node.dev_dir),
                }
            }
        }
    }
    (pdd / "inventory" / "hosts.yml").write_text(yaml.safe_dump(inventory))
    (pdd / "env" / "extravars").write_text(yaml.safe_dump(SURVEY))
    envvars = {"ANSIBLE_COLLECTIONS_PATH": str(installed), "ANSIBLE_LOCAL_TEMP": str(tmp / "ansible-tmp"), **node.env()}
    envvars["PATH"] = f"{VENV / 'bin'}:{envvars.get('PATH', os.environ.get('PATH', ''))}"
    (pdd / "env" / "envvars").write_text(yaml.safe_dump(envvars))
    return pdd


def run_job(pdd: Path, sandbox, *args: str, env: dict[str, str] | None = None, ident: str = "job1") -> tuple[int, dict, list[dict]]:
    run_env = {k: v for k, v in os.environ.items() if not k.startswith("ANSIBLE_")}
    run_env["PATH"] = f"{VENV / 'bin'}:{run_env.get('PATH', '')}"
    run_env.update(env or {})
    cmd = [str(VENV / "bin" / "ansible-runner"), "run", str(pdd), "-p", "clean_slate.yml", "--ident", ident, *args]
    sandbox.run(cmd, env=run_env, check=False, timeout=300)
    artifacts = pdd / "artifacts" / ident
    rc = int((artifacts / "rc").read_text())
    status = (artifacts / "status").read_text().strip()
    events = [json.loads(p.read_text()) for p in sorted((artifacts / "job_events").glob("*.json"), key=lambda p: int(p.name.split("-")[0]))]
    return rc, {"status": status, "stdout": (artifacts / "stdout").read_text()}, events


def stats_artifacts(events: list[dict]) -> dict:
    stats = [e for e in events if e.get("event") == "playbook_on_stats"]
    assert stats, [e.get("event") for e in events]
    return stats[-1]["event_data"].get("artifact_data", {})


@pytest.fixture
def job(tmp_path: Path, installed: Path):
    with Node(gpus=2) as node:
        sb = node.sandbox()
        try:
            yield node, sb, private_data_dir(tmp_path, installed, node)
        finally:
            sb.stop()


def test_job_template_run_publishes_per_host_artifacts(job) -> None:
    _node, sb, pdd = job
    workers = [sb.spawn_worker(gpus=[i], mib=20000, title=f"sglang::scheduler_TP{i}") for i in range(2)]
    rc, status, events = run_job(pdd, sb)
    assert rc == 0 and status["status"] == "successful"
    data = stats_artifacts(events)["clean_slate"]["node1"]
    assert data["clean"] is True and data["clean_count"] == 2 and data["gpu_count"] == 2
    assert data["ended"] == 2 and data["signals"] == {"TERM": 2}
    assert data["summary"].startswith("node1: 2/2 GPUs clean in ")
    assert not any(w.alive() for w in workers)
    ok = [e for e in events if e.get("event") == "runner_on_ok" and e["event_data"].get("task", "").startswith("Clean the GPUs")]
    assert ok and ok[0]["event_data"]["res"]["changed"] is True and ok[0]["event_data"]["res"]["kill"]["changed"] is True


def test_job_fails_and_says_why_when_a_gpu_cannot_be_freed(job) -> None:
    node, sb, pdd = job
    node.set_fault(orphan={1: 4096}, recovery_action={1: 1})  # leaked, and the driver asks for a reset
    rc, status, events = run_job(pdd, sb)
    assert rc != 0 and status["status"] == "failed"
    data = stats_artifacts(events)["clean_slate"]["node1"]
    assert data["clean"] is False and data["clean_count"] == 1
    assert "orphaned_context" in data["failure"]
    failed = [e for e in events if e.get("event") == "runner_on_failed" and not e["event_data"].get("ignore_errors")]
    assert any("GPU 1" in json.dumps(e["event_data"]["res"]) for e in failed)


def test_a_failed_host_is_red_and_publishes_its_artifact(job) -> None:
    """A host whose driver cannot be read: the job fails, its artifact says where and why, the error is printed once."""
    node, sb, pdd = job
    worker = sb.spawn_worker(gpus=[0], mib=8000, title="sglang::scheduler_TP0")
    node.set_fault(init_error="DRIVER_NOT_LOADED")
    rc, status, events = run_job(pdd, sb)
    assert rc != 0 and status["status"] == "failed"
    data = stats_artifacts(events)["clean_slate"]["node1"]
    assert data["clean"] is False and data["phase"] == "preflight" and data["reason"] == "driver_not_loaded", data
    assert "the NVIDIA kernel driver is not loaded" in data["msg"] and data["summary"].startswith("node1: GPUs not read, no process ended - FAILED")
    failed = [e for e in events if e.get("event") == "runner_on_failed" and e["event_data"].get("host") == "node1"]
    assert len(failed) == 1 and not failed[0]["event_data"].get("ignore_errors"), [e["event_data"]["task"] for e in failed]
    assert worker.alive()


def test_a_job_that_targets_no_host_fails(tmp_path: Path, installed: Path) -> None:
    """The job template's Limit and inventory as users get them wrong: red, never 'successful' with nothing done."""
    with Node(gpus=2) as node:
        sb = node.sandbox()
        try:
            worker = sb.spawn_worker(gpus=[0], mib=8000, title="sglang::scheduler_TP0")
            pdd = private_data_dir(tmp_path / "a", installed, node)
            # Limit gpu-nodes against the group gpu_nodes: Ansible itself stops.
            rc, status, _events = run_job(pdd, sb, "--limit", "gpu-nodes", ident="typo")
            assert rc != 0 and status["status"] == "failed"
            assert "Could not match supplied host pattern, ignoring: gpu-nodes" in status["stdout"]
            # A limit on a host outside the playbook's group: the play_hosts guard stops it and says why.
            (pdd / "inventory" / "other.yml").write_text(yaml.safe_dump({"storage": {"hosts": {"db1": {"ansible_connection": "local"}}}}))
            rc, status, events = run_job(pdd, sb, "--limit", "db1", ident="outside")
            assert rc == 1 and status["status"] == "failed"
            text = " ".join(status["stdout"].split())
            assert "[ERROR]: gpuops.clean_slate: --limit 'db1' leaves none of the 1 host(s) of 'gpu_nodes' (node1)" in text, text[-2000:]
            assert "Error processing keyword" not in text and "Origin:" not in text
            assert not [e for e in events if e.get("event", "").startswith("runner_on_")]
            (pdd / "inventory" / "other.yml").unlink()
            # An inventory source that fails to parse (the Proxmox API with an expired token).
            (pdd / "inventory" / "hosts.yml").unlink()
            (pdd / "inventory" / "gpu.proxmox.yml").write_text("plugin: gpuops.clean_slate.proxmox\nvalidate_certs: false\n")
            with PveSim(load_cluster("gpu3")) as sim:
                env = {**sim.env(), "PROXMOX_TOKEN_SECRET": "expired-0000"}
                rc, status, events = run_job(pdd, sb, env=env, ident="expired")
            assert rc != 0 and status["status"] == "failed"
            text = " ".join(status["stdout"].split())
            assert "gpuops.clean_slate: nothing to clean: the inventory has no hosts." in text, text[-2000:]
            assert not [e for e in events if e.get("event") == "runner_on_ok"]
            assert worker.alive()
        finally:
            sb.stop()


def test_the_static_group_spelled_gpu_nodes_with_a_dash_is_cleaned(tmp_path: Path, installed: Path) -> None:
    with Node(gpus=2) as node:
        sb = node.sandbox()
        try:
            workers = [sb.spawn_worker(gpus=[i], mib=8000, title=f"sglang::scheduler_TP{i}") for i in range(2)]
            pdd = private_data_dir(tmp_path, installed, node, group="gpu-nodes")
            rc, status, events = run_job(pdd, sb, "--limit", "gpu-nodes")
            assert rc == 0 and status["status"] == "successful", status["stdout"][-3000:]
            assert stats_artifacts(events)["clean_slate"]["node1"]["clean"] is True
            assert not any(w.alive() for w in workers)
        finally:
            sb.stop()
