"""_probe: calls in a helper process under a deadline, with a session of our own in the helper.

The helper is a real forked process and the hangs are real (a call that sleeps forever); NVML itself is
exercised through the simulated driver in tests/functional/test_driver_hang.py.
"""

from __future__ import annotations

import ctypes
import os
import signal
import time

import pytest

from ansible_collections.gpuops.clean_slate.plugins.module_utils import _probe, _reasons
from ansible_collections.gpuops.clean_slate.plugins.module_utils._errors import CleanSlateError
from ansible_collections.gpuops.clean_slate.plugins.module_utils._nvml import Gpu


class FakeSession:
    """What the helper opens: four GPUs; GPU 3's identity call hangs when HANG_IDENTITY is set."""

    def open(self) -> None:
        _probe.announce("fakeInit")
        if os.environ.get("PROBE_TEST_HANG_INIT"):
            hang()

    def gpus(self, skip=None, on_gpu=None) -> list[Gpu]:
        out = []
        for index in range(4):
            if skip and index in skip:
                out.append(Gpu(index=index, error=skip[index]))
                continue
            if on_gpu:
                on_gpu(index)
            _probe.announce("fakeGetUUID")
            if index == 3 and os.environ.get("PROBE_TEST_HANG_IDENTITY"):
                hang()
            out.append(Gpu(index=index, uuid=f"GPU-{index}", handle=ctypes.pointer(ctypes.c_int(index)), minor=index))
        return out

    def close(self) -> None:
        pass


def hang() -> None:
    while True:
        time.sleep(3600)


def read(session: FakeSession, gpu: Gpu, hung: tuple[int, ...] = ()) -> dict:
    _probe.announce("fakeGetMemory")
    if gpu.index in hung:
        hang()
    return {"index": gpu.index, "pid": os.getpid(), "handle": gpu.handle}


def fail(session: FakeSession, gpu: Gpu) -> None:
    raise CleanSlateError(f"GPU {gpu.index} said no", reason=_reasons.NO_PERMISSION, where=gpu.index)


def crash(session: FakeSession, gpu: Gpu) -> int:
    if gpu.index == 1:
        os._exit(3)
    return gpu.index


def version(session: FakeSession, hung: bool = False) -> str:
    _probe.announce("fakeGetDriverVersion")
    if hung:
        hang()
    return "580.159.04"


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):  # reaped before the open, or between the open and the read
        return False


@pytest.fixture
def prober():
    p = _probe.Prober(0.5, opener=FakeSession)
    yield p
    p.close()


def test_healthy_calls_are_answered_by_one_helper(prober) -> None:
    every = prober.start()
    assert [g.uuid for g in every] == ["GPU-0", "GPU-1", "GPU-2", "GPU-3"]
    assert all(g.handle is None for g in every)  # handles mean nothing outside the helper
    answers = prober.each(read, every)
    assert [a.value["index"] for a in answers] == [0, 1, 2, 3] and not any(a.error for a in answers)
    helper = answers[0].value["pid"]
    assert helper != os.getpid() and {a.value["pid"] for a in answers} == {helper}
    assert prober.call(version) == "580.159.04"
    assert prober.stats.helpers == 1 and prober.stats.calls >= 4 + 4 + 1
    prober.close()
    assert not alive(helper)  # killed and reaped, not left as a zombie


def test_a_hung_gpu_is_abandoned_and_the_others_still_answer(prober) -> None:
    every = prober.start()
    t0 = time.monotonic()
    answers = prober.each(read, every, (1,))
    took = time.monotonic() - t0
    assert [a.hung for a in answers] == [False, True, False, False]
    err = answers[1].error
    assert isinstance(err, _probe.DriverHung) and (err.reason, err.gpu, err.call) == (_reasons.DRIVER_HUNG, 1, "fakeGetMemory")
    assert err.msg.startswith("GPU 1: fakeGetMemory did not return within 0.5 s") and "reboot" in err.msg
    first, rest = answers[0].value["pid"], {answers[2].value["pid"], answers[3].value["pid"]}
    assert rest != {first} and len(rest) == 1 and not alive(first)  # a fresh helper read GPUs 2 and 3
    assert took >= 0.5  # it waited out the deadline (a lower bound only)
    # The hung GPU is never asked again; the others are.
    again = prober.each(read, every, (1,))
    assert again[1].error is err and [a.value["index"] for a in again if a.value] == [0, 2, 3]
    assert prober.stats.helpers == 2 and sorted(prober.hung) == [1]


