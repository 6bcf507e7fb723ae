"""_verify's judgement and diagnoses from readings (the NVML side is covered on the simulated node)."""

from __future__ import annotations

import os
import shutil
import subprocess
import typing as t

import pytest

from ansible_collections.gpuops.clean_slate.plugins.module_utils import _findings, _proctable, _verify
from ansible_collections.gpuops.clean_slate.plugins.module_utils._errors import CleanSlateError
from ansible_collections.gpuops.clean_slate.plugins.module_utils._nvml import (
    NVML_ERROR_GPU_IS_LOST,
    NVML_ERROR_NOT_SUPPORTED,
    NVML_ERROR_TIMEOUT,
    Gpu,
    GpuProcess,
    Memory,
    NvmlError,
)

CRIT = _verify.Criteria(max_used_mib=64, require_no_processes=True)
DEAD_PID = _proctable.pid_max() + 5  # never exists


def reading(
    used: int = 0, procs: list[GpuProcess] | None = None, api: str = "v2", recovery: int | None = 0, name: str = "NVIDIA H200", index: int = 0
) -> _verify.Reading:
    mem = Memory(total_mib=143771, used_mib=used, reserved_mib=615 if api == "v2" else None, free_mib=143771 - used, api=api)
    return _verify.Reading(gpu=Gpu(index=index, uuid=f"GPU-{index}", name=name, minor=index), memory=mem, processes=procs or [], recovery_action=recovery)


def test_idle_gpu_is_clean_and_small_use_is_tolerated() -> None:
    assert _verify.quick_judge(reading(0), CRIT) == (True, None)
    assert _verify.quick_judge(reading(64), CRIT) == (True, None)
    assert _verify.quick_judge(reading(65), CRIT) == (False, None)


def test_listed_process_makes_it_dirty_unless_allowed() -> None:
    r = reading(0, [GpuProcess(pid=DEAD_PID, used_mib=0)])
    assert _verify.quick_judge(r, CRIT) == (False, None)
    assert _verify.quick_judge(r, _verify.Criteria(64, False)) == (True, None)


def test_terminal_states() -> None:
    lost = _verify.Reading(gpu=Gpu(index=3), error=NvmlError(NVML_ERROR_GPU_IS_LOST, "x", gpu=3))
    assert _verify.quick_judge(lost, CRIT) == (False, "gpu_lost")
    unsupported = _verify.Reading(gpu=Gpu(index=0), error=NvmlError(NVML_ERROR_NOT_SUPPORTED, "x"))
    assert _verify.quick_judge(unsupported, CRIT) == (False, "unsupported")
    timeout = _verify.Reading(gpu=Gpu(index=0), error=NvmlError(NVML_ERROR_TIMEOUT, "x"))
    assert _verify.quick_judge(timeout, CRIT) == (False, None)  # transient: keep polling
    assert _verify.quick_judge(reading(0, recovery=1), CRIT) == (False, "needs_reset")
    assert _verify.quick_judge(reading(0, recovery=None), CRIT) == (True, None)


def test_v1_reserved_is_estimated_from_the_idlest_sibling() -> None:
    idle = reading(615, api="v1", index=0)
    busy = reading(615 + 20000, [GpuProcess(pid=1, used_mib=20000)], api="v1", index=1)
    orphan = reading(615 + 4096, api="v1", index=2)
    _verify.estimate_v1_reserved([idle, busy, orphan])
    assert [r.reserved_mib for r in (idle, busy, orphan)] == [615, 615, 615]
    assert idle.used_mib == 0
    assert busy.used_mib == 20000
    # The orphaned memory is not mistaken for reserved memory.
    assert orphan.used_mib == 4096
    assert _verify.quick_judge(orphan, CRIT) == (False, None)


