"""Never falsely green: the clean_slate playbook and role on simulated nodes, through real
ansible-playbook, when something goes wrong.

* target resolution: a host pattern that, after --limit, matches nothing (no such group, a limit
  outside it, an inventory source that failed to parse) stops the run with a message, rc != 0;
  the group spelled gpu-nodes works;
* one failure path: every phase's failure (and an unreachable host) gets its summary line, its
  set_stats entry (clean false, phase, reason, msg), its JSON report and its metrics, and its error
  is printed once;
* tags: no tag combination kills on GPUs that were not read (each phase alone, and include_role under every
  tag selection: test_role_in_your_playbook.py);
* role arguments as survey strings; the node_exporter metrics, read with prometheus_client.

Every scenario checks its victims: what must survive is alive afterwards.
"""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from gpusim import Node
from prometheus_client.parser import text_string_to_metric_families
from pvesim import PveSim, load_cluster
from support import prometheus
from support.ansible import ROOT, VENV_PYTHON, AnsibleRun, is_node_run, local_inventory, local_play, run_playbook
from support.orphans import renamed
from support.proxmox import CLUSTER_SOURCE

PLAYBOOK = ROOT / "playbooks" / "clean_slate.yml"
ROLE = "gpuops.clean_slate.clean_slate"


# ---------------------------------------------------------------------- helpers
# Sockets bound (never listening) for the whole run: nobody else can take their ports, so SSH to one is
# refused at once (the kernel answers a SYN to a bound, non-listening port with a reset). A port only
# picked and let go could be bound by a listener of a test on the other xdist worker meanwhile.
_CLOSED: list[socket.socket] = []


def closed_port() -> int:
    """A loopback TCP port nobody listens on, held so for the rest of the run (an unreachable host)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    _CLOSED.append(s)
    return int(s.getsockname()[1])


def node_vars(node: Node | None, **extra: Any) -> dict[str, Any]:
    """Host vars of a host on ``node`` (None: a host whose driver cannot be read at all)."""
    hv: dict[str, Any] = {"clean_slate_grace_period": 1, "clean_slate_verify_timeout": 3}
    if node is not None:
        hv.update(clean_slate_device_dir=str(node.dev_dir), gpusim_state=str(node.state_dir))
    return {**hv, **extra}


def play(hosts: str = "gpu_nodes", **keywords: Any) -> list[dict[str, Any]]:
    """The role on several simulated nodes: each host reads its own driver (GPUSIM_STATE per host)."""
    return [
        {
            "name": "Clean slate",
            "hosts": hosts,
            "gather_facts": False,
            # A host without a driver state reads "driver not loaded", as on a node whose nvidia.ko is not loaded.
            "environment": {"GPUSIM_STATE": "{{ gpusim_state | default('/nonexistent') }}"},
            **keywords,
            "roles": [{"role": ROLE}],
        }
    ]


def artifacts(run: AnsibleRun) -> dict[str, dict[str, Any]]:
    return run.stats["custom"]["_run"]["clean_slate"]


def summary(run: AnsibleRun, host: str) -> str:
    return run.summary(host)


def fatal_lines(run: AnsibleRun, host: str) -> list[str]:
    """The failures printed for ``host`` (a loop prints one per failed item)."""
    return [line for line in run.stdout.splitlines() if line.startswith((f"fatal: [{host}]: FAILED!", f"failed: [{host}] "))]


#: The phase results of gpuops.clean_slate.clean_slate_node, and the phase each belongs to.
PHASE_KEYS = (("before", "preflight"), ("plan", "plan"), ("kill", "kill"), ("residue", "residue"), ("verify", "verify"))


def gpuops_tasks(run: AnsibleRun, host: str | None = None) -> list[str]:
    """The phases the collection's modules ran for ``host`` (the role's one module reports each phase's result), in order;
    any other module of the collection by its task name."""
    out: list[str] = []
    for r in run.results:
        if r["action"].startswith("gpuops.") and r["status"] != "skipped" and host in (None, r["host"]):
            if is_node_run(r):
                out += [phase for key, phase in PHASE_KEYS if key in r["result"]]
            elif not r["action"].endswith("clean_slate_node"):  # a run of the role's module that ran no phase
                out.append(r["task"].split(" : ")[-1])
    return out


def assert_red(run: AnsibleRun, host: str, phase: str, reason: str, says: str, report_dir: Path | None = None) -> dict[str, Any]:
    """The host's failure is on record: summary line, set_stats entry, JSON report, one fatal error."""
    entry = artifacts(run)[host]
    assert entry["clean"] is False and entry["phase"] == phase and entry["reason"] == reason, (host, entry["msg"])
    assert says in entry["msg"], (host, entry["msg"])
    assert entry["failure"] == entry["msg"]
    line = summary(run, host)
    assert line == entry["summary"] and f" - FAILED in {phase} ({reason}): " in line, line
    assert run.stats["stats"][host]["failures"] == 1, run.stats["stats"][host]
    assert len(fatal_lines(run, host)) == 1, (host, fatal_lines(run, host))
    if report_dir is not None:
        report = json.loads((report_dir / f"{host}.json").read_text())
        assert report["clean"] is False and report["phase"] == phase and report["reason"] == reason and report["msg"] == entry["msg"]
    return entry


