"""clean_slate_install_dependencies on this machine's Debian 12 system Python (3.11, EXTERNALLY-MANAGED,
without the modules' dependencies), through real ansible-playbook on a simulated node: the ways the
dependencies phase fails or only reports. The install itself, and that a second run changes nothing, are
proven over SSH on the lab's hypervisors (tests/lab/test_lab.py::test_hypervisors_with_debians_python_become_ready).

Each test checks that the system Python was not changed and that nothing was ended.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
from pathlib import Path
from typing import Any

import pytest
from gpusim import Node
from support.ansible import ROOT, AnsibleRun, local_inventory, run_playbook

SYSTEM_PYTHON = Path("/usr/bin/python3")
WHEELS = ROOT / ".build" / "wheels"
# The module environment's PATH: python3 is Debian's, as on a Proxmox VE node.
SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

pytestmark = pytest.mark.skipif(
    subprocess.run([str(SYSTEM_PYTHON), "-c", "import ensurepip, venv"], capture_output=True, check=False).returncode != 0,
    reason="needs a system python3 with venv and ensurepip (Debian: python3-venv)",
)


def node_vars(n: Node, **extra: Any) -> dict[str, Any]:
    return {"clean_slate_grace_period": 1, "clean_slate_verify_timeout": 3, "clean_slate_device_dir": str(n.dev_dir), "gpusim_state": str(n.state_dir), **extra}


def artifacts(run: AnsibleRun) -> dict[str, dict[str, Any]]:
    return run.stats["custom"]["_run"]["clean_slate"]


def assert_red(run: AnsibleRun, host: str, phase: str, reason: str, says: str) -> dict[str, Any]:
    """The host failed in ``phase`` with ``reason``: set_stats entry, summary line, one printed error."""
    entry = artifacts(run)[host]
    assert (entry["clean"], entry["phase"], entry["reason"]) == (False, phase, reason), (host, entry)
    assert says in entry["msg"] and entry["failure"] == entry["msg"], (host, entry["msg"])
    assert f" - FAILED in {phase} ({reason}): " in run.summary(host)
    assert run.stats["stats"][host]["failures"] == 1, run.stats["stats"][host]
    assert len([line for line in run.stdout.splitlines() if line.startswith(f"fatal: [{host}]: FAILED!")]) == 1, run.stdout
    return entry


def system_has(module: str) -> bool:
    return subprocess.run([str(SYSTEM_PYTHON), "-c", f"import {module}"], capture_output=True, check=False).returncode == 0


@pytest.fixture
def node():
    with Node(gpus=2, seed="deps") as n:
        sb = n.sandbox()
        try:
            yield n, sb
        finally:
            sb.stop()


def deps_vars(n: Node, tmp_path: Path, **extra: Any) -> dict[str, Any]:
    hv = {
        "ansible_python_interpreter": str(SYSTEM_PYTHON),
        "clean_slate_install_dependencies": True,
        "clean_slate_venv_dir": str(tmp_path / "opt" / "gpuops" / "venv"),
    }
    return node_vars(n, **{**hv, **extra})


def run(n: Node, sb: Any, tmp_path: Path, hosts: dict[str, dict[str, Any]], **kw: Any) -> AnsibleRun:
    inv = local_inventory(tmp_path / "hosts.yml", hosts)
    plays = [
        {
            "name": "Clean slate",
            "hosts": "gpu_nodes",
            "gather_facts": False,
            "environment": {"GPUSIM_STATE": "{{ gpusim_state }}", "PATH": SYSTEM_PATH},
            "roles": [{"role": "gpuops.clean_slate.clean_slate"}],
        }
    ]
    return run_playbook(plays, inventory=inv, env=n.env(), wrapper=sb.nsenter_prefix(), **kw)


def test_an_offline_host_without_all_the_wheels_fails_in_the_dependencies_phase(node, tmp_path: Path) -> None:
    n, sb = node
    worker = sb.spawn_worker(gpus=[0], mib=8000, title="sglang::scheduler_TP0")
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    for whl in WHEELS.glob("jmespath-*.whl"):  # only one of the three
        shutil.copy(whl, wheels)
    assert list(wheels.iterdir()), "make setup fetches the wheels (tools/fetch_test_deps.py)"
    venv = tmp_path / "opt" / "gpuops" / "venv"
    result = run(n, sb, tmp_path, {"offline": deps_vars(n, tmp_path, clean_slate_wheels_dir=str(wheels))})
    assert result.rc == 2, result.output
    entry = assert_red(
        result,
        "offline",
        "dependencies",
        "dependency_install_failed",
        f"could not install nvidia-ml-py, psutil, jmespath into {venv} on offline: ",
    )
    assert "No matching distribution found for nvidia-ml-py" in entry["msg"], entry["msg"]
    version = subprocess.run([str(SYSTEM_PYTHON), "-c", "import platform; print(platform.python_version())"], capture_output=True, text=True, check=True)
    assert f"Put wheels of them for Python {version.stdout.strip()} and the architecture of that host into clean_slate_wheels_dir ({wheels})" in entry["msg"]
    # The environment was made with the system python3, the wheels copied; pip read nothing else (--no-index).
    made = result.task("Make the virtual environment", host="offline")["result"]
    assert made["changed"] is True and made["cmd"][0] == str(SYSTEM_PYTHON), made
    assert (venv / "bin" / "python").exists() and (venv / "wheels" / next(wheels.iterdir()).name).exists()
    assert "include-system-site-packages = true" in (venv / "pyvenv.cfg").read_text()  # Debian's python3-psutil would count
    assert worker.alive(), "nothing may be ended on a host whose GPUs were not read"
    assert not system_has("nvidia_ml_py") and not system_has("pynvml"), "the system Python was changed"


def test_a_python3_without_ensurepip_gets_python3_venv_from_the_package_manager(node, tmp_path: Path) -> None:
    """Debian's python3 without python3-venv has no ensurepip. Here ensurepip is hidden by an overlay whiteout in a
    private mount namespace (this machine's packages stay as they are): the role asks the OS package manager for
    python3-venv (real apt, which finds it installed and changes nothing), and when the environment still cannot
    be made, the host is red with Debian's own words and what venv left half made is removed."""
    n, sb = node
    worker = sb.spawn_worker(gpus=[0], mib=8000, title="sglang::scheduler_TP0")
    stdlib = subprocess.run(
        [str(SYSTEM_PYTHON), "-c", "import os, ensurepip; print(os.path.dirname(os.path.dirname(ensurepip.__file__)))"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    whiteout = tmp_path / "whiteout"
    whiteout.mkdir()
    os.mknod(whiteout / "ensurepip", 0o600 | stat.S_IFCHR, os.makedev(0, 0))  # overlayfs: "no such entry"
    hide = f'mount -t overlay gpuops-test-no-ensurepip -o lowerdir={whiteout}:{stdlib} {stdlib} && exec "$@"'
    venv = tmp_path / "opt" / "gpuops" / "venv"
    inv = local_inventory(tmp_path / "hosts.yml", {"no-ensurepip": deps_vars(n, tmp_path)})
    plays = [
        {
            "name": "Clean slate",
            "hosts": "gpu_nodes",
            "gather_facts": False,
            "environment": {"GPUSIM_STATE": "{{ gpusim_state }}", "PATH": SYSTEM_PATH},
            "roles": [{"role": "gpuops.clean_slate.clean_slate"}],
        }
    ]
    wrapper = [*sb.nsenter_prefix(), "unshare", "--mount", "--propagation", "private", "/bin/sh", "-c", hide, "sh"]
    result = run_playbook(plays, inventory=inv, env=n.env(), wrapper=wrapper)
    assert result.rc == 2, result.output
    probe = json.loads(result.task("Look at the virtual environment", host="no-ensurepip")["result"]["stdout"])
    assert probe["ensurepip"] is False and probe["venv"] == "absent", probe
    package = result.task("Install python3-venv, which python3 -m venv needs", host="no-ensurepip")
    assert package["status"] == "ok" and package["result"]["changed"] is False, package  # installed here: apt did nothing
    entry = assert_red(
        result, "no-ensurepip", "dependencies", "dependency_install_failed", f"could not create the virtual environment {venv} on no-ensurepip: "
    )
    assert "ensurepip is not available" in entry["msg"] and entry["msg"].endswith("nothing was ended."), entry["msg"]
    assert not venv.exists(), "a half-made environment (no pip) was left to pass for a working one"
    assert subprocess.run([str(SYSTEM_PYTHON), "-c", "import ensurepip"], check=False).returncode == 0  # only hidden there
    assert worker.alive()


def test_check_mode_says_what_it_would_install_and_changes_nothing(node, tmp_path: Path) -> None:
    n, sb = node
    worker = sb.spawn_worker(gpus=[0], mib=8000, title="sglang::scheduler_TP0")
    venv = tmp_path / "opt" / "gpuops" / "venv"
    result = run(n, sb, tmp_path, {"dry": deps_vars(n, tmp_path, clean_slate_wheels_dir=str(WHEELS))}, check=True)
    assert result.rc == 2, result.output
    entry = assert_red(result, "dry", "dependencies", "missing_dependencies", f"check mode: the virtual environment {venv} on dry is absent.")
    assert (
        f"A real run makes the virtual environment {venv} ({SYSTEM_PYTHON} -m venv), installs nvidia-ml-py, psutil, jmespath into {venv}"
        f" from the wheels in {WHEELS} and reads the GPUs with it" in entry["msg"]
    ), entry["msg"]
    assert entry["msg"].endswith("Nothing was changed.")
    for task in ("Make the virtual environment", "Copy the wheels of the dependencies"):
        assert result.task(task, host="dry")["result"]["changed"] is True, task  # what it would do
    assert result.task("Install the dependencies into the virtual environment", host="dry")["status"] == "skipped"
    assert not venv.parent.exists(), "check mode made something"
    assert worker.alive()


def test_bad_dependency_variables_are_refused_before_anything_runs(node, tmp_path: Path) -> None:
    n, sb = node
    worker = sb.spawn_worker(gpus=[0], mib=8000, title="sglang::scheduler_TP0")
    hosts = {"bad": deps_vars(n, tmp_path, clean_slate_venv_dir="opt/venv", clean_slate_wheels_dir=str(tmp_path / "no-wheels"))}
    result = run(n, sb, tmp_path, hosts)
    assert result.rc == 2, result.output
    msg = result.task("Fail the host when its GPUs are not proven clean", host="bad")["result"]["msg"]
    assert 'clean_slate_venv_dir must be an absolute path on the host where the modules run, got "opt/venv".' in msg, msg
    assert f'clean_slate_wheels_dir must be a directory on the controller holding the wheels to install, got "{tmp_path / "no-wheels"}"' in msg
    # Nothing reached the host: no module of the collection, no command, copy or package install.
    touched = {"ansible.builtin.command", "ansible.builtin.copy", "ansible.builtin.package"}
    assert not result.node_runs() and not [r["task"] for r in result.results if r["status"] != "skipped" and r["action"] in touched]
    assert artifacts(result)["bad"]["reason"] == "bad_variable"
    assert worker.alive()


def test_an_interpreter_given_as_extra_variable_is_refused_with_the_reason(node, tmp_path: Path) -> None:
    """-e ansible_python_interpreter (or an AWX extra variable) overrides every task's interpreter, so the modules could
    never run from the virtual environment: the host stops before anything is installed, saying so."""
    n, sb = node
    worker = sb.spawn_worker(gpus=[0], mib=8000, title="sglang::scheduler_TP0")
    venv = tmp_path / "opt" / "gpuops" / "venv"
    result = run(n, sb, tmp_path, {"forced": deps_vars(n, tmp_path)}, extra_vars={"ansible_python_interpreter": str(SYSTEM_PYTHON)})
    assert result.rc == 2, result.output
    entry = assert_red(result, "forced", "dependencies", "missing_dependencies", "but ansible_python_interpreter is given as an extra variable")
    assert f"install the dependencies for {SYSTEM_PYTHON}." in entry["msg"], entry["msg"]
    assert not venv.parent.exists() and worker.alive()
