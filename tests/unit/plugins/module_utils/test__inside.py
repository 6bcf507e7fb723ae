"""_inside: the startability program run inside a container through pct exec - the command line, the launch that finds
the container's python3, the deadline that kills the whole process group, and every way it can fail named in a
sentence that says what to do."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import time
import typing as t
from pathlib import Path

import pytest

from ansible_collections.gpuops.clean_slate.plugins.module_utils import _cuda_program, _inside

REQUEST = {"device_dir": "/dev", "gpus": [[2, 2, False]], "nvml_count": 1, "targets": [], "fraction": 0.9, "timeout": 10}


def test_the_command_line_hands_the_program_and_the_request_to_the_containers_shell() -> None:
    argv = _inside.argv("/usr/sbin/pct", 103, REQUEST, sudo=["/usr/bin/sudo", "-n"])
    assert argv[:8] == ["/usr/bin/sudo", "-n", "/usr/sbin/pct", "exec", "103", "--keep-env", "0", "--"]
    assert argv[8:12] == ["/bin/sh", "-c", _inside.LAUNCH, "gpuops-cuda-probe"]
    assert argv[12] == _cuda_program.source() and json.loads(argv[13]) == REQUEST and len(argv) == 14


def launch(path: str, device_dir: str) -> list[str]:
    """The in-container half of the command line, run here with ``path`` as the container's PATH."""
    request = json.dumps({**REQUEST, "device_dir": device_dir})
    return ["/usr/bin/env", "-i", f"PATH={path}", "/bin/sh", "-c", _inside.LAUNCH, _inside.NAME, _cuda_program.source(), request]


def test_the_launch_runs_the_program_with_the_first_python3_and_reads_its_answer(tmp_path) -> None:
    python3 = shutil.which("python3", path="/usr/bin:/bin")
    assert python3, "this machine's python3"
    (tmp_path / "nvidia2").write_bytes(b"")
    done = _inside.run(launch("/usr/bin:/bin", str(tmp_path)), 60)
    answer = _inside.answer_of(103, done, 60)
    assert answer["ok"] is True, answer
    assert answer["devices"]["gpus"] == {2: {"path": f"{tmp_path}/nvidia2", "ok": True, "why": None, "fault": None}} and not answer["devices"]["uvm"]["ok"]
    assert (answer["raw"], answer["left_behind"]) == ({}, []) and answer["python"]


def test_a_container_without_python3_is_named_with_what_to_do(tmp_path) -> None:
    done = _inside.run(launch(str(tmp_path), "/dev"), 60)  # a PATH with no python3 on it
    assert (done["rc"], done["timed_out"]) == (127, False) and _inside.NO_PYTHON in done["stderr"]
    answer = _inside.answer_of(103, done, 60)
    assert answer["ok"] is False and answer["why"].startswith("container 103 has no python3") and "python3-minimal" in answer["why"]


def test_at_the_deadline_the_whole_process_group_is_killed(tmp_path) -> None:
    pids = tmp_path / "pids"
    # pct and what it started (lxc-attach, the program): one process group, each ignoring SIGTERM.
    cmd = ["/bin/sh", "-c", f"trap '' TERM; sleep 60 & echo $! > {pids}; echo $$ >> {pids}; wait"]
    began = time.monotonic()
    done = _inside.run(cmd, 0.5)
    assert done["timed_out"] is True and done["rc"] == -signal.SIGKILL and time.monotonic() - began < 10
    for pid in map(int, pids.read_text().split()):
        stat = Path(f"/proc/{pid}/stat")
        assert not stat.exists() or stat.read_text().split()[2] == "Z", pid
    answer = _inside.answer_of(103, done, 15.5)
    assert answer["ok"] is False and "did not answer within 15.5 s" in answer["why"] and "pct exec 103 -- true" in answer["why"]


