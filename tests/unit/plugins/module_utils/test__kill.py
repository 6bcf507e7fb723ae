"""_kill: rounds of discovery and escalation against real processes (run under tools/pidns-run).

The targets are orphans (tests/support/orphans.py): this test process plays the module, and discovery
protects what the module itself started.
"""

from __future__ import annotations

import os
import sys
import textwrap
import time
import typing as t

import pytest
from support.orphans import end, gone, spawn_orphan

from ansible_collections.gpuops.clean_slate.plugins.module_utils import _kill, _procs, _signals, _stop
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


# ---------------------------------------------------------------------- the stop in a server's own order
# A server's root, shaped as SGLang's launcher stops: on SIGTERM it waits a moment (its watchdog's poll), then ends
# its members itself (kill_process_tree) and exits. Its members record a SIGTERM they get (the module must not send
# them one while their root has its grace) and exit on it.
ROOT = textwrap.dedent(
    """
    import os, signal, subprocess, sys, time
    marker, ignore = sys.argv[1], sys.argv[2] == "ignore"
    member = "import os, signal, sys, time\\n" \\
        "def term(*_):\\n    open(sys.argv[1] + '.term', 'w').close()\\n    os._exit(0)\\n" \\
        "signal.signal(signal.SIGTERM, term)\\nopen(sys.argv[1] + '.up', 'w').close()\\nwhile True: time.sleep(1)\\n"
    kids = [subprocess.Popen([sys.executable, "-c", member, f"{marker}-m{i}", "member"]) for i in range(2)]
    flag = []
    signal.signal(signal.SIGTERM, signal.SIG_IGN if ignore else (lambda *_: flag.append(1)))
    while not flag:
        time.sleep(0.05)
    time.sleep(0.3)
    for k in kids:
        k.kill()
    for k in kids:
        k.wait()
    sys.exit(0)
    """
)


def start_server(tmp_path, ignore: bool = False) -> tuple[int, str]:
    marker = str(tmp_path / f"srv-{os.getpid()}-{time.monotonic_ns()}")
    pid = spawn_orphan([sys.executable, "-c", ROOT, marker, "ignore" if ignore else "stop"], ready=marker.encode())
    deadline = time.monotonic() + 10
    while len([n for n in os.listdir(tmp_path) if n.endswith(".up")]) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    return pid, marker


def stop_kill(marker: str, **kw: t.Any) -> _kill.Kill:
    servers = _stop.parse_servers([{"name": "demo", "roots": [r"import os, signal, subprocess, sys, time"], "grace": kw.pop("grace", 5)}], 1.0)
    return _kill.Kill(lambda: _procs.discover(request(marker)), grace_period=1, kill_timeout=3, deadline=20, servers=servers, **kw)


def test_a_live_root_is_stopped_first_alone_and_its_own_stop_ends_its_tree(tmp_path) -> None:
    pid, marker = start_server(tmp_path)
    kill = stop_kill(marker)
    kill.run()
    by = {e.victim.pid: e.record() for e in kill.ended}
    assert by[pid]["step"] == "root" and by[pid]["server"] == "demo" and by[pid]["grace"] == 5.0
    assert (by[pid]["outcome"], by[pid]["ended_by"], by[pid]["signals_sent"]) == ("terminated", "own_stop", ["TERM"])
    members = [r for p, r in by.items() if p != pid]
    assert len(members) == 2 and all((r["step"], r["outcome"], r["ended_by"], r["signals_sent"]) == ("tree", "stopped", "server_stop", []) for r in members)
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".term")]  # no member ever got a SIGTERM
    assert alive_with(marker) == [] and kill.rounds == 1 and not kill.remaining


def test_a_root_that_does_not_stop_within_its_grace_is_killed_with_the_rest(tmp_path) -> None:
    pid, marker = start_server(tmp_path, ignore=True)
    began = time.monotonic()
    kill = stop_kill(marker, grace=0.5)
    kill.run()
    by = {e.victim.pid: e.record() for e in kill.ended}
    assert (by[pid]["outcome"], by[pid]["ended_by"], by[pid]["signals_sent"]) == ("killed", "KILL", ["TERM", "KILL"])
    members = [r for p, r in by.items() if p != pid]
    assert all((r["outcome"], r["ended_by"], r["signals_sent"]) == ("terminated", "TERM", ["TERM"]) for r in members), members
    assert time.monotonic() - began >= 0.5 and alive_with(marker) == []