def test_a_hang_in_a_gpus_identity_marks_it_and_a_fresh_helper_reads_the_rest(monkeypatch) -> None:
    monkeypatch.setenv("PROBE_TEST_HANG_IDENTITY", "1")
    with _probe.Prober(0.3, opener=FakeSession) as p:
        every = p.start()
        assert [g.uuid for g in every] == ["GPU-0", "GPU-1", "GPU-2", None]
        assert every[3].error is not None and every[3].error.reason == _reasons.DRIVER_HUNG and p.stats.helpers == 2
        assert "fakeGetUUID" in every[3].error.msg
        assert [a.value["index"] if a.value else a.error.reason for a in p.each(read, every)] == [0, 1, 2, _reasons.DRIVER_HUNG]


def test_a_system_hang_fails_the_start_or_every_gpu_after_it(monkeypatch, prober) -> None:
    every = prober.start()
    with pytest.raises(_probe.DriverHung) as err:
        prober.call(version, True)
    assert (err.value.gpu, err.value.call) == (None, "fakeGetDriverVersion")
    # The driver as a whole did not answer: its GPUs are not asked again either.
    assert all(a.error is err.value for a in prober.each(read, every))
    monkeypatch.setenv("PROBE_TEST_HANG_INIT", "1")
    with _probe.Prober(0.3, opener=FakeSession) as p, pytest.raises(_probe.DriverHung) as init:
        p.start()
    assert (init.value.reason, init.value.call) == (_reasons.DRIVER_HUNG, "fakeInit")


def test_errors_keep_their_reason_and_a_crash_costs_only_its_gpu(prober) -> None:
    every = prober.start()
    answers = prober.each(fail, every[:2])
    err = answers[0].error
    assert isinstance(err, CleanSlateError) and (err.reason, err.msg, err.details) == (_reasons.NO_PERMISSION, "GPU 0 said no", {"where": 0})
    crashed = prober.each(crash, every)
    assert crashed[1].error is not None and crashed[1].error.reason == _reasons.NVML_ERROR
    assert [a.value for a in crashed] == [0, None, 2, 3]


def test_nothing_is_waited_for_after_the_end() -> None:
    now = [0.0]
    with _probe.Prober(5, end=10, clock=lambda: now[0], opener=FakeSession) as p:
        every = p.start()
        now[0] = 11
        answers = p.each(read, every)
    assert all(isinstance(a.error, _probe.Late) and a.error.reason == _reasons.TIMEOUT for a in answers)


def test_the_helper_dies_with_the_module_even_when_it_is_killed() -> None:
    # A stand-in for the module: it starts a prober whose call hangs, reports the helper's pid, and is SIGKILLed
    # (as Ansible's async timeout does to a module); the helper must not outlive it.
    r, w = os.pipe()
    module = os.fork()
    if module == 0:  # pragma: no cover - the stand-in module
        try:
            os.close(r)
            p = _probe.Prober(60, opener=FakeSession)
            p.start()
            os.write(w, f"{p._pid}\n".encode())  # pylint: disable=protected-access
            p.each(read, p.every, (0,))
        finally:
            os._exit(1)
    os.close(w)
    with os.fdopen(r) as fh:
        helper = int(fh.readline())
    assert alive(helper)
    os.kill(module, signal.SIGKILL)
    os.waitpid(module, 0)
    deadline = time.monotonic() + 10
    while alive(helper) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not alive(helper)


def test_errors_cross_the_pipe_whole() -> None:
    import pickle

    hung = pickle.loads(pickle.dumps(_probe.DriverHung("nvmlDeviceGetMemoryInfo_v2", 3, 1.25)))
    assert isinstance(hung, _probe.DriverHung) and (hung.gpu, hung.call, hung.reason) == (3, "nvmlDeviceGetMemoryInfo_v2", _reasons.DRIVER_HUNG)
    assert hung.result()["waited_s"] == 1.25


def test_a_call_cut_short_by_the_end_is_late_not_hung() -> None:
    # GPU 1 hangs with a long probe_timeout: the overall end (0.4 s away) stops the wait first, so GPU 1 is
    # not proven hung; it and the GPUs after it were not read.
    with _probe.Prober(30, end=time.monotonic() + 0.4, opener=FakeSession) as p:
        every = p.start()
        answers = p.each(read, every, (1,))
    assert answers[0].error is None
    assert all(isinstance(a.error, _probe.Late) for a in answers[1:]) and not p.hung
