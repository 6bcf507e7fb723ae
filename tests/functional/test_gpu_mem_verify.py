"""gpu_mem_verify through Ansible on the simulated 8 x H200 node."""

from __future__ import annotations

import os
import time

import pytest
from gpusim import CONTEXT_OVERHEAD_MIB
from support.modules import assert_no_traceback, wait_for


def test_idle_h200_reads_clean_not_615_mib_dirty(mod) -> None:
    r = mod("gpu_mem_verify", {"expected_count": 8})
    assert r["_status"] == "ok", r
    assert r["changed"] is False
    assert r["clean"] is True and r["gpu_count"] == 8 and r["clean_count"] == 8
    assert [g["used_mib"] for g in r["gpus"]] == [0] * 8
    assert [g["reserved_mib"] for g in r["gpus"]] == [615] * 8
    assert {g["name"] for g in r["gpus"]} == {"NVIDIA H200"}
    assert {g["total_mib"] for g in r["gpus"]} == {143771}
    assert all(g["diagnosis"] == "clean" and g["memory_api"] == "v2" for g in r["gpus"])
    # Answered by the first poll (how fast that is, tools/bench/kill_verify.py measures).
    assert r["polls"] == 1 and r["time_to_clean_s"] is not None
    assert r["driver_version"] == "580.159.04"
    assert r["msg"].startswith("8/8 GPUs clean in ")
    assert r["python"]["missing"] == []


def test_live_worker_is_dirty_and_named(mod, node, sandbox) -> None:
    w = sandbox.spawn_worker(gpus=[3], mib=20000, title="sglang::scheduler_TP0")
    r = mod("gpu_mem_verify", {"timeout": 0.3})
    assert (r["_status"], r["reason"]) == ("failed", "not_clean")
    assert r["clean"] is False and r["clean_count"] == 7
    g3 = r["gpus"][3]
    assert g3["used_mib"] == 20000 + CONTEXT_OVERHEAD_MIB and g3["diagnosis"] == "busy"
    assert [p["pid"] for p in g3["processes"]] == [w.ns_pid]
    assert g3["processes"][0]["used_mib"] == 20000 and g3["processes"][0]["visible"] is True
    assert str(w.ns_pid) in g3["detail"] and "gpu_procs_kill" in g3["detail"]
    assert f"GPU 3 ({g3['uuid']}): busy" in r["msg"]
    assert all(g["clean"] for i, g in enumerate(r["gpus"]) if i != 3)
    # It kept polling until its deadline (a lower bound: safe however loaded the machine is).
    assert r["elapsed_s"] >= 0.3 and r["polls"] > 1
    assert_no_traceback(r)


def test_report_only_mode_does_not_fail(mod, sandbox) -> None:
    sandbox.spawn_worker(gpus=[0], mib=1000)
    r = mod("gpu_mem_verify", {"timeout": 0, "fail_on_dirty": False})
    assert r["_status"] == "ok" and r["clean"] is False and r["gpus"][0]["diagnosis"] == "busy"
    assert r["polls"] == 1


def test_memory_released_within_the_deadline_reads_clean_when_the_driver_frees_it(mod, node, sandbox) -> None:
    # A long release delay: the module starts while the driver still holds the memory (12 s: starting
    # ansible-playbook takes several seconds on a loaded 2-core CI machine; 4 s was seen to be too short).
    node.set_release_timing(delay_ms=12000)
    w = sandbox.spawn_worker(gpus=[2], mib=30000)
    w.kill()
    deadline = time.monotonic() + 5
    while not [c for c in node.contexts() if c["state"] == "releasing"]:
        assert time.monotonic() < deadline
        time.sleep(0.005)
    [ctx] = node.contexts()
    # The daemon's release stamp (CLOCK_MONOTONIC) as wall-clock time, to compare with the module's.
    released_at = time.time() + (ctx["release_ns"] - time.monotonic_ns()) / 1e9
    r = mod("gpu_mem_verify", {"timeout": 40, "interval": 0.02})
    assert r["_status"] == "ok", r
    record = r["_run"].task("Run gpuops.clean_slate.gpu_mem_verify")
    module_start = record["time"] - r["elapsed_s"]
    clean_at = module_start + r["time_to_clean_s"]
    # The order of events: it polled while the memory was held (more than one poll) and read the
    # GPU clean only once the driver had freed it (never before; 50 ms for the clock conversion),
    # within its deadline. How soon after is a benchmark's business.
    assert module_start < released_at, "the module started after the release: the machine is too slow for this test's delay"
    assert r["polls"] > 1
    assert clean_at >= released_at - 0.05, (clean_at, released_at)