def run_recorded(n: Node, sb: Any, tmp_path: Path, hosts: dict[str, Any]) -> tuple[AnsibleRun, Path]:
    """playbooks/clean_slate.yml on ``hosts`` of ``n``, the JSON reports in tmp_path/reports."""
    reports = tmp_path / "reports"
    inv = local_inventory(tmp_path / "hosts.yml", hosts)
    run = run_playbook(PLAYBOOK, inventory=inv, env=n.env(), extra_vars={"clean_slate_report_dir": str(reports)}, wrapper=sb.nsenter_prefix())
    return run, reports


# ---------------------------------------------------------------------- fixtures
@pytest.fixture
def node():
    with Node(gpus=2, seed="node-a") as n:
        sb = n.sandbox()
        try:
            yield n, sb
        finally:
            sb.stop()


@pytest.fixture
def three_nodes():
    with Node(gpus=2, seed="n1") as n1, Node(gpus=3, seed="n2") as n2, Node(gpus=3, seed="n3") as n3:
        sb = n1.sandbox()
        try:
            yield n1, n2, n3, sb
        finally:
            sb.stop()


# ---------------------------------------------------------------------- target resolution
def write(path: Path, doc: Any) -> Path:
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


@pytest.mark.parametrize(
    ("groups", "limit", "wrapper", "says"),
    [
        (
            {"gpus": ["host-a"]},
            None,
            False,
            "the host pattern 'gpu_nodes' matches no host of the inventory. Groups with hosts: gpus. Put the GPU hosts in a group gpu_nodes",
        ),
        (
            {"gpu_nodes": ["host-a"], "other": ["host-b"]},
            "host-b",
            False,
            "--limit 'host-b' leaves none of the 1 host(s) of 'gpu_nodes' (host-a). Groups with hosts: gpu_nodes, other.",
        ),
        ({"storage": ["host-a"]}, None, True, "the host pattern 'gpu_nodes' matches no host of the inventory. Groups with hosts: storage."),
    ],
    ids=["no-such-group", "limit-outside-the-group", "import_playbook"],
)
def test_a_pattern_that_matches_no_host_stops_the_run(node, tmp_path: Path, groups: dict, limit: str | None, wrapper: bool, says: str) -> None:
    n, sb = node
    worker = sb.spawn_worker(gpus=[0], mib=8000, title="sglang::scheduler_TP0")
    inv = {
        g: {"hosts": {h: {"ansible_connection": "local", "ansible_python_interpreter": VENV_PYTHON, **node_vars(n)} for h in hs}} for g, hs in groups.items()
    }
    playbook = PLAYBOOK
    if wrapper:  # as an AWX project's wrapper imports it
        playbook = write(tmp_path / "clean_slate.yml", [{"name": "Clean slate", "ansible.builtin.import_playbook": "gpuops.clean_slate.clean_slate"}])
    run = run_playbook(playbook, inventory=write(tmp_path / "hosts.yml", inv), env=n.env(), limit=limit, wrapper=sb.nsenter_prefix())
    # A refusal, not a crash: Ansible's status for a run with no host to target, one error that is the message (no
    # "Error processing keyword 'hosts'", no "The filter plugin ... failed", no excerpt of the playbook's source).
    assert run.rc == 1, run.output
    assert run.stderr.count("[ERROR]") == 1 and "\n[ERROR]: gpuops.clean_slate: " in f"\n{run.stderr}", run.output
    text = " ".join(run.stderr.split())
    assert says in text and text.endswith("Nothing was done."), run.output
    assert "Error processing keyword" not in text and "filter plugin" not in text and "Origin:" not in text and "hosts: >-" not in text
    assert not run.results and worker.alive()


def test_the_group_spelled_gpu_nodes_with_a_dash_is_cleaned(node, tmp_path: Path) -> None:
    """A static inventory's `gpu-nodes` (the design card's spelling) works, with and without -l gpu-nodes."""
    n, sb = node
    workers = [sb.spawn_worker(gpus=[i], mib=8000, title=f"sglang::scheduler_TP{i}") for i in range(2)]
    inv = local_inventory(tmp_path / "hosts.yml", {"host-a": node_vars(n)}, group="gpu-nodes")
    run = run_playbook(PLAYBOOK, inventory=inv, env=n.env(), limit="gpu-nodes", wrapper=sb.nsenter_prefix())
    assert run.rc == 0, run.output
    assert artifacts(run)["host-a"]["clean"] is True and artifacts(run)["host-a"]["ended"] == 2
    assert not any(w.alive() for w in workers)


