"""gpu_mem_verify's health verdict through Ansible on the simulated node: every verdict, from the state the real
world leaves (Xid lines in the kernel log, the driver's recovery action, remapped rows, the fabric, modes and an MPS
daemon left behind), read the way the module reads a real node."""

from __future__ import annotations

import datetime
import time

from gpusim import Node
from support.modules import ModuleRunner, assert_no_traceback


def verify(mod: ModuleRunner, **args: object) -> dict:
    args.setdefault("kernel_log", str(mod.node.kernel_log))
    args.setdefault("timeout", 0)
    return mod("gpu_mem_verify", args)


def test_an_idle_h200_node_is_ok_with_every_reading_an_h200_gives(mod, node) -> None:
    r = verify(mod)
    assert r["_status"] == "ok", r
    h = r["health"]
    assert (h["verdict"], h["fail_on"], h["evidence"], h["findings"]) == ("ok", "fix_config", [], [])
    assert r["reset_plan"] is None and r["elapsed_s"] >= r["cuda_s"] > 0 and r["elapsed_s"] >= r["poll_s"]
    # An HGX H200 has a fabric; it is up, so a fabric manager that is not running is no finding.
    assert h["host"] == {
        "mps_daemon": [],
        "fabricmanager": "not_running",
        "kernel_log": "kmsg",
        "kernel_log_read": {"complete": True, "skipped_bytes": 0, "read_from": None},
    }
    for g in r["gpus"]:
        assert g["health"]["verdict"] == "ok" and g["health"]["evidence"] == []
        assert g["health"]["readings"] == {
            "recovery_action": "none",
            "xid": [],
            "remapped_rows": {"correctable": 0, "uncorrectable": 0, "pending": False, "failure": False},
            # Page retirement ended with Volta: an H200 answers NOT_SUPPORTED, which is null, not a guess.
            "retired_pages": None,
            "ecc_volatile_uncorrected": 0,
            "fabric": {"state": "completed", "status": 0, "cluster_uuid": "5a0000000000000000000000000000a5", "clique_id": 1},
            "compute_mode": "default",
            "mig_mode": {"current": False, "pending": False},
            "persistence_mode": True,
        }


def test_an_application_xid_since_the_start_is_restart_app_and_an_older_one_is_ignored(mod, node) -> None:
    node.xid(1, 79)  # before `since`: a reset or reboot has dealt with it
    time.sleep(0.05)
    since = time.time()
    time.sleep(0.05)
    line = node.xid(2, 13, pid=4242, name="python3")
    r = verify(mod, since=since)
    assert r["_status"] == "ok", r  # below fail_on (reset_gpu)
    g2 = r["gpus"][2]["health"]
    assert g2["verdict"] == "restart_app"
    [event] = g2["readings"]["xid"]
    assert (event["xid"], event["bucket"], event["line"]) == (13, "RESTART_APP", line)
    assert since <= event["time"] <= time.time()
    assert r["gpus"][1]["health"]["readings"]["xid"] == [] and r["gpus"][1]["health"]["verdict"] == "ok"
    assert r["health"]["verdict"] == "restart_app"
    assert r["health"]["evidence"][0].startswith("GPU 2: restart_app: Xid 13")
    assert "Health: restart_app" in r["msg"]


