"""The built artifact: nothing from the test tree in it, and everything a user
needs works from it alone (ansible-doc, a module, the FQCN playbook)."""

from __future__ import annotations

import json
import tarfile
from pathlib import Path

from gpusim import Node
from support.ansible import VENV, VENV_PYTHON
from support.packaging import ansible, isolated_env


def test_artifact_holds_the_collection_and_no_test_or_lab_files(artifact: Path) -> None:
    with tarfile.open(artifact) as tar:
        names = set(tar.getnames())
    for needed in (
        "MANIFEST.json",
        "README.md",
        "meta/runtime.yml",
        "meta/execution-environment.yml",
        "plugins/modules/gpu_procs_kill.py",
        "plugins/modules/gpu_mem_verify.py",
        "plugins/modules/pct_exec.py",
        "plugins/inventory/proxmox.py",
        "plugins/filter/play_hosts.py",
        "plugins/filter/play_hosts.yml",
        "plugins/module_utils/_nvml.py",
        "plugins/plugin_utils/_proxmox.py",
        "plugins/plugin_utils/_proxmox_config.py",
        "roles/clean_slate/meta/argument_specs.yml",
        "roles/clean_slate/tasks/main.yml",
        "playbooks/clean_slate.yml",
        "changelogs/changelog.yaml",
        "docs/docsite/extra-docs.yml",
    ):
        assert needed in names, needed
    unwanted = [n for n in names if n.startswith(("tests", ".venv", ".build", ".ci", "ansible_collections")) or n in ("Makefile", "ansible.cfg")]
    assert unwanted == []
    assert not [n for n in names if "__pycache__" in n or n.endswith(".pyc")]
    with tarfile.open(artifact) as tar:
        manifest = json.load(tar.extractfile("MANIFEST.json"))  # type: ignore[arg-type]
    info = manifest["collection_info"]
    assert (info["namespace"], info["name"], info["version"]) == ("gpuops", "clean_slate", "0.1.0")
    assert info["license"] == ["GPL-3.0-or-later"]


def test_ansible_doc_renders_from_the_installed_artifact(installed: Path, tmp_path: Path) -> None:
    env = isolated_env(installed, tmp_path)
    for args, words in (
        (["ansible-doc", "gpuops.clean_slate.gpu_procs_kill"], "Finds every process holding the selected GPUs"),
        (["ansible-doc", "gpuops.clean_slate.gpu_mem_verify"], "Polls NVML until every selected GPU is clean"),
        (["ansible-doc", "gpuops.clean_slate.pct_exec"], "executes a command inside one of that node's LXC containers"),
        (["ansible-doc", "gpuops.clean_slate.clean_slate_node"], "Runs the phases of a clean slate on one host, in one remote execution"),
        (["ansible-doc", "gpuops.clean_slate.gpu_mode_restore"], "makes the next job fail with"),
        (["ansible-doc", "gpuops.clean_slate.gpu_job_residue"], "Finds the residue a killed SGLang, vLLM, NCCL, torch or Ray job leaves"),
        (["ansible-doc", "-t", "inventory", "gpuops.clean_slate.proxmox"], "finds the guests that use a GPU"),
        (["ansible-doc", "-t", "role", "gpuops.clean_slate.clean_slate"], "Give GPU nodes and LXC guests a verified clean slate"),
        (
            ["ansible-doc", "-t", "filter", "gpuops.clean_slate.play_hosts"],
            "Returns the host pattern unchanged when, after `--limit', it matches at least one inventory host",
        ),
    ):
        out = ansible([str(VENV / "bin" / args[0]), *args[1:]], env, tmp_path)
        assert out.returncode == 0, out.stderr
        # The page comes from the installed copy and carries the plugin's own words.
        assert str(installed / "ansible_collections" / "gpuops" / "clean_slate") in out.stdout
        assert words in " ".join(out.stdout.split()), out.stdout[:500]
    listing = ansible([str(VENV / "bin" / "ansible-doc"), "-l", "gpuops.clean_slate"], env, tmp_path)
    assert {"gpuops.clean_slate.gpu_procs_kill", "gpuops.clean_slate.gpu_mem_verify", "gpuops.clean_slate.pct_exec"} <= {
        line.split()[0] for line in listing.stdout.splitlines() if line.strip()
    }


def test_a_module_and_the_playbook_run_from_the_installed_artifact(installed: Path, tmp_path: Path) -> None:
    with Node(gpus=2) as node:
        sb = node.sandbox()
        try:
            worker = sb.spawn_worker(gpus=[1], mib=4000, title="sglang::scheduler_TP1")
            inventory = tmp_path / "hosts.yml"
            inventory.write_text(
                "gpu_nodes:\n  hosts:\n    node1:\n"
                f"      ansible_connection: local\n      ansible_python_interpreter: {VENV_PYTHON}\n"
                f"      clean_slate_device_dir: {node.dev_dir}\n      clean_slate_grace_period: 2\n"
            )
            env = isolated_env(installed, tmp_path, node.env())
            ad_hoc = ansible(
                [
                    str(VENV / "bin" / "ansible"),
                    "node1",
                    "-i",
                    str(inventory),
                    "-m",
                    "gpuops.clean_slate.gpu_mem_verify",
                    "-a",
                    "timeout=0 fail_on_dirty=false",
                ],
                env,
                tmp_path,
                sb.nsenter_prefix(),
            )
            assert ad_hoc.returncode == 0, ad_hoc.stdout + ad_hoc.stderr
            assert '"clean": false' in ad_hoc.stdout and '"used_mib": 4000' in ad_hoc.stdout
            play = ansible([str(VENV / "bin" / "ansible-playbook"), "gpuops.clean_slate.clean_slate", "-i", str(inventory)], env, tmp_path, sb.nsenter_prefix())
            assert play.returncode == 0, play.stdout + play.stderr
            assert "node1: 2/2 GPUs clean" in play.stdout
            assert not worker.alive()
        finally:
            sb.stop()
