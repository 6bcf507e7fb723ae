# Copyright (c) 2026, gpuops.clean_slate maintainers
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# Note: this module_util is PRIVATE to the collection; it may change without notice.

"""Compiled once on the target: a bytecode cache of this collection's code in a module's payload.

Ansible ships a module and its module_utils as sources in a zip (AnsiballZ), and Python compiles every one of them
again at each run, since a zip import writes no ``__pycache__``: for this collection's module_utils about 0.15 s of
each run of clean_slate_node on the host, every time, for the same code (docs/benchmarks.md, "Cost of trust").

:func:`install` (called by clean_slate_node first thing, before it imports any other file of the collection) puts a
finder in front of Python's for this collection's names only, and only when this file itself came from a payload's zip
(on the controller, and wherever the code is not run from a payload, it does nothing). Each file's
code is looked up by the SHA-256 of its source (and the interpreter's bytecode magic), in
``$XDG_CACHE_HOME/gpuops-clean_slate/pyc/<cache tag>/`` (``~/.cache/...`` by default): found, it is loaded instead of
compiled; not found, it is compiled as before and stored for the next run. So a changed file is a new key, never a
stale code object. Trust is Python's own for ``__pycache__``: the directory must belong to this user and be writable
by nobody else, else it is neither read nor written. Nothing is written in check mode (the module's arguments say so
before its code runs), and ``GPUOPS_CLEAN_SLATE_BYTECODE_CACHE=0`` in the module's environment turns it off. Any error
falls back to Python's own import: the cache can make a run faster, never different.

Standard library only; runs on the target's Python 3.9 and later.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import json
import marshal
import os
import sys
import tempfile
import typing as t
import zipimport

#: The names the finder looks after: this collection's own.
PREFIX = "ansible_collections.gpuops.clean_slate."
#: Turns the cache off when "0" in the module's environment.
SWITCH = "GPUOPS_CLEAN_SLATE_BYTECODE_CACHE"
_HEADER = importlib.util.MAGIC_NUMBER


def directory() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "gpuops-clean_slate", "pyc", sys.implementation.cache_tag or "none")


def trusted(path: str, mask: int = 0o022) -> bool:
    """Whether ``path`` is a directory of this user's that no one else can write, below one of the same (so that no one
    else can put another directory in its place either); ``mask``: the permission bits others may not have.

    One rule for both of the collection's caches of code: this one on the target, and the controller's kept payloads
    (plugin_utils/_payload.py, with ``mask`` 0o077)."""
    for d in (path, os.path.dirname(path)):
        try:
            st = os.stat(d)
        except OSError:
            return False
        if not os.path.isdir(d) or st.st_uid != os.geteuid() or st.st_mode & mask:
            return False
    return True


class Cache:
    """Code objects by the hash of their source, in one directory; ``write`` False only reads (check mode)."""

    def __init__(self, path: str, write: bool) -> None:
        self.path = path
        self.write = write
        self.loaded = 0
        self.compiled = 0

    def code(self, source: bytes, filename: str) -> t.Any:
        key = hashlib.sha256(_HEADER + source).hexdigest()
        entry = os.path.join(self.path, key[:40] + ".pyc")
        try:
            with open(entry, "rb") as fh:
                data = fh.read()
            if data[: len(_HEADER)] == _HEADER:
                code = marshal.loads(data[len(_HEADER) :])
                if code.co_filename == filename:
                    self.loaded += 1
                    return code
        except (OSError, ValueError, EOFError, TypeError):
            pass
        code = compile(source, filename, "exec", dont_inherit=True)
        self.compiled += 1
        if self.write:
            self._store(entry, code)
        return code

    def _store(self, entry: str, code: t.Any) -> None:
        try:
            fd, tmp = tempfile.mkstemp(dir=self.path, prefix=".")
            with os.fdopen(fd, "wb") as fh:
                fh.write(_HEADER + marshal.dumps(code))
            os.replace(tmp, entry)  # whole, or not at all: another run never reads half an entry
        except OSError:
            pass


class Loader:
    """The zip's own loader, but for the code: from the cache, or compiled and stored."""

    def __init__(self, inner: t.Any, cache: Cache, source: str | None = None) -> None:
        self.inner = inner
        self.cache = cache
        self.source = source  # read once by the finder, which needs it to know the module is there

    def create_module(self, spec: t.Any) -> None:
        return None

    def exec_module(self, module: t.Any) -> None:
        name = module.__name__
        source, self.source = (self.source if self.source is not None else self.inner.get_source(name)), None
        if source is None:
            raise ImportError(f"no source for {name}", name=name)
        # The zip's own path changes with every run (a temporary file): the code is named by its place inside it, the
        # same each run, so that a stored code object is the code compiled from the same source under the same name.
        origin = module.__spec__.origin or getattr(module, "__file__", None) or name
        filename = origin.split(".zip" + os.sep, 1)[-1]
        exec(self.cache.code(source.encode("utf-8"), filename), module.__dict__)  # the module's own code

    def __getattr__(self, attr: str) -> t.Any:
        # get_source (the CUDA start's program sends its own text into containers), is_package, get_data, ...
        return getattr(self.inner, attr)


