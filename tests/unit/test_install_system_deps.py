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
    for name in ("apt-get", "dpkg-deb", *SERVICE_TOOLS):
        stub = bin_dir / name
        # apt-get download leaves a .deb of each package in the directory it runs in, as the real one does.
        fetch = 'if [ "$1" = download ]; then shift; for a in "$@"; do case $a in -*) ;; *) : > "${a}_1_amd64.deb";; esac; done; fi\n'
        stub.write_text(f'#!/bin/sh\necho "{name} $*" >> {log}\n' + (fetch if name == "apt-get" else ""))
        stub.chmod(0o755)
    # Only the stand-ins and a few shell tools are on PATH, so every package the script looks for on PATH is missing;
    # sshd is found in /usr/sbin on a machine that has it, which is the case that used to stop and disable its service.
    for tool in ("id", "dirname", "mktemp", "mkdir", "rm"):
        shutil.copy(shutil.which(tool) or f"/usr/bin/{tool}", bin_dir / tool)
    # A checkout of its own, whose .build/debian holds nothing yet.
    script = tmp_path / "checkout" / "tools" / "install-system-deps"
    script.parent.mkdir(parents=True)
    shutil.copy(SCRIPT, script)
    done = subprocess.run(["/bin/sh", str(script)], env={"PATH": str(bin_dir)}, capture_output=True, text=True, timeout=30, check=False)
    assert done.returncode == 0, done.stderr
    calls = log.read_text().splitlines()
    installs = [c for c in calls if c.startswith("apt-get install")]
    assert len(installs) == 1 and "strace" in installs[0] and "gcc" in installs[0], calls
    # Prometheus and node_exporter are unpacked into the checkout, never installed (their packages start services).
    assert "prometheus" not in installs[0]
    assert [c for c in calls if c.startswith("apt-get download")] == ["apt-get download -qq prometheus prometheus-node-exporter"], calls
    unpacked = sorted(c for c in calls if c.startswith("dpkg-deb"))
    target = tmp_path / "checkout" / ".build" / "debian"
    assert [(c.split()[1], Path(c.split()[2]).name, c.split()[3]) for c in unpacked] == [
        ("-x", "prometheus-node-exporter_1_amd64.deb", str(target)),
        ("-x", "prometheus_1_amd64.deb", str(target)),
    ], calls
    touched = [c for c in calls if c.split(" ", 1)[0] in SERVICE_TOOLS]
    assert touched == [], f"setup touched the machine's services: {touched}"