def test_gpu_nodes_spelled_with_a_dash_fails_against_a_gpu_nodes_group(node, tmp_path: Path) -> None:
    """The Proxmox inventory's group is gpu_nodes: -l gpu-nodes matches nothing, and Ansible stops (rc 1)."""
    n, sb = node
    worker = sb.spawn_worker(gpus=[0], mib=8000, title="sglang::scheduler_TP0")
    inv = local_inventory(tmp_path / "hosts.yml", {"host-a": node_vars(n)})
    run = run_playbook(PLAYBOOK, inventory=inv, env=n.env(), limit="gpu-nodes", wrapper=sb.nsenter_prefix())
    assert run.rc == 1, run.output
    text = " ".join(run.stderr.split())
    assert "Could not match supplied host pattern, ignoring: gpu-nodes" in text
    assert "Specified inventory, host pattern and/or --limit leaves us with no hosts to target." in text
    assert not run.results and worker.alive()


@pytest.mark.parametrize("limit", [None, "gpu_nodes"], ids=["no-limit", "limit-gpu_nodes"])
def test_an_inventory_that_failed_to_parse_stops_the_run(node, limit: str | None) -> None:
    """The Proxmox inventory with an expired token: 'No inventory was parsed' is red, not rc 0."""
    n, sb = node
    worker = sb.spawn_worker(gpus=[0], mib=8000, title="sglang::scheduler_TP0")
    with PveSim(load_cluster("gpu3")) as sim:
        env = {**n.env(), **sim.env(), "PROXMOX_TOKEN_SECRET": "expired-0000"}
        run = run_playbook(PLAYBOOK, inventory=CLUSTER_SOURCE, env=env, limit=limit, wrapper=sb.nsenter_prefix())
    assert run.rc == 1, run.output
    text = " ".join(run.stderr.split())
    assert "401 invalid token value!" in text and "Error processing keyword" not in text
    assert "gpuops.clean_slate: nothing to clean: the inventory has no hosts. An inventory source failed to parse" in text, run.output
    assert "expired-0000" not in run.stdout + run.stderr
    assert not run.results and worker.alive()


def test_the_examples_ansible_cfg_turns_inventory_and_limit_mistakes_into_errors(node, tmp_path: Path) -> None:
    """docs/examples/*/ansible.cfg: an inventory source that fails and a limit that matches nothing stop
    Ansible itself; a good run is not disturbed by it."""
    n, sb = node
    worker = sb.spawn_worker(gpus=[0], mib=8000, title="sglang::scheduler_TP0")
    inv = local_inventory(tmp_path / "hosts.yml", {"host-a": node_vars(n)})
    static = {**n.env(), "ANSIBLE_CONFIG": str(ROOT / "docs" / "examples" / "static" / "ansible.cfg")}
    run = run_playbook(PLAYBOOK, inventory=inv, env=static, limit="gpu-nodes", wrapper=sb.nsenter_prefix())
    assert run.rc == 1 and "[ERROR]: Could not match supplied host pattern, ignoring: gpu-nodes" in run.stderr, run.output
    assert worker.alive()
    with PveSim(load_cluster("gpu3")) as sim:
        env = {**n.env(), **sim.env(), "PROXMOX_TOKEN_SECRET": "expired-0000", "ANSIBLE_CONFIG": str(ROOT / "docs" / "examples" / "proxmox" / "ansible.cfg")}
        run = run_playbook(PLAYBOOK, inventory=CLUSTER_SOURCE, env=env, wrapper=sb.nsenter_prefix())
    assert run.rc != 0 and "Completely failed to parse inventory source" in " ".join(run.stderr.split()), run.output
    assert worker.alive() and not run.results
    run = run_playbook(PLAYBOOK, inventory=inv, env=static, wrapper=sb.nsenter_prefix())
    assert run.rc == 0, run.output
    assert artifacts(run)["host-a"]["clean"] is True and not worker.alive()


