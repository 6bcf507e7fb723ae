"""_cuda: a failed CUDA start named from its code, the call and the device files, and the probe's helper: forked,
answering on a pipe, reaped, with CUDA never loaded in the calling process."""

from __future__ import annotations

import os

import pytest

from ansible_collections.gpuops.clean_slate.plugins.module_utils import _cuda, _findings

DEVICES_OK = {"uvm": {"ok": True, "why": None}, "gpus": {0: {"ok": True, "why": None}}, "uvm_major": 511}


def judged(raw: dict, devices: dict | None = None, mode: str | None = "default", free: int | None = 143156) -> dict:
    return _cuda.judge({"steps": {}, **raw}, 0, 0.9, 10, devices or DEVICES_OK, mode, free)


@pytest.mark.parametrize(
    ("raw", "reason", "words", "verdict"),
    [
        ({"code": 2, "step": "cuMemAlloc_v2", "cuda_total_mib": 143156, "cuda_free_mib": 112629}, "cuda_oom", "NVML reads 143156 MiB free", "reset_gpu"),
        ({"code": 46, "step": "cuDevicePrimaryCtxRetain"}, "cuda_busy", "compute mode back to default", "restart_app"),
        ({"code": 214, "step": "cuDevicePrimaryCtxRetain"}, "ecc_uncorrectable", "reset it", "reset_gpu"),
        ({"code": 802, "step": "cuInit"}, "fabric_not_ready", "nvidia-fabricmanager", "fix_config"),
        ({"hung": "cuDevicePrimaryCtxRetain", "waited_s": 10}, "cuda_hung", "stuck in cuDevicePrimaryCtxRetain", "reboot"),
        (
            {"step": "dlopen", "dlopen_error": "libcuda.so.1: cannot open shared object file"},
            "no_libcuda",
            "the driver's, of the loaded kernel module's version",
            "fix_config",
        ),
        # The user-space driver of another version than the kernel module: its installation, never a GPU reset.
        ({"code": 35, "step": "cuInit"}, "no_libcuda", "older than the kernel module", "fix_config"),
        ({"code": 803, "step": "cuInit"}, "no_libcuda", "different versions", "fix_config"),
        # cuInit's 999 while NVML reads the GPU: the unified-memory driver, not the GPU (numbers unknown here: said so).
        ({"code": 999, "step": "cuInit"}, "uvm_missing", "its numbers cannot be checked here", "fix_config"),
        # A 999 past cuInit is the GPU's.
        ({"code": 999, "step": "cuDevicePrimaryCtxRetain"}, "cuda_error", "Check dmesg", "reset_gpu"),
    ],
)
def test_each_failure_is_named_with_its_code_and_what_fixes_it(raw, reason, words, verdict) -> None:
    record = judged(raw)
    assert record["ok"] is False and record["reason"] == reason and words in record["detail"], record
    assert record["code"] == raw.get("code") and (record["error"] or "").startswith("CUDA_ERROR" if raw.get("code") else "")
    # The detail is what happened, then the table's fix; the finding carries the table's verdict.
    assert record["detail"] == f"{record['facts']} {_findings.FINDINGS[reason].fix}"
    name, found_verdict, text = _cuda.finding(record)
    assert (name, found_verdict) == (reason, verdict) and record["facts"] in text
    if verdict == "fix_config":
        assert "reset" not in record["detail"].lower() and "reboot" not in record["facts"].lower(), record["detail"]


def test_the_device_files_decide_between_uvm_missing_and_a_missing_gpu() -> None:
    no_uvm = {**DEVICES_OK, "uvm": {"ok": False, "why": "/dev/nvidia-uvm is absent", "fault": "absent"}}
    record = judged({"code": 999, "step": "cuInit"}, no_uvm)
    assert record["reason"] == "uvm_missing" and "/dev/nvidia-uvm is absent" in record["detail"] and "dynamic" in record["detail"]
    wrong = {**DEVICES_OK, "uvm": {"ok": False, "fault": "wrong", "why": "/dev/nvidia-uvm is 1:3 (mem's numbers), not the nvidia-uvm device (511:0)"}}
    record = judged({"code": 999, "step": "cuInit"}, wrong)
    assert record["reason"] == "uvm_missing" and "1:3 (mem's numbers)" in record["facts"] and "reset" not in record["detail"].lower()
    unloaded = {**DEVICES_OK, "uvm_loaded": False, "numbers_checked": True}
    assert "module is not loaded" in judged({"code": 999, "step": "cuInit"}, unloaded)["facts"]
    no_gpu = {**DEVICES_OK, "gpus": {0: {"ok": False, "why": "/dev/nvidia0 is present but cannot be opened: the device cgroup refuses it"}}}
    assert judged({"code": 100, "step": "cuInit"}, no_gpu)["reason"] == "device_missing"
    no_ctl = {**DEVICES_OK, "ctl": {"ok": False, "why": "/dev/nvidiactl is absent"}}
    assert judged({"code": 100, "step": "cuInit"}, no_ctl)["reason"] == "device_missing"
    # A start that worked is no finding, whatever the files say.
    ok = judged({"ok": True, "allocated_mib": 128840}, no_uvm)
    assert ok["ok"] is True and ok["reason"] is None and _cuda.finding(ok) is None and "128840 MiB" in ok["detail"]


def test_the_helper_answers_without_cuda_in_this_process(monkeypatch) -> None:
    # No libcuda on the path: the helper answers that it cannot load it, and is reaped.
    monkeypatch.setenv("LD_LIBRARY_PATH", "/nonexistent")
    raw, left = _cuda.probe([_cuda.Target(0, "GPU-00000000-0000-0000-0000-000000000000")], 0.9, 10)
    assert left == [] and raw[0]["step"] == "dlopen" and "libcuda.so.1" in raw[0]["dlopen_error"]
    with pytest.raises(ChildProcessError):
        os.waitpid(raw[0]["pid"], os.WNOHANG)  # already reaped
    with open("/proc/self/maps", encoding="utf-8") as fh:
        assert "libcuda" not in fh.read()  # the module process never loads CUDA


def test_a_start_that_could_not_be_made_is_unproven_and_says_nothing_of_the_gpus_health() -> None:
    unproven = "the CUDA start could not be made inside container 103, where the next server starts: container 103 has no python3."
    record = judged({"ok": False, "unproven": unproven})
    assert (record["ok"], record["reason"]) == (False, "cuda_unproven") and record["detail"].startswith(unproven)
    assert "not proven startable" in record["detail"] and _cuda.finding(record) is None
    abandoned = judged({"ok": False, "abandoned": "cuInit"})
    assert abandoned["reason"] == "cuda_error" and "went away" in abandoned["detail"] and abandoned["step"] == "cuInit"
