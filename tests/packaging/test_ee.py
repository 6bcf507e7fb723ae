"""The execution environment: ansible-builder's view of the collection agrees
with meta/, and docs/execution-environment.yml makes a build context whose
galaxy stage installs the collection (run here without a container engine)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import yaml
from support.ansible import ROOT, VENV
from support.packaging import clean_env


def builder(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(VENV / "bin" / "ansible-builder"), *args], cwd=cwd, capture_output=True, text=True, check=False, timeout=120)


def requirement_lines(path: Path) -> list[str]:
    return [line.strip() for line in path.read_text().splitlines() if line.strip() and not line.lstrip().startswith("#")]


def test_introspect_agrees_with_meta(installed: Path) -> None:
    meta = yaml.safe_load((ROOT / "meta" / "execution-environment.yml").read_text())
    assert meta["dependencies"] == {"python": "meta/ee-requirements.txt", "system": "meta/ee-bindep.txt"}
    out = builder("introspect", str(installed), cwd=installed)
    assert out.returncode == 0, out.stderr
    data = yaml.safe_load(out.stdout.split("\n", 1)[1])
    wanted_python = requirement_lines(ROOT / "meta" / "ee-requirements.txt")
    wanted_system = requirement_lines(ROOT / "meta" / "ee-bindep.txt")
    found_python = [entry for entry in data["python"] if "gpuops.clean_slate" in str(entry)]
    found_system = [entry for entry in data["system"] if "gpuops.clean_slate" in str(entry)]
    # Entry for entry, as ansible-builder attributes them (today both lists are empty on purpose,
    # see the note at the end; test_introspect_reads_the_meta_files_it_is_pointed_at proves the
    # files are read, so an entry added to meta/ must show up here).
    tag = "  # from collection gpuops.clean_slate"
    assert found_python == [w + tag for w in wanted_python]
    assert found_system == [w + tag for w in wanted_system]


def test_introspect_reads_the_meta_files_it_is_pointed_at(installed: Path, tmp_path: Path) -> None:
    # The files above declare nothing; prove ansible-builder does read them, through a copy that declares one of each.
    copy = tmp_path / "collections"
    shutil.copytree(installed, copy, symlinks=True)
    meta = copy / "ansible_collections" / "gpuops" / "clean_slate" / "meta"
    (meta / "ee-requirements.txt").write_text((meta / "ee-requirements.txt").read_text() + "jmespath>=1.0\n")
    (meta / "ee-bindep.txt").write_text((meta / "ee-bindep.txt").read_text() + "openssh-clients [platform:rpm]\n")
    out = builder("introspect", str(copy), cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    data = yaml.safe_load(out.stdout.split("\n", 1)[1])
    assert [e for e in data["python"] if "gpuops.clean_slate" in str(e)] == ["jmespath>=1.0  # from collection gpuops.clean_slate"]
    assert [e for e in data["system"] if "gpuops.clean_slate" in str(e)] == ["openssh-clients [platform:rpm]  # from collection gpuops.clean_slate"]


def test_build_context_installs_the_collection(artifact: Path, tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    shutil.copy(ROOT / "docs" / "execution-environment.yml", tmp_path / "docs")
    shutil.copy(artifact, tmp_path / artifact.name)
    out = builder("create", "-f", "docs/execution-environment.yml", "-c", "context", cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    context = tmp_path / "context"
    containerfile = next(p for p in (context / "Containerfile", context / "Dockerfile") if p.exists()).read_text()
    assert "ansible-galaxy collection install" in containerfile
    assert "FROM quay.io/ansible/awx-ee:latest" in containerfile or "quay.io/ansible/awx-ee:latest" in containerfile
    assert (context / "_build" / "collections" / artifact.name).exists()
    requirements = yaml.safe_load((context / "_build" / "requirements.yml").read_text())
    assert requirements["collections"] == [{"name": f"collections/{artifact.name}", "type": "file"}]
    # The image's galaxy stage, run here: from /build, install the requirements.
    dest = tmp_path / "image-collections"
    run = subprocess.run(
        [str(VENV / "bin" / "ansible-galaxy"), "collection", "install", "--offline", "--force", "-r", "requirements.yml", "-p", str(dest)],
        cwd=context / "_build",
        env=clean_env(),
        capture_output=True,
        text=True,
        check=False,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert (dest / "ansible_collections" / "gpuops" / "clean_slate" / "plugins" / "modules" / "gpu_procs_kill.py").exists()