# ---------------------------------------------------------------------- one failure path
def test_mixed_run_one_green_one_unreadable_one_unreachable(three_nodes, tmp_path: Path) -> None:
    """The acceptance scenario on simulated nodes (the lab repeats it over SSH): exactly one green host
    in set_stats, a red run, every host on record (summary, set_stats, JSON report, metrics); the metrics read by
    Debian's node_exporter and Prometheus beside a dcgm-exporter endpoint, every query of the guide's "Records" run
    as written there."""
    n1, n2, n3, sb = three_nodes
    ended = [n1.spawn_worker(gpus=[i], mib=8000, sandbox=sb) for i in range(2)]
    # It holds the unreadable host's device files: a kill that went on without the driver would end it.
    bystander = n2.spawn_worker(gpus=[0], mib=8000, sandbox=sb)
    # Memory no process holds: the clean of 'held' cannot free it, and its GPUs are read to the end.
    n3.set_fault(orphan={1: 4096})
    reports, metrics = tmp_path / "reports", tmp_path / "metrics"
    metrics.mkdir()
    hosts = {
        "clean": node_vars(n1),
        "held": node_vars(n3, clean_slate_verify_timeout=0.5),
        "unreadable": node_vars(None, clean_slate_device_dir=str(n2.dev_dir)),
        "gone": {"ansible_connection": "ssh", "ansible_host": "127.0.0.1", "ansible_port": closed_port(), "ansible_user": "root"},
    }
    inv = local_inventory(tmp_path / "hosts.yml", hosts)
    # Prometheus scrapes from before the run (it is slow to begin), node_exporter reading the metrics directory.
    with prometheus.prometheus(metrics, lambda: prometheus.dcgm_text([n1, n3]), tmp_path) as prom:
        run = run_playbook(
            play(),
            inventory=inv,
            env=n1.env(),
            extra_vars={"clean_slate_report_dir": str(reports), "clean_slate_metrics_dir": str(metrics)},
            wrapper=sb.nsenter_prefix(),
        )
        prom.settle()
        promql_beside_dcgm_exporter(prom, metrics, [n1, n3])
    assert run.rc == 2, run.output
    green = {h for h, e in artifacts(run).items() if e["clean"]}
    assert green == {"clean"} and set(artifacts(run)) == set(hosts)
    assert artifacts(run)["clean"]["phase"] == "done" and artifacts(run)["clean"]["reason"] == ""
    assert not any(w.alive() for w in ended) and bystander.alive()

    entry = assert_red(run, "unreadable", "preflight", "driver_not_loaded", "the NVIDIA kernel driver is not loaded", reports)
    assert summary(run, "unreadable").startswith("unreadable: GPUs not read, no process ended - FAILED in preflight (driver_not_loaded)")
    assert entry["gpu_count"] == 0 and "kill" not in gpuops_tasks(run, "unreadable")

    entry = assert_red(run, "gone", "preflight", "unreachable", "gone is unreachable (", reports)
    assert "Connection refused" in entry["msg"] and "make it reachable" in entry["msg"]
    # Ansible's own UNREACHABLE line (kept in the play by ignore_unreachable) and the role's one failure.
    assert len([line for line in run.stdout.splitlines() if line.startswith("fatal: [gone]: UNREACHABLE!")]) == 1

    assert_red(run, "held", "verify", "held_outside_namespace", "GPU 1", reports)

    # node_exporter textfile metrics, per host, parsed as Prometheus parses them.
    written = ["clean_slate_clean.prom", "clean_slate_held.prom", "clean_slate_unreadable.prom"]
    assert sorted(p.name for p in metrics.iterdir()) == written  # nothing to write on 'gone'
    fams = {f.name: f for f in text_string_to_metric_families((metrics / "clean_slate_clean.prom").read_text())}
    assert fams["clean_slate_last_run_success"].samples[0].value == 1
    assert fams["clean_slate_last_run_success"].samples[0].labels == {"host": "clean"}
    assert fams["clean_slate_last_run_processes_ended"].samples[0].value == 2
    assert fams["clean_slate_last_run_duration_seconds"].samples[0].value > 0
    used = {s.labels["gpu"]: s for s in fams["clean_slate_gpu_used_mib"].samples}
    assert set(used) == {"0", "1"} and all(s.value == 0 for s in used.values())
    assert {s.labels["UUID"] for s in used.values()} == {g.uuid for g in n1.gpus}
    assert used["1"].labels["device"] == "nvidia1" and used["1"].labels["modelName"] == n1.gpus[1].name
    assert (metrics / "clean_slate_clean.prom").stat().st_mode & 0o777 == 0o644
    red = {f.name: f for f in text_string_to_metric_families((metrics / "clean_slate_unreadable.prom").read_text())}
    assert red["clean_slate_last_run_success"].samples[0].value == 0
    assert red["clean_slate_last_run_info"].samples[0].labels == {"host": "unreadable", "phase": "preflight", "reason": "driver_not_loaded"}
    assert "clean_slate_gpu_used_mib" not in red or red["clean_slate_gpu_used_mib"].samples == []


#: The guide's joins ("Joins with dcgm-exporter"), each with the series (gpu, host, value) it must return after the mixed
#: run: dcgm-exporter's endpoint serves the GPUs of 'clean' (both freed) and of 'held' (GPU 1 holds memory no process
#: holds), and the hosts' files are in one textfile directory, as a hypervisor holds its containers' files.
JOINS = {
    # dcgm-exporter's series, with the host the clean names.
    "DCGM_FI_DEV_FB_USED * on(UUID) group_left(host) group by (UUID, host) (clean_slate_gpu_used_mib)": [
        ("0", "clean", 0.0), ("0", "held", 0.0), ("1", "clean", 0.0), ("1", "held", 4096.0), ("2", "held", 0.0)
    ],
    # The GPUs, as dcgm-exporter reads them, of hosts whose last clean failed.
    ("DCGM_FI_DEV_FB_USED * on(UUID) group_left(host) (group by (UUID, host) (clean_slate_gpu_used_mib) and on(host) (clean_slate_last_run_success == 0))"): [
        ("0", "held", 0.0), ("1", "held", 4096.0), ("2", "held", 0.0)
    ],
    # dcgm-exporter's GPUs on the nodes where a clean failed: node_exporter and dcgm-exporter on the same machine,
    # scraped at the same address on two ports.
    (
        'label_replace(DCGM_FI_DEV_FB_USED, "node", "$1", "instance", "(.+):[0-9]+")'
        ' and on(node) label_replace(clean_slate_last_run_success == 0, "node", "$1", "instance", "(.+):[0-9]+")'
    ): [("0", None, 0.0), ("0", None, 0.0), ("1", None, 0.0), ("1", None, 4096.0), ("2", None, 0.0)],
}  # fmt: skip
#: The guide's alerts, and the hosts each fires for.
ALERTS = {"clean_slate_last_run_success == 0": {"held", "unreadable"}, "time() - clean_slate_last_run_timestamp_seconds > 86400": set()}