def test_diagnoses() -> None:
    own = {os.getpid()}
    # Memory held, NVML lists a pid that does not exist here, and a visible process maps the device file.
    r = reading(20000, [GpuProcess(pid=DEAD_PID, used_mib=20000)])
    holders = {os.getpid(): _proctable.Holding(gpu_fds={0}, gpu_maps={0})}
    diag, detail, pids = _verify.diagnose(r, CRIT, holders, set())
    assert diag == "busy" and pids == [os.getpid()]
    assert "do not exist here" in detail
    # Our own NVML handle holds the file too, but it is never the culprit.
    diag = _verify.diagnose(r, CRIT, holders, own)[0]
    # ... and then the listed pid that exists nowhere here means: held from outside this namespace.
    assert diag == "held_outside_namespace"
    # Memory held, nothing listed, nothing holding.
    diag, detail = _verify.diagnose(reading(4096, recovery=1), CRIT, {}, own)[:2]
    assert diag == "orphaned_context"
    assert "recovery action is gpu_reset" in detail and detail.endswith(_findings.FINDINGS["orphaned_context"].fix) and "reset plan" in detail
    # Without the driver's word, a container cannot tell an orphan from memory held by the host.
    diag = _verify.diagnose(reading(4096, recovery=0), CRIT, {}, own)[0]
    assert diag == ("orphaned_context" if _proctable.in_initial_pidns() else "held_outside_namespace")
    diag, detail = _verify.diagnose(reading(0, recovery=2), CRIT, {}, own)[:2]
    assert diag == "needs_reset" and "node_reboot" in detail
    lost = _verify.Reading(gpu=Gpu(index=3), error=NvmlError(NVML_ERROR_GPU_IS_LOST, "nvmlDeviceGetHandleByIndex", gpu=3))
    diag, detail = _verify.diagnose(lost, CRIT, {}, own)[:2]
    assert diag == "gpu_lost" and "reboot" in detail
    timeout = _verify.Reading(gpu=Gpu(index=1), error=NvmlError(NVML_ERROR_TIMEOUT, "nvmlDeviceGetMemoryInfo_v2", gpu=1))
    assert _verify.diagnose(timeout, CRIT, {}, own)[0] == "unresponsive"


def test_an_unlisted_holder_is_blamed_only_for_memory_the_listed_ones_cannot_explain() -> None:
    """Every CUDA process maps every GPU's device file; a live context also costs the device a
    little more than NVML charges its process (9 MiB for torch). Neither may make another job's
    process the culprit of a GPU its own listed workers explain."""
    listed = [subprocess.Popen(["sleep", "30"]) for _unused in range(2)]
    other = subprocess.Popen(["sleep", "30"])
    try:
        procs = [GpuProcess(pid=p.pid, used_mib=1000) for p in listed]
        holders = {p.pid: _proctable.Holding(gpu_fds={0, 1}, gpu_maps={0, 1}) for p in [*listed, other]}
        nvml = {p.pid: {0} for p in listed}  # NVML lists them on GPU 0 (minor 0); `other` nowhere
        # 2 x 9 MiB of overhead beyond the 64 MiB slack still belongs to the listed two.
        diag, _detail, pids = _verify.diagnose(reading(2000 + 2 * 9, procs), CRIT, holders, set(), nvml)
        assert diag == "busy" and pids == sorted(p.pid for p in listed)
        # Another whole context's worth (a real one is >= 518 MiB) is held by someone unlisted.
        diag, _detail, pids = _verify.diagnose(reading(2000 + 600, procs), CRIT, holders, set(), nvml)
        assert pids == sorted(p.pid for p in [*listed, other])
        # Under MIG NVML charges no process anything: the arithmetic says nothing, so nobody unlisted is blamed.
        mig = [GpuProcess(pid=p.pid, used_mib=None) for p in listed]
        diag, _detail, pids = _verify.diagnose(reading(2600, mig), CRIT, holders, set(), nvml)
        assert pids == sorted(p.pid for p in listed)
    finally:
        for p in [*listed, other]:
            p.kill()
            p.wait()


def test_poll_returns_at_once_when_clean_and_waits_until_the_deadline_otherwise() -> None:
    class Session:
        def __init__(self, used: list[int]) -> None:
            self.used = used

        def memory(self, gpu: Gpu) -> Memory:
            value = self.used.pop(0) if len(self.used) > 1 else self.used[0]
            return Memory(143771, value, 615, 143771 - value, "v2")

        def processes(self, gpu: Gpu) -> list[GpuProcess]:
            return []

        def recovery_action(self, gpu: Gpu) -> int:
            return 0

    now = [0.0]

    def clock() -> float:
        return now[0]

    def sleep(s: float) -> None:
        now[0] += s

    out = _verify.poll_until_clean(Session([0]), [Gpu(index=0, minor=0)], CRIT, timeout=30, interval=0.1, clock=clock, sleep=sleep)
    assert out.polls == 1 and out.time_to_clean_s == 0.0 and out.clean_count == 1
    now[0] = 0.0
    out = _verify.poll_until_clean(Session([20000, 20000, 0]), [Gpu(index=0, minor=0)], CRIT, timeout=30, interval=0.1, clock=clock, sleep=sleep)
    assert out.polls == 3 and abs(out.time_to_clean_s - 0.2) < 1e-9
    now[0] = 0.0
    out = _verify.poll_until_clean(Session([20000]), [Gpu(index=0, minor=0)], CRIT, timeout=1.0, interval=0.1, clock=clock, sleep=sleep)
    assert out.time_to_clean_s is None and out.clean_count == 0
    assert 0.99 < out.elapsed_s < 1.01 and 10 <= out.polls <= 12
    assert out.gpus[0]["diagnosis"] in ("orphaned_context", "held_outside_namespace")
    msg = _verify.failure_message(out, 1)
    assert msg.startswith("1 of 1 GPU(s) not clean after 1.0 s. GPU 0 (")


