"""_trees: which sessions and process groups of the targets are entered, over process tables shaped like the real
servers' (pids chosen far above any real one, so the PID-1 check reads no real process)."""

from __future__ import annotations

import typing as t
from dataclasses import dataclass

from ansible_collections.gpuops.clean_slate.plugins.module_utils import _trees


@dataclass
class F:
    pid: int
    pgid: int
    sid: int
    comm: str = "python3"
    cmdline: str = ""
    kernel: bool = False


def table(*rows: F) -> dict[int, F]:
    return {f.pid: f for f in rows}


def members(
    facts: dict[int, F], roots: t.Iterable[int], guarded: t.Container[int] = (), gpus: dict[int, str] | None = None
) -> tuple[dict[int, str], list[dict[str, t.Any]]]:
    held = gpus or {}
    return _trees.members(facts, roots, guarded, held.get)


# An SGLang tree after its launcher (900001) died: each scheduler leads a session of its own; the resource tracker
# stays in the dead launcher's session and group.
SGLANG = table(
    F(900002, 900001, 900001, cmdline="python3 -c from multiprocessing.resource_tracker import main;main(6)"),
    F(900010, 900010, 900010, cmdline="sglang::scheduler_TP0"),
    F(900011, 900010, 900010, cmdline="python3 -m torch._inductor.compile_worker"),  # its compile worker, reparented
    F(900020, 900020, 900020, cmdline="sglang::scheduler_TP1"),
)
# A vLLM tree whose API server (900100) died with its engine core: the workers and the tracker are in its group.
VLLM = table(
    F(900101, 900100, 900100, cmdline="python3 -c from multiprocessing.resource_tracker import main;main(6)"),
    F(900110, 900100, 900100, cmdline="VLLM::Worker_TP0"),
    F(900111, 900100, 900100, cmdline="VLLM::Worker_TP1"),
)


def test_a_session_a_target_leads_is_entered_a_dead_launchers_session_is_not() -> None:
    added, left_out = members(SGLANG, [900010, 900020])
    assert added == {900011: "in the session of PID 900010 (sglang::scheduler_TP0), which a target leads"}
    assert left_out == []  # the tracker shares no session or group with a target


def test_a_group_whose_leader_died_is_entered() -> None:
    added, _unused = members(VLLM, [900110, 900111])
    assert added == {900101: "in process group 900100 of PID 900110 (VLLM::Worker_TP0), whose leader has exited"}


def test_a_live_leader_that_is_no_target_keeps_its_session_and_group_closed() -> None:
    # The same tree under a live login shell (or supervisor) that leads the session and the group.
    shell = table(F(900100, 900100, 900100, comm="bash", cmdline="-bash"), *VLLM.values())
    assert members(shell, [900110, 900111]) == ({}, [])
    # A pid reused by a process of another session is no leader: the group counts as leaderless.
    reused = table(F(900100, 900500, 900500, cmdline="sleep 100"), *VLLM.values())
    assert 900101 in members(reused, [900110])[0]


def test_a_tree_holding_a_guarded_process_or_an_init_is_never_entered() -> None:
    assert members(VLLM, [900110], guarded={900101}) == ({}, [])
    # An init (pid 1) in the group: a container's init that started the server in its own group.
    with_init = table(F(1, 900100, 900100, comm="init"), *VLLM.values())
    assert members(with_init, [900110]) == ({}, [])


def test_with_a_gpu_subset_a_tree_running_on_other_gpus_is_not_ended() -> None:
    added, left_out = members(VLLM, [900111], gpus={900110: "GPU 0"})
    assert added == {}
    why = "in process group 900100 of PID 900111 (VLLM::Worker_TP1), whose leader has exited, but"
    assert {r["pid"]: r["why"] for r in left_out} == {
        900101: f"{why} PID 900110 of its tree holds GPU 0, which is not selected",
        900110: f"{why} it holds GPU 0, which is not selected",
    }