def _zip_importer(entry: str) -> t.Any:
    """The zip importer of a path entry, or None where the entry is not inside a zip."""
    found = sys.path_importer_cache.get(entry)
    if isinstance(found, zipimport.zipimporter):
        return found
    if found is not None:
        return None
    try:
        return zipimport.zipimporter(entry)  # the archive's directory is read once per process (zipimport caches it)
    except (zipimport.ZipImportError, OSError, TypeError, ValueError):
        return None


class Finder:
    """In front of Python's finders: this collection's names, when the zip of a payload is where they come from.

    It makes the module's spec itself rather than through the zip importer's ``find_spec``: that one asks the importer
    for the module's file name, which the importer finds out by compiling the module (``zipimporter.get_filename``),
    and then compiles it again to run it; a payload's every file was compiled twice at each run. Here the zip's own
    table says whether the name is a module or a package, the source is read once, and the code comes from the cache."""

    def __init__(self, cache: Cache) -> None:
        self.cache = cache

    def find_spec(self, name: str, path: t.Any = None, target: t.Any = None) -> t.Any:
        if not name.startswith(PREFIX):
            return None
        last = name.rpartition(".")[2]
        for entry in path if path is not None else sys.path:
            importer = _zip_importer(entry) if isinstance(entry, str) else None
            if importer is None:
                return None  # not from a payload's zip: Python's own finders decide
            try:
                package = importer.is_package(name)
                source = importer.get_source(name)
            except zipimport.ZipImportError:
                continue  # not in this entry
            if source is None:
                return None  # bytecode only: the zip importer's own way
            base = f"{importer.archive}{os.sep}{importer.prefix}{last}"
            spec = importlib.machinery.ModuleSpec(
                name, t.cast(t.Any, Loader(importer, self.cache, source)), origin=base + os.sep + "__init__.py" if package else base + ".py", is_package=package
            )
            spec.has_location = True
            if package:
                spec.submodule_search_locations = [base]
            return spec
        return None

    def invalidate_caches(self) -> None:
        return None


def check_mode() -> bool | None:
    """Whether the module runs in check mode, from its arguments (set before its code runs); None when unknown."""
    basic = sys.modules.get("ansible.module_utils.basic")
    raw = getattr(basic, "_ANSIBLE_ARGS", None)
    if not raw:
        return None
    try:
        args = json.loads(raw)
        return bool(args.get("ANSIBLE_MODULE_ARGS", {}).get("_ansible_check_mode", False))
    except (ValueError, AttributeError, TypeError):
        return None


def install(loader: t.Any = None) -> Cache | None:
    """Put the finder in front, when this file (or ``loader``'s) was imported from a payload's zip; the cache, or None when
    it is not used here (a controller, the switch off, a directory that cannot be trusted)."""
    try:
        if not isinstance(loader if loader is not None else globals().get("__loader__"), zipimport.zipimporter) or os.environ.get(SWITCH) == "0":
            return None
        if any(isinstance(f, Finder) for f in sys.meta_path):
            return None
        path = directory()
        write = check_mode() is False
        if write and not os.path.isdir(path):
            os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)  # makedirs gives its mode to the last one only
            os.makedirs(path, mode=0o700, exist_ok=True)
        if not trusted(path):
            return None
        cache = Cache(path, write)
        sys.meta_path.insert(0, Finder(cache))
        return cache
    except OSError:
        return None