def test_elapsed_includes_the_scan_that_names_the_holders(monkeypatch) -> None:
    class Session:
        def memory(self, gpu: Gpu) -> Memory:
            return Memory(143771, 20000, 615, 123156, "v2")

        def processes(self, gpu: Gpu) -> list[GpuProcess]:
            return []

        def recovery_action(self, gpu: Gpu) -> int:
            return 0

    now = [0.0]
    real_scan = _proctable.scan_device_holders

    def slow_scan(*args, **kwargs):
        now[0] += 0.17  # what 3 000 processes cost on the adversarial sweep's machine
        return real_scan(*args, **kwargs)

    monkeypatch.setattr(_proctable, "scan_device_holders", slow_scan)

    def sleep(s: float) -> None:
        now[0] += s

    out = _verify.poll_until_clean(Session(), [Gpu(index=0, minor=0)], CRIT, timeout=0.5, interval=0.1, clock=lambda: now[0], sleep=sleep)
    assert out.clean_count == 0
    assert abs(out.elapsed_s - 0.67) < 1e-6, out.elapsed_s


def test_a_gpu_held_only_by_a_protected_daemon_says_so(tmp_path) -> None:
    # A real process whose executable is named like a protected daemon, holding GPU 0's file.
    exe = tmp_path / "nv-hostengine"
    shutil.copy2("/bin/sleep", exe)
    daemon = subprocess.Popen([str(exe), "60"])
    job = subprocess.Popen(["sleep", "60"])
    try:
        holders = {daemon.pid: _proctable.Holding(gpu_fds={0}, gpu_maps={0})}
        r = reading(8000, [GpuProcess(pid=daemon.pid, used_mib=8000)])
        diag, detail, pids = _verify.diagnose(r, CRIT, holders, set())
        assert diag == "held_by_protected" and pids == [daemon.pid]
        assert f"held by protected daemon PID(s) {daemon.pid} (nv-hostengine)" in detail and "unprotect" in detail
        # With a job beside it, the GPU is busy, and the message says which holder will not be ended.
        holders[job.pid] = _proctable.Holding(gpu_fds={0}, gpu_maps={0})
        r = reading(16000, [GpuProcess(pid=daemon.pid, used_mib=8000), GpuProcess(pid=job.pid, used_mib=8000)])
        diag, detail, _pids = _verify.diagnose(r, CRIT, holders, set())
        assert diag == "busy" and f"PID(s) {daemon.pid} are protected daemons" in detail
    finally:
        for p in (daemon, job):
            p.kill()
            p.wait()


def outcome(*clean: bool, elapsed: float = 0.25) -> _verify.Outcome:
    gpus = [
        {"index": i, "uuid": f"GPU-{i}", "clean": c, "diagnosis": "clean" if c else "busy", "detail": "clean" if c else "held by PID(s) 42 (python3)."}
        for i, c in enumerate(clean)
    ]
    return _verify.Outcome(gpus=gpus, elapsed_s=elapsed, time_to_clean_s=None, polls=1, notes=[])


def lost(index: int) -> Gpu:
    return Gpu(index=index, error=NvmlError(NVML_ERROR_GPU_IS_LOST, "x", gpu=index))


