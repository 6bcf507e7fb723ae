"""The real playbook over real SSH against the multi-host lab (see docs/lab.md).

Eight GPU hosts from the Proxmox inventory plugin: pve1, pve2 and pve3 (hypervisors, 8 simulated GPUs
each, with this machine's Debian 12 Python and none of the modules' dependencies until the role installs
them into a virtual environment) and five real LXC containers on them: ct101 (unprivileged, its own sshd,
Python 3.9), ct102 (privileged, GPUs as raw lxc.mount.entry lines), ct201 (unprivileged, devN), cleaned
from their hypervisor through pct and container scope or, with the inventory's pct_remote, from inside
through community.proxmox's proxmox_pct_remote connection; ct103 (no nvidia-uvm) and ct129 with pve3 (the
seeds' container, eight GPUs) take part in their own tests only. Every assertion reads real processes,
LXC's own tools, the simulated driver's memory state or the results the modules sent back.
"""

from __future__ import annotations

import fnmatch
import json
import os
import shutil
import subprocess
import sys
import typing as t
from pathlib import Path

import pytest
import yaml
from gpusim.servers import Server, ServerStartError, start_sglang
from lab.builder import CLUSTER_FILE, LOCK_DIR, ROOT, SYSTEM_PYTHON, WHEELS, Host, Lab, LabError, cgroup_bases, nspid, remove_stale_runs
from pvesim import load_cluster
from support.ansible import AnsibleRun

pytestmark = pytest.mark.lab

#: The hosts of the playbook runs that name no --limit (Lab.default_limit).
GPU_HOSTS = {"pve1", "pve2", "ct101", "ct102", "ct201"}
#: Every host of the inventory's gpu_nodes: the above, the seeds' node and container, the one without nvidia-uvm.
INVENTORY_HOSTS = GPU_HOSTS | {"pve3", "ct129", "ct103"}


# ---------------------------------------------------------------------- helpers
def viewer(host: Host) -> Host:
    """Where the modules for ``host`` run: a container without network is cleaned from its node."""
    return host.node if host.reach == "hypervisor" and host.node is not None else host


def expected_pids(host: Host) -> set[int]:
    """The host's workload, as pids of the namespace its modules run in."""
    return {p.pid_at(viewer(host).depth) for p in host.workload}


def result_of(run: AnsibleRun, host: str) -> dict[str, t.Any]:
    """clean_slate_result, the role's per-host result."""
    return run.clean_slate_result(host)


def stats(run: AnsibleRun) -> dict[str, dict[str, int]]:
    return run.stats["stats"]


def run_targets(run: AnsibleRun, name: str) -> list[dict[str, t.Any]]:
    """What gpu_procs_kill ended (or, in check mode, would end) for ``name``."""
    return run.phase("kill", host=name)["targets"]


def assert_clean(lab: Lab, run: AnsibleRun, name: str) -> None:
    host = lab[name]
    res = result_of(run, name)
    assert res["clean"] is True and res["failure"] == "", (name, res, run.output)
    assert res["clean_count"] == res["gpu_count"] == len(host.gpus), (name, res)
    assert lab.used_mib(host) == dict.fromkeys(host.gpus, 0), name
    assert not [p.name for p in host.workload if p.alive()], f"{name}: workload survived"


def assert_untouched(lab: Lab, name: str, before: dict[int, int]) -> None:
    host = lab[name]
    assert all(p.alive() for p in host.workload), f"{name}: {[p.name for p in host.workload if not p.alive()]} ended"
    assert lab.used_mib(host) == before, name


def assert_proven_inside(lab: Lab, run: AnsibleRun, name: str) -> None:
    """A container cleaned from its node: its GPUs were proven startable inside it (the CUDA start made there, through
    pct exec and the container's python3), and NVML on the node read each probe gone."""
    host = lab[name]
    probe = run.phase("verify", host=name)["cuda_probe"]
    assert (probe["container"]["vmid"], probe["container"]["ok"], probe["container"]["left"]) == (host.vmid, True, []), probe
    assert probe["probed"] == probe["started"] == len(host.gpus) and probe["gone_after_s"] is not None, probe
    assert any(c[:7] == ["exec", str(host.vmid), "--keep-env", "0", "--", "/bin/sh", "-c"] for c in lab.pct_calls(host.node)), name


def reading(run: AnsibleRun, name: str) -> dict[str, t.Any]:
    """The preflight reading the kill went on: the one after the dependencies were installed, if any."""
    return run.phase("before", host=name)


def modules_python(host: Host) -> str:
    """The interpreter the role runs the modules of ``host`` with."""
    return str(host.venv / "bin" / "python") if host.venv is not None else host.python


def system_python_has(module: str) -> bool:
    return subprocess.run([SYSTEM_PYTHON, "-c", f"import {module}"], capture_output=True, check=False).returncode == 0


def nodes(lab: Lab) -> list[Host]:
    """The hypervisors of the default runs (pve3's GPUs are all ct129's)."""
    return [n for n in lab.nodes if n.name in GPU_HOSTS]


def ready(lab: Lab) -> None:
    """The hypervisors' virtual environments exist (a test run alone may come before the one that made them)."""
    if any(n.venv is None or not (n.venv / "bin" / "python").exists() for n in nodes(lab)):
        run = lab.playbook(limit=",".join(n.name for n in nodes(lab)))
        assert run.rc == 0, run.output
        lab.reset()


def daemons_alive(lab: Lab) -> dict[str, list[str]]:
    return {h.name: sorted(n for n, p in h.daemons.items() if p.alive()) for h in lab.hosts.values()}


def all_daemons(lab: Lab) -> dict[str, list[str]]:
    return {h.name: sorted(h.daemons) for h in lab.hosts.values()}


