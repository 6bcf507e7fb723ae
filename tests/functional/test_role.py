"""The clean_slate role on simulated nodes, through real ansible-playbook: serial, strategy
free, include_role from another play (with its result used by a later task), check mode, and
report files. Tags and failures: test_role_failures.py."""

from __future__ import annotations

import importlib.util
import json
import marshal
import os
from pathlib import Path

import pytest
from gpusim import CONTEXT_OVERHEAD_MIB, Node
from support.ansible import ROOT, VENV_PYTHON, run_playbook

PLAYBOOK = ROOT / "playbooks" / "clean_slate.yml"


@pytest.fixture
def two_nodes():
    """Two simulated 4-GPU nodes, both driven from one sandbox (two inventory hosts)."""
    with Node(gpus=4, seed="node-a") as a, Node(gpus=4, seed="node-b") as b:
        sb = a.sandbox()
        try:
            yield a, b, sb
        finally:
            sb.stop()


def inventory(tmp: Path, nodes: dict[str, Node]) -> Path:
    lines = ["gpu_nodes:", "  hosts:"]
    for name, node in nodes.items():
        lines += [
            f"    {name}:",
            "      ansible_connection: local",
            f"      ansible_python_interpreter: {VENV_PYTHON}",
            f"      clean_slate_device_dir: {node.dev_dir}",
            f"      gpusim_state: {node.state_dir}",
            "      clean_slate_grace_period: 1",
            "      clean_slate_expected_gpus: 4",
        ]
    path = tmp / "hosts.yml"
    path.write_text("\n".join(lines) + "\n")
    return path


def play(**keywords) -> list[dict]:
    # Each host reads its own simulated driver: the environment keyword, per host.
    return [
        {
            "name": "Clean slate",
            "hosts": "gpu_nodes",
            "gather_facts": False,
            "environment": {"GPUSIM_STATE": "{{ gpusim_state }}"},
            **keywords,
            "roles": [{"role": "gpuops.clean_slate.clean_slate"}],
        }
    ]


def load(a: Node, b: Node, sb) -> list:
    # No names to match: each host finds its own workers through its own NVML and device files.
    return [b.spawn_worker(gpus=[i], mib=8000, sandbox=sb) for i in range(2)] + [a.spawn_worker(gpus=[i], mib=8000, sandbox=sb) for i in range(3)]


@pytest.mark.parametrize("keywords", [{"serial": 1}, {"strategy": "free"}, {}], ids=["serial-1", "strategy-free", "linear"])
def test_two_hosts_with_serial_strategy_free_and_linear(two_nodes, tmp_path: Path, keywords: dict) -> None:
    a, b, sb = two_nodes
    workers = load(a, b, sb)
    # A cache directory of this run's own, to see the payload's bytecode cache (module_utils/_pyc) at work.
    cache = tmp_path / "xdg"
    run = run_playbook(
        play(**keywords), inventory=inventory(tmp_path, {"host-a": a, "host-b": b}), env={**a.env(), "XDG_CACHE_HOME": str(cache)}, wrapper=sb.nsenter_prefix()
    )
    assert run.rc == 0, run.output
    assert not any(w.alive() for w in workers)
    # The module ran from its payload's zip and stored the code of the collection's files it imported, each named by its
    # place in the payload (the same every run, so the next run loads it), in a directory only this user can write.
    [tagged] = (cache / "gpuops-clean_slate" / "pyc").iterdir()
    names = {marshal.loads(e.read_bytes()[len(importlib.util.MAGIC_NUMBER) :]).co_filename for e in tagged.iterdir()}
    ours = "ansible_collections/gpuops/clean_slate/"
    assert f"{ours}plugins/module_utils/_node.py" in names and all(n.startswith(ours) for n in names), names
    assert tagged.stat().st_mode & 0o777 == 0o700
    summaries = {h: run.summary(h) for h in ("host-a", "host-b")}
    assert summaries["host-a"].startswith("host-a: 4/4 GPUs clean in ") and "3 processes ended" in summaries["host-a"]
    assert summaries["host-b"].startswith("host-b: 4/4 GPUs clean in ") and "2 processes ended" in summaries["host-b"]
    stats = run.stats["custom"]["_run"]["clean_slate"]
    assert set(stats) == {"host-a", "host-b"} and all(v["clean"] for v in stats.values())


