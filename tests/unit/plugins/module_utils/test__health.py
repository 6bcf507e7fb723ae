"""_health: the Xid catalog buckets, the kernel log readers, and the pure verdicts of a GPU and of a host."""

from __future__ import annotations

import datetime
import shutil
import subprocess
import time
import typing as t

import pytest

from ansible_collections.gpuops.clean_slate.plugins.module_utils import _health

NONE = dict.fromkeys(_health.READING_KEYS)


def readings(**kw: object) -> dict:
    return {**NONE, **kw}


# ---------------------------------------------------------------------- order


def test_the_verdicts_are_ordered_and_fail_on_fails_a_finding_at_or_above_it() -> None:
    """What gpu_mem_verify's fail_on documentation says: a finding at or above fail_on fails; a healthy GPU never does."""
    assert _health.VERDICTS == ("ok", "restart_app", "fix_config", "reset_gpu", "reboot", "drain")
    assert _health.worst([]) == "ok"
    assert _health.worst(["restart_app", "drain", "reset_gpu"]) == "drain"
    assert _health.fails("reset_gpu", "reset_gpu") and _health.fails("reboot", "reset_gpu")
    assert not _health.fails("restart_app", "reset_gpu")
    # A configuration fault fails at the default (fix_config), and is only reported from reset_gpu up.
    assert _health.fails("fix_config", "fix_config") and not _health.fails("fix_config", "reset_gpu") and not _health.fails("restart_app", "fix_config")
    # fail_on: ok fails on any finding, as restart_app does, and never on a healthy verdict.
    assert [v for v in _health.VERDICTS if _health.fails(v, "ok")] == [v for v in _health.VERDICTS if _health.fails(v, "restart_app")]
    assert not _health.fails("ok", "ok")
    assert not any(_health.fails(v, "never") for v in _health.VERDICTS)


# ---------------------------------------------------------------------- Xid catalog


@pytest.mark.parametrize(
    ("xid", "bucket"),
    [
        (13, "RESTART_APP"),
        (31, "RESTART_APP"),
        (43, "IGNORE"),
        (45, "IGNORE"),
        (48, "RESET_GPU"),
        (63, "IGNORE"),
        (64, "RESET_GPU"),
        (109, "RESET_GPU"),
        (79, "RESTART_BM"),
        (92, "IGNORE"),
        (95, "RESET_GPU"),
        (119, "RESET_GPU"),
        (9999, "UNKNOWN"),
    ],
)
def test_xid_buckets(xid: int, bucket: str) -> None:
    assert _health.xid_bucket(xid) == bucket


@pytest.mark.parametrize(
    ("text", "bucket"),
    [
        ("GPU recovery action changed from 0x0 (None) to 0x1 (GPU Reset Required)", "RESET_GPU"),
        ("GPU recovery action changed from 0x0 (None) to 0x2 (Node Reboot Required)", "RESTART_BM"),
        ("GPU recovery action changed from 0x0 (None) to 0x3 (Drain P2P)", "DRAIN_P2P"),
        ("GPU recovery action changed from 0x1 (GPU Reset Required) to 0x0 (None)", "IGNORE"),
        ("something else", "RESET_GPU"),
    ],
)
def test_xid_154_carries_the_new_recovery_action(text: str, bucket: str) -> None:
    assert _health.xid_bucket(154, text) == bucket


# ---------------------------------------------------------------------- the kernel log

KMSG = (
    b"6,0,1000000,-;NVRM: loading NVIDIA UNIX Open Kernel Module for x86_64  580.159.04  Release Build\n"
    b" SUBSYSTEM=pci\n"
    b" DEVICE=+pci:0000:18:00.0\n"
    b"4,1,5000000,-;NVRM: Xid (PCI:0000:18:00): 13, pid=4242, name=python3, Graphics SM Warp Exception\n"
    b"4,2,9000000,-;NVRM: Xid (PCI:0000:2a:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.\n"
    b"garbage without a header\n"
)


def test_kmsg_records_become_epoch_times_and_xids_are_found_since_a_time() -> None:
    assert [when for when, _m in _health.parse_kmsg(KMSG, boot=1000.0, needle=None)] == [1001.0, 1005.0, 1009.0]
    messages = _health.parse_kmsg(KMSG, boot=1000.0)
    assert [when for when, _m in messages] == [1005.0, 1009.0]
    events = _health.xid_events(messages, since=1002.0)
    assert [(e["xid"], e["bus"], e["bucket"], e["time"]) for e in events] == [
        (13, (0, 0x18, 0), "RESTART_APP", 1005.0),
        (79, (0, 0x2A, 0), "RESTART_BM", 1009.0),
    ]
    assert events[0]["line"].startswith("NVRM: Xid (PCI:0000:18:00): 13,")
    assert _health.xid_events(messages, since=1006.0)[0]["xid"] == 79


