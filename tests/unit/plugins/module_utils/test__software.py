"""_software: DCGM level 1's software checks: device files present and openable, the environment DCGM flags, and
each failed check a finding with its verdict."""

from __future__ import annotations

import os
import stat

import pytest

from ansible_collections.gpuops.clean_slate.plugins.module_utils import _software


def test_device_files_absent_present_and_unopenable(tmp_path) -> None:
    (tmp_path / "nvidia0").write_bytes(b"")
    (tmp_path / "nvidiactl").write_bytes(b"")
    (tmp_path / "nvidia-caps").mkdir()
    devices = _software.device_nodes(str(tmp_path), [(0, 0, False), (1, 1, True)], 2)
    assert devices["gpus"][0]["ok"] and devices["ctl"]["ok"]
    assert devices["gpus"][1] == {"path": str(tmp_path / "nvidia1"), "ok": False, "why": f"{tmp_path}/nvidia1 is absent"}
    assert not devices["uvm"]["ok"] and devices["caps"] == {"path": str(tmp_path / "nvidia-caps"), "ok": False, "why": f"{tmp_path}/nvidia-caps is empty"}
    assert (devices["gpu_files"], devices["nvml_count"]) == (1, 2)
    found = _software.findings(devices, {"found": []}, {0: True, 1: False}, {0: True, 1: None})
    assert [(f["name"], f["verdict"], f["gpu"]) for f in found] == [
        ("device_missing", "reset_gpu", 1),
        ("uvm_missing", "reset_gpu", None),
        ("uvm_tools_missing", "ok", None),
        ("caps_missing", "reset_gpu", None),
        ("device_count", "ok", None),
        ("persistence_off", "ok", 1),
    ]


@pytest.mark.skipif(os.geteuid() != 0, reason="mknod needs root")
def test_a_node_no_driver_serves_is_present_and_cannot_be_opened(tmp_path) -> None:
    path = tmp_path / "nvidia-uvm"
    os.mknod(path, stat.S_IFCHR | 0o666, os.makedev(241, 0))  # a major no driver has here
    n = _software.node(str(path))
    assert n["ok"] is False and "present but cannot be opened" in n["why"]


def test_the_environment_dcgm_flags_is_found_where_it_can_be_seen() -> None:
    env = _software.environment({"CUDA_INJECTION64_PATH": "/opt/hook.so", "PATH": "/bin"})
    assert env["found"][0] == {"name": "CUDA_INJECTION64_PATH", "where": "the module's environment", "value": "/opt/hook.so"}
    assert "the module's environment" in env["read"] and "job's own environment" in env["not_visible"]
    [f] = [
        f
        for f in _software.findings(
            {"gpus": {}, "ctl": {"ok": True}, "uvm": {"ok": True}, "uvm_tools": {"ok": True}, "caps": None, "gpu_files": 0, "nvml_count": 0},
            env,
            {},
            {3: False},
        )
        if f["gpu"] is None
    ]
    assert (f["name"], f["verdict"]) == ("cuda_env", "restart_app")


def test_in_a_container_the_count_is_its_gpus_and_unchecked_files_are_said_not_failed(tmp_path) -> None:
    (tmp_path / "nvidia2").write_bytes(b"")
    devices = {**_software.device_nodes(str(tmp_path), [(2, 2, False), (3, 3, False)], 2), "container": 103}
    found = {f["name"]: f for f in _software.findings(devices, {"found": []}, {}, {})}
    assert found["device_count"]["text"].startswith(f"2 GPU(s) are selected for container 103 and {tmp_path} holds 1 GPU device file(s)")
    unchecked = {"dir": "/dev", "container": 103, "gpus": {}, "unchecked": "the CUDA start could not be made inside container 103: no python3."}
    [f] = _software.findings(unchecked, {"found": []}, {}, {})
    assert (f["name"], f["verdict"]) == ("devices_unchecked", "ok") and "no python3" in f["text"]
