"""_stop: roots by their servers' patterns, resource trackers by their command lines, and a tracker's clients found by
its pipe, on a real multiprocessing resource tracker."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from ansible_collections.gpuops.clean_slate.plugins.module_utils import _stop
from ansible_collections.gpuops.clean_slate.plugins.module_utils._errors import CleanSlateError

SGLANG = {"name": "sglang", "roots": [r"-m sglang\.launch_server( |$)", r"(^|/)sglang serve( |$)"], "grace": 25}
VLLM = {"name": "vllm", "roots": [r"(^|/)vllm serve( |$)", r"-m vllm\.entrypoints\."]}


@pytest.mark.parametrize(
    ("cmdline", "fd"),
    [
        ("/usr/bin/python3 -c from multiprocessing.resource_tracker import main;main(7)", 7),
        ("/usr/bin/python3 -B -s -c from multiprocessing.resource_tracker import main;main(12)", 12),
        ("/usr/bin/python3 -c from joblib.externals.loky.backend.resource_tracker import main; main(5, 0)", 5),
        ("/usr/bin/python3 -c from loky.backend.resource_tracker import main; main(9, 1)", 9),
        ("python3 -c from multiprocessing.spawn import spawn_main; spawn_main(tracker_fd=7, pipe_handle=9) --multiprocessing-fork", None),
        ("sglang::scheduler_TP0", None),
        ("python3 tracker.py main(7)", None),
    ],
)
def test_a_tracker_is_known_by_its_command_line_and_names_its_pipe(cmdline: str, fd: int | None) -> None:
    assert _stop.tracker_fd(cmdline) == fd


def test_roots_are_told_by_their_servers_patterns_and_the_grace_defaults_to_the_kills() -> None:
    servers = _stop.parse_servers([SGLANG, VLLM], grace_period=10.0)
    assert [(s.name, s.grace) for s in servers] == [("sglang", 25.0), ("vllm", 10.0)]
    assert _stop.server_of("/usr/bin/python3 -m sglang.launch_server --model-path /m --tp-size 8", servers).name == "sglang"
    assert _stop.server_of("/usr/local/bin/sglang serve --model-path /m", servers).name == "sglang"
    assert _stop.server_of("/usr/bin/python3 /usr/local/bin/vllm serve /m --port 8000", servers).name == "vllm"
    assert _stop.server_of("/usr/bin/python3 -m vllm.entrypoints.openai.api_server --model /m", servers).name == "vllm"
    for member in ("sglang::scheduler_TP0", "sglang::detokenizer", "VLLM::EngineCore", "VLLM::Worker_TP3", "python3 -m sglang.launch_serverx"):
        assert _stop.server_of(member, servers) is None, member


@pytest.mark.parametrize(
    ("entry", "words"),
    [
        ({"name": "x", "roots": ["("]}, "servers: x: '(' is not a valid regular expression"),
        ({"name": "x", "roots": [""]}, "servers: x: an empty root pattern matches every process"),
        ({"name": "x", "roots": []}, "every server needs a name and at least one root pattern"),
        ({"name": "", "roots": ["a"]}, "every server needs a name and at least one root pattern"),
        ({"name": "x", "roots": ["a"], "grace": -1}, "servers: x: grace must be from 0 to 86400 seconds, got -1"),
        ({"name": "x", "roots": ["a"], "grace": float("nan")}, "servers: x: grace must be a finite number"),
    ],
)
def test_bad_servers_are_refused_naming_the_option(entry: dict, words: str) -> None:
    with pytest.raises(CleanSlateError) as err:
        _stop.parse_servers([entry], grace_period=10.0)
    assert err.value.reason == "bad_arguments" and err.value.details["option"] == "servers" and words in err.value.msg, err.value.msg


# A client process as a spawn-context server makes one: it starts multiprocessing's resource tracker, registers a
# semaphore in it, prints the tracker's pid and waits for its stdin to close.
CLIENT = """
import multiprocessing, sys
from multiprocessing import resource_tracker as rt
lock = multiprocessing.get_context("spawn").Lock()
rt.ensure_running()
print(rt._resource_tracker._pid, lock._semlock.name, flush=True)
sys.stdin.read()
"""


def test_a_trackers_clients_are_the_processes_holding_its_pipe_and_it_unlinks_once_they_are_gone() -> None:
    client = subprocess.Popen([sys.executable, "-c", CLIENT], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert client.stdout is not None
        tracker_text, name = client.stdout.readline().split()
        tracker = int(tracker_text)
        # The client's spawn returns once the tracker's exec is past its point of no return, which is before the kernel
        # has set the new command line up: read under load, /proc/<pid>/cmdline can still be empty for a moment.
        cmdline, deadline = "", time.monotonic() + 5
        while not cmdline.strip() and time.monotonic() < deadline:
            with open(f"/proc/{tracker}/cmdline", "rb") as fh:
                cmdline = fh.read().replace(b"\0", b" ").decode()
            time.sleep(0 if cmdline.strip() else 0.01)
        fd = _stop.tracker_fd(cmdline)
        assert fd is not None, cmdline
        pipe = _stop.pipe_of(tracker, fd)
        assert pipe is not None and pipe.startswith("pipe:[")
        assert _stop.clients(tracker, pipe) == [client.pid]
        assert os.path.exists(f"/dev/shm/sem.{name.lstrip('/')}")
        client.kill()  # the client crashes: the tracker is its pipe's last holder, so it unlinks and exits
        client.wait()
        assert _stop.clients(tracker, pipe) == []
        deadline = time.monotonic() + 10
        while os.path.exists(f"/dev/shm/sem.{name.lstrip('/')}") and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not os.path.exists(f"/dev/shm/sem.{name.lstrip('/')}")
    finally:
        client.kill()
        client.wait()


def test_a_fd_that_is_no_pipe_is_no_trackers() -> None:
    with open(os.devnull) as fh:
        assert _stop.pipe_of(os.getpid(), fh.fileno()) is None
    assert _stop.pipe_of(os.getpid(), 999999) is None