def test_a_file_in_kmsg_format_is_read_like_dev_kmsg(tmp_path) -> None:
    log = tmp_path / "kmsg"
    boot = _health.boot_epoch()
    now_us = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    log.write_bytes(f"4,0,{now_us},-;NVRM: Xid (PCI:0000:18:00): 48, pid=1, name=x, DBE\n".encode())
    source, events, read = _health.read_xids(time.time() - 60, str(log))
    assert source == "kmsg" and read == {"complete": True, "skipped_bytes": 0, "read_from": None}
    [event] = events
    assert event["xid"] == 48 and event["bucket"] == "RESET_GPU"
    assert abs(event["time"] - (boot + now_us / 1e6)) < 1


@pytest.mark.parametrize(
    ("xid", "text", "bucket", "verdict"),
    [
        (45, "pid=4242, name=python3, Ch 00000008", "IGNORE", "ok"),
        (13, "pid=4242, name=python3, Graphics SM Warp Exception", "RESTART_APP", "restart_app"),
        (64, "Row Remapper: Failed to mark a row for remapping.", "RESET_GPU", "reset_gpu"),
        (79, "pid='<unknown>', name=<unknown>, GPU has fallen off the bus.", "RESTART_BM", "reboot"),
        (142, "NVENC3 error", "CONTACT_SUPPORT", "drain"),
        (54, "Auxiliary power is not connected to the GPU board", "CHECK_MECHANICALS", "drain"),
        (154, "GPU recovery action changed from 0x0 (None) to 0x3 (Drain P2P)", "DRAIN_P2P", "drain"),
        (57, "pid='<unknown>', name=<unknown>, unused on these GPUs", "CONTACT_SUPPORT", "drain"),
        (166, "pid='<unknown>', name=<unknown>, no action in the catalog yet", "UNKNOWN", "reset_gpu"),
        (78, "vGPU start error", "UPDATE_SWFW", "fix_config"),
    ],
)
def test_each_bucket_read_from_a_kernel_log_gives_its_verdict(tmp_path, xid: int, text: str, bucket: str, verdict: str) -> None:
    """One Xid of each bucket, as the driver prints it, read from a kernel log and judged."""
    log = tmp_path / "kmsg"
    now_us = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    log.write_bytes(kmsg_line(7, now_us, f"NVRM: Xid (PCI:0000:18:00): {xid}, {text}", prio=4))
    _source, events, _read = _health.read_xids(time.time() - 60, str(log))
    assert [(e["xid"], e["bucket"]) for e in events] == [(xid, bucket)]
    judged_readings = readings(xid=[{k: v for k, v in e.items() if k != "bus"} for e in events])
    judged = _health.judge_gpu(judged_readings)
    assert judged["verdict"] == verdict
    assert (judged["evidence"] == []) is (verdict == "ok")


def test_an_unreadable_kernel_log_is_none(tmp_path) -> None:
    assert _health.read_kmsg(str(tmp_path / "missing")) is None


def kmsg_line(seq: int, usec: int, message: str, prio: int = 6) -> bytes:
    return f"{prio},{seq},{usec},-;{message}\n".encode()


def test_a_50_mb_kernel_log_is_read_from_its_end_and_says_what_it_did_not_read(tmp_path) -> None:
    """/var/log/kern.log on a busy node: the newest Xid is at the end, 50 MB in; the oldest records are the ones left."""
    log = tmp_path / "kern.log"
    now_us = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    start_us = now_us - 3_600_000_000  # the log covers the last hour
    filler = b"".join(kmsg_line(i, start_us + i, f"eth0: link flap {i:08d} " + "x" * 80) for i in range(1000))
    with log.open("wb") as fh:
        fh.write(kmsg_line(0, start_us, "NVRM: Xid (PCI:0000:18:00): 13, pid=1, name=x, old application error"))
        while fh.tell() < 50 * 1024 * 1024:
            fh.write(filler)
        fh.write(kmsg_line(999999, now_us, "NVRM: Xid (PCI:0000:2a:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus."))
    size = log.stat().st_size
    read = _health.read_kmsg(str(log))
    assert read is not None and read.complete
    # Memory stays bounded: only the Xid records are kept, not 16 MiB of the log.
    assert read.data.count(b"\n") == 1 and b": 79," in read.data
    assert size - _health.MAX_LOG_BYTES <= read.skipped_bytes < size - _health.MAX_LOG_BYTES + 200
    since = time.time() - 7200  # the job started before the oldest record that was read
    source, events, info = _health.read_xids(since, str(log))
    assert source == "kmsg" and [e["xid"] for e in events] == [79]
    assert info["skipped_bytes"] == read.skipped_bytes and info["complete"] is True
    assert since < info["read_from"] < time.time()
    note = _health.unread_note(info, since, str(log))
    assert note is not None and "only its newest records were read" in note and "Xid errors logged between since and then were not seen" in note
    assert "they are all older than since" in t.cast(str, _health.unread_note(info, info["read_from"] + 1, str(log)))
    assert _health.unread_note({"complete": True, "skipped_bytes": 0, "read_from": None}, since, str(log)) is None


