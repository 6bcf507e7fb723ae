"""_xids: the Xid catalog as data, held to the catalog's text, to NVIDIA's k8s device plugin and to the guide (each
bucket read through a real kernel log: test__health.py)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from ansible_collections.gpuops.clean_slate.plugins.module_utils import _health, _nvml, _xids

ROOT = Path(__file__).resolve().parents[4]
GUIDE = ROOT / "docs" / "docsite" / "rst" / "guide_clean_slate.rst"

# The catalog's immediate action for each Xid it gives one on Ampere and newer GPUs, as its table prints it
# (docs.nvidia.com/deploy/xid-errors/analyzing-xid-catalog.html, the edition of Xids 1-172, read 2026-12-02).
CATALOG_TEXT = {
    "RESTART_APP": [
        *(8, 11, 13, 25, 31, 32, 39, 40, 41, 60, 68, 69, 70, 71, 72, 75, 76, 77, 80, 82, 83, 84, 85, 86, 88, 89, 94),
        *range(96, 106),
        *range(126, 136),
        139,
    ],
    "IGNORE": [14, 37, 38, 43, 44, 63, 66, 67, 92, 93, 106, 107, 108, 121, 137, 141, 157, 160, 161],
    "RESET_GPU": [46, 62, 64, 95, 109, 110, 119, 120, 136, 140, 143, 155, 156, 158],
    "RESTART_BM": [79],
    "RESTART_VM": [151],
    "UPDATE_SWFW": [78],
    # 142, and every Xid the catalog marks "Unused" on these GPUs (round4: the catalog's own CONTACT_SUPPORT, as
    # NVIDIA's NVSentinel reads it).
    "CONTACT_SUPPORT": [
        142,
        *(*range(1, 8), 9, 10, 12, *range(15, 25), *range(26, 31), *range(33, 37), 42, 47, *range(49, 54)),
        *(*range(55, 60), 61, 65, 73, 81, 87, 90, 91, *range(111, 119), *range(122, 126), 138),
    ],
    "CHECK_MECHANICALS": [54],
}
# Xids that apply to no data-center GPU (the catalog's four columns all NO): nothing to do.
CATALOG_TEXT["IGNORE"] += [152, 153]
# The catalog's workflows, and the bucket each reads as here (the reason is each entry's source).
WORKFLOWS = {45: "IGNORE", 48: "RESET_GPU", 74: "RESET_GPU", 144: "RESET_GPU", 145: "RESET_GPU", 146: "RESET_GPU"}
WORKFLOWS.update({147: "IGNORE", 148: "IGNORE", 149: "RESET_GPU", 150: "RESET_GPU"})
# CHECK_UVM: "if UVM/vGPU is being utilized, RESET_GPU; otherwise IGNORE" - every CUDA context uses UVM.
WORKFLOWS[159] = "RESET_GPU"


def test_every_entry_has_a_known_bucket_a_meaning_and_a_source() -> None:
    for xid, entry in _xids.XIDS.items():
        assert entry.bucket in _xids.BUCKETS and entry.bucket != _xids.UNKNOWN, xid
        assert entry.meaning and entry.source, xid
    assert set(_xids.XID154_BUCKETS) <= set(_nvml.RECOVERY_ACTIONS.values())
    assert set(_xids.XID154_BUCKETS.values()) <= set(_xids.BUCKETS)


def test_every_bucket_has_a_verdict() -> None:
    assert set(_health.BUCKET_VERDICTS) == set(_xids.BUCKETS)
    assert set(_health.BUCKET_VERDICTS.values()) <= set(_health.VERDICTS)


def test_each_xid_has_the_catalogs_immediate_action() -> None:
    expected = {xid: bucket for bucket, xids in CATALOG_TEXT.items() for xid in xids}
    assert len(expected) == sum(len(x) for x in CATALOG_TEXT.values()), "an Xid in two buckets"
    expected.update(WORKFLOWS)
    assert {xid: e.bucket for xid, e in _xids.XIDS.items()} == expected
    for xid in WORKFLOWS:
        assert "WORKFLOW" in _xids.XIDS[xid].source or "CHECK_UVM" in _xids.XIDS[xid].source, xid
    # Where it differs from NVIDIA's NVSentinel over the same catalog, the entry says so.
    for xid in (78, 159, *_xids.UNUSED):
        assert "NVSentinel" in _xids.XIDS[xid].source, xid


@pytest.mark.parametrize(("xid", "bucket"), [(43, "IGNORE"), (45, "IGNORE"), (63, "IGNORE"), (64, "RESET_GPU"), (109, "RESET_GPU")])
def test_the_xids_read_from_outside_have_the_catalogs_bucket(xid: int, bucket: str) -> None:
    """Issue 26: these five differed from the catalog."""
    assert _health.xid_bucket(xid) == bucket


def test_the_device_plugins_application_xids_are_never_a_fault_of_the_gpu_but_109() -> None:
    assert _xids.K8S_DEVICE_PLUGIN_IGNORED == (13, 31, 43, 45, 68, 109)
    for xid in _xids.K8S_DEVICE_PLUGIN_IGNORED:
        assert "k8s-device-plugin" in _xids.XIDS[xid].source, xid
        expected = {"RESET_GPU"} if xid == 109 else {"IGNORE", "RESTART_APP"}
        assert _xids.XIDS[xid].bucket in expected, xid


def test_actionless_xids_are_unknown_and_unused_ones_contact_support() -> None:
    for xid in (162, 168, 172, 9999):
        assert xid not in _xids.XIDS and _health.xid_bucket(xid) == "UNKNOWN", xid
    for xid in (1, 9, 57, 61):
        assert _health.xid_bucket(xid) == "CONTACT_SUPPORT" and _health.BUCKET_VERDICTS["CONTACT_SUPPORT"] == "drain", xid
    # The software, not the GPU: no reset fixes it.
    assert _health.BUCKET_VERDICTS[_health.xid_bucket(78)] == "fix_config"


def test_the_guide_names_the_catalog_and_each_bucket_it_lists_is_the_tables() -> None:
    text = " ".join(GUIDE.read_text(encoding="utf-8").split())
    row = text.split("the immediate action (resolution bucket) of NVIDIA's Xid catalog", 1)[1].split("_xids.py", 1)[0]
    assert "Xids 1 to 172" in row and "read 2026-12-02" in row and "read 2026-12-02" in _xids.CATALOG and "NVSentinel" in row
    listed = 0
    for buckets, numbers in re.findall(r"((?:``[A-Z_]+``(?: and | = ``[a-z_]+``|, )?)+)[^(]*\(([\d, .]+)\)", row):
        names = set(re.findall(r"``([A-Z_]+)``", buckets))
        for xid in re.findall(r"\d+", numbers):
            assert _xids.XIDS[int(xid)].bucket in names, (xid, names)
            listed += 1
    assert listed >= 15