def test_a_pending_row_remap_is_reset_gpu_and_fails_at_the_default_threshold(mod, node) -> None:
    node.set_health(4, remap_uncorrectable=1, remap_pending=1)
    r = verify(mod)
    assert (r["_status"], r["reason"]) == ("failed", "unhealthy"), r
    assert r["clean"] is False and r["clean_count"] == 8  # the memory is clean; the health is not
    g4 = r["gpus"][4]["health"]
    assert g4["verdict"] == "reset_gpu"
    assert g4["readings"]["remapped_rows"] == {"correctable": 0, "uncorrectable": 1, "pending": True, "failure": False}
    assert "row remapping is pending" in g4["evidence"][0] and g4["findings"][0]["name"] == "row_remap_pending"
    assert "fail_on is fix_config" in r["msg"]
    # The advisory reset plan: GPU 4 alone (an HGX H200: from Hopper on each GPU alone), on this host, by its bus ID,
    # the daemon that holds it stopped before and started after; nothing was reset.
    plan = r["reset_plan"]
    assert plan["advisory"] is True and [(g["index"], g["why"]) for g in plan["gpus"]] == [(4, ["row_remap_pending"])]
    assert plan["where"] == "this host" and plan["together"] == ""
    bus = r["gpus"][4]["pci_bus_id"]
    reset = [c for c in plan["commands"] if c.startswith("nvidia-smi -r")]
    assert [c.split("  #")[0] for c in reset] == [f"nvidia-smi -r -i {bus}"] and f"nvidia-smi -r -i {bus}" in r["msg"]
    assert r["lines"][-2].startswith("Reset plan (advisory: nothing was reset): reset GPU 4, on this host")
    assert_no_traceback(r)
    # fail_on: never reports the same verdict without failing.
    r = verify(mod, fail_on="never")
    assert r["_status"] == "ok" and r["clean"] is True and r["health"]["verdict"] == "reset_gpu"


def test_a_gpu_that_fell_off_the_bus_in_the_log_is_reboot(mod, node) -> None:
    since = time.time()
    node.xid(6, 79)
    r = verify(mod, since=since, fail_on="reboot")
    assert (r["_status"], r["reason"]) == ("failed", "unhealthy"), r
    assert r["gpus"][6]["health"]["verdict"] == "reboot"
    assert r["health"]["verdict"] == "reboot"
    assert "reboot" in r["msg"]


def test_the_drivers_recovery_action_gives_the_verdict(mod, node) -> None:
    node.set_fault(recovery_action={3: 2})  # NODE_REBOOT
    r = verify(mod, fail_on="drain")
    # Memory judgement first: the recovery action makes the GPU not clean (needs_reset), as before.
    assert (r["_status"], r["reason"]) == ("failed", "not_clean"), r
    g3 = r["gpus"][3]
    assert g3["diagnosis"] == "needs_reset"
    assert g3["health"]["verdict"] == "reboot" and g3["health"]["readings"]["recovery_action"] == "node_reboot"


def test_a_failed_row_remap_is_drain_and_its_xid_64_alone_a_reset(mod, node) -> None:
    """NVML's remap failure is an RMA case (drain); the catalog's immediate action for the Xid 64 line alone is a reset."""
    since = time.time()
    node.set_health(0, remap_failure=1)
    node.xid(1, 64)
    r = verify(mod, since=since, fail_on="drain")
    assert (r["_status"], r["reason"]) == ("failed", "unhealthy"), r
    assert r["gpus"][0]["health"]["verdict"] == "drain" and r["health"]["verdict"] == "drain"
    assert r["gpus"][1]["health"]["verdict"] == "reset_gpu"
    assert [(e["xid"], e["bucket"]) for e in r["gpus"][1]["health"]["readings"]["xid"]] == [(64, "RESET_GPU")]


def test_one_xid_of_each_bucket_on_a_gpu_each_gives_the_catalogs_verdict(mod, node) -> None:
    """The Xids whose bucket was read wrong before (43, 45, 63, 109) and one of each other bucket, as the driver logs them."""
    since = time.time()
    logged = {0: 43, 1: 45, 2: 63, 3: 109, 4: 13, 5: 142, 6: 54, 7: 57}
    for gpu, xid in logged.items():
        node.xid(gpu, xid, text={142: "NVENC3 Error", 54: "Auxiliary power is not connected to the GPU board"}.get(xid))
    r = verify(mod, since=since, fail_on="never")
    assert r["_status"] == "ok", r
    got = {g["index"]: (g["health"]["readings"]["xid"][0]["bucket"], g["health"]["verdict"]) for g in r["gpus"]}
    assert got == {
        0: ("IGNORE", "ok"),
        1: ("IGNORE", "ok"),
        2: ("IGNORE", "ok"),
        3: ("RESET_GPU", "reset_gpu"),
        4: ("RESTART_APP", "restart_app"),
        5: ("CONTACT_SUPPORT", "drain"),
        6: ("CHECK_MECHANICALS", "drain"),
        # Unused on these GPUs: the catalog's (and NVSentinel's) CONTACT_SUPPORT.
        7: ("CONTACT_SUPPORT", "drain"),
    }
    # An Xid the catalog gives no action yet (166) is treated as a reset, and says so.
    node.xid(7, 166)
    r = verify(mod, since=since, fail_on="never")
    assert [(e["xid"], e["bucket"]) for e in r["gpus"][7]["health"]["readings"]["xid"]] == [(57, "CONTACT_SUPPORT"), (166, "UNKNOWN")]
    assert any("Xid 166" in e and "not in the collection's table" in e for e in r["health"]["evidence"])


