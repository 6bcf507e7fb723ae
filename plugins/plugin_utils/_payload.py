# Copyright (c) 2026, gpuops.clean_slate maintainers
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# Note: this plugin_util is PRIVATE to the collection; it may change without notice.

"""The module's AnsiballZ payload, built once and kept between runs on the controller.

Ansible builds a module's payload (the module and every module_util it imports, zipped) once per ``ansible-playbook``
run, in the run's own local temporary directory, and throws it away at the run's end. For clean_slate_node that build
is most of what the role's task costs the controller beyond a ``ping``: finding its module_utils means compiling each of
them (about 0.17 s of 0.24 s for this collection's and Ansible's; docs/benchmarks.md, "Cost of trust"). An operator who
restarts a server many times a day pays it every run for the same payload.

So, for this one module only: after a run built it, its entry of Ansible's cache is copied beside Ansible's own local
temporary directories (``<local_tmp>/gpuops-clean_slate-ansiballz/``, the same user's, mode 0700, as Ansible's) with a
manifest of every source it was built from (the controller's path, size and modification time of each, read from the
entry itself) and Ansible's and Python's versions; before a later run's build it is copied back into that run's cache,
under the name Ansible gave it, only when every source is unchanged. Ansible then finds its own entry and builds
nothing. Whatever does not hold (another Ansible, a changed file, an entry Ansible names otherwise, any error) leaves
Ansible to build the payload as it always does: the cache can make a run faster, never different.
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import os
import pickle
import shutil
import sys
import tempfile
import typing as t
import zipfile

import ansible
from ansible import constants as C
from ansible.release import __version__ as ANSIBLE_VERSION

from ansible_collections.gpuops.clean_slate.plugins.module_utils import _pyc

#: The module whose payload is kept (Ansible's cache file names begin with its FQN).
MODULE = "ansible_collections.gpuops.clean_slate.plugins.modules.clean_slate_node"
#: Where the kept payloads go, beside the run's own local temporary directory.
DIRNAME = "gpuops-clean_slate-ansiballz"


def _run_cache() -> str | None:
    """This run's AnsiballZ cache directory (Ansible's, under its per-run local temporary directory)."""
    local_tmp = getattr(C, "DEFAULT_LOCAL_TMP", None)
    return os.path.join(local_tmp, "ansiballz_cache") if isinstance(local_tmp, str) and local_tmp else None


def _kept() -> str | None:
    """This collection's own directory of kept payloads: one per pair of roots (below), so that two checkouts or two
    installed versions of the collection, run by the same user, never take each other's payload."""
    local_tmp = getattr(C, "DEFAULT_LOCAL_TMP", None)
    if not isinstance(local_tmp, str) or not local_tmp:
        return None
    key = hashlib.sha256(json.dumps(ROOTS, sort_keys=True).encode()).hexdigest()[:16]
    return os.path.join(os.path.dirname(local_tmp.rstrip("/")), DIRNAME, key)


def _trusted(path: str) -> bool:
    """A directory of this user's that only this user can read or write, below one of the same (the rule of the
    target's bytecode cache, stricter: a payload is the code a host runs as root)."""
    return _pyc.trusted(path, mask=0o077)


def _stamp(path: str) -> list[t.Any] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return [st.st_size, st.st_mtime_ns]


#: Where the payload's files come from on the controller: Ansible's own, and this collection's.
ROOTS = {
    "ansible/": os.path.dirname(os.path.dirname(os.path.abspath(ansible.__file__))),
    "ansible_collections/gpuops/clean_slate/": os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
}


