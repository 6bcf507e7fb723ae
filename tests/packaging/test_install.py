"""The install paths a newcomer takes (issue 31): the README's build and install, run as written in a fresh clone
with the demo's virtual environment on PATH (whose .pth puts a checkout on Python's path); the artifact holds the
tracked files galaxy.yml's manifest names and none of what else lies in a checkout; the AWX project example installs
the collection without Ansible Galaxy, as AWX's project sync runs ansible-galaxy."""

from __future__ import annotations

import os
import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest
import yaml
from support.ansible import ROOT, VENV
from support.packaging import clean_env

VERSION = "0.1.0"
ARTIFACT = f"gpuops-clean_slate-{VERSION}.tar.gz"

#: What a checkout holds besides its tracked files, none of which belongs in the artifact.
UNTRACKED = (
    "notes.txt",  # a scratch file at the top
    "reports/host-a.json",  # clean_slate_report_dir=reports, run in the checkout
    "playbooks/reports/host-a.json",
    "gpuops-clean_slate-0.0.9.tar.gz",  # an older build
    ".venv/lib/python3.13/site-packages/x.py",
    ".build/dist/x.tar.gz",
    "tests/output/junk.txt",  # ansible-test's output
    "docs/results/gpu-h200x8-2027-01-01.json",  # a new hardware run, not yet committed
    "plugins/modules/__pycache__/gpu_procs_kill.cpython-313.pyc",
    "roles/clean_slate/tasks/main.yml~",  # an editor's backup
    "roles/clean_slate/tasks/.main.yml.swp",
    "changelogs/.plugin-cache.yaml",
    "tools/scratch.py",
)


def tracked(root: Path) -> list[str]:
    out = subprocess.run(["git", "-C", str(root), "ls-files", "-z"], capture_output=True, check=True).stdout.decode()
    return [p for p in out.split("\0") if p and (root / p).is_file()]


def ships(name: str) -> bool:
    """Whether a tracked file belongs in the artifact: the collection's content and its documentation, nothing of the
    tooling, the test tree or the hardware results."""
    top = name.split("/", 1)[0]
    if name in ("README.md", "CHANGELOG.md", "COPYING"):
        return True
    if name.startswith("docs/results/"):
        return False
    return top in ("meta", "changelogs", "docs", "playbooks", "plugins", "roles")