def test_a_fabric_not_up_without_fabric_manager_is_fix_config_and_says_start_it(mod, node, sandbox) -> None:
    node.set_health([0, 1], fabric_state="in_progress")
    r = verify(mod)
    # CUDA cannot start there (error 802): the GPUs are not clean, whatever the health verdict says (issue 29).
    assert (r["_status"], r["reason"]) == ("failed", "not_clean"), r
    assert [g["diagnosis"] for g in r["gpus"][:3]] == ["fabric_not_ready", "fabric_not_ready", "clean"]
    # Fabric Manager brings the fabric up, not a reset: a configuration fault, no reset plan.
    assert r["gpus"][0]["startable"]["code"] == 802 and r["health"]["verdict"] == "fix_config" and r["reset_plan"] is None
    assert {k: r["gpus"][0]["health"]["readings"]["fabric"][k] for k in ("state", "status")} == {"state": "in_progress", "status": 0}
    assert r["health"]["host"]["fabricmanager"] == "not_running"
    assert any("nvidia-fabricmanager is not running" in e for e in r["health"]["evidence"])
    # With the fabric manager running (a stand-in process of that name), the GPUs still wait for it.
    node.spawn_daemon("nv-fabricmanager", sandbox=sandbox)
    r = verify(mod)
    assert r["health"]["host"]["fabricmanager"] == "running"
    assert not any("nvidia-fabricmanager is not running" in e for e in r["health"]["evidence"])
    assert r["gpus"][1]["health"]["verdict"] == "fix_config"


def test_exclusive_compute_mode_and_an_mps_daemon_left_behind_are_restart_app(mod, node, sandbox) -> None:
    node.set_compute_mode(5, "exclusive_process")
    mps = node.spawn_daemon("nvidia-cuda-mps-control", sandbox=sandbox)
    r = verify(mod)
    assert r["_status"] == "ok", r
    assert r["gpus"][5]["health"]["readings"]["compute_mode"] == "exclusive_process"
    assert r["gpus"][5]["health"]["verdict"] == "restart_app"
    assert r["health"]["host"]["mps_daemon"] == [mps.ns_pid]
    assert r["health"]["verdict"] == "restart_app"
    assert any("MPS daemon" in e and str(mps.ns_pid) in e for e in r["health"]["evidence"])
    r = verify(mod, fail_on="restart_app")
    assert (r["_status"], r["reason"]) == ("failed", "unhealthy")


def test_a_pending_mig_change_and_volatile_ecc_errors(mod, node) -> None:
    node.set_health(7, mig_pending=1, ecc_volatile_uncorrected=3, persistence=0)
    r = verify(mod, fail_on="never")
    g7 = r["gpus"][7]["health"]
    assert g7["readings"]["mig_mode"] == {"current": False, "pending": True}
    assert g7["readings"]["ecc_volatile_uncorrected"] == 3 and g7["readings"]["persistence_mode"] is False
    assert g7["verdict"] == "reset_gpu"
    assert [e.split(":")[0] for e in g7["evidence"]] == ["restart_app", "reset_gpu"]


