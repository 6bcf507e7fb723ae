"""_pyc: the payload's bytecode cache on the target. Real zip imports (zipimport, as AnsiballZ runs a module): the
first import compiles and stores each file's code under its source's hash, the next loads it and compiles nothing, a
changed source is a new entry, check mode reads and never writes, a directory others can write is not trusted, and the
zip loader's own answers (get_source: the CUDA start's program sends its own text) stay as they were."""

from __future__ import annotations

import builtins
import json
import os
import sys
import types
import zipfile
from pathlib import Path

import pytest

from ansible_collections.gpuops.clean_slate.plugins.module_utils import _pyc


def payload(tmp: Path, name: str, source: str) -> Path:
    path = tmp / f"{name}.zip"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("pycachetest/__init__.py", "")
        zf.writestr("pycachetest/mod.py", source)
    return path


@pytest.fixture
def imports(monkeypatch):
    """Import pycachetest.mod from a zip through a Finder of the given cache; the modules forgotten after each."""
    monkeypatch.setattr(_pyc, "PREFIX", "pycachetest")
    added: list[object] = []

    def load(zip_path: Path, cache: _pyc.Cache) -> types.ModuleType:
        for name in ("pycachetest.mod", "pycachetest"):
            sys.modules.pop(name, None)
        sys.path.insert(0, str(zip_path))
        finder = _pyc.Finder(cache)
        sys.meta_path.insert(0, finder)
        added.append(finder)
        try:
            import pycachetest.mod  # type: ignore[import-not-found]  # pylint: disable=import-outside-toplevel

            return pycachetest.mod
        finally:
            sys.meta_path.remove(finder)
            sys.path.remove(str(zip_path))

    yield load
    for name in ("pycachetest.mod", "pycachetest"):
        sys.modules.pop(name, None)


def test_compiled_once_then_loaded_and_a_changed_source_is_a_new_entry(tmp_path, imports) -> None:
    store = tmp_path / "cache"
    store.mkdir(mode=0o700)
    zip_path = payload(tmp_path, "one", "VALUE = 41 + 1\n")
    first = _pyc.Cache(str(store), write=True)
    mod = imports(zip_path, first)
    assert mod.VALUE == 42 and (first.compiled, first.loaded) == (2, 0) and len(os.listdir(store)) == 2
    # The zip loader's own answers stay: the source of the module, as zipimport gives it.
    assert mod.__loader__.get_source("pycachetest.mod") == "VALUE = 41 + 1\n"
    again = _pyc.Cache(str(store), write=True)
    assert imports(payload(tmp_path, "two", "VALUE = 41 + 1\n"), again).VALUE == 42  # another zip path, same source
    assert (again.compiled, again.loaded) == (0, 2)
    changed = _pyc.Cache(str(store), write=True)
    assert imports(payload(tmp_path, "three", "VALUE = 7\n"), changed).VALUE == 7
    assert (changed.compiled, changed.loaded) == (1, 1) and len(os.listdir(store)) == 3


def test_a_module_found_in_the_cache_is_never_compiled_not_even_to_find_it(tmp_path, imports, monkeypatch) -> None:
    """The zip importer's own find_spec compiles a module to learn its file name, then again to run it; the finder
    makes the spec from the zip's table instead, so a warm import compiles nothing, and the module is where it was."""
    store = tmp_path / "cache"
    store.mkdir(mode=0o700)
    imports(payload(tmp_path, "one", "VALUE = 1\n"), _pyc.Cache(str(store), write=True))
    compiled: list[str] = []
    real = builtins.compile
    monkeypatch.setattr(builtins, "compile", lambda source, filename, *a, **k: compiled.append(str(filename)) or real(source, filename, *a, **k))
    warm = _pyc.Cache(str(store), write=True)
    zip_path = payload(tmp_path, "two", "VALUE = 1\n")
    mod = imports(zip_path, warm)
    assert mod.VALUE == 1 and (warm.compiled, warm.loaded) == (0, 2) and compiled == []
    assert mod.__file__ == f"{zip_path}{os.sep}pycachetest{os.sep}mod.py" and mod.__spec__.parent == "pycachetest"
    assert sys.modules["pycachetest"].__path__ == [f"{zip_path}{os.sep}pycachetest"]


def test_check_mode_reads_and_never_writes(tmp_path, imports, monkeypatch) -> None:
    store = tmp_path / "cache"
    store.mkdir(mode=0o700)
    basic = types.ModuleType("ansible.module_utils.basic")
    basic._ANSIBLE_ARGS = json.dumps({"ANSIBLE_MODULE_ARGS": {"_ansible_check_mode": True}}).encode()  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "ansible.module_utils.basic", basic)
    assert _pyc.check_mode() is True
    cache = _pyc.Cache(str(store), write=_pyc.check_mode() is False)
    assert imports(payload(tmp_path, "one", "VALUE = 1\n"), cache).VALUE == 1 and os.listdir(store) == []
    basic._ANSIBLE_ARGS = json.dumps({"ANSIBLE_MODULE_ARGS": {}}).encode()  # type: ignore[attr-defined]
    assert _pyc.check_mode() is False


def test_only_a_directory_of_this_users_that_no_one_else_can_write_is_trusted(tmp_path) -> None:
    mine = tmp_path / "mine"
    mine.mkdir(mode=0o700)
    assert _pyc.trusted(str(mine))
    os.chmod(mine, 0o777)
    assert not _pyc.trusted(str(mine)) and not _pyc.trusted(str(tmp_path / "absent"))
    # Nor one below a directory others can write: they could put their own in its place.
    shared = tmp_path / "shared"
    shared.mkdir()
    (shared / "cache").mkdir(mode=0o700)
    os.chmod(shared, 0o700)
    assert _pyc.trusted(str(shared / "cache"))
    os.chmod(shared, 0o777)
    assert not _pyc.trusted(str(shared / "cache"))


def test_nothing_is_installed_outside_a_payload_or_when_switched_off(monkeypatch) -> None:
    before = list(sys.meta_path)
    assert _pyc.install() is None  # imported from the checkout's files, not a zip
    monkeypatch.setenv(_pyc.SWITCH, "0")
    assert _pyc.install(zipimport_loader()) is None
    assert sys.meta_path == before


def zipimport_loader() -> object:
    import zipimport  # pylint: disable=import-outside-toplevel

    return zipimport.zipimporter.__new__(zipimport.zipimporter)