def _manifest(entry: str) -> dict[str, t.Any] | None:
    """What an entry of Ansible's cache was built from: each file of its zip, as the controller's source file with its
    size and mtime. None when a file cannot be traced to one (the entry is then never kept): only the packages'
    empty ``__init__.py`` that Ansible writes itself have no source."""
    with open(entry, "rb") as fh:
        cached = pickle.load(fh)  # Ansible's own cache entry, in the user's own 0700 directory
    zipped = getattr(cached, "zip_data", None)
    if not isinstance(zipped, bytes):
        return None
    sources: dict[str, t.Any] = {}
    with zipfile.ZipFile(io.BytesIO(base64.b64decode(zipped))) as zf:
        for info in zf.infolist():
            if info.is_dir():
                continue
            root = next((r for r in ROOTS if info.filename.startswith(r)), None)
            here = None
            if root == "ansible/":
                here = os.path.join(ROOTS[root], info.filename)
            elif root:
                here = os.path.join(ROOTS[root], info.filename[len(root) :])
            stamp = _stamp(here) if here else None
            if here is None or stamp is None:
                if info.file_size == 0 and info.filename.endswith("__init__.py"):
                    continue  # a package Ansible made up for the payload
                return None
            sources[here] = stamp
    return {"ansible": ANSIBLE_VERSION, "python": list(sys.version_info[:2]), "roots": ROOTS, "sources": sources} if sources else None


def _fresh(manifest: dict[str, t.Any]) -> bool:
    if manifest.get("ansible") != ANSIBLE_VERSION or manifest.get("python") != list(sys.version_info[:2]) or manifest.get("roots") != ROOTS:
        return False  # another Ansible, Python, or the payload of another copy of the collection
    sources = manifest.get("sources")
    return isinstance(sources, dict) and bool(sources) and all(_stamp(path) == stamp for path, stamp in sources.items())


def restore() -> int:
    """Copy every kept payload of the module whose sources are unchanged into this run's cache (where Ansible has none
    yet); how many. Never raises."""
    try:
        run_cache, kept = _run_cache(), _kept()
        if not run_cache or not kept or not os.path.isdir(kept) or not _trusted(kept):
            return 0  # only a directory of this user's that no one else can write is trusted
        restored = 0
        for name in os.listdir(kept):
            if not name.startswith(MODULE + "-") or name.endswith(".json") or os.path.exists(os.path.join(run_cache, name)):
                continue
            with open(os.path.join(kept, name + ".json"), encoding="utf-8") as fh:
                manifest = json.load(fh)
            if not _fresh(manifest):
                continue
            os.makedirs(run_cache, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=run_cache, prefix=".gpuops-")
            os.close(fd)
            shutil.copyfile(os.path.join(kept, name), tmp)
            os.replace(tmp, os.path.join(run_cache, name))  # whole, or not at all: Ansible never reads half an entry
            restored += 1
        return restored
    except (OSError, ValueError):
        return 0


def keep() -> int:
    """Keep this run's payloads of the module (those not kept yet, or kept from other sources); how many. Never raises."""
    try:
        run_cache, kept = _run_cache(), _kept()
        if not run_cache or not kept or not os.path.isdir(run_cache):
            return 0
        os.makedirs(os.path.dirname(kept), mode=0o700, exist_ok=True)  # makedirs gives its mode to the last one only
        os.makedirs(kept, mode=0o700, exist_ok=True)
        if not _trusted(kept):
            return 0
        saved = 0
        for name in os.listdir(run_cache):
            if not name.startswith(MODULE + "-") or name.endswith((".lock", "-part")) or name.startswith("."):
                continue
            path = os.path.join(kept, name + ".json")
            if os.path.exists(path):
                try:
                    with open(path, encoding="utf-8") as fh:
                        if _fresh(json.load(fh)):
                            continue
                except ValueError:
                    pass
            manifest = _manifest(os.path.join(run_cache, name))
            if manifest is None:
                continue
            for src, dst in ((os.path.join(run_cache, name), os.path.join(kept, name)),):
                fd, tmp = tempfile.mkstemp(dir=kept, prefix=".")
                os.close(fd)
                shutil.copyfile(src, tmp)
                os.replace(tmp, dst)
            fd, tmp = tempfile.mkstemp(dir=kept, prefix=".")
            with os.fdopen(fd, "w", encoding="utf-8") as fh:
                json.dump(manifest, fh)
            os.replace(tmp, path)
            saved += 1
        return saved
    except (OSError, ValueError, pickle.UnpicklingError, AttributeError, EOFError):
        return 0
