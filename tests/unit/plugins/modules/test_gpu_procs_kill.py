"""gpu_procs_kill's main() in-process: a failure after signals were sent still lists every signal sent.

The failure is forced where no real run can force it (the wait after the first signal breaks, discovery
breaks in a later round); the victims are real processes, orphans so that this test process can play
the module (tests/support/orphans.py). Run under tools/pidns-run.
"""

from __future__ import annotations

import json
import os
import sys

import pytest
from ansible.module_utils.testing import patch_module_args
from support.orphans import end, gone, spawn_orphan

from ansible_collections.gpuops.clean_slate.plugins.module_utils import _errors, _procs, _signals
from ansible_collections.gpuops.clean_slate.plugins.modules import gpu_procs_kill


def run_main(args: dict, capsys) -> tuple[int, dict]:
    with patch_module_args(args), pytest.raises(SystemExit) as exc:
        gpu_procs_kill.main()
    return int(exc.value.code or 0), json.loads(capsys.readouterr().out)


@pytest.fixture
def victim():
    marker = f"unit-victim-{os.getpid()}"
    pid = spawn_orphan([sys.executable, "-c", "import time; time.sleep(60)", marker], ready=marker.encode())
    yield pid, marker
    end(pid)


def args(marker: str) -> dict:
    return {"patterns": [marker], "discovery": [], "allow_name_only": True, "grace_period": 1, "kill_timeout": 1}


def test_an_unexpected_failure_after_the_first_signal_lists_it(victim, capsys, monkeypatch) -> None:
    pid, marker = victim

    def broken(*_args, **_kwargs):
        raise RuntimeError("the wait broke")

    monkeypatch.setattr(_signals, "wait_exit", broken)
    code, result = run_main(args(marker), capsys)
    assert code == 1
    assert result["reason"] == "internal_error"
    assert result["msg"].startswith("gpu_procs_kill failed unexpectedly after it had sent 1 signal(s) to 1 process(es): the wait broke.")
    assert [(t["pid"], t["signals_sent"], t["round"]) for t in result["targets"]] == [(pid, ["TERM"], 1)]
    assert gone(pid, 5)


def test_a_failure_in_a_later_round_keeps_the_first_rounds_signals(victim, capsys, monkeypatch) -> None:
    pid, marker = victim
    real = _procs.discover
    calls = []

    def flaky(req):
        calls.append(1)
        if len(calls) > 1:
            raise _errors.CleanSlateError("where: the expression failed on the candidate records: boom", reason="bad_arguments")
        return real(req)

    monkeypatch.setattr(_procs, "discover", flaky)
    code, result = run_main(args(marker), capsys)
    assert code == 1
    assert (result["reason"], result["msg"]) == ("bad_arguments", "where: the expression failed on the candidate records: boom")
    assert [(t["pid"], t["signals_sent"], t["outcome"]) for t in result["targets"]] == [(pid, ["TERM"], "terminated")]


def test_nothing_is_signalled_when_the_input_is_refused(victim, capsys) -> None:
    pid, marker = victim
    code, result = run_main({**args(marker), "kill_timeout": float("nan")}, capsys)
    assert (code, result["reason"], result["targets"]) == (1, "bad_arguments", [])
    assert os.path.exists(f"/proc/{pid}")
