"""_metrics: the node_exporter textfile of a host's outcome, its directory checked first, written whole."""

from __future__ import annotations

import os
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from ansible_collections.gpuops.clean_slate.plugins.module_utils import _metrics


def test_the_metrics_text_parses_as_prometheus_reads_it() -> None:
    gpu = {"index": 0, "uuid": "GPU-1", "pci_bus_id": "0000:18:00.0", "minor": 4, "name": 'H200 "SXM"\nx', "used_mib": 3}
    plan = {"gpus": [{"index": 0, "uuid": "GPU-1", "pci_bus_id": "0000:18:00.0", "why": ["row_remap_pending"]}], "where": "this host"}
    r = {
        "clean": False,
        "ended": 2,
        "phase": "verify",
        "reason": "busy",
        "after": [3],
        "targets": [1],
        "gpus": [gpu],
        "health": {"verdict": "reboot"},
        "reset_plan": plan,
    }
    fams = {f.name: f for f in text_string_to_metric_families(_metrics.text(r, 'h"1\\', 1.5, 101.5))}
    assert fams["clean_slate_last_run_success"].samples[0].value == 0
    assert fams["clean_slate_last_run_duration_seconds"].samples[0].value == 1.5
    assert fams["clean_slate_last_run_info"].samples[0].labels == {"host": 'h"1\\', "phase": "verify", "reason": "busy"}
    assert fams["clean_slate_last_run_health"].samples[0].value == 4
    [advised] = fams["clean_slate_gpu_reset_advised"].samples
    assert advised.labels == {"host": 'h"1\\', "gpu": "0", "UUID": "GPU-1", "pci_bus_id": "0000:18:00.0", "why": "row_remap_pending"} and advised.value == 1
    [used] = fams["clean_slate_gpu_used_mib"].samples
    assert used.labels["device"] == "nvidia4" and used.labels["modelName"] == 'H200 "SXM"\nx' and used.value == 3
    assert _metrics.path("/m/", "a b") == "/m/clean_slate_a_b.prom" and _metrics.path("", "h") == ""


def test_a_directory_that_cannot_take_the_file_is_named_before_anything_runs(tmp_path: Path) -> None:
    assert _metrics.directory_problem(str(tmp_path)) == ""
    assert "must be an absolute path" in _metrics.directory_problem("metrics")
    assert "does not exist on this host" in _metrics.directory_problem(str(tmp_path / "nope"))
    (tmp_path / "file").write_text("")
    assert "does not exist on this host" in _metrics.directory_problem(str(tmp_path / "file"))


def test_the_file_is_replaced_whole_and_leaves_no_temporary(tmp_path: Path) -> None:
    target = tmp_path / "clean_slate_h.prom"
    target.write_text("old\n")
    inode = target.stat().st_ino
    _metrics.write(str(target), "new\n")
    assert target.read_text() == "new\n" and target.stat().st_ino != inode and oct(target.stat().st_mode & 0o777) == "0o644"
    assert os.listdir(tmp_path) == ["clean_slate_h.prom"]