def test_the_verdict_counts_clean_gpus_and_healthy_ones() -> None:
    every = [Gpu(index=i) for i in range(4)]
    assert _verify.verdict(outcome(True, True, True, True), every, 4, None) == (None, ["4/4 GPUs clean in 0.25 s"])
    assert _verify.verdict(outcome(True, True, True, True), every, 4, 4) == (None, ["4/4 GPUs clean in 0.25 s"])
    # The seconds are what the verdict waited for, when given (the CUDA start included).
    assert _verify.verdict(outcome(True, True, True, True), every, 4, 4, elapsed=0.91) == (None, ["4/4 GPUs clean in 0.91 s"])
    # No GPU at all is not read as a clean count.
    assert _verify.verdict(outcome(), [], 0, None) == (None, ["no GPU to verify: NVML lists none (0.25 s)"])
    reason, lines = _verify.verdict(outcome(True, False), every, 2, None)
    assert reason == "not_clean" and lines[0] == "1 of 2 GPU(s) not clean after 0.2 s." and lines[1].startswith("GPU 1 (GPU-1): busy: held by PID(s) 42")


def test_a_failure_says_each_thing_once() -> None:
    """Seven busy GPUs: each GPU's own facts (its memory, its PIDs) on a line, the fix they share once, on the first;
    eight GPUs whose CUDA start failed the same way: one line naming the eight, its fix once. Each GPU's detail keeps its
    whole sentence."""
    busy = _verify.ADVICE["busy"]
    gpus = [
        {"index": i, "uuid": f"GPU-{i}", "clean": False, "diagnosis": "busy", "detail": f"8009 MiB used, held by PID(s) {3 + 2 * i} (other{i}). {busy}"}
        for i in range(7)
    ]
    gpus.append({"index": 7, "uuid": "GPU-7", "clean": True, "diagnosis": "clean", "detail": "clean"})
    out = _verify.Outcome(gpus=gpus, elapsed_s=0.02, time_to_clean_s=None, polls=1, notes=[])
    lines = _verify.failure_lines(out, 8)
    assert lines[0] == "7 of 8 GPU(s) not clean after 0.0 s." and len(lines) == 8
    assert lines[1] == f"GPU 0 (GPU-0): busy: 8009 MiB used, held by PID(s) 3 (other0). Fix: {busy}"
    for i in range(1, 7):
        assert lines[i + 1] == f"GPU {i} (GPU-{i}): busy: 8009 MiB used, held by PID(s) {3 + 2 * i} (other{i})."
    assert _verify.failure_message(out, 8) == " ".join(lines) and all(g["detail"].endswith(busy) for g in gpus[:7])

    facts = "CUDA error 999 in cuInit: /dev/nvidia-uvm is absent."
    fix = _findings.FINDINGS["uvm_missing"].fix
    starts = {"ok": False, "reason": "uvm_missing", "facts": facts, "detail": f"{facts} {fix}"}
    gpus = [{"index": i, "uuid": f"GPU-{i}", "clean": False, "diagnosis": "uvm_missing", "detail": f"{facts} {fix}", "startable": starts} for i in range(8)]
    out = _verify.Outcome(gpus=gpus, elapsed_s=0.1, time_to_clean_s=None, polls=1, notes=[])
    assert _verify.failure_lines(out, 8) == ["8 of 8 GPU(s) not clean after 0.1 s.", f"GPUs 0-7: uvm_missing: {facts} Fix: {fix}"]


def test_a_lost_gpu_is_counted_but_not_healthy() -> None:
    every = [Gpu(index=0), lost(1), Gpu(index=2)]
    reason, lines = _verify.verdict(outcome(True, True), every, 2, 3)
    assert (reason, lines) == ("missing_gpus", ["expected 3 GPUs, found 2 healthy of 3 (lost: GPU 1)."])
    # Both problems: each is said, and the dirty GPU decides the reason.
    reason, lines = _verify.verdict(outcome(True, False), every, 2, 3)
    assert reason == "not_clean" and " ".join(lines).startswith("expected 3 GPUs, found 2 healthy of 3 (lost: GPU 1). 1 of 2 GPU(s) not clean")
    # Fewer GPUs than expected and none lost: the driver shows fewer, and the device files say why.
    shortfall = [{"name": "device_missing", "verdict": "fix_config", "gpu": None, "text": "/dev/nvidia1 is absent"}]
    assert _verify.verdict(outcome(True), [Gpu(index=0)], 1, 8, shortfall) == (
        "missing_gpus",
        ["expected 8 GPUs, found 1 healthy of 1: /dev/nvidia1 is absent."],
    )


