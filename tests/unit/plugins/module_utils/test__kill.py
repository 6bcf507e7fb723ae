"""_kill: rounds of discovery and escalation against real processes (run under tools/pidns-run).

The targets are orphans (tests/support/orphans.py): this test process plays the module, and discovery
protects what the module itself started.
"""

from __future__ import annotations

import os
import sys
import textwrap
import time

import pytest
from support.orphans import end, gone, spawn_orphan

from ansible_collections.gpuops.clean_slate.plugins.module_utils import _kill, _procs, _signals
from ansible_collections.gpuops.clean_slate.plugins.module_utils._errors import CleanSlateError

# A launcher that ignores SIGTERM (so do the children it forks and execs) and starts a child every 50 ms.
LAUNCHER = textwrap.dedent(
    """
    import signal, subprocess, sys, time
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    while True:
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", sys.argv[1]])
        time.sleep(0.05)
    """
)


def alive_with(word: str) -> list[int]:
    """Live (not zombie) processes whose command line contains ``word``."""
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/cmdline", "rb") as fh:
                cmdline = fh.read()
            with open(f"/proc/{name}/stat") as fh:
                state = fh.read().rpartition(")")[2].split()[0]
        except OSError:
            continue
        if word.encode() in cmdline and state not in ("Z", "X"):
            out.append(int(name))
    return out


def request(pattern: str) -> _procs.Request:
    return _procs.Request(gpus=[], all_gpus=True, nvml_processes={}, use_nvml=False, use_device_files=False, patterns=_procs.compile_patterns([pattern]))


@pytest.fixture
def launcher():
    started: list[int] = []

    def start(marker: str, name: str = "launcher") -> int:
        pid = spawn_orphan([sys.executable, "-c", LAUNCHER + f"# {name}", marker], ready=marker.encode())
        started.append(pid)
        deadline = time.monotonic() + 10
        while len(alive_with(marker)) < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        return pid

    yield start
    for pid in started:
        end(pid)


def test_children_forked_during_the_grace_period_are_ended_in_later_rounds(launcher) -> None:
    marker = f"late-child-{os.getpid()}"
    pid = launcher(marker)
    kill = _kill.Kill(lambda: _procs.discover(request(marker)), grace_period=0.5, kill_timeout=2, deadline=10)
    kill.run()
    assert gone(pid, 5)
    assert kill.rounds >= 2 and not kill.remaining and not kill.deadline_passed
    late = [e for e in kill.ended if e.round > 1]
    assert late, [e.record() for e in kill.ended]
    # Each ignored SIGTERM and needed SIGKILL, and every signal is recorded.
    assert all(e.victim.outcome in ("killed", "vanished") for e in kill.ended)
    assert all(e.victim.signals_sent in (["TERM", "KILL"], []) for e in kill.ended)
    time.sleep(0.2)
    assert alive_with(marker) == []


def test_what_still_appears_at_the_deadline_is_remaining(launcher) -> None:
    marker = f"endless-child-{os.getpid()}"
    # The launcher itself does not match: its children keep coming.
    pid = launcher(marker, name="not-a-target")
    seen: set[int] = set()

    def discover() -> _procs.Plan:
        # On a loaded machine the launcher can fall behind, and a discovery that finds nothing new ends the
        # kill early (correctly): wait until a child the kill has not seen yet exists, so that every round,
        # as in the scenario, finds one.
        until = time.monotonic() + 10
        while not (set(alive_with(marker)) & set(alive_with("time.sleep(60)"))) - seen - {pid} and time.monotonic() < until:
            time.sleep(0.01)
        plan = _procs.discover(request(f"time.sleep\\(60\\).*{marker}"))
        seen.update(c.pid for c in plan.targets)
        return plan

    kill = _kill.Kill(discover, grace_period=0.3, kill_timeout=2, deadline=1.0)
    start = time.monotonic()
    kill.run()
    assert kill.deadline_passed and kill.remaining
    assert all(marker in c.facts.cmdline for c in kill.remaining)
    assert pid not in {e.candidate.pid for e in kill.ended}
    # No round starts after the deadline; the last round's SIGKILL still gets its wait. A generous bound for a loaded CI
    # machine: the point is that it stopped, not how fast.
    assert time.monotonic() - start < 1.0 + 0.3 + 2 + 10


def test_every_signal_is_recorded_before_a_failure(monkeypatch) -> None:
    marker = f"failing-{os.getpid()}"
    victim = spawn_orphan([sys.executable, "-c", "import time; time.sleep(60)", marker], ready=marker.encode())

    def broken(*_args, **_kwargs):
        raise RuntimeError("the wait broke")

    monkeypatch.setattr(_signals, "wait_exit", broken)
    kill = _kill.Kill(lambda: _procs.discover(request(marker)), grace_period=1, kill_timeout=1)
    with pytest.raises(RuntimeError):
        kill.run()
    assert [(e.candidate.pid, e.victim.signals_sent) for e in kill.ended] == [(victim, ["TERM"])]
    assert kill.signalled() and kill.targets()[0]["signals_sent"] == ["TERM"]
    assert gone(victim, 5)


