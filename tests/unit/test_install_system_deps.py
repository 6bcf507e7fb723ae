"""tools/install-system-deps, run for real with every package missing: it installs them and touches no service of
the machine. apt-get, systemctl, service, invoke-rc.d and update-rc.d are stand-ins that record their arguments (the
only stand-ins: the machine's package manager and services are not the test's to change)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tools" / "install-system-deps"
SERVICE_TOOLS = ("systemctl", "service", "invoke-rc.d", "update-rc.d", "deb-systemd-invoke", "deb-systemd-helper")


def test_setup_installs_what_is_missing_and_never_touches_a_service(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("the script installs only as root")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "calls"
    for name in ("apt-get", *SERVICE_TOOLS):
        stub = bin_dir / name
        stub.write_text(f'#!/bin/sh\necho "{name} $*" >> {log}\n')
        stub.chmod(0o755)
    # Only the stand-ins and id are on PATH, so every tool the script looks for on PATH is missing; sshd is
    # found in /usr/sbin on a machine that has it, which is the case that used to stop and disable its service.
    shutil.copy(shutil.which("id") or "/usr/bin/id", bin_dir / "id")
    done = subprocess.run(["/bin/sh", str(SCRIPT)], env={"PATH": str(bin_dir)}, capture_output=True, text=True, timeout=30, check=False)
    assert done.returncode == 0, done.stderr
    calls = log.read_text().splitlines()
    installs = [c for c in calls if c.startswith("apt-get install")]
    assert len(installs) == 1 and "strace" in installs[0] and "gcc" in installs[0], calls
    touched = [c for c in calls if c.split(" ", 1)[0] in SERVICE_TOOLS]
    assert touched == [], f"setup touched the machine's services: {touched}"