# ---------------------------------------------------------------------- inventory and transport
def test_inventory_from_the_api_describes_the_lab(lab: Lab) -> None:
    graph = lab.ansible_inventory("--graph", "gpu_nodes")
    assert graph.returncode == 0, graph.stderr
    members = {line.strip(" |-") for line in graph.stdout.splitlines()[1:]}
    assert members == INVENTORY_HOSTS, graph.stdout
    requests_before = lab.sim.request_count if lab.sim else 0
    listing = lab.ansible_inventory("--list")
    assert listing.returncode == 0, listing.stderr
    assert lab.sim is not None and lab.sim.request_count > requests_before  # the API was asked, with the token

    hostvars = json.loads(listing.stdout)["_meta"]["hostvars"]

    def plain(v: t.Any) -> t.Any:
        return v["__ansible_unsafe"] if isinstance(v, dict) and set(v) == {"__ansible_unsafe"} else v

    for name in INVENTORY_HOSTS:
        host, hv = lab[name], hostvars[name]
        if host.kind == "node":
            assert plain(hv["ansible_host"]) == host.address
            assert plain(hv["proxmox_type"]) == "node"
        elif host.reach == "ssh":
            assert plain(hv["ansible_host"]) == host.address  # from the API's /interfaces answer
        else:
            assert "ansible_host" not in hv, f"{name} has no network: it must be reached through its node"
        if host.kind == "lxc":
            assert host.node is not None
            assert plain(hv["proxmox_node"]) == host.node.name
            assert plain(hv["proxmox_vmid"]) == host.vmid
            devices = {plain(d) for d in hv["proxmox_gpu_devices"]}
            assert {d for d in devices if d[len("/dev/nvidia") :].isdigit()} == {f"/dev/nvidia{g}" for g in host.gpus}
            # The API served the container's file on the cluster file system, the one it was started from.
            lines = [line for line in lab.conf_path(host).read_text().splitlines() if not line.startswith("#")]
            assert ("/dev/nvidia-uvm" in devices) == any("/dev/nvidia-uvm" in line for line in lines), (name, devices)


def test_pct_on_the_hypervisor_enters_the_container(fresh: Lab) -> None:
    lab = fresh
    ct102, ct201 = lab["ct102"], lab["ct201"]
    play = [
        {
            "name": "pct on pve1",
            "hosts": "pve1",
            "gather_facts": False,
            "tasks": [
                {"name": "Status", "ansible.builtin.command": "pct status 102 --verbose"},
                {"name": "Inside", "gpuops.clean_slate.pct_exec": {"vmid": 102, "argv": ["ps", "-eo", "pid=,args="]}},
                {"name": "Other node", "ansible.builtin.command": "pct exec 201 -- true", "failed_when": False},
                {"name": "Module on the other node's container", "gpuops.clean_slate.pct_exec": {"vmid": 201, "argv": ["true"]}, "ignore_errors": True},
            ],
        }
    ]
    run = lab.playbook(play)
    status = run.task("Status", host="pve1")["result"]["stdout_lines"]
    assert "status: running" in status
    assert ct102.init is not None
    assert f"pid: {ct102.init.pid_at(1)}" in status  # the init pid as pve1 sees it
    inside = run.task("Inside", host="pve1")["result"]
    assert inside["rc"] == 0, inside
    rows = [line.split(None, 1) for line in inside["stdout_lines"]]
    listed = {int(pid): args for pid, args in rows if not args.startswith("ps ")}
    # Exactly the container's processes, with the pids of its own namespace: LXC's init is 1 (it names
    # itself "init") with its one child, then the lab's daemon and job.
    assert listed.pop(1) == "init"
    assert [listed.pop(pid) for pid, args in list(listed.items()) if args == "/bin/sleep infinity"] == ["/bin/sleep infinity"]
    assert listed == {p.pid_at(2): p.name.replace(" (forked child)", "") for p in [*ct102.workload, *ct102.daemons.values()]}
    other = run.task("Other node", host="pve1")["result"]
    assert other["rc"] == 255
    assert other["stderr"] == "Configuration file 'nodes/pve1/lxc/201.conf' does not exist"
    module = run.task("Module on the other node's container", host="pve1")["result"]
    assert module["reason"] == "no_such_container", module
    assert ct201.running()


# ---------------------------------------------------------------------- the job
def test_hypervisors_with_debians_python_become_ready_and_a_second_run_changes_nothing(fresh: Lab) -> None:
    """pve1 and pve2 start with Debian's EXTERNALLY-MANAGED python3 and none of the modules' dependencies. One
    run makes a virtual environment on each (pve1 from the controller's package index, pve2 from the wheels the
    controller ships; the containers cleaned through them use the same one) and cleans every host; the second
    changes nothing and uses the environments at once. The system Python is never changed. (First of the
    playbook runs in this file, so that the others find the environments made.)"""
    lab = fresh
    assert lab.index is not None
    for node in nodes(lab):
        assert node.venv is not None
        shutil.rmtree(node.venv, ignore_errors=True)
        Path(f"{node.venv}.lock").unlink(missing_ok=True)
    assert not any(system_python_has(m) for m in ("pynvml", "psutil", "jmespath")), "the lab's hypervisors must start without them"
    asked = len(lab.index.requests)

    first = lab.playbook()
    assert first.rc == 0, first.output
    assert all(stats(first)[name]["changed"] >= 1 for name in GPU_HOSTS), stats(first)
    for node in nodes(lab):
        assert node.venv is not None and node.address is not None
        sharing = [node.name] + [c.name for c in lab.containers if c.node is node and c.reach == "hypervisor" and c.name in GPU_HOSTS]
        for name in sharing:
            probe = json.loads(first.task("Look at the virtual environment", host=name)["result"]["stdout"])
            assert (probe["python"], probe["venv"], probe["ensurepip"]) == (SYSTEM_PYTHON, "absent", True), probe
            # The module ran once, with the environment the role made (not with Debian's python3, which lacks them).
            ran = first.role_clean(name)["result"]
            assert ran["python"]["executable"] == str(node.venv / "bin" / "python") and ran["python"]["missing"] == [], ran["python"]
            assert ran["python"]["version"] == probe["version"]  # the environment was made with the node's python3
            pip = first.task("Install the dependencies into the virtual environment", host=name)["result"]
            assert ("--no-index" in pip["cmd"]) == (name not in ("pve1", "ct102")), pip["cmd"]
        # They share the node's environment; under its lock one of them made it and installed, the others found it done.
        made = [n for n in sharing if first.task("Make the virtual environment", host=n)["result"]["changed"]]
        installed = [n for n in sharing if first.task("Install the dependencies into the virtual environment", host=n)["result"]["changed"]]
        assert len(made) == 1 and len(installed) == 1, (node.name, made, installed)
        assert "include-system-site-packages = true" in (node.venv / "pyvenv.cfg").read_text()
        listed = subprocess.run(
            [str(node.venv / "bin" / "python"), "-m", "pip", "list", "--format", "json", "--disable-pip-version-check"],
            env={"PIP_CONFIG_FILE": os.devnull, "PATH": "/usr/bin:/bin"},
            capture_output=True,
            text=True,
            check=True,
        )
        versions = {p["name"].lower(): p["version"] for p in json.loads(listed.stdout)}
        pins = dict(w.name.split("-")[:2] for w in WHEELS.glob("*.whl"))
        assert {k.replace("_", "-"): v for k, v in pins.items()}.items() <= versions.items(), versions
    # pve1 (and ct102 through it) asked the index; pve2 read the copied wheels and asked nobody.
    asked_by = {client for client, _path in lab.index.requests[asked:]}
    paths = {path for _client, path in lab.index.requests[asked:]}
    assert asked_by == {lab["pve1"].address}, lab.index.requests[asked:]
    assert {"/simple/nvidia-ml-py/", "/simple/psutil/", "/simple/jmespath/"} <= paths, paths
    pve2_venv = lab["pve2"].venv
    assert pve2_venv is not None
    assert sorted(p.name for p in (pve2_venv / "wheels").iterdir()) == sorted(p.name for p in WHEELS.glob("*.whl"))
    for name in GPU_HOSTS:
        assert_clean(lab, first, name)
    assert not any(system_python_has(m) for m in ("pynvml", "psutil", "jmespath")), "the system Python was changed"

    second = lab.playbook()
    assert second.rc == 0, second.output
    for name in GPU_HOSTS:
        host = lab[name]
        assert stats(second)[name]["changed"] == 0, (name, stats(second)[name])
        assert stats(second)[name]["failures"] == 0
        res = result_of(second, name)
        assert res["ended"] == 0 and res["clean"] is True, res
        assert run_targets(second, name) == []
        assert second.phase("before", host=name)["python"]["executable"] == modules_python(host)
        if host.venv is not None:
            for step in ("Make the virtual environment", "Install the dependencies into the virtual environment"):
                assert second.task(step, host=name)["status"] == "skipped", (name, step)