@pytest.fixture(scope="module")
def clone(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh clone of the working tree (its tracked files as they are now), as `make demo` leaves it: the checkout's
    link ansible_collections/gpuops/clean_slate, and the untracked files above."""
    dest = tmp_path_factory.mktemp("clone") / "clean_slate"
    for name in tracked(ROOT):
        target = dest / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, target)
    link = dest / "ansible_collections" / "gpuops" / "clean_slate"
    link.parent.mkdir(parents=True)
    link.symlink_to("../..")
    for name in UNTRACKED:
        (dest / name).parent.mkdir(parents=True, exist_ok=True)
        (dest / name).write_text("not part of the collection\n")
    return dest


def readme_install_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Install") :]
    block = section[section.index("```") + 3 :]
    return [line.strip() for line in block[: block.index("```")].splitlines() if line.strip()]


def test_the_readme_install_works_from_a_fresh_clone_as_written(clone: Path, tmp_path: Path) -> None:
    """The README's two commands, in the clone, with the demo's venv first on PATH: the collection lands in the user's
    collections path (it used to say "Nothing to do": the checkout itself looked installed), and nothing of the
    checkout is touched."""
    commands = readme_install_commands()
    assert commands == ["ansible-galaxy collection build", f"ansible-galaxy collection install {ARTIFACT}"], commands
    home = tmp_path / "home"
    home.mkdir()
    env = {**clean_env(), "HOME": str(home), "PATH": f"{VENV / 'bin'}:{os.environ.get('PATH', '/usr/bin:/bin')}"}
    # The trap itself: the venv's Python has a checkout (with its ansible_collections link) on its path.
    paths = subprocess.run([str(VENV / "bin" / "python"), "-c", "import sys; print('\\n'.join(sys.path))"], capture_output=True, text=True, check=True)
    assert str(ROOT) in paths.stdout.splitlines()
    outputs = []
    for command in commands:
        out = subprocess.run(command.split(), cwd=clone, env=env, capture_output=True, text=True, check=False, timeout=300)
        assert out.returncode == 0, (command, out.stdout, out.stderr)
        outputs.append(out.stdout)
    assert "Nothing to do" not in outputs[-1] and f"gpuops.clean_slate:{VERSION} was installed successfully" in outputs[-1], outputs[-1]
    installed = home / ".ansible" / "collections" / "ansible_collections" / "gpuops" / "clean_slate"
    assert (installed / "MANIFEST.json").is_file() and (installed / "roles" / "clean_slate" / "tasks" / "main.yml").is_file()
    link = clone / "ansible_collections" / "gpuops" / "clean_slate"
    assert link.is_symlink() and os.readlink(link) == "../.." and (clone / "galaxy.yml").is_file()

    # What it built: the tracked files galaxy.yml's manifest names, and none of what else lies in the checkout.
    with tarfile.open(clone / ARTIFACT) as tar:
        shipped = {m.name for m in tar.getmembers() if m.isfile()} - {"MANIFEST.json", "FILES.json"}
    assert not [n for n in shipped if n in UNTRACKED or n.startswith(("ansible_collections/", "tests/", "tools/", ".")) or "__pycache__" in n]
    assert shipped == {n for n in tracked(ROOT) if ships(n)}, sorted(shipped ^ {n for n in tracked(ROOT) if ships(n)})


def test_the_awx_project_installs_the_collection_without_galaxy(clone: Path, tmp_path: Path) -> None:
    """docs/examples/awx as an AWX project, synced as AWX syncs it (awx/playbooks/project_update.yml: ansible-galaxy in
    the project's root, the requirements file by its path, a collections path of its own): the collection comes from
    the artifact in the project; Galaxy, here a port nobody listens on, is never asked."""
    project = tmp_path / "project"
    shutil.copytree(ROOT / "docs" / "examples" / "awx", project)
    requirements = project / "collections" / "requirements.yml"
    [entry] = yaml.safe_load(requirements.read_text())["collections"]
    assert entry["type"] == "file" and entry["name"] == f"collections/{ARTIFACT}", entry
    artifact = clone / ARTIFACT
    if not artifact.exists():  # built by the test above when it ran; build it otherwise
        subprocess.run([str(VENV / "bin" / "ansible-galaxy"), "collection", "build"], cwd=clone, env=clean_env(), check=True, capture_output=True)
    shutil.copy2(artifact, project / entry["name"])
    cache = tmp_path / "cache" / "requirements_collections"
    env = {
        **clean_env(),
        "HOME": str(tmp_path),
        "ANSIBLE_COLLECTIONS_PATHS": str(cache),
        "ANSIBLE_COLLECTIONS_SCAN_SYS_PATH": "False",
        "ANSIBLE_GALAXY_SERVER": "http://127.0.0.1:9/",
        "ANSIBLE_FORCE_COLOR": "false",
    }
    cmd = [str(VENV / "bin" / "ansible-galaxy"), "collection", "install", "-r", str(requirements), "--collections-path", str(cache)]
    out = subprocess.run(cmd, cwd=project, env=env, capture_output=True, text=True, check=False, timeout=300)
    assert out.returncode == 0 and f"gpuops.clean_slate:{VERSION} was installed successfully" in out.stdout, out.stdout + out.stderr
    assert (cache / "ansible_collections" / "gpuops" / "clean_slate" / "MANIFEST.json").is_file()
    # The job template's playbook resolves against what the sync installed.
    check = subprocess.run(
        [str(VENV / "bin" / "ansible-playbook"), "--syntax-check", "-i", "localhost,", "clean_slate.yml"],
        cwd=project,
        env={**env, "ANSIBLE_COLLECTIONS_PATH": str(cache)},
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert check.returncode == 0, check.stdout + check.stderr