@pytest.mark.parametrize(
    ("done", "says"),
    [
        ({"rc": 255, "stderr": "container '103' not running!\n"}, "container 103 is not running"),
        ({"rc": 255, "stderr": "Configuration file 'nodes/pve1/lxc/103.conf' does not exist\n"}, "container 103 does not exist on node pve1"),
        ({"rc": 1, "stderr": '  File "<string>", line 57\n    f"{x}"\n         ^\nSyntaxError: invalid syntax\n'}, "older than Python 3.6"),
        ({"rc": 1, "stderr": "Traceback (most recent call last):\nMemoryError\n"}, "the probe failed in container 103 (exit status 1: MemoryError)"),
        ({"rc": 0, "stdout": "motd\n"}, "printed no answer"),
        ({"rc": 0, "stdout": _cuda_program.ANSWER + "{not json\n"}, "printed no answer"),
        ({"rc": None, "error": "[Errno 13] Permission denied: '/usr/sbin/pct'"}, "pct could not be started ([Errno 13]"),
    ],
)
def test_each_way_it_cannot_answer_is_a_sentence(done: dict[str, t.Any], says: str) -> None:
    answer = _inside.answer_of(103, {"stdout": "", "stderr": "", "elapsed_s": 0.1, "timed_out": False, **done}, 15.5)
    assert answer["ok"] is False and says in answer["why"], answer


class NoPct:
    params: t.ClassVar[dict[str, t.Any]] = {"pct_path": None}
    check_mode = False

    def get_bin_path(self, arg: str, required: bool = False, opt_dirs: list[str] | None = None) -> str | None:
        return None

    def run_command(self, args: t.Any, **kwargs: t.Any) -> tuple[int, str, str]:  # pragma: no cover - not called
        raise AssertionError(args)


def test_a_node_without_pct_cannot_enter_the_container() -> None:
    answer = _inside.runner(NoPct())(103, REQUEST, 10)
    assert answer["ok"] is False and "pct was not found" in answer["why"] and "container 103" in answer["why"]


class Node:
    """The module on a node whose pct is ``pct_path``."""

    check_mode = False

    def __init__(self, pct_path: str) -> None:
        self.params = {"pct_path": pct_path}

    def get_bin_path(self, arg: str, required: bool = False, opt_dirs: list[str] | None = None) -> str | None:  # pragma: no cover - as root
        return None


def test_what_of_the_run_outlives_pct_is_killed_before_the_verdict_and_nothing_else(tmp_path) -> None:
    """A pct that returns while a process of its run lives on (one the program's lifeline cannot reach: another session,
    stdin not the caller's pipe): the node finds it by the run's token on its command line, SIGKILLs it, and waits it
    gone. The same command line without that token (a later run's, another tool's) is left alone."""
    stray, bystander = tmp_path / "stray", tmp_path / "bystander"
    pct = tmp_path / "pct"
    # pct exec <vmid> --keep-env 0 -- <the container's command>: run it here, leaving a copy of its process behind.
    pct.write_text(f'#!/bin/sh\nshift 5\nsetsid sh -c \'trap "" TERM HUP; sleep 60; :\' "$@" </dev/null >/dev/null 2>&1 & echo $! > {stray}\nexec "$@"\n')
    pct.chmod(0o755)
    other = subprocess.Popen(["sh", "-c", "sleep 60; :", _inside.NAME, json.dumps({**REQUEST, "run": "0" * 32})], start_new_session=True)
    bystander.write_text(str(other.pid))
    try:
        answer = _inside.runner(Node(str(pct)))(103, REQUEST, 10)
        assert answer["ok"] is True, answer  # the program answered, as it does
        pid = int(stray.read_text())
        assert answer["ended"] == [pid] and answer["left"] == [], answer
        stat = Path(f"/proc/{pid}/stat")
        assert not stat.exists() or stat.read_text().split()[2] == "Z"
        assert other.poll() is None  # not of this run
        # Nothing left: nothing ended.
        pct.write_text('#!/bin/sh\nshift 5\nexec "$@"\n')
        answer = _inside.runner(Node(str(pct)))(103, REQUEST, 10)
        assert (answer["ok"], answer["ended"], answer["left"]) == (True, [], []), answer
    finally:
        other.kill()
        other.wait()
