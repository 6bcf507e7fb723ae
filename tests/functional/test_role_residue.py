"""The clean_slate role's residue phase on a simulated node, through real ansible-playbook: the kill phase
ends a job, the residue phase removes what it left and keeps what a protected daemon holds, a port the job
listened on is free again, and the result reaches the summary line, set_stats and the JSON report."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import typing as t
from pathlib import Path

import pytest
from gpusim import Node
from gpusim.residue import inside, private_shm, spawn
from support.ansible import ROOT, local_inventory, run_playbook

PLAYBOOK = ROOT / "playbooks" / "clean_slate.yml"


@pytest.fixture
def site() -> t.Iterator[tuple[Node, t.Any, Path, Path]]:
    """A 4-GPU node, a sandbox with a /dev/shm of its own, and test-owned stand-ins for /tmp and ~/.cache."""
    top = Path(tempfile.mkdtemp(prefix="role-"))
    work, cache = top / "t", top / "c"
    work.mkdir()
    cache.mkdir()
    with Node(gpus=4, seed="residue") as node:
        sb = node.sandbox()
        private_shm(sb)
        try:
            yield node, sb, work, cache
        finally:
            sb.stop()
    shutil.rmtree(top, ignore_errors=True)


def inventory(path: Path, node: Node, work: Path, cache: Path, **extra: t.Any) -> Path:
    host = {
        "clean_slate_device_dir": str(node.dev_dir),
        "clean_slate_expected_gpus": 4,
        "clean_slate_grace_period": 2,
        "clean_slate_residue_sockets": [
            f"{work}/tmp????????",
            f"{work}/????????-????-????-????-????????????",
            f"{work}/*-????????-????-????-????-????????????",
        ],
        "clean_slate_residue_locks": [f"{cache}/**/*.lock", f"{cache}/torch_extensions/**/lock"],
        "clean_slate_residue_dirs": [f"{work}/torchelastic_*"],
        # The residue these tests make is seconds old: no minimum age (test_role_servers holds that rule).
        "clean_slate_residue_min_age": 0,
        **extra,
    }
    return local_inventory(path / "inventory.yml", {"gpu-node-1": host})


def test_the_residue_of_the_killed_job_goes_and_the_port_is_free(site, tmp_path: Path) -> None:
    node, sb, work, cache = site
    workers = [sb.spawn_worker(gpus=[i], mib=8000, title=f"sglang::scheduler_TP{i}") for i in range(2)]
    # The job that the kill phase ends (its name matches '^sglang::'), its HTTP listener, and a daemon that must survive.
    job = spawn(sb, "job", "--tmp", work, "--cache", cache, "--segments", "4", "--kib", "512", "--comm", "sglang::dp_work")
    http = spawn(sb, "listen", "--comm", "sglang::tokeniz")
    port = http.info["port"]
    daemon = spawn(sb, "hold", "--comm", "nv-hostengine", "--map", job.info["shm"][0])
    reports = tmp_path / "reports"
    inv = inventory(tmp_path, node, work, cache, clean_slate_residue_ports=[port], clean_slate_report_dir=str(reports))
    run = run_playbook(PLAYBOOK, inventory=inv, env=node.env(), wrapper=sb.nsenter_prefix())
    assert run.rc == 0, run.output
    assert not job.alive() and not http.alive() and not any(w.alive() for w in workers)
    assert daemon.alive()
    orphans = set(job.info["shm"][1:]) | set(job.info["sockets"])
    assert not any(os.path.lexists(inside(sb, p)) for p in orphans)
    assert os.path.exists(inside(sb, job.info["shm"][0]))
    # Locks and directories are only reported by default.
    assert all(os.path.lexists(p) for p in job.info["locks"] + job.info["dirs"])
    residue = run.phase("residue")
    assert {r["path"] for r in residue["removed"]} == orphans
    assert residue["held"][0]["holders"][0]["name"] == "nv-hostengine"
    line = run.summary()
    shm_count = len(job.info["shm"]) - 1
    assert f"4 processes ended (4 by TERM, 0 by KILL); {shm_count} stale segments and 3 sockets (" in line, line
    assert f"removed, 1 held by live processes (kept), 2 stale locks and 1 directory reported (removal not enabled), port {port} free" in line, line
    stats = run.stats["custom"]["_run"]["clean_slate"]["gpu-node-1"]
    assert stats["clean"] is True
    assert stats["residue"]["removed"] == len(orphans) and stats["residue"]["ports"] == {str(port): "free"}
    report = json.loads((reports / "gpu-node-1.json").read_text())
    assert report["residue"]["removed_bytes"] == residue["summary"]["removed_bytes"] > 0
    assert set(report["residue"]["paths"]["removed"]) == orphans
    # The phase runs with its tag (and verify, without which a run proves nothing and is red); a second run finds nothing to remove.
    run = run_playbook(PLAYBOOK, inventory=inv, env=node.env(), tags="clean_slate_residue,clean_slate_verify", wrapper=sb.nsenter_prefix())
    assert run.rc == 0, run.output
    again = run.phase("residue")
    assert again["changed"] is False and again["summary"]["removed"] == 0
    assert [r["result"]["phases"] for r in run.node_runs()] == [["residue", "verify"]]
    assert "kill" not in run.role_clean()["result"]


def test_a_listener_the_kill_phase_does_not_end_fails_the_host(site, tmp_path: Path) -> None:
    node, sb, work, cache = site
    other = spawn(sb, "listen", "--comm", "redis-server")
    port = other.info["port"]
    reports = tmp_path / "reports"
    inv = inventory(tmp_path, node, work, cache, clean_slate_residue_ports=[port], clean_slate_report_dir=str(reports))
    run = run_playbook(PLAYBOOK, inventory=inv, env=node.env(), wrapper=sb.nsenter_prefix())
    assert run.rc != 0
    assert other.alive()
    # The residue task's own failure stops the host (the role's one failure path prints it once).
    failed = run.phase("residue")
    assert failed["reason"] == "port_in_use", failed
    assert f"port {port} is still listened on by PID {other.ns_pid} (redis-server)" in failed["msg"], failed["msg"]
    assert "stop that service or add a pattern that matches it" in failed["msg"]
    assert "verify" not in run.role_clean()["result"]  # the run stopped at the residue
    report = json.loads((reports / "gpu-node-1.json").read_text())
    assert report["clean"] is False and report["phase"] == "residue" and report["reason"] == "port_in_use", report
    assert report["residue"]["ports"] == {str(port): "listening"}
    assert " - FAILED in residue (port_in_use): " in report["summary"], report["summary"]


def test_check_mode_removes_nothing_and_says_what_would_go(site, tmp_path: Path) -> None:
    node, sb, work, cache = site
    dead = spawn(sb, "job", "--tmp", work, "--kib", "256")
    dead.kill()
    live = spawn(sb, "job", "--tmp", work, "--comm", "sglang::dp_work")
    run = run_playbook(PLAYBOOK, inventory=inventory(tmp_path, node, work, cache), env=node.env(), check=True, wrapper=sb.nsenter_prefix())
    assert run.rc == 0, run.output
    assert live.alive()
    everything = dead.info["shm"] + dead.info["sockets"] + live.info["shm"] + live.info["sockets"]
    assert all(os.path.lexists(inside(sb, p)) for p in everything)
    residue = run.phase("residue")
    assert {r["path"] for r in residue["removed"]} == set(dead.info["shm"] + dead.info["sockets"])
    line = run.summary()
    assert "would be removed" in line and "processes would be ended (check mode)" in line, line