def promql_beside_dcgm_exporter(prom: prometheus.Prometheus, textfile_dir: Path, nodes: list[Node]) -> None:
    """The guide's queries, as written there, against Prometheus scraping node_exporter's textfile collector and a
    dcgm-exporter endpoint for ``nodes``; promtool's one finding is the camelCase labels kept from dcgm-exporter."""
    guide = " ".join((ROOT / "docs" / "docsite" / "rst" / "guide_clean_slate.rst").read_text().split())
    for expr in [*JOINS, *ALERTS]:
        assert expr in guide, f"the guide does not give this query as tested: {expr}"
    for text in [*(p.read_text() for p in sorted(textfile_dir.iterdir())), prometheus.dcgm_text(nodes)]:
        camel = "UUID=" in text  # a file with per-GPU rows ('unreadable' has none)
        assert prometheus.promtool_findings(text) == ((3, {"label names should be written in 'snake_case' not 'camelCase'"}) if camel else (0, set())), text
    # node_exporter read every file whole.
    assert [float(r["value"][1]) for r in prom.query("node_textfile_scrape_error")] == [0.0]
    for expr, want in JOINS.items():
        got = sorted((r["metric"]["gpu"], r["metric"].get("host"), float(r["value"][1])) for r in prom.query(expr))
        assert got == sorted(want, key=lambda w: (w[0], w[1] or "", w[2])), (expr, got)
    for expr, hosts in ALERTS.items():
        assert {r["metric"]["host"] for r in prom.query(expr)} == hosts, expr


def test_every_phase_failure_is_reported(three_nodes, tmp_path: Path) -> None:
    """One run, one host failing in each phase; the hosts that fail before the kill share node 1, whose
    worker must survive them all."""
    n1, n2, n3, sb = three_nodes
    # No name the default patterns know: the hosts of nodes 2 and 3 must not end it either.
    survivor = n1.spawn_worker(gpus=[0], mib=8000, sandbox=sb)
    n2.set_fault(orphan={1: 4096}, recovery_action={1: 1})  # leaked, and the driver asks for a reset
    reports = tmp_path / "reports"
    blocked = tmp_path / "blocked"
    blocked.write_text("a file where the report directory should be\n")
    bare = tmp_path / "bare-python"
    subprocess.run([VENV_PYTHON, "-m", "venv", "--without-pip", str(bare)], check=True)
    hosts = {
        "deps": node_vars(n1, ansible_python_interpreter=str(bare / "bin" / "python")),
        "pre-stop": node_vars(n1, clean_slate_pre_stop_commands=["/bin/false"]),
        "kill": node_vars(n1, clean_slate_where="targets[?"),
        "verify": node_vars(n2, clean_slate_verify_timeout=0.5),
        "report": node_vars(n3, clean_slate_report_dir=str(blocked)),
        "metrics": node_vars(n3, clean_slate_metrics_dir=str(tmp_path / "no-such-dir")),
        # A profile of the user's with an unknown key, a port that is none and a glob outside the roots (issue 38).
        "profile": node_vars(
            n1,
            clean_slate_profiles=["sglang", "vllm", "torchrun"],
            clean_slate_profile_definitions={
                "torchrun": {
                    "processes": {"roots": ["torchrun"]},
                    "ports": [{"name": "master", "port": 70000}],
                    "residue": {"shm": ["/etc/torch-*"]},
                    "prots": 1,
                }
            },
        ),
    }
    for hv in hosts.values():
        hv.setdefault("clean_slate_report_dir", str(reports))
    inv = local_inventory(tmp_path / "hosts.yml", hosts)
    run = run_playbook(play(), inventory=inv, env=n1.env(), wrapper=sb.nsenter_prefix())
    assert run.rc == 2, run.output
    assert survivor.alive(), "a host that failed before its kill ended a process"
    assert not any(e["clean"] for e in artifacts(run).values()) and set(artifacts(run)) == set(hosts), run.output

    assert_red(run, "deps", "dependencies", "missing_dependencies", "lacks nvidia-ml-py, psutil, jmespath", reports)
    assert_red(run, "pre-stop", "pre_stop", "command_failed", 'a pre-stop command failed on pre-stop ("/bin/false"): exit status 1. Fix it or remove', reports)
    assert "kill" not in gpuops_tasks(run, "pre-stop")
    assert_red(run, "kill", "arguments", "bad_variable", "clean_slate_where: 'targets[?' is not a valid JMESPath expression", reports)
    entry = assert_red(run, "verify", "verify", "orphaned_context", "GPU 1", reports)
    assert summary(run, "verify").startswith("verify: 2/3 GPUs clean in ")
    assert entry["after"] == [0, 4096, 0]
    # The report host was cleaned and verified, but its report could not be written: red, and the
    # published entry says why.
    entry = assert_red(run, "report", "report", "report_not_written", f"could not write the JSON report {blocked}/report.json on the controller: ")
    assert entry["clean_count"] == entry["gpu_count"] == 3
    # A metrics directory that does not exist is refused before anything runs (not found after the kill).
    assert_red(run, "metrics", "arguments", "bad_variable", f"clean_slate_metrics_dir: {tmp_path / 'no-such-dir'} does not exist on this host", reports)
    assert not gpuops_tasks(run, "metrics")
    # Bad profile input is refused before anything is signalled, each problem named where it is.
    entry = assert_red(run, "profile", "arguments", "bad_variable", "clean_slate_profile_definitions.torchrun has unknown key(s) prots", reports)
    assert "clean_slate_profile_definitions.torchrun.ports[0].port: 70000 is not a TCP port (1-65535)." in entry["msg"], entry["msg"]
    assert "clean_slate_profile_definitions.torchrun.residue.shm: '/etc/torch-*' is outside the roots" in entry["msg"], entry["msg"]
    assert not gpuops_tasks(run, "profile")
    # Records are written whole: nothing half-written is left beside them.
    assert sorted(p.name for p in reports.iterdir()) == sorted(f"{h}.json" for h in hosts if h != "report")


