"""_residue.report: the result's lists, counts and sizes, and the diff."""

from __future__ import annotations

import typing as t
from pathlib import Path

from ansible_collections.gpuops.clean_slate.plugins.module_utils._residue import module, report


def test_list_limit_cuts_lists_not_counts(tree: Path, request_for: t.Callable[..., module.Request]) -> None:
    r = module.run(request_for(tree, list_limit=2), check_mode=True)
    assert len(r["removed"]) == 2 and r["summary"]["removed"] == 7 and r["truncated"] is True


def test_human_sizes() -> None:
    assert [report.human(n) for n in (512, 4096, 3 * 1024**3 + 100 * 1024**2)] == ["512 B", "4.0 KiB", "3.1 GiB"]


def test_the_diff_shows_what_went_and_what_is_left() -> None:
    result = {"removed": [{"path": "/dev/shm/a"}, {"path": "/dev/shm/b"}], "errors": [{"path": "/dev/shm/c"}]}
    assert report.diff(result, check_mode=False) == {"before": "/dev/shm/a\n/dev/shm/b\n/dev/shm/c\n", "after": "/dev/shm/c\n"}
    assert report.diff(result, check_mode=True) == {"before": "/dev/shm/a\n/dev/shm/b\n", "after": ""}
