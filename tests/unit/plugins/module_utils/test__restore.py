"""_restore: the gpu_mode_restore module's logic that needs no GPU.

Input is refused before anything is read or changed, naming the option; the MPS daemon is found by
what it is (a real process whose executable is called nvidia-cuda-mps-control) and ended through a
pidfd, and the module's own ancestors are never among the targets. The NVML side runs against the
simulated driver in tests/functional/test_gpu_mode_restore.py.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
import typing as t
from pathlib import Path

import pytest

from ansible_collections.gpuops.clean_slate.plugins.module_utils import _probe, _reasons, _restore
from ansible_collections.gpuops.clean_slate.plugins.module_utils._errors import CleanSlateError


def params(**over: t.Any) -> dict[str, t.Any]:
    base = {"gpus": [], "compute_mode": None, "mps": None, "mps_timeout": 10, "probe_timeout": 10}
    base.update(over)
    return base


@pytest.mark.parametrize(
    ("over", "option"),
    [
        ({}, "compute_mode"),  # nothing declared
        ({"compute_mode": "exclusive_thread"}, "compute_mode"),
        ({"mps": "running"}, "mps"),
        ({"mps": "stopped", "mps_timeout": -1}, "mps_timeout"),
        ({"mps": "stopped", "mps_timeout": float("nan")}, "mps_timeout"),
        ({"compute_mode": "default", "probe_timeout": 0}, "probe_timeout"),
        ({"compute_mode": "default", "gpus": ["not-a-gpu"]}, "gpus"),
    ],
)
def test_bad_input_is_refused_naming_the_option(over: dict[str, t.Any], option: str) -> None:
    with pytest.raises(CleanSlateError) as err:
        _restore.validate(params(**over))
    assert err.value.reason == _reasons.BAD_ARGUMENTS
    assert err.value.details.get("option") == option, err.value.details


def test_good_input_gives_the_gpu_selectors() -> None:
    assert _restore.validate(params(compute_mode="default", gpus=[0, "1"])) == [0, 1]
    assert _restore.validate(params(mps="stopped")) == []


def test_the_argument_spec_offers_exactly_the_modes_it_can_restore() -> None:
    spec = _restore.argument_spec()
    assert spec["compute_mode"]["choices"] == ["default", "prohibited", "exclusive_process"]
    assert spec["mps"]["choices"] == ["stopped"]


def test_answers_returns_values_and_raises_the_first_error() -> None:
    assert _restore.answers([_probe.Answer(value="default"), _probe.Answer(value="prohibited")]) == ["default", "prohibited"]
    boom = CleanSlateError("first", reason=_reasons.NVML_ERROR)
    with pytest.raises(CleanSlateError, match="first"):
        _restore.answers([_probe.Answer(value=1), _probe.Answer(error=boom), _probe.Answer(error=RuntimeError("second"))])


@pytest.fixture
def mps_daemon(tmp_path: Path) -> t.Iterator[subprocess.Popen[bytes]]:
    """A real process that *is* an MPS control daemon by its executable's name (a copy of sleep)."""
    exe = tmp_path / "nvidia-cuda-mps-control"
    shutil.copy(shutil.which("sleep") or "/bin/sleep", exe)
    proc = subprocess.Popen([str(exe), "600"])
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and not Path(f"/proc/{proc.pid}/exe").exists():
        time.sleep(0.01)
    yield proc
    if proc.poll() is None:
        proc.kill()
    proc.wait()


def test_the_mps_daemon_is_found_by_what_it_is_and_ended(mps_daemon: subprocess.Popen[bytes]) -> None:
    # A process that only calls itself so is not a target.
    impostor = subprocess.Popen(["bash", "-c", "exec -a nvidia-cuda-mps-control sleep 600"])
    try:
        time.sleep(0.2)
        found = _restore.mps_daemons()
        assert mps_daemon.pid in found
        assert impostor.pid not in found
        assert os.getpid() not in found and 1 not in found
        ended, survivors = _restore.stop_mps([mps_daemon.pid], timeout=5)
        assert ended == [mps_daemon.pid] and survivors == []
        assert mps_daemon.wait(timeout=5) == -15
        assert impostor.poll() is None, "the impostor was signalled"
    finally:
        impostor.kill()
        impostor.wait()