# ---------------------------------------------------------------------- role arguments
#: The guide's worked example ("Server profiles"): a torchrun job, a profile a user adds in YAML.
TORCHRUN = yaml.safe_load(
    r"""
torchrun:
  description: torchrun training job (torch.distributed.run)
  processes:
    roots: ['(^|/)torchrun( |$)', '-m torch\.distributed\.(run|launch)( |$)']
  stop:
    grace: 30
  ports:
    - {name: master, port: 29400}
  residue:
    dirs: [/tmp/torchelastic_*]
"""
)


def test_list_variables_as_survey_strings(three_nodes, tmp_path: Path) -> None:
    """`-e clean_slate_gpus=...` and survey answers are strings: "0,1" and "[0, 1]" both mean GPUs 0 and 1."""
    n1, n2, n3, sb = three_nodes
    on_0_1 = [n.spawn_worker(gpus=[i], mib=8000, sandbox=sb) for n in (n2, n3) for i in range(2)]
    on_2 = [n.spawn_worker(gpus=[2], mib=8000, sandbox=sb) for n in (n2, n3)]
    hosts = {
        "comma": node_vars(n3, clean_slate_gpus="0,1"),
        "yaml": node_vars(n2, clean_slate_gpus="[0, 1]"),
        "numbers": node_vars(n1, clean_slate_grace_period="-1", clean_slate_verify_interval="0", clean_slate_kill_timeout="5"),
        "typo": node_vars(n1, clean_slate_gpus="0,one"),
        # A profile added by the user in YAML (the guide's torchrun example), applied through a survey answer.
        "profile": node_vars(n1, clean_slate_profiles="sglang,vllm,torchrun", clean_slate_profile_definitions=TORCHRUN),
    }
    agent = n1.spawn_worker(gpus=[1], mib=8000, sandbox=sb, supervise=0, title="torchrun --nproc-per-node 1 train.py", child_title="python3 train.py")
    run = run_playbook(play(), inventory=local_inventory(tmp_path / "hosts.yml", hosts), env=n1.env(), wrapper=sb.nsenter_prefix())
    assert run.rc == 2, run.output
    assert not any(w.alive() for w in on_0_1) and all(w.alive() for w in on_2)
    assert set(artifacts(run)) == set(hosts), run.output
    for host in ("comma", "yaml"):
        assert artifacts(run)[host]["clean"] is True and artifacts(run)[host]["gpu_count"] == 2, artifacts(run)[host]
    entry = assert_red(run, "numbers", "arguments", "bad_variable", "clean_slate_verify_interval must be from 0.001 to 60 seconds, got 0.")
    # Every refused variable at once, each named once, before anything ran.
    assert "clean_slate_grace_period must be from 0 to 86400 seconds, got -1." in entry["msg"], entry["msg"]
    assert "kill_timeout" not in entry["msg"] and "verify_timeout" not in entry["msg"]
    entry = assert_red(run, "typo", "arguments", "bad_variable", "clean_slate_gpus: 'one' is neither a GPU index, a GPU UUID nor a device path")
    assert entry["msg"].count("clean_slate_gpus") == 1, entry["msg"]  # the kill's and the verification's GPUs: one variable
    assert not gpuops_tasks(run, "numbers") and not gpuops_tasks(run, "typo")
    # The user's profile was applied: its root, the agent, got the first signal alone and its server's grace; its worker
    # was ended after it.
    assert artifacts(run)["profile"]["clean"] is True, artifacts(run)["profile"]
    ended = {x["pid"]: x for x in run.phase("kill", "profile")["targets"]}
    assert (ended[agent.ns_pid]["step"], ended[agent.ns_pid]["server"], ended[agent.ns_pid]["grace"]) == ("root", "torchrun", 30.0), ended
    assert ended[agent.ns_pid]["ended_by"] == "own_stop" and ended[agent.worker_ns_pid]["step"] == "tree" and not agent.alive()


