# Copyright (c) 2026, gpuops.clean_slate maintainers
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Test-only callback: append every task result to a JSON-lines file.

Tests read the real results that came back through Ansible's module
transport instead of scraping the human-oriented screen output.
"""

from __future__ import annotations

import json
import os
import time

from ansible.plugins.callback import CallbackBase

DOCUMENTATION = """
name: results_json
type: aggregate
short_description: write task results as JSON lines (tests only)
description:
  - Appends one JSON object per task result to the file named by E(GPUOPS_TEST_RESULTS).
options: {}
"""


class CallbackModule(CallbackBase):
    CALLBACK_VERSION = 2.0
    CALLBACK_TYPE = "aggregate"
    CALLBACK_NAME = "results_json"
    CALLBACK_NEEDS_ENABLED = False

    def __init__(self) -> None:
        super().__init__()
        self._path = os.environ.get("GPUOPS_TEST_RESULTS")

    def _write(self, status: str, result) -> None:
        if not self._path:
            return
        record = {
            "time": time.time(),
            "status": status,
            "host": result._host.get_name(),
            "task": result._task.get_name(),
            "action": result._task.action,
            "result": result._result,
        }
        with open(self._path, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(record, default=str) + "\n")

    def v2_runner_on_ok(self, result) -> None:
        self._write("ok", result)

    def v2_runner_on_failed(self, result, ignore_errors=False) -> None:
        self._write("failed", result)

    def v2_runner_on_skipped(self, result) -> None:
        self._write("skipped", result)

    def v2_runner_on_unreachable(self, result) -> None:
        self._write("unreachable", result)

    def v2_playbook_on_stats(self, stats) -> None:
        if not self._path:
            return
        summary = {h: stats.summarize(h) for h in sorted(stats.processed)}
        with open(self._path, "a", encoding="utf-8") as fh:
            fh.write(json.dumps({"status": "stats", "stats": summary, "custom": stats.custom}, default=str) + "\n")
