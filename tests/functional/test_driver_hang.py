"""A hung driver cannot hang the run: through Ansible on the simulated node, with the simulator's hang fault
(an NVML call that never returns, on a chosen GPU), the modules return within their bound with ``driver_hung``,
report the other GPUs, and leave no process of theirs behind."""

from __future__ import annotations

import datetime
import os

from gpusim.procfs import pidns_inode
from support.modules import assert_no_traceback


def seconds(result: dict) -> float:
    """The module's own duration, from the start and end it reports."""
    return (datetime.datetime.fromisoformat(result["end"]) - datetime.datetime.fromisoformat(result["start"])).total_seconds()


def left_in(sandbox, keep: set[int]) -> list[tuple[int, str]]:
    """Processes of the sandbox's PID namespace other than its init and ``keep``: what the Ansible run left."""
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) in keep or int(name) == sandbox.init_pid:
            continue
        try:
            if pidns_inode(int(name)) != sandbox.ns_inode:
                continue
            with open(f"/proc/{name}/cmdline", "rb") as fh:
                out.append((int(name), fh.read().replace(b"\0", b" ").decode(errors="replace")))
        except OSError:
            continue
    return out


def test_a_gpu_whose_call_hangs_is_driver_hung_within_the_bound_and_the_others_are_reported(mod, node, sandbox) -> None:
    busy = sandbox.spawn_worker(gpus=[0], mib=20000, title="sglang::scheduler_TP0")  # keeps the module polling to its timeout
    node.set_fault(hang={"functions": ["nvmlDeviceGetMemoryInfo"], "gpus": [2]})
    r = mod("gpu_mem_verify", {"timeout": 3, "probe_timeout": 1, "interval": 0.05})
    assert (r["_status"], r["reason"]) == ("failed", "not_clean"), r
    # The bound: the module's timeout plus one second, although GPU 2's call never returned.
    assert seconds(r) <= 3 + 1, seconds(r)
    # No CUDA start on a node whose driver hangs (a helper stuck there outlives its SIGKILL), each GPU saying why.
    assert all(g["startable"]["ok"] is None and "driver_hung" in g["startable"]["skipped"] for g in r["gpus"]), [g["startable"] for g in r["gpus"]]
    by_index = {g["index"]: g for g in r["gpus"]}
    assert by_index[2]["diagnosis"] == "driver_hung" and by_index[2]["clean"] is False
    assert "nvmlDeviceGetMemoryInfo_v2 did not return within 1.0 s" in by_index[2]["detail"] and "reboot" in by_index[2]["detail"]
    assert by_index[2]["uuid"] == node.gpus[2].uuid  # its identity was read before the hang
    # The other GPUs are still reported: GPU 0 busy (named), the rest clean.
    assert by_index[0]["diagnosis"] == "busy" and [p["pid"] for p in by_index[0]["processes"]] == [busy.ns_pid]
    assert [i for i, g in by_index.items() if g["clean"]] == [1, 3, 4, 5, 6, 7]
    assert "GPU 2 (" in r["msg"] and "driver_hung" in r["msg"]
    assert r["polls"] > 1 and r["driver_version"] == "580.159.04"
    # No process of the module is left behind: only the sandbox's init and the worker live in its namespace.
    assert left_in(sandbox, {busy.pid}) == []
    assert_no_traceback(r)


def test_a_hang_when_nvml_opens_fails_the_module_with_driver_hung(mod, node, sandbox) -> None:
    node.set_fault(hang=["nvmlDeviceGetCount"])
    r = mod("gpu_mem_verify", {"timeout": 30, "probe_timeout": 1})
    assert (r["_status"], r["reason"]) == ("failed", "driver_hung"), r
    assert r["msg"].startswith("nvmlDeviceGetCount_v2 did not return within 1.0 s") and "reboot" in r["msg"]
    assert r["call"] == "nvmlDeviceGetCount_v2" and r["clean"] is False and r["gpus"] == []
    assert left_in(sandbox, set()) == []
    assert_no_traceback(r)


def test_every_gpu_hung_still_returns_in_time(mod, node, sandbox) -> None:
    # Each GPU hangs in its own helper in turn; the overall end caps them all.
    node.set_fault(hang={"functions": ["nvmlDeviceGetComputeRunningProcesses"], "gpus": []})
    r = mod("gpu_mem_verify", {"timeout": 2, "probe_timeout": 0.5})
    assert (r["_status"], r["reason"]) == ("failed", "not_clean"), r
    assert seconds(r) <= 2 + 1, seconds(r)
    assert {g["diagnosis"] for g in r["gpus"]} <= {"driver_hung", "unresponsive"}
    assert sum(g["diagnosis"] == "driver_hung" for g in r["gpus"]) >= 3
    assert left_in(sandbox, set()) == []


def test_the_kill_ends_the_holders_of_a_hung_gpu_through_its_device_file(mod, node, sandbox) -> None:
    node.set_fault(hang={"functions": ["nvmlDeviceGetComputeRunningProcesses"], "gpus": [1]})
    w0 = sandbox.spawn_worker(gpus=[0], mib=20000, title="sglang::scheduler_TP0")
    w1 = sandbox.spawn_worker(gpus=[1], mib=20000, title="sglang::scheduler_TP1")
    r = mod("gpu_procs_kill", {"grace_period": 2, "kill_timeout": 2, "probe_timeout": 1})
    assert r["_status"] == "ok", r
    targets = {t["pid"]: t for t in r["targets"]}
    assert targets[w0.ns_pid]["outcome"] == "terminated" and any(x.startswith("listed by NVML on GPU") for x in targets[w0.ns_pid]["reasons"])
    # GPU 1's listing hung: its holder was found through the device file, and ended.
    assert targets[w1.ns_pid]["outcome"] == "terminated"
    assert not any(x.startswith("listed by NVML") for x in targets[w1.ns_pid]["reasons"])
    assert any(x.startswith("holds nvidia") for x in targets[w1.ns_pid]["reasons"])
    assert not w0.alive() and not w1.alive()
    warnings = " ".join(r.get("warnings", []))
    assert "NVML did not answer within probe_timeout (1.0 s) for GPU(s) [1]" in warnings and "reboot" in warnings
    assert any("GPU 1: NVML process list unavailable" in n and "did not return" in n for n in r["notes"])
    assert left_in(sandbox, set()) == []
