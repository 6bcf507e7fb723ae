"""AWX / Automation Controller run playbooks through ansible-runner: the
playbook from the installed artifact, a project wrapper as a job template would
use it, survey-style extra vars (numbers and booleans as strings), and the job
artifacts AWX reads (set_stats data, events, exit status)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml
from gpusim import Node
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


def private_data_dir(tmp: Path, installed: Path, node: Node) -> Path:
    pdd = tmp / "job"
    (pdd / "project").mkdir(parents=True)
    (pdd / "inventory").mkdir()
    (pdd / "env").mkdir()
    (pdd / "project" / "clean_slate.yml").write_text("---\n- name: Clean slate\n  ansible.builtin.import_playbook: gpuops.clean_slate.clean_slate\n")
    inventory = {
        "gpu_nodes": {
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


def run_job(pdd: Path, sandbox) -> tuple[int, dict, list[dict]]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ANSIBLE_")}
    env["PATH"] = f"{VENV / 'bin'}:{env.get('PATH', '')}"
    sandbox.run([str(VENV / "bin" / "ansible-runner"), "run", str(pdd), "-p", "clean_slate.yml", "--ident", "job1"], env=env, check=False, timeout=300)
    artifacts = pdd / "artifacts" / "job1"
    rc = int((artifacts / "rc").read_text())
    status = (artifacts / "status").read_text().strip()
    events = [json.loads(p.read_text()) for p in sorted((artifacts / "job_events").glob("*.json"), key=lambda p: int(p.name.split("-")[0]))]
    return rc, {"status": status}, events


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
    ok = [e for e in events if e.get("event") == "runner_on_ok" and e["event_data"].get("task", "").endswith("End the GPU processes")]
    assert ok and ok[0]["event_data"]["res"]["changed"] is True


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