def test_hypervisor_mode_without_a_hypervisor_is_refused_and_recorded(node, tmp_path: Path) -> None:
    """The clean step runs on the hypervisor (delegate_to): without one it must still refuse, name the variable and
    leave the host's record, not fail on an empty delegate_to."""
    n, sb = node
    worker = sb.spawn_worker(gpus=[0], mib=8000, title="sglang::scheduler_TP0")
    hosts = {"ct129": node_vars(n, clean_slate_mode="hypervisor", clean_slate_hypervisor="", clean_slate_vmid=129)}
    run, reports = run_recorded(n, sb, tmp_path, hosts)
    assert run.rc == 2, run.output
    assert_red(run, "ct129", "arguments", "bad_variable", "clean_slate_hypervisor is empty, but clean_slate_mode is hypervisor for ct129", reports)
    assert not run.node_runs() and worker.alive()


def test_a_variable_the_argument_spec_refuses_is_refused_and_recorded(node, tmp_path: Path) -> None:
    """A wrong type or choice (here an unknown mode, a boolean that is none and a negative grace period) used to stop
    the host in Ansible's own check of the role's argument spec, before the role could record it. The playbook
    imports the role without that check; the clean step applies the same spec, names every variable, and the host
    is red and on record (summary, set_stats, JSON report) with nothing signalled. A play of its own that keeps
    Ansible's check still stops the host there."""
    n, sb = node
    worker = sb.spawn_worker(gpus=[0], mib=8000, title="sglang::scheduler_TP0")
    bad = {"clean_slate_mode": "sideways", "clean_slate_include_children": "maybe", "clean_slate_grace_period": -1}
    hosts = {"typo": node_vars(n, **bad)}
    run, reports = run_recorded(n, sb, tmp_path, hosts)
    assert run.rc == 2, run.output
    entry = assert_red(run, "typo", "arguments", "bad_variable", "value of clean_slate_mode must be one of: auto, local, hypervisor, got: sideways.", reports)
    # Ansible's words, without Python's internal type names.
    assert "clean_slate_include_children must be true or false; the value given is text that cannot be read as one." in entry["msg"], entry["msg"]
    assert "<class" not in entry["msg"] and "_AnsibleTagged" not in entry["msg"]
    assert entry["msg"].endswith(" Nothing was changed."), entry["msg"]
    assert not [r for r in run.results if r["task"].startswith("Validating arguments")]
    assert not run.node_runs() and worker.alive()

    # With Ansible's own check (roles: in a play of one's own, as before), the host stops in it and is not recorded.
    checked = run_playbook(play(), inventory=local_inventory(tmp_path / "one.yml", {"typo": hosts["typo"]}), env=n.env(), wrapper=sb.nsenter_prefix())
    assert checked.rc == 2 and worker.alive(), checked.output
    failed = [r for r in checked.results if r["status"] == "failed"]
    assert len(failed) == 1 and failed[0]["task"].split(" : ")[-1].startswith("Validating arguments against arg spec"), failed
    assert "clean_slate_mode" in failed[0]["result"]["msg"]


def test_a_module_run_that_ansible_fails_is_the_preflights_failure_with_ansibles_message(node, tmp_path: Path) -> None:
    """No Python where the module runs: Ansible fails the run before any phase. The record names the preflight and
    Ansible's own message (not a run in which --tags selected no phase), and the error is printed once."""
    n, sb = node
    worker = sb.spawn_worker(gpus=[0], mib=8000, title="sglang::scheduler_TP0")
    hosts = {"nopython": node_vars(n, ansible_python_interpreter="/nonexistent/python3")}
    run, reports = run_recorded(n, sb, tmp_path, hosts)
    assert run.rc == 2, run.output
    assert_red(run, "nopython", "preflight", "gpus_unreadable", "/nonexistent/python3", reports)
    assert worker.alive()


def test_an_unknown_gpu_from_extra_vars_names_the_variable(node, tmp_path: Path) -> None:
    n, sb = node
    worker = sb.spawn_worker(gpus=[0], mib=8000, title="sglang::scheduler_TP0")
    inv = local_inventory(tmp_path / "hosts.yml", {"host-a": node_vars(n)})
    run = run_playbook(PLAYBOOK, inventory=inv, env=n.env(), args=["-e", "clean_slate_gpus=[99]"], wrapper=sb.nsenter_prefix())
    assert run.rc == 2, run.output
    assert_red(run, "host-a", "preflight", "bad_arguments", "clean_slate_gpus: GPU index 99 does not exist; this host has 2 GPU(s) (indices 0-1).")
    assert worker.alive()


