"""_residue.report: the result's lists, counts and sizes, and the diff."""

from __future__ import annotations

import typing as t
from pathlib import Path

from ansible_collections.gpuops.clean_slate.plugins.module_utils._residue import module, report


def test_list_limit_cuts_lists_not_counts(tree: Path, request_for: t.Callable[..., module.Request]) -> None:
    r = module.run(request_for(tree, list_limit=2), check_mode=True)
    assert len(r["removed"]) == 2 and r["summary"]["removed"] == 7 and r["truncated"] is True


def test_human_sizes() -> None:
    assert [report.human(n) for n in (512, 4096, 3 * 1024**3 + 100 * 1024**2)] == ["512 B", "4.0 KiB", "3.1 GiB"]


def test_the_diff_shows_what_went_and_what_is_left() -> None:
    result = {"removed": [{"path": "/dev/shm/a"}, {"path": "/dev/shm/b"}], "errors": [{"path": "/dev/shm/c"}]}
    assert report.diff(result, check_mode=False) == {"before": "/dev/shm/a\n/dev/shm/b\n/dev/shm/c\n", "after": "/dev/shm/c\n"}
    assert report.diff(result, check_mode=True) == {"before": "/dev/shm/a\n/dev/shm/b\n", "after": ""}


def port(number: int, state: str, owners: list[dict[str, t.Any]], **kw: t.Any) -> dict[str, t.Any]:
    return {"port": number, "state": state, "container": None, "owners": owners, "connections": 0, "time_wait": 0, "remaining_s": None, **kw}


def test_a_servers_port_fails_only_when_a_process_of_that_server_listens() -> None:
    vllm = {"pid": 7, "name": "python", "listening": True, "matches": "^VLLM::"}
    web = {"pid": 8, "name": "nginx", "listening": True}
    ports = [
        port(8000, "listening", [vllm], server="vllm", name="http"),
        port(30000, "listening", [web], server="sglang", name="http"),
        port(29500, "time_wait", [], server="vllm", name="dp_master", time_wait=2),  # SO_REUSEADDR binds through it
        port(6379, "listening", [web]),  # the user's own port: any listener fails it, as before
    ]
    failures = report.problems({"listening"}, [], False, [], ports)
    assert [(reason, msg.split(" is ")[0]) for reason, msg in failures] == [("port_in_use", "port 8000 (vllm http)"), ("port_in_use", "port 6379")]
    assert "PID 7 (python), a process of the server" in failures[0][1]
    summary = {"kinds": {}, "removed": 0, "held": 0, "kept": 0, "stale": 0, "errors": 0, "zombies": 0, "non_reaping": []}
    msg = report.message(summary, ports, check_mode=False)
    assert msg == (
        "no stale residue, port 8000 (vllm http) listening (PID 7 python), port 30000 (sglang http) listening (PID 8 nginx),"
        " port 6379 listening (PID 8 nginx), 1 server port free for the next start"
    ), msg
