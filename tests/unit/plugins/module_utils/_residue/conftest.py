"""Shared by the _residue tests: a test-owned tree of residue, real files and sockets, and requests over it."""

from __future__ import annotations

import shutil
import socket
import tempfile
import typing as t
from pathlib import Path

import pytest

from ansible_collections.gpuops.clean_slate.plugins.module_utils._residue import module, walk


def residue_request(tmp: Path, **kw: t.Any) -> module.Request:
    """A request over the tree of :func:`tree`: every kind, every kind removed."""
    globs = [
        walk.parse_glob("shm", f"{tmp}/shm/nccl-*"),
        walk.parse_glob("sockets", f"{tmp}/sock/*"),
        walk.parse_glob("locks", f"{tmp}/cache/**/*.lock"),
        walk.parse_glob("dirs", f"{tmp}/torchelastic_*"),
    ]
    return module.Request(globs=globs, remove=set(walk.KINDS), **kw)


@pytest.fixture
def request_for() -> t.Callable[..., module.Request]:
    """:func:`residue_request`, for the tests of every part."""
    return residue_request


def default_globs(kind: str, tmp: Path) -> list[walk.Glob]:
    """The module's own defaults for /tmp, moved under a test-owned directory."""
    defaults = {"sockets": walk.DEFAULT_SOCKETS, "dirs": walk.DEFAULT_DIRS}[kind]
    return [walk.parse_glob(kind, g.replace("/tmp/", f"{tmp}/", 1)) for g in defaults if g.startswith("/tmp/")]


@pytest.fixture
def defaults_under() -> t.Callable[[str, Path], list[walk.Glob]]:
    """:func:`default_globs`."""
    return default_globs


@pytest.fixture
def short_tmp() -> t.Iterator[Path]:
    """A test-owned directory with a short path (a unix socket path has 107 bytes at most)."""
    top = Path(tempfile.mkdtemp(prefix="u-"))
    yield top
    shutil.rmtree(top, ignore_errors=True)


@pytest.fixture
def tree(short_tmp: Path) -> Path:
    """Three segments and another file, a dead socket, two locks (one deep), a torchelastic run directory."""
    tmp_path = short_tmp
    (tmp_path / "shm").mkdir()
    (tmp_path / "sock").mkdir()
    for i in range(3):
        (tmp_path / "shm" / f"nccl-{i:06d}").write_bytes(b"x" * 8192)
    (tmp_path / "shm" / "other-file").write_bytes(b"x")
    deep = tmp_path / "cache" / "a" / "b" / "c"
    deep.mkdir(parents=True)
    (deep / "x.lock").write_bytes(b"")
    (tmp_path / "cache" / "top.lock").write_bytes(b"")
    run = tmp_path / "torchelastic_abc" / "r" / "attempt_0"
    run.mkdir(parents=True)
    (run / "error.json").write_text("{}")
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(tmp_path / "sock" / "dead"))
    s.close()
    return tmp_path
