"""_cuda_program: one self-contained text, imported by the module and run as a program inside a container by a
Python as old as 3.6; its helpers end when the caller that holds its lifeline goes away."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import threading
import time
import typing as t
from pathlib import Path

import pytest

from ansible_collections.gpuops.clean_slate.plugins.module_utils import _cuda_program

TEXT = _cuda_program.source()
PY36 = Path(os.environ.get("PYENV_ROOT", os.path.expanduser("~/.pyenv"))) / "versions" / "3.6.15" / "bin" / "python3.6"


def test_the_text_is_its_own_file_and_stands_alone() -> None:
    assert Path(_cuda_program.__file__).read_text(encoding="utf-8") == TEXT
    tree = ast.parse(TEXT, feature_version=(3, 6))  # nothing newer than 3.6 in its syntax
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert imported <= set(sys.stdlib_module_names) and "__future__" not in imported, imported


def run_program(python: str, device_dir: Path, targets: list, env: dict[str, str] | None = None) -> dict:
    request = {"device_dir": str(device_dir), "gpus": [[0, 0, False], [1, 1, False]], "nvml_count": 2, "targets": targets, "fraction": 0.9, "timeout": 10}
    argv = [python, "-I", "-c", TEXT, json.dumps(request)]
    # Its stdin is the caller's pipe, held open until the answer is in (the lifeline).
    with subprocess.Popen(
        argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={"PATH": "/usr/bin:/bin", **(env or {})}
    ) as proc:
        stdout = t.cast(t.IO[str], proc.stdout).read()
        t.cast(t.IO[str], proc.stdin).close()
        assert proc.wait(timeout=60) == 0, t.cast(t.IO[str], proc.stderr).read()
    [line] = [x for x in stdout.splitlines() if x.startswith(_cuda_program.ANSWER)]
    return json.loads(line[len(_cuda_program.ANSWER) :])


@pytest.mark.parametrize("python", [sys.executable, str(PY36)], ids=["this", "3.6"])
def test_run_as_a_program_it_answers_what_the_files_and_the_start_say(python: str, tmp_path) -> None:
    if not os.path.exists(python):
        pytest.skip(f"{python} is not installed here")
    (tmp_path / "nvidia0").write_bytes(b"")
    (tmp_path / "nvidiactl").write_bytes(b"")
    target = [0, "GPU-00000000-0000-0000-0000-000000000000", False]
    answer = run_program(python, tmp_path, [target], {"LD_LIBRARY_PATH": "/nonexistent"})
    devices = answer["devices"]
    assert devices["gpus"]["0"]["ok"] and devices["gpus"]["1"]["why"] == f"{tmp_path}/nvidia1 is absent" and devices["ctl"]["ok"]
    assert not devices["uvm"]["ok"] and (devices["gpu_files"], devices["nvml_count"]) == (1, 2)
    raw = answer["raw"]["0"]
    assert raw["step"] == "dlopen" and "libcuda.so.1" in raw["dlopen_error"] and raw["pid"] != answer["pid"]
    assert answer["left_behind"] == [] and python.endswith("3.6") == answer["python"].startswith("3.6.")


def test_a_helper_ends_when_the_caller_lets_go_of_the_lifeline(monkeypatch) -> None:
    def stuck(out_fd: int, *_args: object) -> None:  # a start that never returns (a GPU wedged in the driver)
        os.write(out_fd, b"S cuDevicePrimaryCtxRetain\n")
        time.sleep(600)

    monkeypatch.setattr(_cuda_program, "start", stuck)  # in the real helper, which closes what it inherited
    read_end, write_end = os.pipe()
    threading.Timer(0.5, os.close, [write_end]).start()  # the caller goes away while the starts hang
    began = time.monotonic()
    try:
        raw, left = _cuda_program.probe([(0, "GPU-x", False), (1, "GPU-y", True)], 0.9, 60, lifeline=read_end)
    finally:
        os.close(read_end)
    assert time.monotonic() - began < 30 and left == []
    assert {gpu: (r["ok"], r["abandoned"]) for gpu, r in raw.items()} == {0: (False, "cuDevicePrimaryCtxRetain"), 1: (False, "cuDevicePrimaryCtxRetain")}
    for r in raw.values():
        with pytest.raises(ChildProcessError):
            os.waitpid(r["pid"], os.WNOHANG)  # killed and reaped


def test_a_lifeline_held_open_changes_nothing_and_the_deadline_still_holds(monkeypatch) -> None:
    monkeypatch.setattr(_cuda_program, "start", lambda out_fd, *_a: (os.write(out_fd, b"S cuInit\n"), time.sleep(600)))
    read_end, write_end = os.pipe()
    try:
        raw, left = _cuda_program.probe([(3, "GPU-z", False)], 0.9, 0.5, lifeline=read_end)
    finally:
        os.close(read_end)
        os.close(write_end)
    assert left == [] and raw[3]["hung"] == "cuInit" and "abandoned" not in raw[3]


# ---------------------------------------------------------------------- ready together (issue 39)
def test_each_gpus_pattern_differs_from_every_others_at_every_offset() -> None:
    size = 3 * 4096 + 100
    patterns = [_cuda_program.pattern(g, size) for g in range(8)]
    assert all(len(p) == size for p in patterns)
    for a in range(8):
        for b in range(a + 1, 8):
            assert all(x != y for x, y in zip(patterns[a][:4096], patterns[b][:4096]))


def test_what_the_peer_check_found_of_a_pair() -> None:
    good = {"can": [True, True], "enable": [0, 704], "copies": [{"code": None, "match": True}, {"code": None, "match": True}]}
    assert _cuda_program.pair_works(good) is True
    assert _cuda_program.pair_works({**good, "can": [True, False]}) is False
    assert _cuda_program.pair_works({**good, "can": [True, "CUresult 999"]}) is False  # an error is not a yes (1 == True in Python)
    assert _cuda_program.pair_works({**good, "enable": [0, 217]}) is False
    assert _cuda_program.pair_works({**good, "copies": [{"code": None, "match": False}, {"code": None, "match": True}]}) is False
    assert _cuda_program.pair_works({**good, "copies": [{"code": 700, "match": None}]}) is None  # not both ways checked
    assert _cuda_program.pair_works({"can": [None, None]}) is None


def write_cache(home: Path, name: str, entries: object) -> Path:
    home.mkdir(parents=True, exist_ok=True)
    path = home / f"gpu_p2p_access_cache_for_{name}.json"
    path.write_text(json.dumps(entries))
    return path


def test_vllms_cached_answers_are_read_never_through_a_link_and_judged_stale_against_the_check(tmp_path) -> None:
    root = tmp_path
    vllm = root / "home" / "ops" / ".cache" / "vllm"
    mine = write_cache(vllm, "0,1,2,3", {f"{a}->{b}": True for a in range(4) for b in range(4)})
    write_cache(root / "root" / ".cache" / "vllm", "GPU-bb,GPU-aa", {"0->1": True, "1->0": False})
    (vllm / "gpu_p2p_access_cache_for_9.json").write_text("{not json")
    # A user's cache directory that is a link elsewhere is not followed.
    elsewhere = tmp_path / "elsewhere"
    write_cache(elsewhere, "0,1", {"0->1": True})
    (root / "home" / "eve" / ".cache").mkdir(parents=True)
    os.symlink(elsewhere, root / "home" / "eve" / ".cache" / "vllm")
    caches = _cuda_program.p2p_caches(str(root), _cuda_program.P2P_CACHE_DIRS)
    assert [c["path"] for c in caches] == [
        "/root/.cache/vllm/gpu_p2p_access_cache_for_GPU-bb,GPU-aa.json",
        "/home/ops/.cache/vllm/gpu_p2p_access_cache_for_0,1,2,3.json",
        "/home/ops/.cache/vllm/gpu_p2p_access_cache_for_9.json",
    ]
    assert caches[1]["devices"] == ["0", "1", "2", "3"] and caches[1]["entries"]["2->3"] is True and "error" in caches[2]
    works = {"0-1": True, "2-3": False, "0-2": None}
    # CUDA ordinals are the GPUs' here, in order; UUIDs map by name.
    assert _cuda_program.stale_pairs(caches[1], [0, 1, 2, 3], {}, works) == [[2, 3]]
    assert _cuda_program.stale_pairs(caches[1], [4, 5, 6, 7], {}, works) == []  # a container's ordinals: its own GPUs
    assert _cuda_program.stale_pairs(caches[0], [], {"gpu-aa": 3, "gpu-bb": 2}, works) == [[2, 3]]  # 0 -> 1 is GPU-bb -> GPU-aa
    # Removed only while it is the file that was read.
    item = dict(caches[1])
    mine.unlink()
    write_cache(vllm, "0,1,2,3", {})
    assert _cuda_program.remove_cache(str(root), item) == "it changed since it was read"
    fresh = _cuda_program.p2p_caches(str(root), ["/home/ops/.cache/vllm"])[0]
    assert _cuda_program.remove_cache(str(root), fresh) is None and not mine.exists()


def test_next_start_reads_the_room_and_removes_a_stale_answer_when_asked(tmp_path) -> None:
    stale = write_cache(tmp_path / "root" / ".cache" / "vllm", "0,1", {"0->1": True, "1->0": True})
    raw = {"pairs": [{"gpus": [1, 0], "can": [True, True], "enable": [0, 0], "copies": [{"code": None, "match": False}, {"code": None, "match": True}]}]}
    asked = {"dirs": ["/root/.cache/vllm"], "remove": False, "ordinals": [0, 1], "uuids": {}}
    out = _cuda_program.next_start(str(tmp_path), raw, {"shm": str(tmp_path), "peers_cache": asked})
    assert out["shm"]["path"] == str(tmp_path) and out["shm"]["free_mib"] <= out["shm"]["size_mib"]
    assert len(out["p2p_caches"]) == 1
    item = out["p2p_caches"][0]
    assert (item["stale"], item["removed"]) == ([[0, 1]], False) and stale.exists()
    out = _cuda_program.next_start(str(tmp_path), raw, {"shm": None, "peers_cache": {**asked, "remove": True}})
    assert out["shm"] is None and out["p2p_caches"][0]["removed"] is True and not stale.exists()
    assert _cuda_program.shm_room(str(tmp_path / "absent"))["error"]