def test_a_consumer_gpu_reports_null_where_it_has_no_such_feature() -> None:
    with Node(gpus=1, name="NVIDIA GeForce RTX 4090", total_mib=24564, reserved_mib=300) as node:
        sb = node.sandbox()
        try:
            r = verify(ModuleRunner(node, sb))
        finally:
            sb.stop()
    assert r["_status"] == "ok", r
    readings = r["gpus"][0]["health"]["readings"]
    for key in ("remapped_rows", "retired_pages", "ecc_volatile_uncorrected", "fabric", "mig_mode"):
        assert readings[key] is None, key
    assert readings["compute_mode"] == "default" and readings["persistence_mode"] is True
    assert r["health"]["host"]["fabricmanager"] == "not_needed"


def test_health_off_and_bad_health_options(mod) -> None:
    r = verify(mod, health=False)
    assert r["_status"] == "ok" and r["health"] is None and "health" not in r["gpus"][0]
    for since in ("yesterday-ish", "nan", "inf", "-inf"):
        r = verify(mod, since=since)
        assert (r["_status"], r["reason"], r.get("option")) == ("failed", "bad_arguments", "since"), r
    r = verify(mod, since="2026-12-01T08:00:00Z")
    assert r["_status"] == "ok" and r["health"]["since"] == datetime.datetime(2026, 12, 1, 8, tzinfo=datetime.timezone.utc).timestamp()


def test_a_health_query_that_hangs_is_a_hung_driver_and_the_others_are_judged(mod, node) -> None:
    node.set_fault(hang={"functions": ["nvmlDeviceGetRemappedRows"], "gpus": [3]})
    node.set_health(5, remap_pending=1)
    r = verify(mod, probe_timeout=1)
    assert (r["_status"], r["reason"]) == ("failed", "not_clean"), r
    g3 = r["gpus"][3]
    assert g3["diagnosis"] == "driver_hung" and g3["clean"] is False and "nvmlDeviceGetRemappedRows" in g3["detail"]
    assert g3["health"]["verdict"] == "reboot" and g3["health"]["readings"]["remapped_rows"] is None
    # The GPUs after it were still read, by a fresh helper.
    assert r["gpus"][5]["health"]["verdict"] == "reset_gpu" and r["gpus"][7]["health"]["readings"]["fabric"] is not None
    assert r["health"]["verdict"] == "reboot"


def test_fail_on_ok_fails_on_any_finding_and_never_on_a_healthy_host(mod, node) -> None:
    """What the documentation says: a finding at or above fail_on fails the host; a healthy host never fails."""
    r = verify(mod, fail_on="ok")
    assert r["_status"] == "ok" and r["health"]["verdict"] == "ok", r
    node.xid(2, 13, pid=4242, name="python3")
    for fail_on in ("ok", "restart_app"):
        r = verify(mod, fail_on=fail_on, since=time.time() - 60)
        assert (r["_status"], r["reason"], r["health"]["verdict"]) == ("failed", "unhealthy", "restart_app"), r
    r = verify(mod, fail_on="reset_gpu", since=time.time() - 60)
    assert r["_status"] == "ok" and r["health"]["verdict"] == "restart_app"


def test_the_newest_xid_of_a_50_mb_kernel_log_is_read_and_the_result_says_what_was_not(mod, node) -> None:
    """A busy node's kern.log: 50 MB of other records, then the GPU falls off the bus."""
    since = time.time()
    start_us = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000 - 3_600_000_000
    filler = b"".join(f"6,{i},{start_us + i},-;eth0: link flap {i:08d} {'x' * 80}\n".encode() for i in range(1000))
    with node.kernel_log.open("ab") as fh:
        while fh.tell() < 50 * 1024 * 1024:
            fh.write(filler)
    node.xid(6, 79)
    r = verify(mod, since=since - 7200)
    assert (r["_status"], r["reason"]) == ("failed", "unhealthy"), r
    assert r["gpus"][6]["health"]["verdict"] == "reboot" and [e["xid"] for e in r["gpus"][6]["health"]["readings"]["xid"]] == [79]
    read = r["health"]["host"]["kernel_log_read"]
    assert read["complete"] is True and read["skipped_bytes"] > 30 * 1024 * 1024 and since - 7200 < read["read_from"] < since
    assert any("only its newest records were read" in n and "were not seen" in n for n in r["notes"]), r["notes"]
