"""_residue.owners: holders found by inode, whatever the path, and bound sockets (real processes, under tools/pidns-run)."""

from __future__ import annotations

import os
import tempfile
import typing as t
from pathlib import Path

from ansible_collections.gpuops.clean_slate.plugins.module_utils._residue import module


def test_holders_are_found_by_inode_whatever_the_path(tree: Path, hold, request_for: t.Callable[..., module.Request]) -> None:
    shm = tree / "shm"
    p_map = hold("map", shm / "nccl-000000")
    p_fd = hold("fd", shm / "nccl-000001")
    p_cwd = hold("cwd", tree / "torchelastic_abc" / "r")
    p_lock = hold("flock", tree / "cache" / "top.lock")
    (tree / "sock" / "dead").unlink()
    p_bind = hold("bind", tree / "sock" / "dead")
    # Another name for a held segment: the holder's fd shows the first name, the inode is the same.
    os.link(shm / "nccl-000001", shm / "nccl-alias")
    r = module.run(request_for(tree), check_mode=False)
    held = {x["path"]: {h["pid"]: h["how"] for h in x["holders"]} for x in r["held"]}
    assert held[f"{shm}/nccl-000000"] == {p_map.pid: ["fd", "mmap"]}  # Python's mmap keeps a dup of the fd
    # One item per inode: whichever name was listed first stands for both.
    alias = {f"{shm}/nccl-000001", f"{shm}/nccl-alias"} & set(held)
    assert len(alias) == 1 and held[alias.pop()] == {p_fd.pid: ["fd"]}
    assert held[f"{tree}/torchelastic_abc"] == {p_cwd.pid: ["cwd"]}
    assert held[f"{tree}/cache/top.lock"] == {p_lock.pid: ["fd", "lock"]}
    assert held[f"{tree}/sock/dead"] == {p_bind.pid: ["bound"]}
    assert {x["path"] for x in r["removed"]} == {f"{shm}/nccl-000002", f"{tree}/cache/a/b/c/x.lock"}
    assert all(Path(p).exists() for p in held)


def test_a_directory_with_a_socket_a_live_process_is_bound_to_is_held(short_tmp: Path, hold, defaults_under) -> None:
    """A bound socket holds no fd on its file: only the unix tables tell, for a directory glob alone too."""
    d = Path(tempfile.mkdtemp(prefix="torch-shm-dir-", dir=short_tmp))
    manager = hold("bind", d / "manager.sock")
    req = module.Request(globs=defaults_under("dirs", short_tmp), remove={"dirs"})
    r = module.run(req, check_mode=False)
    assert (d / "manager.sock").exists()
    assert [(x["path"], [h["pid"] for h in x["holders"]], x["holders"][0]["how"]) for x in r["held"]] == [(str(d), [manager.pid], ["bound"])]
    assert r["removed"] == []


def test_what_any_thread_holds_is_kept_and_a_process_whose_main_thread_exited_is_no_zombie(
    tree: Path, thread_hold, request_for: t.Callable[..., module.Request]
) -> None:
    """Issue 26: each of these was removed as orphaned, the last process even reported as a zombie."""
    shm = tree / "shm"
    by_thread = thread_hold("files", shm / "nccl-000000")  # only a thread with its own file table has it open
    exited_fd = thread_hold("exit-fd", shm / "nccl-000001")  # the main thread exited; a thread holds the fd
    exited_map = thread_hold("exit-map", shm / "nccl-000002")  # ... or maps it, its fd closed
    workdir = thread_hold("fs", tree / "torchelastic_abc" / "r")  # only a thread works in it
    binder = thread_hold("files-bind", tree / "sock" / "live")  # bound by a thread with its own file table
    r = module.run(request_for(tree), check_mode=False)
    held = {x["path"]: {h["pid"]: h["how"] for h in x["holders"]} for x in r["held"]}
    assert held == {
        f"{shm}/nccl-000000": {by_thread.pid: ["fd"]},
        f"{shm}/nccl-000001": {exited_fd.pid: ["fd"]},
        f"{shm}/nccl-000002": {exited_map.pid: ["fd", "mmap"]},  # Python's mmap keeps a dup of the fd
        f"{tree}/torchelastic_abc": {workdir.pid: ["cwd"]},
        f"{tree}/sock/live": {binder.pid: ["bound"]},
    }
    assert all(Path(p).exists() for p in held)
    assert {x["path"] for x in r["removed"]} == {f"{tree}/sock/dead", f"{tree}/cache/a/b/c/x.lock", f"{tree}/cache/top.lock"}
    assert not {exited_fd.pid, exited_map.pid} & {z["pid"] for z in r["zombies"]}