def test_dev_kmsg_is_read_to_its_end_keeping_only_xid_records() -> None:
    """The kernel's own ring buffer, read as the module reads it (root in this PID namespace may read it)."""
    read = _health.read_kmsg("/dev/kmsg", needle=b"NVRM: Xid")
    if read is None:
        pytest.skip("/dev/kmsg is not readable here")
    assert read.complete and read.skipped_bytes == 0
    assert all(b"NVRM: Xid" in line for line in read.data.splitlines())
    everything = _health.read_kmsg("/dev/kmsg", needle=b";")
    assert everything is not None and everything.complete and everything.data.count(b"\n") > 0
    # A read that takes longer than its bound stops and says so (a clock that has already run out).
    clock = iter(range(0, 10**9, 10)).__next__
    slow = _health.read_kmsg("/dev/kmsg", needle=b";", max_s=0.0, clock=lambda: float(clock()))
    assert slow is not None
    lines = everything.data.count(b"\n")
    assert slow.complete is (lines < 1024)
    if not slow.complete:
        assert "could not be read to its end" in t.cast(str, _health.unread_note({"complete": False}, 0.0, "/dev/kmsg"))


def test_bus_keys_of_nvml_and_of_an_xid_line_agree() -> None:
    assert _health.bus_key("00000000:18:00.0") == _health.bus_key("0000:18:00") == (0, 0x18, 0)
    assert _health.bus_key(None) is None and _health.bus_key("nonsense") is None


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (None, 5.0),
        ("", 5.0),
        (1796112000, 1796112000.0),
        ("1796112000.5", 1796112000.5),
        ("2026-12-01T08:00:00Z", datetime.datetime(2026, 12, 1, 8, tzinfo=datetime.timezone.utc).timestamp()),
        ("2026-12-01 08:00:00+01:00", datetime.datetime(2026, 12, 1, 7, tzinfo=datetime.timezone.utc).timestamp()),
        ("yesterday", None),
        (True, None),
        # Not a time: nan would count every Xid, inf none.
        (float("nan"), None),
        (float("inf"), None),
        ("nan", None),
        ("-inf", None),
    ],
)
def test_since(value: object, expected: float | None) -> None:
    assert _health.parse_since(value, 5.0) == expected


# ---------------------------------------------------------------------- a GPU's verdict


def test_a_gpu_with_nothing_to_say_is_ok() -> None:
    r = readings(recovery_action="none", xid=[], compute_mode="default", persistence_mode=False, mig_mode={"current": True, "pending": True})
    h = _health.judge_gpu(r, "clean")
    assert h == {"verdict": "ok", "evidence": [], "findings": [], "readings": r}


@pytest.mark.parametrize(
    ("r", "verdict", "words"),
    [
        (readings(recovery_action="gpu_reset"), "reset_gpu", "recovery action is gpu_reset"),
        (readings(recovery_action="node_reboot"), "reboot", "node_reboot"),
        (readings(recovery_action="drain_p2p"), "drain", "drain_p2p"),
        (readings(recovery_action="drain_and_reset"), "drain", "drain_and_reset"),
        (readings(remapped_rows={"correctable": 0, "uncorrectable": 1, "pending": True, "failure": False}), "reset_gpu", "row remapping is pending"),
        (readings(remapped_rows={"correctable": 0, "uncorrectable": 1, "pending": False, "failure": True}), "drain", "RMA"),
        (readings(retired_pages={"pending": True, "single_bit": 0, "double_bit": 1}), "reset_gpu", "page retirement is pending"),
        (readings(ecc_volatile_uncorrected=2), "restart_app", "2 uncorrectable ECC"),
        # Fabric Manager brings the fabric up, not a reset.
        (readings(fabric={"state": "not_started", "status": 0}), "fix_config", "fabric is not_started"),
        (readings(fabric={"state": "completed", "status": 3}), "reset_gpu", "NVML error 3"),
        (readings(compute_mode="exclusive_process"), "restart_app", "busy or unavailable"),
        (readings(compute_mode="prohibited"), "restart_app", "prohibited"),
        (readings(mig_mode={"current": False, "pending": True}), "reset_gpu", "MIG mode change (on)"),
    ],
)
def test_each_finding_gives_its_verdict_with_a_sentence(r: dict, verdict: str, words: str) -> None:
    h = _health.judge_gpu(r)
    assert h["verdict"] == verdict
    [sentence] = h["evidence"]
    assert sentence.startswith(f"{verdict}: ") and words in sentence


