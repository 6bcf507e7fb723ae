"""The rolling restart of docs/examples/rolling_restart.yml, as AWX runs it (ansible-runner), over SSH on the lab.

Three hosts that a controller can reach (ct101, pve1, pve2), one at a time (``serial: 1``, sorted, so ct101, then
pve1, then pve2), stopping the wave at the first failed host (``max_fail_percentage: 0``). Each host carries the
lab's job; pve1's driver holds an orphaned context it asks a GPU reset for, so pve1 stays dirty. The server is a
stand-in (tests/lab/rolling_server.py, copied to the hosts by a play before the example): a scheduler-named worker
per GPU, ready on /health once its model has loaded (a second and a half) and its warm-up probe was answered.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml
from lab.builder import ROOT, Lab
from support.ansible import VENV

pytestmark = pytest.mark.lab

EXAMPLE = ROOT / "docs" / "examples" / "rolling_restart.yml"
SERVER = Path(__file__).resolve().parent / "rolling_server.py"
PIDFILE = "/tmp/gpuops-rolling-server.pid"


def health(address: str) -> int | None:
    """The status of GET /health on the host's port 30000, from the controller (None: nothing answers)."""
    try:
        with urllib.request.urlopen(f"http://{address}:30000/health", timeout=3) as answer:
            return int(answer.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)
    except OSError:
        return None


def test_rolling_restart_stops_the_wave_at_a_host_that_stays_dirty(fresh: Lab, tmp_path: Path) -> None:
    lab = fresh
    first, dirty, later = lab["ct101"], lab["pve1"], lab["pve2"]
    jobs = {h.name: list(h.workload) for h in (first, dirty, later)}
    dirty.gpu_sim.set_fault(orphan={1: 8000}, recovery_action={1: 1})

    pdd = tmp_path / "job"
    (pdd / "project").mkdir(parents=True)
    (pdd / "env").mkdir()
    (pdd / "inventory").symlink_to(lab.inventory.parent)  # type: ignore[union-attr]
    shutil.copy(EXAMPLE, pdd / "project" / "rolling_restart.yml")
    put_server = {
        "name": "Put the server stand-in on the hosts",
        "hosts": "ct101:pve1:pve2",
        "gather_facts": False,
        "tasks": [{"name": "Copy it", "ansible.builtin.copy": {"src": str(SERVER), "dest": "/tmp/gpuops-rolling-server.py", "mode": "0755"}}],
    }
    (pdd / "project" / "wave.yml").write_text(yaml.safe_dump([put_server, {"ansible.builtin.import_playbook": "rolling_restart.yml"}], sort_keys=False))
    extra = {
        "rolling_hosts": "ct101:pve1:pve2",
        "rolling_batch": 1,
        "rolling_max_fail_percentage": 0,
        "server_start_command": "setsid -f python3 /tmp/gpuops-rolling-server.py --gpus {{ clean_slate_gpus | join(',') }} --pidfile " + PIDFILE,
        "server_ready_retries": 20,
        "server_ready_delay": 1,
        "clean_slate_pre_stop_commands": [],
    }
    (pdd / "env" / "extravars").write_text(json.dumps(extra))
    # The recommended configuration (docs/examples): pipelining, ControlPersist, errors for patterns that match nothing.
    envvars = {**lab.env(), "ANSIBLE_CONFIG": str(ROOT / "docs" / "examples" / "proxmox" / "ansible.cfg"), "PATH": f"{VENV / 'bin'}:{os.environ['PATH']}"}
    (pdd / "env" / "envvars").write_text(json.dumps(envvars))
    run_env = {k: v for k, v in os.environ.items() if not k.startswith("ANSIBLE_")}
    run_env["PATH"] = envvars["PATH"]
    try:
        subprocess.run(
            [str(VENV / "bin" / "ansible-runner"), "run", str(pdd), "-p", "wave.yml", "--ident", "wave"],
            env=run_env,
            cwd=str(ROOT),
            capture_output=True,
            timeout=600,
            check=False,
        )
        art = pdd / "artifacts" / "wave"
        stdout = (art / "stdout").read_text()
        assert (art / "status").read_text().strip() == "failed" and int((art / "rc").read_text()) != 0, stdout[-4000:]
        events = [json.loads(p.read_text()) for p in sorted((art / "job_events").glob("*.json"), key=lambda p: int(p.name.split("-")[0]))]
        done = [
            (e["event_data"]["host"], e["event_data"]["task"], e["event"], e["event_data"].get("res") or {})
            for e in events
            if e.get("event") in ("runner_on_ok", "runner_on_failed") and e["event_data"].get("play", "").startswith("Restart")
        ]
        order = [(h, t) for h, t, _e, _r in done]
        # Batch by batch, sorted: ct101 went through the whole play before pve1 began; pve2's batch never came.
        hosts_in_order = [h for h, _t in order]
        assert hosts_in_order == sorted(hosts_in_order) and set(hosts_in_order) == {"ct101", "pve1"}, order
        ready = [(h, r) for h, t, e, r in done if t == "Wait until the server is ready"]
        assert [h for h, _r in ready] == ["ct101"], order
        # The model loads for a second and a half: the endpoint was polled again until it answered.
        assert ready[0][1]["status"] == 200 and ready[0][1]["attempts"] >= 2, ready
        started = [h for h, t, e, _r in done if t == "Start the inference server" and e == "runner_on_ok"]
        assert started == ["ct101"], order
        failed = [(h, t) for h, t, e, _r in done if e == "runner_on_failed"]
        assert failed == [("pve1", "Fail the host when its GPUs are not proven clean")], failed
        # The artifact AWX reads: each host that ran, the dirty one counted failed and named with its reason.
        stats = next(e for e in events if e.get("event") == "playbook_on_stats")["event_data"]
        published = stats["artifact_data"]["clean_slate"]
        assert set(published) == {"ct101", "pve1"}, published
        assert published["ct101"]["clean"] is True
        assert published["pve1"]["clean"] is False and published["pve1"]["reason"] == "orphaned_context", published["pve1"]
        assert {h for h, n in stats["failures"].items() if n} == {"pve1"}, stats
        # ct101: its old job ended, the new server holds its GPUs and answers, from the controller too.
        assert not any(p.alive() for p in jobs["ct101"])
        assert all(mib > 0 for mib in lab.used_mib(first).values()) and health(str(first.address)) == 200
        # pve1: not started (nothing answers on its port); its job ended, its driver still holds the orphan.
        assert health(str(dirty.address)) is None and not any(p.alive() for p in jobs["pve1"])
        # pve2: the wave stopped before its batch: its job runs on, untouched.
        assert all(p.alive() for p in jobs["pve2"]) and health(str(later.address)) is None
    finally:
        stop = [
            {
                "name": "Stop the server stand-in",
                "hosts": "ct101",
                "gather_facts": False,
                "tasks": [{"name": "Stop it", "ansible.builtin.shell": f"test ! -e {PIDFILE} || kill $(cat {PIDFILE})", "changed_when": True}],
            }
        ]
        lab.playbook(stop, limit="ct101")
        lab.wait_free(first)