def test_options_are_checked_before_the_gpus_are_touched(tmp_path) -> None:
    params = {
        "timeout": 30,
        "interval": 0.1,
        "probe_timeout": 10,
        "max_used_mib": 64,
        "expected_count": None,
        "device_dir": str(tmp_path),
        "gpus": [0, "/dev/nvidia3"],
    }
    assert _verify.validate(params) == [0, "/dev/nvidia3"]
    assert _verify.validate({**params, "containers": [103], "pct_path": None}) == [0, "/dev/nvidia3"]
    bad = (
        ("interval", 0),
        ("timeout", float("inf")),
        ("probe_timeout", 0.05),
        ("probe_timeout", float("nan")),
        ("expected_count", 2000),
        ("device_dir", str(tmp_path / "no")),
        ("containers", [103, 104]),
        ("containers", [99]),
        ("pct_path", str(tmp_path)),
        # Ready together (issue 39): sizes and thresholds.
        ("peers_copy_mib", 0),
        ("peers_copy_mib", 4096),
        ("peers_min_bandwidth", -0.1),
        ("peers_min_bandwidth", 1.5),
        ("peers_min_bandwidth", float("nan")),
        ("nvlink_error_threshold", -1),
        ("shm_min_mib", -5),
        ("peers_cache", "delete"),
        ("peers_cache_dirs", ["relative/vllm"]),
        ("peers_cache_dirs", ["/home/../etc"]),
    )
    assert _verify.validate({**params, "peers_copy_mib": 1024, "peers_min_bandwidth": 0, "peers_cache_dirs": ["/srv/*/vllm"]}) == [0, "/dev/nvidia3"]
    for option, value in bad:
        with pytest.raises(CleanSlateError) as err:
            _verify.validate({**params, option: value})
        assert err.value.details["option"] == option


def test_python_facts_name_missing_packages(monkeypatch) -> None:
    facts = _verify.python_facts()
    assert facts["missing"] == [] and facts["executable"]
    real = _verify.importlib.util.find_spec
    monkeypatch.setattr(_verify.importlib.util, "find_spec", lambda name: None if name == "pynvml" else real(name))
    assert _verify.python_facts()["missing"] == ["nvidia-ml-py"]


def test_a_gpu_whose_memory_is_still_going_down_is_waited_for_past_the_timeout() -> None:
    class Session:
        def __init__(self, used: t.Callable[[float], int]) -> None:
            self.used = used

        def memory(self, gpu: Gpu) -> Memory:
            value = self.used(now[0])
            return Memory(143771, value, 615, 143771 - value, "v2")

        def processes(self, gpu: Gpu) -> list[GpuProcess]:
            return []

        def recovery_action(self, gpu: Gpu) -> int:
            return 0

    now = [0.0]

    def sleep(s: float) -> None:
        now[0] += s

    def poll(used: t.Callable[[float], int], **kw: t.Any) -> _verify.Outcome:
        now[0] = 0.0
        return _verify.poll_until_clean(Session(used), [Gpu(index=0, minor=0)], CRIT, timeout=30, interval=0.5, clock=lambda: now[0], sleep=sleep, **kw)

    # A GB300-like teardown: 100 GB going down for 50 s. Past the 30 s timeout it still moves: clean at 50 s.
    falling = poll(lambda s: max(0, int(100000 * (1 - s / 50))), progress_timeout=120, progress_window=10)
    assert falling.time_to_clean_s is not None and 49.9 < falling.time_to_clean_s < 50.6 and falling.clean_count == 1
    # Without progress_timeout the verdict comes at the timeout, as before.
    assert poll(lambda s: max(0, int(100000 * (1 - s / 50))), progress_timeout=0).time_to_clean_s is None
    # A GPU stuck at the same use (no progress) is not clean at the timeout either, whatever the cap.
    stuck = poll(lambda s: 20000, progress_timeout=120, progress_window=10)
    assert stuck.time_to_clean_s is None and 29.9 < stuck.elapsed_s < 30.6
    # One that stops moving at 40 s is judged a window later (the cap is never passed).
    stalled = poll(lambda s: max(20000, int(100000 * (1 - s / 50))), progress_timeout=120, progress_window=10)
    assert stalled.time_to_clean_s is None and 49.9 < stalled.elapsed_s < 50.6
    capped = poll(lambda s: max(0, int(100000 * (1 - s / 500))), progress_timeout=60, progress_window=10)
    assert capped.time_to_clean_s is None and 59.9 < capped.elapsed_s < 60.6
