"""The modules run as an ordinary user (become from root, as a site without sudo does it with su).

Everything else in the suite runs as root, where every /proc/PID/fd is readable and every
process can be signalled. An ordinary user sees other users' GPU processes through NVML but not
their file descriptors, and may not signal them: the modules must end what they may, leave the
rest alone without failing on EPERM, and say what they could not see or do.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

from support.ansible import local_play, run_playbook

NSVIEW = Path(__file__).resolve().parents[1] / "sim" / "gpusim" / "_nsview.py"
NOBODY = 65534


def test_modules_become_an_ordinary_user_end_its_jobs_and_report_what_they_could_not_see(node, sandbox) -> None:
    mine = sandbox.spawn_worker(gpus=[0], mib=2000, title="python3 train.py", user=NOBODY)
    theirs = sandbox.spawn_worker(gpus=[1], mib=3000, title="python3 serve.py")  # root's
    become = {"become": True, "become_user": "nobody", "become_method": "su", "become_flags": "-s /bin/sh"}
    tasks = [
        {"name": "End GPU processes", "gpuops.clean_slate.gpu_procs_kill": {"device_dir": str(node.dev_dir), "grace_period": 2}, **become},
        {
            "name": "Verify",
            "gpuops.clean_slate.gpu_mem_verify": {"device_dir": str(node.dev_dir), "timeout": 0.5, "fail_on_dirty": False},
            **become,
        },
    ]
    # The interpreters live under /root (mode 0700) on this machine: the run gets a mount namespace
    # where other users can reach them (gpusim/_nsview.py); nothing else changes.
    python = os.path.realpath(sys.executable)
    wrapper = [*sandbox.nsenter_prefix(), sys.executable, "-I", "-S", str(NSVIEW), "--expose", python, "--"]
    # The module's own temporary directory must be writable by the user it runs as.
    remote_tmp = tempfile.mkdtemp(prefix="gpuops-nobody-")
    os.chmod(remote_tmp, 0o1777)
    env = {**node.env(), "ANSIBLE_PIPELINING": "1", "ANSIBLE_REMOTE_TEMP": remote_tmp}
    try:
        run = run_playbook(local_play(tasks), inventory="localhost,", env=env, wrapper=wrapper)
    finally:
        shutil.rmtree(remote_tmp, ignore_errors=True)
    assert run.rc == 0, run.output
    kill = run.task("End GPU processes")["result"]
    # Its own job is ended...
    assert [(t["pid"], t["user"], t["outcome"]) for t in kill["targets"]] == [(mine.ns_pid, "nobody", "terminated")]
    assert not mine.alive()
    # ...root's is left alone before anything is sent (no EPERM crash), and the result says so.
    assert any(i["pid"] == theirs.ns_pid and "may not signal it" in i["why"] for i in kill["ignored"]), kill["ignored"]
    assert theirs.alive()
    notes = " ".join(kill["notes"])
    assert "could not be inspected for device files (permission); run with become: true" in notes
    assert "belong to other users and were left alone; run with become: true" in notes
    verify = run.task("Verify")["result"]
    assert verify["clean"] is False
    gpus = {g["index"]: g for g in verify["gpus"]}
    assert gpus[0]["clean"] is True
    assert gpus[1]["diagnosis"] == "busy" and f"{theirs.ns_pid} (" in gpus[1]["detail"]
    assert any("could not be inspected (permission)" in n for n in verify["notes"])
