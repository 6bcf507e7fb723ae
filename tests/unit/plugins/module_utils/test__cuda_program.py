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
