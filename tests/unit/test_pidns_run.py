"""tools/pidns-run: a private /tmp and /dev/shm that still show the run's own checkout.

CI and people clone under /tmp; the fresh tmpfs on /tmp must not hide the work tree (cwd) or the
command being run, while everything else in /tmp stays out of sight.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

PIDNS_RUN = Path(__file__).resolve().parents[2] / "tools" / "pidns-run"


def test_checkout_under_tmp_stays_visible_and_the_rest_of_tmp_does_not() -> None:
    with tempfile.TemporaryDirectory(prefix="gpuops-checkout-", dir="/tmp") as work, tempfile.NamedTemporaryFile(prefix="gpuops-other-", dir="/tmp") as other:
        (Path(work) / "marker").write_text("from the checkout\n")
        script = Path(work) / "bin" / "show"
        script.parent.mkdir()
        script.write_text("#!/bin/sh\ncat marker\nls -a /tmp\nls /dev/shm | wc -l\n")
        script.chmod(0o755)
        proc = subprocess.run([sys.executable, str(PIDNS_RUN), str(script)], cwd=work, capture_output=True, text=True, timeout=60, check=False)
        assert proc.returncode == 0, proc.stderr
        lines = proc.stdout.split()
        assert lines[:3] == ["from", "the", "checkout"]
        assert os.path.basename(work) in lines
        assert os.path.basename(other.name) not in lines, "the rest of /tmp must be private"
        assert lines[-1] == "0", "/dev/shm must be a fresh tmpfs"


def test_command_under_tmp_is_found_from_elsewhere() -> None:
    with tempfile.TemporaryDirectory(prefix="gpuops-tool-", dir="/tmp") as work:
        script = Path(work) / "hello"
        script.write_text("#!/bin/sh\necho hello from $(pwd)\n")
        script.chmod(0o755)
        proc = subprocess.run([sys.executable, str(PIDNS_RUN), str(script)], cwd="/", capture_output=True, text=True, timeout=60, check=False)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.strip() == "hello from /"