@pytest.mark.parametrize(
    ("fault", "diagnosis", "words"),
    [
        ({"init_error": "LIB_RM_VERSION_MISMATCH"}, "driver_library_mismatch", "different versions"),
        ({"init_error": "DRIVER_NOT_LOADED"}, "driver_not_loaded", "kernel driver is not loaded"),
    ],
)
def test_driver_faults_give_a_diagnosis(mod, node, fault, diagnosis, words) -> None:
    node.set_fault(**fault)
    r = mod("gpu_mem_verify")
    assert r["_status"] == "failed"
    assert r["diagnosis"] == r["reason"] == diagnosis and words in r["msg"]
    assert r["gpus"] == [] and r["clean"] is False
    assert_no_traceback(r)


def test_missing_library_gives_a_diagnosis(mod) -> None:
    r = mod("gpu_mem_verify", library=False)
    assert r["_status"] == "failed"
    assert r["diagnosis"] == r["reason"] == "library_not_found"
    assert "libnvidia-ml.so.1 was not found" in r["msg"]
    assert_no_traceback(r)


def test_lost_gpu_is_diagnosed_without_waiting_out_the_timeout(mod, node) -> None:
    node.set_fault(lost=[5])
    r = mod("gpu_mem_verify", {"timeout": 20, "expected_count": 8})
    assert r["_status"] == "failed"
    g5 = r["gpus"][5]
    assert g5["diagnosis"] == "gpu_lost" and g5["clean"] is False and "reboot" in g5["detail"]
    assert all(g["clean"] for i, g in enumerate(r["gpus"]) if i != 5)
    assert "expected 8 GPUs, found 7 healthy of 8 (lost: GPU 5)" in r["msg"]
    assert r["polls"] == 1, "a lost GPU cannot recover by waiting: the first poll settles it"
    assert_no_traceback(r)


def test_driver_timeout_on_one_gpu(mod, node) -> None:
    node.set_fault(timeout={"functions": ["nvmlDeviceGetMemoryInfo_v2"], "gpus": [2]})
    r = mod("gpu_mem_verify", {"timeout": 0.3})
    assert r["_status"] == "failed"
    assert r["gpus"][2]["diagnosis"] == "unresponsive"
    assert r["clean_count"] == 7
    assert_no_traceback(r)


def test_orphaned_context_with_reset_flag(mod, node) -> None:
    node.set_fault(orphan={4: 4096}, recovery_action={4: 1})  # the driver asks for a GPU reset
    r = mod("gpu_mem_verify", {"timeout": 0.3})
    assert r["_status"] == "failed"
    g4 = r["gpus"][4]
    assert g4["used_mib"] == 4096 and g4["processes"] == []
    assert g4["recovery_action"] == "gpu_reset"
    assert g4["diagnosis"] == "orphaned_context"
    assert "nvidia-smi -r" in g4["detail"]
    # The plan names GPU 4 by its bus ID; nothing was reset (the orphan is still there).
    plan = r["reset_plan"]
    assert [(g["index"], g["why"]) for g in plan["gpus"]] == [(4, ["orphaned_context", "recovery_action"])] and plan["advisory"] is True
    assert f"nvidia-smi -r -i {g4['pci_bus_id']}" in r["msg"] and node.memory(4)["used_mib"] == 4096
    assert_no_traceback(r)


def test_memory_held_by_the_host_is_held_outside_the_namespace(mod, node) -> None:
    # The worker lives outside the sandbox (like a host process seen from an LXC guest).
    node.spawn_worker(gpus=[1], mib=8000)
    r = mod("gpu_mem_verify", {"timeout": 0.2})
    g1 = r["gpus"][1]
    assert g1["used_mib"] == 8000 + CONTEXT_OVERHEAD_MIB and g1["processes"] == []
    assert g1["diagnosis"] == "held_outside_namespace"
    assert "Proxmox host" in g1["detail"]


