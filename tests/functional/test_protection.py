"""Protection against the tree and group expansions: a pattern that matches this module's
ancestors (here, the test process that plays Ansible) must not pull their other children in.
Runs the real discovery in this test's private PID namespace."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from ansible_collections.gpuops.clean_slate.plugins.module_utils import _procs


def test_children_of_a_protected_ancestor_are_not_pulled_in() -> None:
    # A child of this (guarded) process, standing for Ansible's other workers: children of the module's ancestors.
    sibling = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)  # ansible-worker-for-another-host"])
    try:
        time.sleep(0.2)
        with open(f"/proc/{os.getpid()}/cmdline") as fh:
            me = " ".join(fh.read().split("\0")[:2])
        req = _procs.Request(
            gpus=[],
            all_gpus=True,
            nvml_processes={},
            use_nvml=False,
            use_device_files=False,
            patterns=_procs.compile_patterns([r"^" + me.replace("/", r"\/").replace(".", r"\.")]),
            include_children=True,
            process_group=True,
            protect=_procs.protect_list([], []),
        )
        plan = _procs.discover(req)
        targets = {c.pid for c in plan.targets}
        assert sibling.pid not in targets, [c.reasons for c in plan.targets]
        protected = {p["pid"]: p["why"] for p in plan.protected}
        assert protected[os.getpid()] == "this module's own process"
        # The same sibling is a target when it matches on its own merit.
        req.patterns = _procs.compile_patterns(["ansible-worker-for-another-host"])
        assert sibling.pid in {c.pid for c in _procs.discover(req).targets}
    finally:
        sibling.kill()
        sibling.wait()