def test_every_host_ends_clean_and_daemons_survive(fresh: Lab) -> None:
    lab = fresh
    targets = {name: expected_pids(lab[name]) for name in GPU_HOSTS}
    daemons = all_daemons(lab)
    run = lab.playbook()
    assert run.rc == 0, run.output
    assert set(stats(run)) == GPU_HOSTS
    for name in GPU_HOSTS:
        host = lab[name]
        s = stats(run)[name]
        assert s["failures"] == 0 and s["unreachable"] == 0, (name, s)
        assert_clean(lab, run, name)
        kill = run.phase("kill", host=name)
        assert {tg["pid"] for tg in kill["targets"]} == targets[name], (name, kill["targets"])
        assert all(tg["outcome"] in ("terminated", "killed") for tg in kill["targets"]), kill["targets"]
        assert result_of(run, name)["mode"] == ("hypervisor" if host.reach == "hypervisor" else "local")
        if host.reach == "hypervisor":
            assert {tg["container"] for tg in kill["targets"]} == {host.vmid}
            assert_proven_inside(lab, run, name)
        # The stubborn vLLM worker needed SIGKILL; the others went on SIGTERM.
        stubborn = {p.pid_at(viewer(host).depth) for p in host.workload if p.ignores_term}
        assert {tg["pid"] for tg in kill["targets"] if "KILL" in tg["signals_sent"]} == stubborn
        python = reading(run, name)["python"]
        assert python["executable"] == modules_python(host) and python["missing"] == [], (name, python)
        if host.venv is None:
            assert python["version"].startswith("3.9."), python  # ct101: the oldest target Python
    for node in nodes(lab):
        assert [node.gpu_sim.memory(i)["used_mib"] for i in range(len(node.gpu_sim.gpus))] == [0] * len(node.gpu_sim.gpus)
    assert daemons_alive(lab) == daemons
    assert all(h.sshd is not None and h.sshd.alive() for h in lab.hosts.values() if h.reach == "ssh")
    pve1_calls = lab.pct_calls(lab["pve1"])
    assert ["status", "102", "--verbose"] in pve1_calls
    assert ["status", "201", "--verbose"] in lab.pct_calls(lab["pve2"])
    assert not any("101" in call for call in pve1_calls), "ct101 has its own sshd: pct is not needed for it"


def assert_red_without_uvm(run: AnsibleRun, name: str, mode: str) -> None:
    """ct103 (GPU 2 and nvidiactl, no nvidia-uvm): NVML reads its GPU clean, yet it is red, uvm_missing, found where its
    next server would start; its summary line says why and what to do."""
    res = result_of(run, name)
    assert (res["clean"], res["phase"], res["reason"], res["mode"]) == (False, "verify", "uvm_missing", mode), res
    [g] = run.phase("verify", host=name)["gpus"]
    assert (g["index"], g["used_mib"], g["processes"]) == (2, 0, [])  # NVML: clean
    assert (g["startable"]["reason"], g["startable"]["code"], g["startable"]["step"]) == ("uvm_missing", 999, "cuInit"), g["startable"]
    summary = run.summary(name)
    assert "FAILED in verify (uvm_missing)" in summary and "/dev/nvidia-uvm is absent" in summary, summary
    assert "pass /dev/nvidia-uvm and /dev/nvidia-uvm-tools through" in summary, summary