def test_foreign_pids_from_an_old_driver_are_held_outside_the_namespace(mod, node) -> None:
    outside = node.spawn_worker(gpus=[1], mib=8000)
    node.set_fault(legacy_pids=True)
    r = mod("gpu_mem_verify", {"timeout": 0.2})
    g1 = r["gpus"][1]
    # The old driver reports the host pid, which names nothing in this small namespace.
    assert [p["pid"] for p in g1["processes"]] == [outside.pid]
    assert g1["processes"][0]["visible"] is False
    assert g1["diagnosis"] == "held_outside_namespace"


def test_forked_child_is_named_although_nvml_lists_its_dead_parent(mod, sandbox) -> None:
    w = sandbox.spawn_worker(gpus=[6], mib=12000, fork_child=True)
    assert wait_for(lambda: not w.alive()) and w.child_alive()
    r = mod("gpu_mem_verify", {"timeout": 0.2})
    g6 = r["gpus"][6]
    assert g6["diagnosis"] == "busy"
    assert [p["pid"] for p in g6["processes"]] == [w.ns_pid]
    assert g6["processes"][0]["visible"] is False
    assert f"{w.child_ns_pid} (" in g6["detail"]
    assert "do not exist here" in g6["detail"]


def test_old_driver_without_memory_v2_is_estimated_and_says_so(mod, node, sandbox) -> None:
    node.set_fault(memory_v2_unsupported=True)
    sandbox.spawn_worker(gpus=[0], mib=5000)
    r = mod("gpu_mem_verify", {"timeout": 0, "fail_on_dirty": False})
    assert all(g["memory_api"] == "v1" for g in r["gpus"])
    assert [g["used_mib"] for g in r["gpus"]] == [5000 + CONTEXT_OVERHEAD_MIB] + [0] * 7
    assert {g["reserved_mib"] for g in r["gpus"]} == {615}
    assert any("lacks nvmlDeviceGetMemoryInfo_v2" in n for n in r["notes"])


@pytest.mark.parametrize("api", ["v1", "v2"])
def test_older_process_entry_points_are_probed(mod, node, sandbox, api) -> None:
    node.set_fault(process_api=api)
    w = sandbox.spawn_worker(gpus=[7], mib=3000)
    r = mod("gpu_mem_verify", {"timeout": 0, "fail_on_dirty": False})
    assert [(p["pid"], p["used_mib"]) for p in r["gpus"][7]["processes"]] == [(w.ns_pid, 3000)]


def test_not_available_process_memory_is_null(mod, node, sandbox) -> None:
    node.set_fault(memory_na=True)
    w = sandbox.spawn_worker(gpus=[7], mib=3000)
    r = mod("gpu_mem_verify", {"timeout": 0, "fail_on_dirty": False})
    assert [(p["pid"], p["used_mib"]) for p in r["gpus"][7]["processes"]] == [(w.ns_pid, None)]


def test_subset_by_index_uuid_and_device(mod, sandbox) -> None:
    sandbox.spawn_worker(gpus=[0], mib=1000)
    first = mod("gpu_mem_verify", {"gpus": [2], "timeout": 0})
    uuid2 = first["gpus"][0]["uuid"]
    r = mod("gpu_mem_verify", {"gpus": [1, uuid2, "/dev/nvidia3"], "timeout": 0})
    assert r["_status"] == "ok"
    assert [g["index"] for g in r["gpus"]] == [1, 2, 3]


def test_expected_count_mismatch_fails(mod) -> None:
    r = mod("gpu_mem_verify", {"expected_count": 9})
    assert (r["_status"], r["reason"]) == ("failed", "missing_gpus")
    assert "expected 9 GPUs, found 8 healthy of 8" in r["msg"]


