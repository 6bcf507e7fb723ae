"""_residue.remove: the last check before each unlink (real files, changed between the judgement and the removal)."""

from __future__ import annotations

import os
import typing as t
from pathlib import Path

from ansible_collections.gpuops.clean_slate.plugins.module_utils._residue import module, remove, walk


def test_a_file_replaced_after_the_judgement_is_left_alone(tree: Path, request_for: t.Callable[..., module.Request]) -> None:
    notes: list[str] = []
    roots = walk.open_roots([])
    items, walkers = walk.collect(request_for(tree).globs, roots, notes)
    try:
        by_name = {i.name: i for i in items}
        # A new job creates a segment under the same name between the scan and the unlink.
        (tree / "shm" / "nccl-000000").unlink()
        (tree / "shm" / "nccl-000000").write_bytes(b"new")
        remove.remove(by_name["nccl-000000"])
        assert by_name["nccl-000000"].verdict == "skipped" and "changed since it was judged" in by_name["nccl-000000"].why
        assert (tree / "shm" / "nccl-000000").read_bytes() == b"new"
        # A file that appears in a judged directory stops its removal before anything inside is gone.
        (tree / "torchelastic_abc" / "r" / "late.json").write_text("{}")
        remove.remove(by_name["torchelastic_abc"])
        assert by_name["torchelastic_abc"].verdict == "skipped" and "late.json appeared" in by_name["torchelastic_abc"].why
        assert (tree / "torchelastic_abc" / "r" / "attempt_0" / "error.json").exists()
        # A regular file with another hard link: an fd through the other name is not provably absent.
        os.link(tree / "shm" / "nccl-000001", tree / "hardlink")
        remove.remove(by_name["nccl-000001"])
        assert by_name["nccl-000001"].verdict == "skipped" and "hard links" in by_name["nccl-000001"].why
        remove.remove(by_name["nccl-000002"])
        assert by_name["nccl-000002"].verdict == "removed" and not (tree / "shm" / "nccl-000002").exists()
    finally:
        for w in walkers:
            w.close()
        for r in roots:
            os.close(r.fd)


def test_check_mode_reports_exactly_what_the_run_does(tree: Path, hold, request_for: t.Callable[..., module.Request]) -> None:
    """One decision for both: a segment with a second name, held open under that name, stays in both."""
    os.link(tree / "shm" / "nccl-000001", tree / "other-name")
    holder = hold("fd", tree / "other-name")

    def outcome(r: dict) -> dict[str, set[tuple[str, str]]]:
        return {key: {(x["path"], x.get("why", "")) for x in r[key]} for key in ("removed", "held", "stale", "ignored", "errors")}

    predicted = outcome(module.run(request_for(tree), check_mode=True))
    assert all(os.path.exists(p) for p, _why in predicted["removed"])  # check mode changed nothing
    done = outcome(module.run(request_for(tree), check_mode=False))
    assert predicted == done
    assert (f"{tree}/shm/nccl-000001", "has 2 hard links; left alone") in done["ignored"]
    assert (tree / "shm" / "nccl-000001").exists() and holder.poll() is None