def test_container_scope_spares_the_other_container_and_the_node_and_proves_startable_inside(fresh: Lab) -> None:
    """--limit ct102,ct103, both cleaned from pve1 through pct in their own scope. ct102's workload ends and its GPUs
    are proven startable inside it; ct103, without nvidia-uvm, reads clean through NVML on pve1 (whose own GPUs start
    CUDA) but is red, uvm_missing: the CUDA start and the device files are the container's."""
    lab = fresh
    ct102, ct103 = lab["ct102"], lab["ct103"]
    others = {name: lab.used_mib(lab[name]) for name in GPU_HOSTS - {"ct102"}}
    want = expected_pids(ct102)
    run = lab.playbook(limit="ct102,ct103")
    assert run.rc == 2, run.output  # ct103 failed
    assert set(stats(run)) == {"ct102", "ct103"}
    assert (stats(run)["ct102"]["failures"], stats(run)["ct103"]["failures"]) == (0, 1), stats(run)
    assert_clean(lab, run, "ct102")
    # The record says how the container was cleaned (built by "Clean the GPUs" itself, from its own run).
    res = result_of(run, "ct102")
    assert (res["mode"], res["label"]) == ("hypervisor", "pve1/ct102"), res
    assert run.role_clean("ct102")["result"]["recorded"] is True
    kill = run.phase("kill", host="ct102")
    assert {tg["pid"] for tg in kill["targets"]} == want
    assert {tg["container"] for tg in kill["targets"]} == {102}
    assert_proven_inside(lab, run, "ct102")
    assert_red_without_uvm(run, "ct103", "hypervisor")
    assert run.phase("verify", host="ct103")["cuda_probe"]["container"]["vmid"] == 103
    assert [f["name"] for f in run.phase("verify", host="ct103")["software"]["findings"]] == ["uvm_missing", "uvm_tools_missing"]
    assert lab.used_mib(ct103) == {2: 0}
    # pve1 itself and ct101, on the same node and the same driver, keep running.
    for name, before in others.items():
        assert_untouched(lab, name, before)
    assert all(p.alive() for p in ct102.daemons.values())
    assert ["status", "102", "--verbose"] in lab.pct_calls(lab["pve1"])


def test_a_container_through_proxmox_pct_remote_is_cleaned_in_its_own_scope(fresh: Lab) -> None:
    """With the inventory's pct_remote, ct201 (no address) gets community.proxmox's proxmox_pct_remote connection:
    SSH (paramiko) to pve2, then /usr/sbin/pct exec 201 for every command. auto mode then cleans it like a host
    of its own (local mode): the modules run inside the container and see only its processes, with the pids
    of its own PID namespace; pve2, its daemons and the other container's neighbours keep running. ct103,
    reached the same way through pve1, is red from inside as from its node: uvm_missing."""
    lab = fresh
    ct201, pve2 = lab["ct201"], lab["pve2"]
    untouched = {name: lab.used_mib(lab[name]) for name in GPU_HOSTS - {"ct201"}}
    daemons = all_daemons(lab)
    calls = len(lab.pct_calls(pve2))
    inside = {p.pid_at(2) for p in ct201.workload}  # as the container's own PID namespace numbers them
    run = lab.playbook(inventory=lab.pct_remote_inventory(), limit="ct201,ct103")
    assert run.rc == 2, run.output  # ct103 failed
    assert_red_without_uvm(run, "ct103", "local")
    assert set(stats(run)) == {"ct201", "ct103"} and stats(run)["ct201"]["failures"] == 0, stats(run)
    res = result_of(run, "ct201")
    assert res["mode"] == "local" and res["label"] == "ct201", res
    assert_clean(lab, run, "ct201")
    kill = run.phase("kill", host="ct201")
    assert {tg["pid"] for tg in kill["targets"]} == inside, kill["targets"]
    assert {tg["pid"] for tg in kill["targets"] if "KILL" in tg["signals_sent"]} == {p.pid_at(2) for p in ct201.workload if p.ignores_term}
    assert reading(run, "ct201")["python"]["executable"] == ct201.python  # the container's own, not pve2's
    for name, before in untouched.items():
        assert_untouched(lab, name, before)
    assert daemons_alive(lab) == daemons  # ct201's own dcgm-exporter too
    # Every command went through /usr/sbin/pct exec 201 on pve2: the connection plugin's form, never the role's
    # hypervisor mode (pct status, pct exec --keep-env 0).
    through = lab.pct_calls(pve2)[calls:]
    assert through and all(call[:3] == ["exec", "201", "--"] for call in through), through


def test_check_mode_ends_nothing(fresh: Lab) -> None:
    lab = fresh
    ready(lab)
    before = {name: lab.used_mib(lab[name]) for name in GPU_HOSTS}
    run = lab.playbook(check=True)
    assert run.rc == 0, run.output
    for name in GPU_HOSTS:
        res = result_of(run, name)
        assert res["check_mode"] is True
        assert res["ended"] == 0
        assert res["would_end"] == len(lab[name].workload), (name, res)
        assert {tg["pid"] for tg in run_targets(run, name)} == expected_pids(lab[name])
        assert all(tg["signals_sent"] == [] for tg in run_targets(run, name))
        assert_untouched(lab, name, before[name])


# ---------------------------------------------------------------------- failures stay per host
def test_stopped_container_fails_alone(fresh: Lab) -> None:
    lab = fresh
    lab.stop_container(lab["ct201"])
    run = lab.playbook()
    assert run.rc == 2, run.output  # some hosts failed
    s = stats(run)
    assert s["ct201"]["failures"] == 1, s
    res = result_of(run, "ct201")
    assert "container 201 is not running" in res["failure"], res
    assert res["clean"] is False and (res["phase"], res["reason"]) == ("kill", "not_running"), res
    assert "FAILED in kill (not_running): " in res["summary"]
    for name in GPU_HOSTS - {"ct201"}:
        assert s[name]["failures"] == 0 and s[name]["unreachable"] == 0, (name, s[name])
        assert_clean(lab, run, name)
    assert all(p.alive() for p in lab["pve2"].daemons.values())


