"""Fixtures for the packaging tests: the built collection artifact, installed
into an empty collections path, used with no reference to the checkout."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from support.ansible import ROOT, VENV
from support.packaging import clean_env

VERSION = "0.1.0"


@pytest.fixture(scope="session")
def artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    subprocess.run(
        [str(VENV / "bin" / "ansible-galaxy"), "collection", "build", "--force", "--output-path", str(out)],
        cwd=ROOT,
        check=True,
        capture_output=True,
    )
    path = out / f"gpuops-clean_slate-{VERSION}.tar.gz"
    assert path.exists()
    return path


@pytest.fixture(scope="session")
def installed(artifact: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A collections path holding only the installed artifact."""
    dest = tmp_path_factory.mktemp("collections")
    subprocess.run(
        [str(VENV / "bin" / "ansible-galaxy"), "collection", "install", "--offline", "--force", "-p", str(dest), str(artifact)],
        check=True,
        capture_output=True,
        cwd=dest,
        env=clean_env(),
    )
    assert (dest / "ansible_collections" / "gpuops" / "clean_slate" / "MANIFEST.json").exists()
    return dest
