# Copyright (c) 2026, gpuops.clean_slate maintainers
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Benchmark-only callback: the wall time of each task, from its start to the next task's (or the play's end).

What docs/benchmarks.md's per-task tables were measured with:

    ANSIBLE_CALLBACK_PLUGINS=tools/bench/callback GPUOPS_TASKTIME=tasks.txt ansible-playbook -i <inventory> playbooks/clean_slate.yml

Each line of the file is "<seconds> <task name>"; the first ("start") is from the callback's load to the first
task, the last the total since the load. Without GPUOPS_TASKTIME it does nothing. With GPUOPS_TASKTIME_RESULTS, each
result that carries ``timings`` (clean_slate_node's profile of its own run, and the verification's inside it) is
appended there as one JSON line, so a run on a real GPU (tools/gpu/playbook_ab.py --profile) is accounted for part by
part as tools/bench/cost.py does on the simulated node.
"""

from __future__ import annotations

import json
import os
import time

from ansible.plugins.callback import CallbackBase

DOCUMENTATION = """
name: tasktime
type: aggregate
short_description: write each task's wall time to a file (benchmarks only)
description:
  - Appends one line per task, its wall time and its name, to the file named by E(GPUOPS_TASKTIME).
options: {}
"""


class CallbackModule(CallbackBase):
    CALLBACK_VERSION = 2.0
    CALLBACK_TYPE = "aggregate"
    CALLBACK_NAME = "tasktime"
    CALLBACK_NEEDS_ENABLED = False

    def __init__(self) -> None:
        super().__init__()
        self._path = os.environ.get("GPUOPS_TASKTIME")
        self._loaded = self._last = time.time()
        self._name = "start"
        self._lines: list[str] = []
        self._results = os.environ.get("GPUOPS_TASKTIME_RESULTS")

    def _mark(self, name: str) -> None:
        now = time.time()
        self._lines.append(f"{now - self._last:7.3f} {self._name}")
        self._last, self._name = now, name

    def v2_playbook_on_task_start(self, task, is_conditional) -> None:
        self._mark(task.get_name())

    def v2_runner_on_ok(self, result) -> None:
        res = result._result
        if self._results and isinstance(res.get("timings"), dict):
            verify = res.get("verify") if isinstance(res.get("verify"), dict) else {}
            row = {"elapsed_s": res.get("elapsed_s"), "timings": res["timings"], "verify": verify.get("timings") or {}}
            with open(self._results, "a", encoding="utf-8") as f:
                f.write(json.dumps(row) + "\n")

    def v2_playbook_on_stats(self, stats) -> None:
        self._mark("end")
        self._lines.append(f"{time.time() - self._loaded:7.3f} total since the callback was loaded")
        if self._path:
            with open(self._path, "a", encoding="utf-8") as f:
                f.write("\n".join(self._lines) + "\n")