def test_mixed_run_one_green_one_unreadable_one_unreachable(fresh: Lab, tmp_path: Path) -> None:
    """A clean node, a node whose driver cannot be read and a container unreachable over SSH: exactly
    one green host in set_stats, a red job, and every host on record (summary, set_stats, JSON report,
    node_exporter metrics where its node answers). Nothing of the red hosts is touched."""
    lab = fresh
    pve2, ct101 = lab["pve2"], lab["ct101"]
    untouched = {name: lab.used_mib(lab[name]) for name in GPU_HOSTS - {"pve1"}}
    pve2.gpu_sim.set_fault(init_error="DRIVER_NOT_LOADED")
    lab.stop_sshd(ct101)
    reports, metrics = tmp_path / "reports", tmp_path / "metrics"
    metrics.mkdir()
    run = lab.playbook(limit="pve1,pve2,ct101", extra_vars={"clean_slate_report_dir": str(reports), "clean_slate_metrics_dir": str(metrics)})
    assert run.rc == 2, run.output  # some hosts failed: the job is red
    artifacts = run.stats["custom"]["_run"]["clean_slate"]
    assert set(artifacts) == {"pve1", "pve2", "ct101"}
    assert [name for name, entry in artifacts.items() if entry["clean"]] == ["pve1"]
    assert_clean(lab, run, "pve1")
    expected = {
        "pve2": ("preflight", "driver_not_loaded", "the NVIDIA kernel driver is not loaded"),
        "ct101": ("preflight", "unreachable", "ct101 is unreachable ("),
    }
    for name, (phase, reason, says) in expected.items():
        entry = artifacts[name]
        assert (entry["clean"], entry["phase"], entry["reason"]) == (False, phase, reason), entry
        assert says in entry["msg"] and f"FAILED in {phase} ({reason})" in entry["summary"], entry
        assert stats(run)[name]["failures"] == 1, stats(run)[name]
        report = json.loads((reports / f"{name}.json").read_text())
        assert report["reason"] == reason and report["summary"] == entry["summary"]
        assert result_of(run, name)["summary"] == entry["summary"]
        failed = [line for line in run.stdout.splitlines() if line.startswith(f"fatal: [{name}]: FAILED!")]
        assert len(failed) == 1, failed  # each error printed once
    assert json.loads((reports / "pve1.json").read_text())["clean"] is True
    assert run.role_clean("ct101")["status"] == "unreachable"
    # Nothing was ended on the hosts that failed before their kill.
    assert not [r["host"] for r in run.node_runs() if r["host"] != "pve1" and "kill" in r["result"]]
    for name, before in untouched.items():
        assert_untouched(lab, name, before)
    # Metrics written over SSH by the hypervisors; none for the host nobody reached.
    assert sorted(p.name for p in metrics.iterdir()) == ["clean_slate_pve1.prom", "clean_slate_pve2.prom"]
    text = (metrics / "clean_slate_pve1.prom").read_text()
    assert 'clean_slate_last_run_success{host="pve1"} 1' in text and 'clean_slate_last_run_processes_ended{host="pve1"} ' in text
    assert 'clean_slate_last_run_success{host="pve2"} 0' in (metrics / "clean_slate_pve2.prom").read_text()


def test_orphaned_gpu_memory_fails_that_host_with_the_diagnosis(fresh: Lab) -> None:
    lab = fresh
    pve2 = lab["pve2"]
    # Leaked memory the driver flags for a GPU reset: an orphaned context even seen from a PID
    # namespace (unflagged, a namespace cannot tell it from memory the host holds; tests/host
    # covers the unflagged case on the real host path).
    pve2.gpu_sim.set_fault(orphan={1: 8000}, recovery_action={1: 1})
    run = lab.playbook(extra_vars={"clean_slate_verify_timeout": 2})
    assert run.rc == 2, run.output
    s = stats(run)
    assert s["pve2"]["failures"] == 1, s
    res = result_of(run, "pve2")
    assert "GPU 1" in res["failure"] and "orphaned_context" in res["failure"], res["failure"]
    assert "8000 MiB used with no process holding it" in res["failure"]
    assert (res["phase"], res["reason"]) == ("verify", "orphaned_context")
    gpus = {g["index"]: g for g in res["gpus"]}
    assert gpus[1]["diagnosis"] == "orphaned_context" and not gpus[1]["clean"]
    assert all(gpus[i]["clean"] for i in (0, 2, 3))
    # Its processes were still ended (the kill comes first); only the orphan is left.
    assert not [p.name for p in pve2.workload if p.alive()]
    assert lab.used_mib(pve2) == {0: 0, 1: 8000, 2: 0, 3: 0}
    for name in GPU_HOSTS - {"pve2"}:  # ct201 shares pve2's driver but not GPU 1
        assert s[name]["failures"] == 0, (name, s[name])
        assert_clean(lab, run, name)


@pytest.mark.parametrize(
    ("bad", "task", "says"),
    [
        (
            {"clean_slate_verify_timeout": -1},
            "Fail the host when its GPUs are not proven clean",
            "clean_slate_verify_timeout must be from 0 to 86400 seconds, got -1.",
        ),
        # The role's argument spec, applied by the clean step (the playbook turns Ansible's own check off so that
        # the refused host is recorded): the same sentence as Ansible's, and on record.
        (
            {"clean_slate_mode": "sideways"},
            "Fail the host when its GPUs are not proven clean",
            "value of clean_slate_mode must be one of: auto, local, hypervisor",
        ),
    ],
    ids=["negative-timeout", "unknown-mode"],
)
def test_bad_variables_fail_before_anything_runs(fresh: Lab, bad: dict[str, t.Any], task: str, says: str) -> None:
    lab = fresh
    before = {name: lab.used_mib(lab[name]) for name in GPU_HOSTS}
    calls = {n.name: len(lab.pct_calls(n)) for n in lab.nodes}
    run = lab.playbook(extra_vars=bad)
    assert run.rc == 2, run.output
    failed = [r for r in run.results if r["status"] == "failed"]
    assert {r["host"] for r in failed} == GPU_HOSTS
    assert all(task in r["task"] for r in failed), {r["task"] for r in failed}
    assert all(says in r["result"]["msg"] for r in failed), failed[0]["result"]["msg"]
    # Nothing reached the GPUs: no phase ran (a host whose module refused the value only records why), no other
    # module ran, no pct call, every process and GPU as before.
    phases = {"before", "plan", "pre_stop", "kill", "residue", "restore", "verify"}
    assert not [r["host"] for r in run.node_runs() if phases & set(r["result"])], [r["result"] for r in run.node_runs()]
    assert not [r for r in run.results if r["action"].startswith("gpuops.") and not r["action"].endswith("clean_slate_node")]
    assert {n.name: len(lab.pct_calls(n)) for n in lab.nodes} == calls
    for name in GPU_HOSTS:
        assert_untouched(lab, name, before[name])
        res = result_of(run, name)
        assert (res["phase"], res["reason"]) == ("arguments", "bad_variable") and says in res["msg"], res


def lxc_info(lab: Lab, host: Host) -> dict[str, str]:
    """``lxc-info -n <vmid>`` on the container's node, as a dict."""
    proc = lab.lxc(host, "lxc-info")
    assert proc.returncode == 0, proc.stderr
    return {k.strip(): v.strip() for k, _sep, v in (line.partition(":") for line in proc.stdout.splitlines())}


def status_field(pid: int, key: str) -> str:
    return next(line.split(":", 1)[1].split() for line in Path(f"/proc/{pid}/status").read_text().splitlines() if line.startswith(key + ":"))[0]


