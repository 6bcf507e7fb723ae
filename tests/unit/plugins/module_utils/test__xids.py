"""_xids: the Xid catalog as data (each Xid's bucket against its source: test__health.py reads the buckets)."""

from __future__ import annotations

from ansible_collections.gpuops.clean_slate.plugins.module_utils import _health, _nvml, _xids


def test_every_entry_has_a_known_bucket_a_meaning_and_a_source() -> None:
    for xid, entry in _xids.XIDS.items():
        assert entry.bucket in _xids.BUCKETS and entry.bucket != _xids.UNKNOWN, xid
        assert entry.meaning and entry.source, xid
    assert set(_xids.XID154_BUCKETS) <= set(_nvml.RECOVERY_ACTIONS.values())
    assert set(_xids.XID154_BUCKETS.values()) <= set(_xids.BUCKETS)


def test_every_bucket_has_a_verdict() -> None:
    assert set(_health.BUCKET_VERDICTS) == set(_xids.BUCKETS)
    assert set(_health.BUCKET_VERDICTS.values()) <= set(_health.VERDICTS)