def test_without_a_live_root_the_rest_is_ended_at_once(tmp_path) -> None:
    pid, marker = start_server(tmp_path)
    end(pid)  # the crash: the root SIGKILLed, its members reparented and left
    kill = stop_kill(marker)
    began = time.monotonic()
    kill.run()
    records = [e.record() for e in kill.ended]
    assert len(records) == 2 and all((r["step"], r["ended_by"]) == ("tree", "TERM") for r in records), records
    assert time.monotonic() - began < 3  # no root's grace to wait out
    assert len([p for p in os.listdir(tmp_path) if p.endswith(".term")]) == 2


# A client of a resource tracker, shaped as a GPU worker whose teardown outlasts the grace period: it ignores SIGTERM,
# registers a semaphore with multiprocessing's resource tracker (spawn context) and waits.
CLIENT = textwrap.dedent(
    """
    import multiprocessing, signal, sys, time
    from multiprocessing import resource_tracker as rt
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    lock = multiprocessing.get_context("spawn").Lock()
    rt.ensure_running()
    open(sys.argv[1] + "." + lock._semlock.name.lstrip("/"), "w").close()
    while True:
        time.sleep(1)
    """
)


def test_a_resource_tracker_is_spared_while_its_client_lives_and_unlinks_its_semaphore_itself(tmp_path) -> None:
    marker = str(tmp_path / f"client-{os.getpid()}")
    client = spawn_orphan([sys.executable, "-c", CLIENT, marker], ready=marker.encode())
    deadline = time.monotonic() + 10
    while not [n for n in os.listdir(tmp_path) if n.startswith("client-") and "mp-" in n] and time.monotonic() < deadline:
        time.sleep(0.01)
    [sem] = [n.split(".", 1)[1] for n in os.listdir(tmp_path) if n.startswith("client-")]
    assert os.path.exists(f"/dev/shm/sem.{sem}")
    req = _procs.Request(
        gpus=[], all_gpus=True, nvml_processes={}, use_nvml=False, use_device_files=False, patterns=_procs.compile_patterns([marker]), include_children=True
    )
    kill = _kill.Kill(lambda: _procs.discover(req), grace_period=0.5, kill_timeout=3, deadline=10, spare_trackers=True)
    kill.run()
    by = {e.step: e.record() for e in kill.ended}
    assert set(by) == {"tree", "tracker"}, by
    assert by["tree"]["pid"] == client and by["tree"]["signals_sent"] == ["TERM", "KILL"]
    # Never signalled: it saw its last client go, unlinked what that client registered and exited on its own.
    assert (by["tracker"]["signals_sent"], by["tracker"]["outcome"], by["tracker"]["ended_by"]) == ([], "stopped", "own_exit"), by["tracker"]
    assert not os.path.exists(f"/dev/shm/sem.{sem}")


def test_a_teardown_that_moves_is_waited_for_past_the_deadline_and_one_that_stalls_is_not() -> None:
    clock = [0.0]
    moves = iter([True, True, True, False, False, False, False, False, False, False, False])
    v = _signals.Victim(pid=1, identity=None)
    v.exiting_since = 0.0

    def wait_exit(victims: list[_signals.Victim], deadline: float, start: float, outcome: str, clock_fn: t.Any) -> None:
        clock[0] = deadline  # nothing exits: time passes to the slice's end

    real = _signals.wait_exit
    _signals.wait_exit = wait_exit  # type: ignore[assignment]
    try:
        _signals.wait_teardown([v], deadline=2.0, start=0.0, clock=lambda: clock[0], progress=lambda _v: next(moves), cap=60.0, stall=1.0)
    finally:
        _signals.wait_exit = real  # type: ignore[assignment]
    # Moves at 0.25 and 0.5 s, then none: waited until the deadline (2 s), not beyond (the last move was more than the
    # stall window before it).
    assert clock[0] == 2.0
    clock[0] = 0.0
    moves = iter([True] * 20 + [False] * 20)
    _signals.wait_exit = wait_exit  # type: ignore[assignment]
    try:
        _signals.wait_teardown([v], deadline=2.0, start=0.0, clock=lambda: clock[0], progress=lambda _v: next(moves), cap=60.0, stall=1.0)
    finally:
        _signals.wait_exit = real  # type: ignore[assignment]
    # It moved every 0.25 s until 4.75 s: waited past the deadline, until 1 s (the stall window) after its last move.
    assert clock[0] == pytest.approx(5.75)