# ---------------------------------------------------------------------- tags
def test_tags_kill_never_runs_on_gpus_that_were_not_read(node, tmp_path: Path) -> None:
    n, sb = node
    worker = sb.spawn_worker(gpus=[0], mib=8000, title="sglang::scheduler_TP0")
    inv = local_inventory(tmp_path / "hosts.yml", {"host-a": node_vars(n)})
    # The driver cannot be read: --tags clean_slate_kill still takes the preflight reading, which stops the host.
    n.set_fault(init_error="DRIVER_NOT_LOADED")
    run = run_playbook(PLAYBOOK, inventory=inv, env=n.env(), tags="clean_slate_kill", wrapper=sb.nsenter_prefix())
    assert run.rc == 2, run.output
    assert_red(run, "host-a", "preflight", "driver_not_loaded", "the NVIDIA kernel driver is not loaded")
    assert worker.alive() and gpuops_tasks(run) == ["preflight"]
    # Skipping the reading does not get round it.
    n.clear_faults()
    run = run_playbook(
        PLAYBOOK, inventory=inv, env=n.env(), tags="clean_slate_kill", args=["--skip-tags", "clean_slate_preflight"], wrapper=sb.nsenter_prefix()
    )
    assert run.rc == 2, run.output
    assert_red(run, "host-a", "kill", "gpus_not_read", "the kill was refused because the GPUs were not read first")
    assert worker.alive() and gpuops_tasks(run) == []
    # Opting in to name-only matching ends it, and the run stays red: nothing verified the GPUs.
    n.set_fault(init_error="DRIVER_NOT_LOADED")
    run = run_playbook(
        PLAYBOOK, inventory=inv, env=n.env(), tags="clean_slate_kill", extra_vars={"clean_slate_allow_name_only": True}, wrapper=sb.nsenter_prefix()
    )
    assert run.rc == 2, run.output
    assert not worker.alive()
    assert_red(run, "host-a", "verify", "not_verified", "1 process(es) were ended, but the GPUs were not verified")
    assert summary(run, "host-a").startswith("host-a: GPUs not verified in ")


# ---------------------------------------------------------------------- records
def test_relative_report_dir_is_taken_from_where_ansible_playbook_runs(node, tmp_path: Path) -> None:
    n, sb = node
    inv = local_inventory(tmp_path / "hosts.yml", {"host-a": node_vars(n)})
    workdir = tmp_path / "ops"
    workdir.mkdir()
    run = run_playbook(PLAYBOOK, inventory=inv, env=n.env(), extra_vars={"clean_slate_report_dir": "reports"}, wrapper=sb.nsenter_prefix(wd=str(workdir)))
    assert run.rc == 0, run.output
    report = json.loads((workdir / "reports" / "host-a.json").read_text())
    assert report["clean"] is True and report["phase"] == "done"
    assert not (ROOT / "playbooks" / "reports").exists()
    assert stat.S_IMODE(os.stat(workdir / "reports" / "host-a.json").st_mode) == 0o644


# ---------------------------------------------------------------------- the README does what it says
def test_the_readme_module_example_ends_renamed_workers_in_any_case(tmp_path: Path) -> None:
    """README.md, "The modules on their own", run as written: VLLM::Worker_TP1 is ended with the others."""
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("### The modules on their own") :]
    tasks = yaml.safe_load(section[section.index("```yaml") + len("```yaml") : section.index("```", section.index("```yaml") + 7)])
    assert [next(iter(k for k in t if k != "name")) for t in tasks] == ["gpuops.clean_slate.gpu_procs_kill", "gpuops.clean_slate.gpu_mem_verify"]
    with Node(gpus=8, seed="readme") as n:
        sb = n.sandbox()
        try:
            # Renamed processes that hold no GPU: only the name patterns can find them.
            procs = renamed(sb, ["VLLM::Worker_TP1", "sglang::scheduler_TP0", "other-job"])
            # The tasks as written; the simulated node keeps its device files in its own directory, not /dev, which the
            # play says once for both modules (as on a host whose device files live elsewhere).
            defaults = {f"gpuops.clean_slate.{m}": {"device_dir": str(n.dev_dir)} for m in ("gpu_procs_kill", "gpu_mem_verify")}
            run = run_playbook(local_play(tasks, module_defaults=defaults), inventory="localhost,", env=n.env(), wrapper=sb.nsenter_prefix())
            assert run.rc == 0, run.output
            ended = {t["cmdline"].split()[0] for t in run.task(tasks[0]["name"])["result"]["targets"]}
            assert ended == {"VLLM::Worker_TP1", "sglang::scheduler_TP0"}
            assert not procs["VLLM::Worker_TP1"].is_running() and not procs["sglang::scheduler_TP0"].is_running()
            assert procs["other-job"].is_running()
            assert run.task(tasks[1]["name"])["result"]["clean_count"] == 8
        finally:
            sb.stop()