def test_include_role_from_another_play_publishes_its_result(two_nodes, tmp_path: Path) -> None:
    a, _b, sb = two_nodes
    a.spawn_worker(gpus=[1], mib=8000, sandbox=sb, title="VLLM::Worker_TP1")
    report_dir = tmp_path / "reports"
    deploy = [
        {
            "name": "Deploy inference servers",
            "hosts": "gpu_nodes",
            "gather_facts": False,
            "environment": {"GPUSIM_STATE": "{{ gpusim_state }}"},
            "tasks": [
                {
                    "name": "Clean the GPUs first",
                    "ansible.builtin.include_role": {"name": "gpuops.clean_slate.clean_slate"},
                    "vars": {"clean_slate_report_dir": str(report_dir)},
                },
                {
                    "name": "Start the server only on a clean slate",
                    "ansible.builtin.assert": {"that": ["clean_slate_result.clean", "clean_slate_result.ended == 1"]},
                },
            ],
        }
    ]
    run = run_playbook(deploy, inventory=inventory(tmp_path, {"host-a": a}), env=a.env(), wrapper=sb.nsenter_prefix())
    assert run.rc == 0, run.output
    assert run.task("Start the server only on a clean slate")["status"] == "ok"
    report = json.loads((report_dir / "host-a.json").read_text())
    assert report["clean"] is True and report["ended"] == 1 and report["after"] == [0, 0, 0, 0]
    assert report["before"][1] == 8000 + CONTEXT_OVERHEAD_MIB


def test_check_mode_reports_what_would_end_and_ends_nothing(two_nodes, tmp_path: Path) -> None:
    a, _b, sb = two_nodes
    worker = a.spawn_worker(gpus=[2], mib=8000, sandbox=sb, title="sglang::scheduler_TP2")
    run = run_playbook(PLAYBOOK, inventory=inventory(tmp_path, {"host-a": a}), env=a.env(), check=True, wrapper=sb.nsenter_prefix())
    assert run.rc == 0, run.output
    assert worker.alive()
    kill = run.phase("kill")
    assert [t["cmdline"] for t in kill["targets"]] == ["sglang::scheduler_TP2"]
    assert "1 processes would be ended (check mode)" in run.summary()
    assert os.path.exists(f"/proc/{worker.pid}")


def test_the_pre_stop_plan_is_the_kills_own(two_nodes, tmp_path: Path) -> None:
    """The plan taken before the pre-stop commands and the real kill come from one set of arguments: the plan
    lists exactly what the kill ends, a launcher found only by the host's own name pattern included."""
    a, _b, sb = two_nodes
    worker = a.spawn_worker(gpus=[0], mib=8000, sandbox=sb, title="custom-job::worker0")
    sb.spawn_detached(["bash", "-c", 'exec -a "custom-job::launcher" sleep 300'])
    marker = tmp_path / "pre-stop-ran"
    inv = inventory(tmp_path, {"host-a": a})
    extra = {"clean_slate_pre_stop_commands": [f"touch {marker}"], "clean_slate_patterns": ["^custom-job::"]}
    run = run_playbook(play(), inventory=inv, env=a.env(), extra_vars=extra, wrapper=sb.nsenter_prefix())
    assert run.rc == 0, run.output
    plan, kill = run.phase("plan"), run.phase("kill")
    assert marker.exists(), "there was something to end, so the pre-stop commands ran"
    planned = sorted((t["pid"], t["cmdline"]) for t in plan["targets"])
    ended = sorted((t["pid"], t["cmdline"]) for t in kill["targets"])
    assert planned == ended and {c.split()[0] for _p, c in ended} == {"custom-job::worker0", "custom-job::launcher"}, (planned, ended)
    assert not worker.alive()
    # One module run for every phase, the pre-stop plan and commands included.
    assert len(run.node_runs()) == 1 and [r["result"]["phases"] for r in run.node_runs()] == [["preflight", "kill", "residue", "verify"]]
    assert [r["action"] for r in run.results if r["action"].startswith("gpuops.") and r["status"] != "skipped"] == ["gpuops.clean_slate.clean_slate_node"]