def ended(pid: int, outcome: str | None, signals: list[str], round_: int = 1) -> _kill.Ended:
    f = _procs.ProcFacts(pid=pid, comm="w", cmdline="w", exe="/w", uid=0, ppid=1, pgid=pid, starttime=1, state="S", kernel=False)
    return _kill.Ended(_procs.Candidate(facts=f), _signals.Victim(pid=pid, identity=None, signals_sent=signals, outcome=outcome), round_)


def test_the_result_counts_only_what_was_ended_and_warns_about_what_it_could_not_see() -> None:
    kill = _kill.Kill(_procs.Plan)
    kill.rounds = 2
    kill.unreadable = 3
    kill.protected = [
        {"pid": 7, "name": "nv-hostengine", "why": "protected daemon (nv-hostengine)", "holds_gpu_memory": True, "gpus": [1], "used_mib": 500},
        {"pid": 8, "name": "sshd", "why": "protected daemon (sshd)"},
    ]
    runs = [ended(10, "terminated", ["TERM"]), ended(11, "vanished", []), ended(12, "killed", ["TERM", "KILL"], 2)]
    result, reason, warnings = _kill.outcome(kill, runs, False, 10, 1.5, [], ["NVML cannot be read (x)"], diff=True)
    assert reason is None
    assert result["summary"] == {
        "terminated": 1,
        "killed": 1,
        "exited": 0,
        "vanished": 1,
        "unkillable": 0,
        "teardown": 0,
        "teardown_s": 0.0,
        "signals": {"TERM": 2, "KILL": 1},
        "rounds": 2,
        "respawned": 1,
    }
    assert result["msg"] == (
        "ended 2 process(es) (1 on their first signal, 1 needed SIGKILL); 1 had exited before their signal;"
        " 1 of them appeared during the kill and were ended in 2 rounds;"
        " 2 protected, 1 of them holding GPU memory (see the warnings)"
    )
    assert warnings[0] == "NVML cannot be read (x)"
    assert warnings[1].startswith("3 process(es) could not be inspected for device files (permission)")
    assert warnings[2].startswith("PID 7 (nv-hostengine) holds 500 MiB on GPU 1 and is not ended: protected daemon (nv-hostengine).")
    assert result["diff"] == {"before": "10 w\n11 w\n12 w\n", "after": ""}


def test_remaining_processes_fail_the_run() -> None:
    kill = _kill.Kill(_procs.Plan)
    kill.rounds, kill.deadline_passed = 3, True
    kill.remaining = [ended(20, None, []).candidate]
    result, reason, _warnings = _kill.outcome(kill, [ended(10, "killed", ["TERM", "KILL"])], False, 10, 41.0, [], [], diff=False)
    assert reason == "holders_remain"
    assert result["remaining"][0]["pid"] == 20
    assert result["msg"].startswith(
        "1 process(es) were still there after 41.0 s and 3 round(s) of ending (0 process(es) appeared during the kill): PID 20 (w)."
    )


def test_where_is_compiled_only_when_given_and_a_bad_one_names_the_option() -> None:
    assert _kill.compile_where(None) is None and _kill.compile_where("") is None
    assert _kill.compile_where("[?used_mib > `1024`]").search([{"used_mib": 2048}, {"used_mib": 10}]) == [{"used_mib": 2048}]
    with pytest.raises(CleanSlateError) as err:
        _kill.compile_where("[?used_mib >")
    assert (err.value.reason, err.value.details["option"]) == ("bad_arguments", "where")
    assert err.value.msg.startswith("where: '[?used_mib >' is not a valid JMESPath expression")


def test_options_are_refused_before_any_container_is_looked_up(tmp_path) -> None:
    looked_up = []
    p = {
        "grace_period": 1,
        "kill_timeout": 1,
        "deadline": None,
        "probe_timeout": 10,
        "containers": [42],
        "device_dir": str(tmp_path),
        "pct_path": None,
        "discovery": ["device_files"],
        "patterns": [],
    }
    with pytest.raises(CleanSlateError) as err:
        _kill.build_request(p, lambda: looked_up.append(1) or [], [], [])
    assert err.value.details["option"] == "containers" and looked_up == []


def test_a_run_that_failed_before_its_kill_lists_no_signal() -> None:
    run = _kill.ModuleRun(list)
    assert run.details("bad_arguments") == {"targets": [], "protected": []}