def test_a_device_dir_without_gpu_files_is_a_warning(mod, sandbox, tmp_path) -> None:
    # The forked child NVML does not list can only be named through its device files.
    w = sandbox.spawn_worker(gpus=[6], mib=12000, fork_child=True)
    assert wait_for(lambda: not w.alive()) and w.child_alive()
    (tmp_path / "dev").mkdir()
    r = mod("gpu_mem_verify", {"timeout": 0.1, "device_dir": str(tmp_path / "dev")})
    assert r["_status"] == "failed"
    assert any(x.startswith("The GPU device files cannot be used (") and "holds no GPU device file" in x for x in r["warnings"]), r.get("warnings")
    assert str(w.child_ns_pid) not in r["gpus"][6]["detail"]
    r = mod("gpu_mem_verify", {"timeout": 0.1})
    assert not r.get("warnings") and f"{w.child_ns_pid} (" in r["gpus"][6]["detail"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ({"timeout": -1}, "timeout must be from 0 to 86400 seconds, got -1."),
        # Not finite or beyond a day: these used to hang (timeout nan, inf) or busy-loop (interval nan).
        ({"timeout": "nan"}, "timeout must be a finite number from 0 to 86400 seconds, got nan."),
        ({"timeout": "inf"}, "timeout must be a finite number from 0 to 86400 seconds, got inf."),
        ({"timeout": 86401}, "timeout must be from 0 to 86400 seconds, got 86401."),
        ({"interval": "nan"}, "interval must be a finite number from 0.001 to 60 seconds, got nan."),
        ({"interval": "inf"}, "interval must be a finite number from 0.001 to 60 seconds, got inf."),
        ({"interval": 61}, "interval must be from 0.001 to 60 seconds, got 61."),
        ({"expected_count": 5000}, "expected_count must be from 0 to 1024, got 5000."),
        ({"max_used_mib": 2**40}, "max_used_mib must be from 0 to 1048576 MiB"),
        ({"device_dir": "/nonexistent/dev"}, "device_dir: /nonexistent/dev does not exist on this host"),
        ({"fail_on_dirty": "maybe"}, "fail_on_dirty"),
        ({"gpus": [9]}, "gpus: GPU index 9 does not exist; this host has 8 GPU(s) (indices 0-7)"),
        ({"gpus": ["GPU-zz"]}, "gpus: 'GPU-zz' is neither a GPU index"),
        ({"max_used_mib": -5}, "max_used_mib must be from 0 to 1048576 MiB, got -5."),
        ({"interval": 0}, "interval must be from 0.001 to 60 seconds, got 0."),
        ({"gpus": ["GPU-99999999-1111-2222-3333-444444444444"]}, "gpus: no GPU on this host has UUID"),
    ],
)
def test_bad_input_names_the_option(mod, args, message) -> None:
    r = mod("gpu_mem_verify", args)
    assert r["_status"] == "failed"
    assert message in r["msg"], r["msg"]
    assert r["reason"] == "bad_arguments"
    assert_no_traceback(r)


def test_check_mode_reads_the_same(mod, sandbox) -> None:
    sandbox.spawn_worker(gpus=[5], mib=2000)
    r = mod("gpu_mem_verify", {"timeout": 0, "fail_on_dirty": False}, check=True)
    assert r["_status"] == "ok" and r["changed"] is False
    assert r["gpus"][5]["used_mib"] == 2000 + CONTEXT_OVERHEAD_MIB


def bare_python() -> str | None:
    """A Python 3.9 without the collection's dependencies (pyenv's), to play a bare target."""
    import glob

    found = sorted(glob.glob(os.path.expanduser("~/.pyenv/versions/3.9.*/bin/python3")))
    return found[-1] if found else None


@pytest.mark.skipif(bare_python() is None, reason="no bare Python 3.9 on this machine")
def test_missing_python_dependencies_give_install_advice_on_python_39(mod) -> None:
    r = mod("gpu_mem_verify", interpreter=bare_python())
    assert r["_status"] == "failed"
    assert r["diagnosis"] == "missing_library"
    assert "nvidia-ml-py" in r["msg"] and "Failed to import the required Python library" in r["msg"]
    assert set(r["python"]["missing"]) == {"nvidia-ml-py", "psutil", "jmespath"}
    assert r["python"]["version"].startswith("3.9.")
    k = mod("gpu_procs_kill", interpreter=bare_python())
    assert k["_status"] == "failed" and "psutil" in k["msg"]
    assert_no_traceback(k)