def test_the_containers_are_real_lxc_containers_as_proxmox_makes_them(fresh: Lab) -> None:
    """Each container is a real LXC container on its node: lxc-info says RUNNING with the init's pid as the
    node sees it; its PID 1 is LXC's init.lxc, whose parent is lxc-start; an unprivileged one runs under PVE's
    id map (root inside is uid 100000 on the node: its processes and the files it makes belong to 100000),
    the privileged one under the identity map, and its device cgroup refuses a device it was not given; its
    cgroup is lxc/<vmid>/ns under its node's of this run. Its /dev has exactly the GPUs of its Proxmox
    configuration (devN through the pre-start and autodev hooks, raw lxc.mount.entry lines by LXC itself),
    the node's own device files (same inode), and the simulated driver's libnvidia-ml and libcuda are where
    NVIDIA's hook puts them. ct103, without nvidia-uvm: NVML answers inside it, a CUDA job cannot start. Hosts are separate PID,
    network and UTS namespaces."""
    lab = fresh
    inits = {h.name: h.init for h in lab.hosts.values() if h.init}
    assert len({os.stat(f"/proc/{p.pid}/ns/pid").st_ino for p in inits.values()}) == len(lab.hosts)
    assert len({os.stat(f"/proc/{p.pid}/ns/net").st_ino for p in inits.values()}) == len(lab.hosts)
    assert os.stat("/proc/self/ns/net").st_ino not in {os.stat(f"/proc/{p.pid}/ns/net").st_ino for p in inits.values()}
    for c in lab.containers:
        assert c.init is not None and c.node is not None and c.node.init is not None
        info = lxc_info(lab, c)
        assert (info["Name"], info["State"], info["PID"]) == (str(c.vmid), "RUNNING", str(c.init.pid_at(1))), (c.name, info)
        assert len(c.init.levels) == 3 and c.init.levels[-1] == 1
        assert os.readlink(f"/proc/{c.init.pid}/exe") == "/usr/sbin/init.lxc"
        monitor = int(status_field(c.init.pid, "PPid"))
        assert Path(f"/proc/{monitor}/comm").read_text().strip() == "lxc-start"
        assert os.stat(f"/proc/{monitor}/ns/pid").st_ino == os.stat(f"/proc/{c.node.init.pid}/ns/pid").st_ino
        uid_map = Path(f"/proc/{c.init.pid}/uid_map").read_text().split()
        gid_map = Path(f"/proc/{c.init.pid}/gid_map").read_text().split()
        root = "100000" if c.unprivileged else "0"
        assert (uid_map, gid_map) == ((["0", "100000", "65536"],) * 2 if c.unprivileged else (["0", "0", "4294967295"],) * 2), c.name
        assert status_field(c.init.pid, "Uid") == root and all(status_field(p.pid, "Uid") == root for p in c.workload), c.name
        made = lab.lxc(c, "lxc-attach", "--clear-env", "--", "touch", "/root/made-inside")
        assert made.returncode == 0, made.stderr
        assert (c.rootfs / "root" / "made-inside").stat().st_uid == int(root), c.name
        cgroups = Path(f"/proc/{c.init.pid}/cgroup").read_text().splitlines()
        devices = next(line.split(":", 2)[2] for line in cgroups if line.split(":")[1] == "devices")
        assert devices.endswith(f"/{lab.run_name}/{c.node.name}/lxc/{c.vmid}/ns"), devices
        hostname = lab.lxc(c, "lxc-attach", "--clear-env", "--", "hostname").stdout.strip()
        assert hostname == c.name
        want = {f"nvidia{g}" for g in c.gpus} | {"nvidiactl"} | ({"nvidia-uvm"} if c.name != "ct103" else set())
        dev = f"/proc/{c.init.pid}/root/dev"
        assert {n for n in os.listdir(dev) if n.startswith("nvidia")} == want, c.name
        for name in want:
            inside, on_node = os.stat(f"{dev}/{name}"), os.stat(f"/proc/{c.node.init.pid}/root/dev/{name}")
            assert (inside.st_dev, inside.st_ino) == (on_node.st_dev, on_node.st_ino), (c.name, name)
        for soname in ("libnvidia-ml.so.1", "libcuda.so.1"):
            lib = f"/proc/{c.init.pid}/root/usr/lib/x86_64-linux-gnu/{soname}"
            assert os.readlink(lib) == f"{soname[:-1]}{c.gpu_sim.desc.driver_version}" and os.path.isfile(lib), (c.name, soname)
        assert {i["name"] for i in lab.interfaces(c)} == ({"lo", "eth0"} if c.address else {"lo"}), c.name
    assert [i["inet"] for i in lab.interfaces(lab["ct101"]) if i["name"] == "eth0"] == ["10.77.0.101/24"]
    # The privileged container's device cgroup: /dev/mem's numbers may be made (c *:* m), never opened.
    mem = lab.lxc(lab["ct102"], "lxc-attach", "--clear-env", "--", "sh", "-c", "mknod /tmp/mem c 1 1 && head -c 1 /tmp/mem")
    assert mem.returncode != 0 and "Operation not permitted" in mem.stderr, mem
    # ct103 has no nvidia-uvm: the driver answers (NVML), but a CUDA job cannot start.
    ct103 = lab["ct103"]
    smi = lab.lxc(ct103, "lxc-attach", "--clear-env", "--", "nvidia-smi", "-L")
    assert smi.returncode == 0 and "GPU 2: NVIDIA H200" in smi.stdout, smi
    with pytest.raises(LabError, match="exited before it was ready"):
        lab.spawn_job(ct103, [{"gpus": [2], "mib": 1000, "title": "sglang::scheduler_TP0"}])
    assert "cannot open /dev/nvidiactl or nvidia-uvm" in (ct103.dir / "workers.log").read_text()
    assert lab.used_mib(ct103) == {2: 0}


