"""_payload: clean_slate_node's payload kept between runs on the controller. An entry of Ansible's cache (its shape:
an object with ``zip_data``) is kept with a manifest of every source file it was built from; a later run (a new local
temporary directory) gets it back only while every source is unchanged, only from a directory of this user's that no
one else can write, and only for this module's entries."""

from __future__ import annotations

import base64
import io
import os
import pickle
import types
import zipfile
from pathlib import Path

import pytest

from ansible_collections.gpuops.clean_slate.plugins.plugin_utils import _payload

NAME = _payload.MODULE + "-ZIP_DEFLATED-none"


@pytest.fixture
def sources(tmp_path, monkeypatch):
    """A stand-in for the collection's files (so that a test may change one), and a run's local temporary directory."""
    root = tmp_path / "collection"
    (root / "plugins" / "module_utils").mkdir(parents=True)
    (root / "plugins" / "module_utils" / "_one.py").write_text("ONE = 1\n")
    monkeypatch.setitem(_payload.ROOTS, "ansible_collections/gpuops/clean_slate/", str(root))
    runs = tmp_path / "local"
    runs.mkdir(mode=0o700)
    return root, runs


def run_dir(runs: Path, n: int, monkeypatch) -> Path:
    d = runs / f"ansible-local-{n}"
    (d / "ansiballz_cache").mkdir(parents=True)
    monkeypatch.setattr(_payload.C, "DEFAULT_LOCAL_TMP", str(d), raising=False)
    return d / "ansiballz_cache"


def entry(path: Path, files: dict[str, str]) -> None:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        for name, text in files.items():
            zf.writestr(name, text)
    path.write_bytes(pickle.dumps(types.SimpleNamespace(zip_data=base64.b64encode(buf.getvalue()))))


FILES = {
    "ansible_collections/__init__.py": "",  # a package Ansible makes up
    "ansible_collections/gpuops/clean_slate/plugins/module_utils/_one.py": "ONE = 1\n",
    "ansible/module_utils/basic.py": "...",
}


def test_kept_after_a_build_and_given_back_while_its_sources_are_unchanged(sources, monkeypatch) -> None:
    root, runs = sources
    first = run_dir(runs, 1, monkeypatch)
    entry(first / NAME, FILES)
    entry(first / "ansible.legacy.ping-ZIP_DEFLATED-none", FILES)  # another module's: never kept
    assert _payload.keep() == 1 and _payload.keep() == 0  # kept once
    kept = Path(str(_payload._kept()))
    assert kept.parent == runs / _payload.DIRNAME and (os.stat(kept.parent).st_mode & 0o777) == 0o700
    assert sorted(os.listdir(kept)) == [NAME, NAME + ".json"] and (os.stat(kept).st_mode & 0o777) == 0o700
    second = run_dir(runs, 2, monkeypatch)
    assert _payload.restore() == 1 and (second / NAME).read_bytes() == (first / NAME).read_bytes()
    assert _payload.restore() == 0  # Ansible's own entry is never replaced
    # A source changed: the kept payload is not given back (Ansible builds it again, and the next keep replaces it).
    (root / "plugins" / "module_utils" / "_one.py").write_text("ONE = 2  # changed\n")
    third = run_dir(runs, 3, monkeypatch)
    assert _payload.restore() == 0 and not (third / NAME).exists()


def test_an_entry_with_a_file_of_unknown_origin_is_never_kept(sources, monkeypatch) -> None:
    _root, runs = sources
    first = run_dir(runs, 1, monkeypatch)
    entry(first / NAME, {**FILES, "ansible_collections/other/coll/plugins/module_utils/x.py": "X = 1\n"})
    assert _payload.keep() == 0


def test_a_directory_others_can_write_is_not_trusted(sources, monkeypatch) -> None:
    _root, runs = sources
    first = run_dir(runs, 1, monkeypatch)
    entry(first / NAME, FILES)
    assert _payload.keep() == 1
    os.chmod(runs / _payload.DIRNAME, 0o777)
    run_dir(runs, 2, monkeypatch)
    assert _payload.restore() == 0 and _payload.keep() == 0


def test_another_copy_of_the_collection_never_gets_this_ones_payload(sources, tmp_path, monkeypatch) -> None:
    """Two checkouts (or two installed versions) run by the same user: each its own payload, never the other's."""
    _root, runs = sources
    first = run_dir(runs, 1, monkeypatch)
    entry(first / NAME, FILES)
    assert _payload.keep() == 1
    other = tmp_path / "other-checkout"
    (other / "plugins" / "module_utils").mkdir(parents=True)
    (other / "plugins" / "module_utils" / "_one.py").write_text("ONE = 1\n")
    monkeypatch.setitem(_payload.ROOTS, "ansible_collections/gpuops/clean_slate/", str(other))
    second = run_dir(runs, 2, monkeypatch)
    assert _payload.restore() == 0 and not (second / NAME).exists()  # Ansible builds the other copy's own
    entry(second / NAME, FILES)
    assert _payload.keep() == 1 and len(os.listdir(runs / _payload.DIRNAME)) == 2  # kept beside the first's
    # Even a manifest moved into this copy's directory is refused: it names the roots it was built from.
    (Path(str(_payload._kept())) / (NAME + ".json")).write_text((Path(str(_payload._kept())) / (NAME + ".json")).read_text().replace(str(other), str(_root)))
    assert _payload.restore() == 0