def test_a_row_remap_that_is_done_and_a_fabric_that_is_up_are_ok() -> None:
    r = readings(
        remapped_rows={"correctable": 3, "uncorrectable": 1, "pending": False, "failure": False},
        fabric={"state": "completed", "status": 0},
        retired_pages={"pending": False, "single_bit": 2, "double_bit": 0},
        ecc_volatile_uncorrected=0,
    )
    assert _health.judge_gpu(r)["verdict"] == "ok"


def test_xids_count_once_per_xid_and_an_ignored_one_not_at_all() -> None:
    line = "NVRM: Xid (PCI:0000:18:00): 13, ..."
    xids = [{"xid": 13, "time": 1.0, "bucket": "RESTART_APP", "line": line}] * 3 + [{"xid": 92, "time": 2.0, "bucket": "IGNORE", "line": "92"}]
    h = _health.judge_gpu(readings(xid=xids))
    assert h["verdict"] == "restart_app" and len(h["evidence"]) == 1 and line in h["evidence"][0]


def test_an_unknown_xid_is_not_guessed_harmless() -> None:
    h = _health.judge_gpu(readings(xid=[{"xid": 9999, "time": 1.0, "bucket": "UNKNOWN", "line": "x"}]))
    assert h["verdict"] == "reset_gpu" and "not in the collection's table" in h["evidence"][0]


def test_the_worst_finding_wins_and_every_one_is_listed() -> None:
    r = readings(
        compute_mode="exclusive_process", recovery_action="node_reboot", remapped_rows={"correctable": 0, "uncorrectable": 0, "pending": True, "failure": False}
    )
    h = _health.judge_gpu(r)
    assert h["verdict"] == "reboot"
    assert sorted(e.split(":")[0] for e in h["evidence"]) == ["reboot", "reset_gpu", "restart_app"]


@pytest.mark.parametrize(("diagnosis", "verdict"), [("driver_hung", "reboot"), ("gpu_lost", "reboot"), ("busy", "ok"), ("needs_reset", "ok")])
def test_a_hung_or_lost_gpu_is_reboot(diagnosis: str, verdict: str) -> None:
    assert _health.judge_gpu(dict(NONE), diagnosis)["verdict"] == verdict


# ---------------------------------------------------------------------- the host's verdict


def test_the_host_is_the_worst_of_its_gpus_and_its_own_findings() -> None:
    ok = _health.judge_gpu(readings())
    bad = _health.judge_gpu(readings(recovery_action="gpu_reset"))
    h = _health.judge_host([(0, ok), (1, bad)], {"mps_daemon": [], "fabricmanager": "not_needed", "kernel_log": "kmsg"}, "reset_gpu")
    assert h["verdict"] == "reset_gpu" and h["fail_on"] == "reset_gpu"
    assert h["evidence"] == ["GPU 1: reset_gpu: the driver's recovery action is gpu_reset."]


def test_an_mps_daemon_left_behind_is_restart_app_naming_it() -> None:
    h = _health.judge_host([(0, _health.judge_gpu(readings()))], {"mps_daemon": [77, 78], "fabricmanager": "not_needed"}, "reset_gpu")
    assert h["verdict"] == "restart_app" and "PID(s) 77, 78" in h["evidence"][0]
    [f] = h["findings"]
    assert (f["name"], f["gpus"], f["where"]) == ("mps_daemon", [], "application") and "mps: stopped" in f["fix"]


def test_a_missing_fabric_manager_matters_only_while_a_fabric_is_not_up() -> None:
    waiting = _health.judge_gpu(readings(fabric={"state": "in_progress", "status": 0}))
    up = _health.judge_gpu(readings(fabric={"state": "completed", "status": 0}))
    down = {"mps_daemon": [], "fabricmanager": "not_running"}
    judged = _health.judge_host([(0, waiting)], down, "reset_gpu")
    assert any("not running" in e for e in judged["evidence"]) and judged["verdict"] == "fix_config"
    assert [f["name"] for f in judged["findings"]] == ["fabricmanager_not_running", "fabric_incomplete"]
    assert _health.judge_host([(0, up)], down, "reset_gpu") == {"verdict": "ok", "fail_on": "reset_gpu", "evidence": [], "findings": [], "host": down}