def test_pct_follows_pve_containers_code_path(fresh: Lab) -> None:
    """The node's pct over the real LXC tools, in PVE 8's and 9's words: status from LXC's command socket
    and lxc-info, the config file of this node only, lxc-attach with PVE's environment (keep-env by default,
    PATH as PVE's CLI handler sets it, SSL_CERT_FILE removed; --clear-env gives the container's own), argv
    and exit codes unchanged, and the errors of a stopped container and a bad configuration line."""
    lab = fresh
    pve1, pve2, ct103, ct201 = lab["pve1"], lab["pve2"], lab["ct103"], lab["ct201"]
    assert ct201.init is not None
    fast = {"PCTSIM_LATENCY_MS": "0"}

    def pct(node: Host, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
        return lab.pct(node, *args, env={**fast, **env})

    assert pct(pve2, "status", "201").stdout == "status: running\n"
    for pve, pressure in (("8", False), ("9", True)):
        verbose = dict(line.split(": ", 1) for line in pct(pve2, "status", "201", "--verbose", PCTSIM_PVE=pve).stdout.splitlines())
        assert (verbose["status"], verbose["pid"], verbose["name"], verbose["type"]) == ("running", str(ct201.init.pid_at(1)), "ct201", "lxc")
        assert any(k.startswith("pressure") for k in verbose) == pressure, (pve, verbose)
    kept = pct(pve2, "exec", "201", "--", "env", MARKER="kept", SSL_CERT_FILE="/etc/ssl/x.pem")
    env = dict(line.split("=", 1) for line in kept.stdout.splitlines())
    assert (env["MARKER"], env["PATH"], env["container"]) == ("kept", "/sbin:/bin:/usr/sbin:/usr/bin", "lxc") and "SSL_CERT_FILE" not in env, env
    cleared = pct(pve2, "exec", "201", "--keep-env", "0", "--", "env", MARKER="kept")
    env = dict(line.split("=", 1) for line in cleared.stdout.splitlines())
    assert set(env) == {"container", "PATH", "TERM", "GPUSIM_STATE", "GPUSIM_DEV_DIR"}, env
    old = pct(pve2, "exec", "201", "--keep-env", "0", "--", "true", PCTSIM_PVE="8.1")
    assert (old.returncode, old.stderr) == (255, "Unknown option: keep-env\n400 unable to parse option\npct exec <vmid> [<extra-args>] [OPTIONS]\n")
    argv = pct(pve2, "exec", "201", "--", "printf", "%s|", "a b", "$HOME", "*")
    assert (argv.returncode, argv.stdout) == (0, "a b|$HOME|*|")
    assert pct(pve2, "exec", "201", "--", "sh", "-c", "exit 7").returncode == 7
    missing = pct(pve2, "exec", "201", "--", "no-such-command")
    assert missing.returncode == 127 and 'Failed to exec "no-such-command"' in missing.stderr, missing
    assert pct(pve1, "exec", "201", "--", "true").stderr == "Configuration file 'nodes/pve1/lxc/201.conf' does not exist\n"
    config = pct(pve2, "config", "201").stdout.splitlines()
    assert "dev0: /dev/nvidia4,gid=44" in config and "unprivileged: 1" in config and config == sorted(config), config
    listed = pct(pve1, "list").stdout.splitlines()
    assert listed[0].split() == ["VMID", "Status", "Lock", "Name"] and [r.split() for r in listed[1:]] == [
        ["101", "running", "ct101"],
        ["102", "running", "ct102"],
        ["103", "running", "ct103"],
    ]
    # A line pct cannot read is warned about, as parse_pct_config does; the rest still counts.
    conf = lab.conf_path(ct103)
    text = conf.read_text()
    try:
        conf.write_text(text + "this is not a key\n")
        warned = pct(pve1, "status", "103")
        assert (warned.stdout, warned.stderr) == ("status: running\n", "vm 103 - unable to parse config: this is not a key\n")
    finally:
        conf.write_text(text)
    lab.stop_container(ct103)
    assert not lab.lxc_running(ct103)
    assert pct(pve1, "status", "103").stdout == "status: stopped\n"
    stopped = pct(pve1, "exec", "103", "--", "true")
    assert (stopped.returncode, stopped.stderr) == (255, "container '103' not running!\n")
    lab.start_container(ct103)
    assert pct(pve1, "status", "103").stdout == "status: running\n"


# ---------------------------------------------------------------------- the seeds' container
def role_patterns(kind: str) -> list[str]:
    """The role's default residue patterns of one kind (shm, sockets), as the role reads them."""
    defaults = yaml.safe_load((ROOT / "roles" / "clean_slate" / "defaults" / "main.yml").read_text())
    return list(defaults[f"clean_slate_residue_{kind}"])


def test_seeds_container_129_crashed_server_cleaned_from_the_hypervisor_and_inside(fresh: Lab) -> None:
    """The seeds' scenario on real LXC: container 129 (unprivileged, eight GPUs passed through as devN) on pve3
    runs an SGLang server tree (gpusim.servers: launcher, detokenizer, eight schedulers in sessions of their own)
    that crashes as the seeds' did: the launcher SIGKILLed, the detokenizer dies with it, the schedulers are
    reparented to the container's init and keep their GPU memory, their store port and their shared memory
    and sockets (multiprocessing's resource tracker lives on too). The next start fails on that. The playbook
    cleans it from the hypervisor (pct, container scope 129), then, after a second crash, from inside
    (proxmox_pct_remote, local mode in the container); each time every scheduler ends and nothing but what is
    left of the server, the leftovers the role's residue patterns name are removed from the container's own
    /dev/shm and /tmp, and the next start of the same server comes up. The container, its init and LXC's
    monitor stay, and nothing outside container 129 is touched."""
    lab = fresh
    ct, pve3 = lab["ct129"], lab["pve3"]
    assert ct.init is not None and ct.node is pve3
    monitor = int(status_field(ct.init.pid, "PPid"))
    others = {name: lab.used_mib(lab[name]) for name in GPU_HOSTS}
    daemons = all_daemons(lab)
    box = lab.sandbox(ct)
    patterns = role_patterns("shm") + role_patterns("sockets")
    servers: list[Server] = []
    try:
        for how in ("hypervisor", "inside"):
            srv = start_sglang(pve3.gpu_sim, sandbox=box, tp=8, port=30000)
            servers.append(srv)
            assert {m.gpu for m in srv.ranks} == set(ct.gpus) and all(used >= 100000 for used in lab.used_mib(ct).values())
            survivors = srv.crash()
            schedulers = [m for m in survivors if m.role == "scheduler"]
            # The schedulers (and multiprocessing's resource tracker) outlive the launcher.
            assert len(schedulers) == 8 and {m.role for m in survivors} <= {"scheduler", "resource_tracker"}, survivors
            assert all(int(status_field(m.pid, "PPid")) == ct.init.pid for m in schedulers)  # reparented to init.lxc
            leftovers = [p for p in srv.shm + srv.sockets if srv.path(p).exists()]
            removable = [p for p in leftovers if any(fnmatch.fnmatch(p, pat) for pat in patterns)]
            assert removable, leftovers
            if how == "hypervisor":
                with pytest.raises(ServerStartError):
                    start_sglang(pve3.gpu_sim, sandbox=box, tp=8, port=30000)
            inside = how == "inside"
            seen = {m.pid: m.ns_pid if inside else nspid(m.pid)[1] for m in survivors}  # as the modules see them
            run = lab.playbook(inventory=lab.pct_remote_inventory(), limit="ct129") if inside else lab.playbook(limit="ct129")
            assert run.rc == 0, run.output
            res = result_of(run, "ct129")
            assert res["mode"] == ("local" if inside else "hypervisor"), res
            assert res["clean"] is True and res["clean_count"] == 8, res
            if not inside:
                assert_proven_inside(lab, run, "ct129")
            assert lab.used_mib(ct) == dict.fromkeys(ct.gpus, 0)
            assert not [m for m in srv.members if m.alive()]
            kill = run.phase("kill", host="ct129")
            # Every scheduler ended, and nothing but what the crash left of the server.
            targets = {tg["pid"] for tg in kill["targets"]}
            assert {seen[m.pid] for m in schedulers} <= targets <= set(seen.values()), kill["targets"]
            assert not [p for p in removable if srv.path(p).exists()], how
            # The next start: the same server comes up on the eight GPUs.
            again = start_sglang(pve3.gpu_sim, sandbox=box, tp=8, port=30000)
            servers.append(again)
            assert len(again.ranks) == 8 and all(m.alive() for m in again.members)
            again.stop()
            lab.wait_free(ct)
    finally:
        for srv in servers:
            srv.stop()
    assert ct.init.alive() and Path(f"/proc/{monitor}/comm").read_text().strip() == "lxc-start"
    assert lxc_info(lab, ct)["State"] == "RUNNING"
    assert all(p.alive() for p in ct.daemons.values())
    for name, before in others.items():
        assert_untouched(lab, name, before)
    assert daemons_alive(lab) == daemons


# ---------------------------------------------------------------------- nothing stays behind
#: A lab's session as the conftest runs it (build, the tests, teardown in a finally), whose test fails or
#: which is SIGKILLed in the middle.
CHILD = """
import json, os, signal, sys
from lab.builder import Lab
lab = Lab(json.loads(sys.argv[1]))
try:
    lab.build()
    print(json.dumps({"run": lab.run_id, "containers": [c.name for c in lab.containers if c.running()]}), flush=True)
    if sys.argv[2] == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    raise AssertionError("a test failed")
finally:
    lab.teardown()
"""


def test_a_failed_or_killed_lab_leaves_nothing_behind(lab: Lab) -> None:
    """A lab of one node and one container, built in a PID namespace of its own (tools/pidns-run) beside this
    one: failing after the build, its teardown leaves none of its cgroups and no lock; SIGKILLed, its
    processes, mounts, network and files die with its namespaces and only empty cgroup directories stay,
    which the next lab removes (this lab's own, held by its lock, stay)."""
    small = load_cluster(CLUSTER_FILE)
    small["nodes"] = [n for n in small["nodes"] if n["name"] == "pve2"]
    small["guests"] = [g for g in small["guests"] if g["vmid"] == 201]

    def run_dirs(run: str) -> list[Path]:
        return [base / f"gpuops-lab-{run}" for base in cgroup_bases() if (base / f"gpuops-lab-{run}").exists()]

    for ending in ("fail", "kill"):
        child = subprocess.run(
            [str(ROOT / "tools" / "pidns-run"), sys.executable, "-c", CHILD, json.dumps(small), ending],
            capture_output=True,
            text=True,
            timeout=300,
            cwd=str(ROOT),
            check=False,
        )
        built = json.loads(child.stdout.splitlines()[0]) if child.stdout.startswith("{") else None
        assert built is not None and built["containers"] == ["ct201"], child.stderr[-3000:]
        assert child.returncode != 0
        run = built["run"]
        # No process of that run is left anywhere below this namespace (its cgroups hold none).
        for d in run_dirs(run):
            assert not [p for sub, _dirs, _files in os.walk(d) for p in (Path(sub) / "cgroup.procs").read_text().split()], d
        if ending == "fail":
            assert run_dirs(run) == [] and not (LOCK_DIR / f"{run}.lock").exists(), child.stderr[-3000:]
        else:
            assert run_dirs(run), "a SIGKILLed lab cannot remove its cgroups itself"
            assert run in remove_stale_runs()
            assert run_dirs(run) == [] and not (LOCK_DIR / f"{run}.lock").exists()
    assert run_dirs(lab.run_id) and all(n.running() for n in lab.nodes)


# ---------------------------------------------------------------------- as AWX runs it
def test_awx_wrapper_playbook_with_survey_strings_publishes_artifacts(fresh: Lab, tmp_path: Path) -> None:
    """docs/examples/awx: the one-line wrapper playbook, survey answers as strings (AWX text
    fields), and the set_stats artifacts a workflow's next node receives."""
    lab = fresh
    survey = {
        "clean_slate_grace_period": "1",
        "clean_slate_kill_timeout": "5",
        "clean_slate_verify_timeout": "10",
        "clean_slate_max_used_mib": "64",
        "clean_slate_fail_on_dirty": "true",
        "clean_slate_expected_gpus": "0",
        "clean_slate_report_dir": str(tmp_path / "reports"),
    }
    run = lab.playbook(ROOT / "docs" / "examples" / "awx" / "clean_slate.yml", extra_vars=survey)
    assert run.rc == 0, run.output
    artifacts = run.stats["custom"]["_run"]["clean_slate"]
    assert set(artifacts) == GPU_HOSTS
    for name in GPU_HOSTS:
        entry = artifacts[name]
        assert entry["clean"] is True and entry["failure"] == "", entry
        assert entry["ended"] == len(lab[name].workload) and entry["gpu_count"] == len(lab[name].gpus)
        assert "gpus" not in entry and "targets" not in entry  # the bulky parts stay in the per-host report
        report = json.loads((tmp_path / "reports" / f"{name}.json").read_text())
        assert report["summary"] == entry["summary"] and len(report["targets"]) == entry["ended"]
        assert_clean(lab, run, name)
