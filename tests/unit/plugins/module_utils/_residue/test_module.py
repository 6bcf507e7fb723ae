"""_residue.module: the options refused before anything is looked at, and whole runs (real files, under tools/pidns-run)."""

from __future__ import annotations

import json
import os
import typing as t
from pathlib import Path

import pytest

from ansible_collections.gpuops.clean_slate.plugins.module_utils import _module
from ansible_collections.gpuops.clean_slate.plugins.module_utils._errors import CleanSlateError
from ansible_collections.gpuops.clean_slate.plugins.module_utils._residue import module, walk


def test_everything_orphaned_goes_and_the_rest_of_the_directory_stays(tree: Path, request_for: t.Callable[..., module.Request]) -> None:
    r = module.run(request_for(tree), check_mode=False)
    assert {x["path"] for x in r["removed"]} == {
        *(f"{tree}/shm/nccl-{i:06d}" for i in range(3)),
        f"{tree}/sock/dead",
        f"{tree}/cache/a/b/c/x.lock",
        f"{tree}/cache/top.lock",
        f"{tree}/torchelastic_abc",
    }
    assert sorted(os.listdir(tree / "shm")) == ["other-file"]
    assert not (tree / "torchelastic_abc").exists() and (tree / "cache" / "a" / "b" / "c").is_dir()
    assert r["summary"]["kinds"]["shm"] == {"removed": 3, "bytes": 3 * 8192, "held": 0, "kept": 0, "stale": 0}
    assert r["msg"].startswith("3 stale segments, 1 socket, 2 locks and 1 directory (")
    assert module.run(request_for(tree), check_mode=False)["changed"] is False


def test_check_mode_changes_nothing_and_counts_bytes(tree: Path, request_for: t.Callable[..., module.Request]) -> None:
    r = module.run(request_for(tree), check_mode=True)
    assert r["changed"] is True and r["summary"]["removed"] == 7
    assert r["summary"]["kinds"]["shm"]["bytes"] == 3 * 8192
    assert "would be removed" in r["msg"]
    assert len(os.listdir(tree / "shm")) == 4 and (tree / "torchelastic_abc").is_dir()


def residue_params(**kw: t.Any) -> dict[str, t.Any]:
    p: dict[str, t.Any] = {kind: [] for kind in walk.KINDS}
    p.update(remove=["shm"], users=[], containers=[], pct_path=None, ports=[8000], time_wait_timeout=0.0, patterns=[], protect=[])
    p.update(fail_on=["listening"], list_limit=200, min_age=60.0, roots=list(walk.DEFAULT_ROOTS))
    p.update(kw)
    return p


@pytest.mark.parametrize(
    ("option", "value"),
    [("time_wait_timeout", float("nan")), ("time_wait_timeout", 86401), ("list_limit", -1), ("containers", [99]), ("pct_path", "/nonexistent/pct")],
)
def test_the_modules_options_are_refused_before_any_container_is_looked_up(option: str, value: t.Any) -> None:
    looked_up: list[int] = []
    with pytest.raises(CleanSlateError) as err:
        module.build_request(residue_params(**{option: value}), lambda: looked_up.append(1) or [])
    assert (err.value.reason, err.value.details["option"], looked_up) == ("bad_arguments", option, [])
    req = module.build_request(residue_params(), lambda: looked_up.append(1) or [])
    assert looked_up == [1] and req.ports == [8000] and req.remove == {"shm"}


def test_a_uid_nobody_has_is_refused_before_anything_is_removed(tree: Path, request_for: t.Callable[..., module.Request]) -> None:
    """A typo in users would keep every item and read green; a uid that owns a candidate is a real one."""
    with pytest.raises(CleanSlateError) as err:
        module.run(request_for(tree, users=["987650"]), check_mode=False)
    assert (err.value.reason, err.value.details["option"]) == ("bad_arguments", "users")
    assert len(os.listdir(tree / "shm")) == 4 and (tree / "torchelastic_abc").is_dir()
    os.chown(tree / "shm" / "nccl-000000", 987650, 987650)
    r = module.run(request_for(tree, users=["987650"]), check_mode=False)
    assert [x["path"] for x in r["removed"]] == [f"{tree}/shm/nccl-000000"]


def test_a_name_that_is_not_utf8_is_removed_and_reported_escaped(tree: Path, request_for: t.Callable[..., module.Request]) -> None:
    """Anyone can make such a name in /dev/shm; the result must still carry it (the module's ending escapes it)."""
    raw = os.fsencode(tree / "shm") + b"/nccl-\xff\xfe\n"
    os.close(os.open(raw, os.O_CREAT | os.O_WRONLY, 0o600))
    r = _module.text(module.run(request_for(tree), check_mode=False))
    [record] = [x for x in r["removed"] if x.get("path_escaped")]
    assert record["path"] == f"{tree}/shm/nccl-\\xff\\xfe\n"
    assert not os.path.lexists(raw)
    assert json.loads(json.dumps(r, ensure_ascii=False).encode("utf-8")) == r  # intact as UTF-8 JSON
    assert f"{tree}/shm/nccl-\\xff\\xfe\n" in r["summary"]["paths"]["removed"]