def test_an_xid_of_a_device_no_gpu_has_is_the_hosts_finding() -> None:
    stray = [{"xid": 79, "time": 1.0, "bucket": "RESTART_BM", "line": "NVRM: Xid (PCI:0000:99:00): 79, GPU has fallen off the bus."}]
    h = _health.judge_host([], {"mps_daemon": []}, "drain", stray)
    assert h["verdict"] == "reboot" and "no listed GPU" in h["evidence"][0]


def test_fabric_present() -> None:
    assert not _health.fabric_present([readings(), readings(fabric={"state": "not_supported", "status": 0})])
    assert _health.fabric_present([readings(fabric={"state": "completed", "status": 0})])


def test_host_findings_find_an_mps_daemon_by_its_executable_name(tmp_path) -> None:
    exe = tmp_path / "nvidia-cuda-mps-control"
    shutil.copy2(shutil.which("sleep") or "/bin/sleep", exe)
    before = _health.host_findings(fabric_present=False)
    assert before["fabricmanager"] == "not_needed"
    proc = subprocess.Popen([str(exe), "30"])
    try:
        # comm is cut at 15 characters ("nvidia-cuda-mps"); the executable's name tells it from a namesake.
        deadline = time.monotonic() + 5
        while proc.pid not in _health.host_findings(fabric_present=False)["mps_daemon"]:
            assert time.monotonic() < deadline, "the MPS stand-in was not found"
            time.sleep(0.01)
        assert _health.host_findings(fabric_present=True)["fabricmanager"] in ("running", "not_running")
    finally:
        proc.kill()
        proc.wait()
    assert proc.pid not in _health.host_findings(fabric_present=False)["mps_daemon"]


# ---------------------------------------------------------------------- messages
@pytest.mark.parametrize(
    ("indices", "text"),
    [([3], "GPU 3"), ([1, 2], "GPUs 1, 2"), ([7, 1, 2, 3, 4, 5, 6], "GPUs 1-7"), ([0, 2, 5, 6, 7], "GPUs 0, 2 and 5-7"), ([0, 1, 3], "GPUs 0, 1 and 3")],
)
def test_gpu_lists_read_as_a_person_counts(indices: list[int], text: str) -> None:
    assert _health.gpu_list(indices) == text


def test_the_same_finding_on_eight_gpus_is_one_line_and_its_fix_is_said_once() -> None:
    """A container without its GPUs' device files: eight findings that differ only in the GPU's number are one line
    naming the eight; a finding with facts of its own (a PID, an Xid line) is never folded into another; each name's fix
    (the table's) is said once, worst first."""
    found = [{"name": "device_missing", "verdict": "fix_config", "gpu": i, "text": f"/dev/nvidia{i} is absent: CUDA cannot use GPU {i} here"} for i in range(8)]
    found += [{"name": "device_missing", "verdict": "fix_config", "gpu": None, "text": "/dev/nvidiactl is absent: no CUDA program can start"}]
    found += [
        {"name": "xid", "verdict": "reset_gpu", "gpu": 2, "text": "Xid 48 in the kernel log (RESET_GPU): NVRM: Xid (PCI:0000:1a:00): 48"},
        {"name": "xid", "verdict": "reset_gpu", "gpu": 5, "text": "Xid 48 in the kernel log (RESET_GPU): NVRM: Xid (PCI:0000:9a:00): 48"},
    ]
    groups = _health.grouped(found)
    assert [(g["name"], g["gpus"]) for g in groups] == [("xid", [2]), ("xid", [5]), ("device_missing", list(range(8))), ("device_missing", [])]
    assert groups[2]["text"] == "/dev/nvidia<minor> is absent: CUDA cannot use each GPU here" and groups[2]["where"] == "configuration"
    out = _health.lines(groups)
    assert len(out) == 4 and out[2].startswith("GPUs 0-7: device_missing (fix_config): /dev/nvidia<minor> is absent")
    assert sum("Fix:" in line for line in out) == 2 and "Fix:" in out[0] and "Fix:" not in out[1] and "Fix:" not in out[3]
    # What the message said already is left out.
    assert _health.lines(groups, {"device_missing"}) == out[:2]
