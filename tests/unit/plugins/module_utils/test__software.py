"""_software: DCGM level 1's software checks: device files present and openable, the environment DCGM flags, and
each failed check a finding with its verdict."""

from __future__ import annotations

import os
import stat

import pytest

from ansible_collections.gpuops.clean_slate.plugins.module_utils import _cuda_program, _software


def test_device_files_absent_present_and_unopenable(tmp_path) -> None:
    (tmp_path / "nvidia0").write_bytes(b"")
    (tmp_path / "nvidiactl").write_bytes(b"")
    (tmp_path / "nvidia-caps").mkdir()
    devices = _software.device_nodes(str(tmp_path), [(0, 0, False), (1, 1, True)], 2)
    assert devices["gpus"][0]["ok"] and devices["ctl"]["ok"]
    assert devices["gpus"][1] == {"path": str(tmp_path / "nvidia1"), "ok": False, "why": f"{tmp_path}/nvidia1 is absent", "fault": "absent"}
    assert not devices["uvm"]["ok"]
    assert devices["caps"] == {"path": str(tmp_path / "nvidia-caps"), "ok": False, "why": f"{tmp_path}/nvidia-caps is empty", "fault": "absent"}
    assert (devices["gpu_files"], devices["nvml_count"]) == (1, 2)
    found = _software.findings(devices, {"found": []}, {0: True, 1: False}, {0: True, 1: None})
    assert [(f["name"], f["verdict"], f["gpu"]) for f in found] == [
        ("device_missing", "fix_config", 1),
        ("uvm_missing", "fix_config", None),
        ("uvm_tools_missing", "ok", None),
        ("caps_missing", "fix_config", None),
        ("device_count", "ok", None),
        ("persistence_off", "ok", 1),
    ]


@pytest.mark.skipif(os.geteuid() != 0, reason="mknod needs root")
def test_a_node_no_driver_serves_is_present_and_cannot_be_opened(tmp_path) -> None:
    path = tmp_path / "nvidia-uvm"
    os.mknod(path, stat.S_IFCHR | 0o666, os.makedev(241, 0))  # a major no driver has here
    n = _software.node(str(path))
    assert n["ok"] is False and "present but cannot be opened: no driver serves its numbers" in n["why"] and n["fault"] == "unopenable"


@pytest.mark.skipif(os.geteuid() != 0, reason="mknod needs root")
def test_a_node_with_another_devices_numbers_or_a_regular_file_is_wrong_where_proc_devices_names_the_driver(tmp_path) -> None:
    """What /proc/devices says of the real driver (195 for the GPUs and nvidiactl, a dynamic major for nvidia-uvm) holds
    each node to its numbers: /dev/null's numbers as nvidia-uvm, the GPUs' major as nvidia-uvm, another GPU's minor, a
    regular file (LXC's create=file when the bind's source was missing) are each the wrong device; where /proc/devices
    names no NVIDIA driver (a simulated one) the numbers are not checked."""
    # What /proc/devices said on an H100 with driver 580.159.04 (docs/results/round4-facts-h100x1-2026-12-05.json).
    majors = {1: "mem", 195: "nvidia", 238: "nvidia-uvm", 239: "nvidia-nvswitch", 241: "nvidia-caps", 242: "nvidia-caps-imex-channels"}
    null = tmp_path / "null-as-uvm"
    os.mknod(null, stat.S_IFCHR | 0o666, os.makedev(1, 3))
    n = _software.node(str(null), (_cuda_program.UVM, 0), majors)
    assert (n["ok"], n["fault"], n["rdev"]) == (False, "wrong", [1, 3])
    assert n["why"] == f"{null} is 1:3 (mem's numbers), not the nvidia-uvm device (238:0 on this kernel, from /proc/devices)"
    gpu_as_uvm = tmp_path / "gpu-as-uvm"
    os.mknod(gpu_as_uvm, stat.S_IFCHR | 0o666, os.makedev(195, 0))
    assert "(nvidia's numbers)" in _software.node(str(gpu_as_uvm), (_cuda_program.UVM, 0), majors)["why"]
    other_minor = _software.node(str(gpu_as_uvm), (_cuda_program.FRONTEND, 1), majors)
    assert other_minor["fault"] == "wrong" and "is 195:0, not the nvidia device (195:1" in other_minor["why"]
    regular = tmp_path / "regular"
    regular.write_bytes(b"")
    assert "a regular file" in _software.node(str(regular), (_cuda_program.FRONTEND, 0), majors)["why"]
    # No NVIDIA driver in /proc/devices: present and openable is all that can be said.
    assert _software.node(str(null), (_cuda_program.UVM, 0), {1: "mem"})["ok"] is True


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
    assert (f["name"], f["verdict"]) == ("cuda_env", "fix_config")


def test_in_a_container_the_count_is_its_gpus_and_unchecked_files_are_said_not_failed(tmp_path) -> None:
    (tmp_path / "nvidia2").write_bytes(b"")
    devices = {**_software.device_nodes(str(tmp_path), [(2, 2, False), (3, 3, False)], 2), "container": 103}
    found = {f["name"]: f for f in _software.findings(devices, {"found": []}, {}, {})}
    assert found["device_count"]["text"].startswith(f"2 GPU(s) are selected for container 103 and {tmp_path} holds 1 GPU device file(s)")
    unchecked = {"dir": "/dev", "container": 103, "gpus": {}, "unchecked": "the CUDA start could not be made inside container 103: no python3."}
    [f] = _software.findings(unchecked, {"found": []}, {}, {})
    assert (f["name"], f["verdict"]) == ("devices_unchecked", "ok") and "no python3" in f["text"]
