# Copyright (c) 2026, gpuops.clean_slate maintainers
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# Note: this module_util is PRIVATE to the collection; it may change without notice.

"""Finding residue candidates: the default globs, the scopes' roots, and a walker that never follows a symlink.

Paths are walked one component at a time from a directory fd (``openat`` with ``O_NOFOLLOW``), so no symlink is
followed and no pattern can leave the scope's root; in container scope the root is the container's own
(``/proc/<init>/root``), so the host's files are never seen. Each candidate is an :class:`Item` identified by
device and inode, with its directory fd held open until the end of the run.
"""

from __future__ import annotations

import errno
import fnmatch
import os
import re
import stat as st_mod
import types
import typing as t
from dataclasses import dataclass, field

from ansible_collections.gpuops.clean_slate.plugins.module_utils import _reasons, _scope
from ansible_collections.gpuops.clean_slate.plugins.module_utils._errors import CleanSlateError

# The defaults and the source that makes each name: docs/docsite/rst/guide_clean_slate.rst, "The residue of dead jobs".
DEFAULT_SHM = (
    "/dev/shm/nccl-*",  # NCCL: mkstemp("/dev/shm/nccl-XXXXXX") (NVIDIA/nccl src/misc/shmutils.cc)
    "/dev/shm/vllm*",  # vLLM: vllm_offload_*.mmap (vllm#54002), vllm-* (prime-rl PR#2331)
    # vLLM's multimodal object store: SharedMemory(name=VLLM_OBJECT_STORAGE_SHM_BUFFER_NAME), whose default is
    # VLLM_OBJECT_STORAGE_SHM_BUFFER[_<uuid>] (vllm/envs.py; vllm/distributed/device_communicators/shm_object_storage.py)
    "/dev/shm/VLLM_OBJECT_STORAGE_SHM_BUFFER*",
    # torch: NewProcessWideShmHandle() "/torch_<pid>_<rand>_<n>" (CUDA IPC ref counters, file_system sharing; older
    # releases "/torch_<pid>_<n>") (pytorch aten/src/ATen/MapAllocator.cpp)
    "/dev/shm/torch_*",
    "/dev/shm/psm_*",  # multiprocessing.shared_memory: vLLM's and SGLang's shm_broadcast queues (older SGLang)
    "/dev/shm/sem.mp-*",  # multiprocessing semaphores (spawn context: named, unlinked by the resource tracker)
    # SGLang: make_shm_name(kind) "sgl_shm_<kind>_<pid>_<rand>": mq (distributed/device_communicators/shm_broadcast.py),
    # nodecheck (distributed/parallel_state.py), mm and sync (multimodal), xputensor (python/sglang/srt/utils/stale_shm_cleanup.py)
    "/dev/shm/sgl_shm_*",
    "/dev/shm/sglang_loads_*.shm",  # SGLang: the load snapshot, shm_path_for(ipc_name) (python/sglang/srt/managers/load_snapshot.py)
    # SGLang: write_data_for_multi_tokenizer(): SharedMemory(name=f"multi_tokenizer_args_{pid}") with --tokenizer-worker-num > 1
    # (python/sglang/srt/managers/multi_tokenizer_mixin.py)
    "/dev/shm/multi_tokenizer_args_*",
    # The CUDA driver's IPC segment "cuda.shm.0.<creator pid in hex>.<n>" (libcuda; what a torch server tree left on an
    # H200: docs/results/server-facts-h200x1-2026-12-02.json; SGLang's own sweep lists the family)
    "/dev/shm/cuda.shm.*",
    # loky's (joblib's) semaphores, SemLock name "/loky-<pid>-<rand>" (joblib/externals/loky/backend/synchronize.py);
    # SGLang's own sweep lists them
    "/dev/shm/sem.loky-*",
)
DEFAULT_SOCKETS = (
    "/tmp/tmp????????",  # SGLang: ipc://{NamedTemporaryFile(delete=False).name} (python/sglang/srt/server_args.py PortArgs)
    "/tmp/????????-????-????-????-????????????",  # vLLM: ipc://{VLLM_RPC_BASE_PATH}/{uuid4()} (vllm/utils/network_utils.py)
    "/tmp/*-????????-????-????-????-????????????",  # vLLM: ipc://{TMP_DIR}/{description}-{uuid4()}
    "/tmp/ray/session_*/sockets/*",  # Ray: plasma_store, raylet
    # torch_shm_manager (file_system sharing): a socket in mkdtemp(prefix="torch-shm-dir-"), left when it is killed
    # (seen on the H200: docs/validation.md, round 2); pytorch torch/lib/libshm/manager.cpp.
    "/tmp/torch-shm-dir-*/manager.sock",
)
DEFAULT_LOCKS = (
    "/root/.cache/flashinfer/**/*.lock",  # flashinfer JIT FileLock (flashinfer#972)
    "/home/*/.cache/flashinfer/**/*.lock",
    "/root/.cache/torch_extensions/**/lock",  # torch cpp_extension FileBaton, O_CREAT|O_EXCL (pytorch#189245)
    "/home/*/.cache/torch_extensions/**/lock",
    "/root/.triton/cache/**/*.lock",
    "/home/*/.triton/cache/**/*.lock",
    "/root/.cache/vllm/**/*.lock",  # vLLM compile cache (vllm#21858)
    "/home/*/.cache/vllm/**/*.lock",
    "/tmp/torchinductor_*/locks/*.lock",  # torch inductor's cache locks
    # vLLM's weight download lock: FileLock(f"{tempdir}/{sha256(model)}{model}.lock") (vllm/model_executor/model_loader/weight_utils.py get_lock)
    "/tmp/" + "?" * 64 + "*.lock",
)
DEFAULT_DIRS = (
    "/tmp/torchelastic_*",  # tempfile.mkdtemp(prefix="torchelastic_") (prime-rl PR#2331)
    "/tmp/torch-shm-dir-*",  # torch_shm_manager's directory, empty once its socket is gone
)
# Regular files that are no segments (a rendezvous store, a daemon's marker) and cached answers: the role's server
# profiles name them (roles/clean_slate/profiles/); the modules have none by default.
DEFAULT_FILES: tuple[str, ...] = ()
DEFAULT_CACHES: tuple[str, ...] = ()
#: Where patterns may point: every pattern must lie under one of these (the ``roots`` option).
DEFAULT_ROOTS = ("/dev/shm", "/tmp", "/var/tmp", "/root", "/home")
#: Directories no root may be, or lie under: the system itself (``/dev/shm`` and ``/var/tmp`` are allowed).
SYSTEM_DIRS = ("/bin", "/boot", "/dev", "/etc", "/lib", "/lib32", "/lib64", "/libx32", "/proc", "/run", "/sbin", "/sys", "/usr", "/var")
SYSTEM_EXCEPTIONS = ("/dev/shm", "/var/tmp")

# Names that carry their creator's pid, as its source writes it (decimal, or hex for the CUDA driver), in the creator's
# own PID namespace: such a file is kept while that process lives and started no later than the file last changed.
CREATOR_PID: tuple[tuple[re.Pattern[str], int, str], ...] = (
    (re.compile(r"^sgl_shm_.+_(\d+)_[0-9a-f]+$"), 10, "SGLang's make_shm_name"),
    (re.compile(r"^multi_tokenizer_args_(\d+)$"), 10, "SGLang's multi-tokenizer arguments"),
    (re.compile(r"^torch_(\d+)_\d+(?:_\d+)?$"), 10, "torch's NewProcessWideShmHandle"),
    (re.compile(r"^cuda\.shm\.[0-9a-f]+\.([0-9a-f]+)\.[0-9a-f]+$"), 16, "the CUDA driver's IPC segment"),
    # loky (joblib): SemLock(..., name="/loky-<pid>-<rand>"), which glibc stores as sem.loky-<pid>-<rand>
    # (joblib/externals/loky/backend/synchronize.py)
    (re.compile(r"^sem\.loky-(\d+)-[^/]+$"), 10, "loky's semaphore"),
    # prometheus_client's multiprocess mode: <type>_<pid>.db in PROMETHEUS_MULTIPROC_DIR, mapped by its process
    # (prometheus_client/values.py MultiProcessValue, mmap_dict.py)
    (re.compile(r"^(?:counter|gauge_[a-z]+|histogram|summary)_(\d+)\.db$"), 10, "prometheus_client's multiprocess file"),
)


def creator_pid(name: str) -> int | None:
    """The pid a name says made it, or None for a name without one."""
    for rx, base, _what in CREATOR_PID:
        m = rx.match(name)
        if m:
            pid = int(m.group(1), base)
            return pid if pid > 0 else None
    return None


#: The kinds of residue, each with its option: ``shm`` (segments: regular files), ``sockets`` (socket files, and the 0-byte
#: regular file a socket path is before it is bound), ``locks`` (regular files), ``dirs`` (directories), ``files`` (other
#: regular files: rendezvous stores, markers), ``caches`` (regular files holding a cached answer).
KINDS = ("shm", "sockets", "locks", "dirs", "files", "caches")
#: The kinds whose items are regular files.
REGULAR = ("shm", "locks", "files", "caches")

MAX_DEPTH = 16  # levels a "**" descends
MAX_TREE = 100000  # entries of one directory judged before it is given up as too big
_GLOB = re.compile(r"[*?[]")
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


Key = t.Tuple[int, int]
EMPTY_KEYS: frozenset[Key] = frozenset()
EMPTY_NAMES: frozenset[str] = frozenset()
EMPTY_SOCKETS: t.Mapping[str, Key] = types.MappingProxyType({})


@dataclass
class Glob:
    """One path glob, split into components; a directory glob may say what the directory must hold (``holding``)."""

    kind: str
    pattern: str
    parts: list[str]
    holding: str | None = None  #: dirs only: a name glob every entry must match (a directory recognised by its files)
    option: str = ""  #: the option it came from, when not its kind's (dirs_holding)


def parse_roots(roots: t.Sequence[str]) -> list[tuple[str, ...]]:
    """The ``roots`` option, checked: absolute directories without globs, never ``/`` or a system directory."""
    out = []
    for root in roots:
        text = str(root)
        parts = tuple(p for p in text.split("/") if p)
        norm = "/" + "/".join(parts)
        why = None
        if not text.startswith("/") or "\0" in text or _GLOB.search(text) or any(p in (".", "..") for p in parts):
            why = "is not an absolute directory without globs, '.' or '..'"
        elif not parts:
            why = "is the root directory: every file of the host would be in reach"
        elif norm not in SYSTEM_EXCEPTIONS and any(norm == d or norm.startswith(d + "/") for d in SYSTEM_DIRS):
            why = f"is a system directory (or lies under one: {', '.join(SYSTEM_DIRS)}; /dev/shm and /var/tmp excepted)"
        if why:
            raise CleanSlateError(f"roots: {text!r} {why}.", reason=_reasons.BAD_ARGUMENTS, option="roots")
        out.append(parts)
    return out


def check_roots(globs: t.Sequence[Glob], roots: t.Sequence[tuple[str, ...]]) -> None:
    """Refuse a pattern that does not lie under one of the roots (its leading literal components must be a root's)."""
    for g in globs:
        if not any(len(g.parts) > len(r) and tuple(g.parts[: len(r)]) == r for r in roots):
            shown = ", ".join("/" + "/".join(r) for r in roots) or "none"
            raise CleanSlateError(
                f"{g.option or g.kind}: {g.pattern!r} is outside the roots ({shown}); residue is looked for only there. Add its directory to"
                " roots (clean_slate_residue_roots in the role) if it really holds a job's residue.",
                reason=_reasons.BAD_ARGUMENTS,
                option=g.option or g.kind,
            )


def parse_glob(kind: str, pattern: str) -> Glob:
    """Split and check one pattern; the error names the option."""
    if not isinstance(pattern, str) or not pattern.startswith("/"):
        raise CleanSlateError(f"{kind}: {pattern!r} is not an absolute path glob (for example /dev/shm/nccl-*).", reason=_reasons.BAD_ARGUMENTS, option=kind)
    if "\0" in pattern:
        raise CleanSlateError(f"{kind}: {pattern!r} contains a NUL byte.", reason=_reasons.BAD_ARGUMENTS, option=kind)
    parts = [p for p in pattern.split("/") if p]
    if not parts:
        raise CleanSlateError(f"{kind}: {pattern!r} names the root directory itself.", reason=_reasons.BAD_ARGUMENTS, option=kind)
    if any(p in (".", "..") for p in parts):
        raise CleanSlateError(f"{kind}: {pattern!r} contains '.' or '..'; give the path without them.", reason=_reasons.BAD_ARGUMENTS, option=kind)
    if any("**" in p and p != "**" for p in parts):
        raise CleanSlateError(f"{kind}: {pattern!r}: '**' must be a whole path component (a/**/b).", reason=_reasons.BAD_ARGUMENTS, option=kind)
    if parts[-1] == "**":
        raise CleanSlateError(f"{kind}: {pattern!r} must end with a name pattern, not '**'.", reason=_reasons.BAD_ARGUMENTS, option=kind)
    if kind == "dirs" and ("**" in parts or not _GLOB.sub("", parts[-1])):
        # A directory is removed with everything in it: its name must say what it is (torchelastic_*).
        raise CleanSlateError(
            f"dirs: {pattern!r} must end with a name that has literal characters (such as torchelastic_*) and use no '**'.",
            reason=_reasons.BAD_ARGUMENTS,
            option=kind,
        )
    return Glob(kind=kind, pattern=pattern, parts=parts)


def parse_holding(option: str, entry: t.Mapping[str, t.Any]) -> Glob:
    """One ``dirs_holding`` entry: a directory glob (``dir``, checked as a ``dirs`` pattern) and the name glob every entry
    of such a directory matches (``files``: a name, no ``/``); only a directory that holds at least one such regular file
    and nothing else is a candidate, so a broad ``dir`` (``/tmp/tmp????????``, every ``mkdtemp``) stays safe."""
    glob = parse_glob("dirs", str(entry.get("dir", "")))
    files = entry.get("files")
    if not isinstance(files, str) or not files or "/" in files or "\0" in files or not _GLOB.sub("", files):
        raise CleanSlateError(
            f"{option}: files {files!r} (for {glob.pattern}) must be a file name glob with literal characters and no '/' (for example '*_[0-9]*.db').",
            reason=_reasons.BAD_ARGUMENTS,
            option=option,
        )
    return Glob(kind="dirs", pattern=glob.pattern, parts=glob.parts, holding=files, option=option)


# ---------------------------------------------------------------------- items
class Item:
    """One candidate: a file or directory a glob matched.

    A plain class with slots: items are made by the ten thousand (a full /dev/shm), and each one
    costs its construction.
    """

    __slots__ = (
        "creator",
        "dev",
        "dir_fd",
        "holder_pids",
        "holders",
        "ino",
        "kind",
        "name",
        "nbytes",
        "newest",
        "parent",
        "released",
        "st",
        "tree",
        "tree_dirs",
        "tree_names",
        "tree_sockets",
        "verdict",
        "vmid",
        "why",
    )

    def __init__(self, kind: str, parent: str, vmid: int | None, dir_fd: int, name: str, dev: int, ino: int, st: os.stat_result | None = None) -> None:
        self.kind = kind
        self.parent = parent  # the directory, as the scope sees it
        self.vmid = vmid
        self.dir_fd = dir_fd  # the directory, held open until the end
        self.name = name
        self.dev = dev
        self.ino = ino
        # Regular files on tmpfs are judged by the directory entry's inode alone and stat'ed only when
        # their owner, size or removal needs it: 10 000 segments in /dev/shm cost 10 000 stats less.
        self.st = st
        self.nbytes = st.st_blocks * 512 if st is not None and kind != "dirs" else 0
        # dirs only: every entry inside, and itself (empty and shared for files)
        self.tree: t.AbstractSet[Key] = EMPTY_KEYS
        self.tree_dirs: t.AbstractSet[Key] = EMPTY_KEYS
        self.tree_names: t.AbstractSet[str] = EMPTY_NAMES
        # dirs only: the socket files inside (name -> key). A socket bound by a live process holds no fd on the
        # file's inode, only the unix tables name it, so a directory is judged against them as well.
        self.tree_sockets: t.Mapping[str, Key] = EMPTY_SOCKETS
        self.holders: list[dict[str, t.Any]] = []
        self.holder_pids: frozenset[int] = frozenset()  # every holder's pid (holders lists ten at most); 0 for an unknown binder
        self.verdict = "remove"  # remove, held, kept, stale, skipped, removed, vanished, error
        self.why = ""
        # dirs only: the newest change (mtime or ctime, ns) of anything in the tree, found while it is listed
        self.newest = 0
        self.creator: dict[str, t.Any] | None = None  # the live process its name says made it (kept for it)
        self.released: list[int] | None = None  # the pids this run's kill ended that held it (orphaned at once)

    def changed_ns(self) -> int | None:
        """When it (for a directory, anything in it) last changed: the newest of mtime and ctime, in ns; None when gone."""
        st = self.stat()
        if st is None:
            return None
        return max(st.st_mtime_ns, st.st_ctime_ns, self.newest)

    @property
    def path(self) -> str:
        return f"{self.parent}/{self.name}"

    @property
    def key(self) -> Key:
        return (self.dev, self.ino)

    def stat(self) -> os.stat_result | None:
        """The item's stat (fetched once); None when it is gone or no longer the file that was found."""
        if self.st is None:
            try:
                st = os.stat(self.name, dir_fd=self.dir_fd, follow_symlinks=False)
            except OSError:
                return None
            if (st.st_dev, st.st_ino) != self.key:
                return None
            self.st = st
            if self.kind != "dirs":
                self.nbytes = st.st_blocks * 512
        return self.st

    def record(self) -> dict[str, t.Any]:
        st = self.stat()
        rec: dict[str, t.Any] = {"path": self.path, "kind": self.kind, "bytes": self.nbytes, "uid": st.st_uid if st else None, "container": self.vmid}
        if not self.path.isascii() and not is_utf8(self.path):
            # The module's ending writes each byte that is not UTF-8 as \xNN (_module.text); say that it did.
            rec["path_escaped"] = True
        if self.holders:
            rec["holders"] = self.holders
        if self.creator:
            rec["creator"] = self.creator
        if self.released:
            rec["released_by"] = self.released
        if self.why:
            rec["why"] = self.why
        return rec


def is_utf8(name: str) -> bool:
    """Whether a name read from the file system is valid UTF-8 (else it holds surrogate escapes of its bytes)."""
    try:
        name.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


@dataclass
class Root:
    """Where one scope's paths start: this host's / or a container's /proc/<init>/root."""

    fd: int
    vmid: int | None
    init_pid: int | None
    scope: _scope.Scope | None
    fstypes: dict[int, str] = field(default_factory=dict)  # device -> file system type, from its mountinfo

    @property
    def netdir(self) -> str:
        return "/proc/self/net" if self.init_pid is None else f"/proc/{self.init_pid}/net"

    def label(self, path: str) -> str:
        return path if self.vmid is None else f"{path} (container {self.vmid})"


class Walker:
    """Expands globs under a root, never following a symlink, keeping the directory fds of candidates."""

    def __init__(self, root: Root, notes: list[str]) -> None:
        self.root = root
        self.notes = notes
        self.kept: list[int] = []
        self.items: list[Item] = []
        self.names: set[str] = set()  # every matched name, duplicates (hard links) included: fds are matched by name first
        self._seen: set[tuple[str, int, int]] = set()

    def _open(self, fd: int, name: str, rel: str, literal: bool) -> int | None:
        try:
            return os.open(name, DIR_FLAGS, dir_fd=fd)
        except OSError as exc:
            if literal and exc.errno in (errno.ELOOP, errno.ENOTDIR):
                self.notes.append(f"{self.root.label(rel + '/' + name)} is a symbolic link or not a directory; it was not followed.")
            elif literal and exc.errno not in (errno.ENOENT,):
                self.notes.append(f"{self.root.label(rel + '/' + name)}: {exc.strerror}.")
            return None

    @staticmethod
    def _subdirs(fd: int) -> list[str]:
        try:
            with os.scandir(fd) as it:
                return [e.name for e in it if e.is_dir(follow_symlinks=False)]
        except OSError:
            return []

    def walk(self, kind: str, dir_parts: list[str], names: re.Pattern[str], holding: str | None = None) -> None:
        """Visit every directory matching ``dir_parts`` and collect its entries matching ``names`` (directories that hold
        only files matching ``holding``, when given)."""
        self._holding = re.compile(fnmatch.translate(holding)) if holding else None
        top = os.dup(self.root.fd)
        try:
            self._descend(top, "", dir_parts, 0, 0, kind, names)
        finally:
            os.close(top)
            self._holding = None

    _holding: re.Pattern[str] | None = None

    def _descend(self, fd: int, rel: str, parts: list[str], i: int, depth: int, kind: str, names: re.Pattern[str]) -> None:
        if i == len(parts):
            self._collect(fd, rel, kind, names)
            return
        part = parts[i]
        if part == "**":
            self._descend(fd, rel, parts, i + 1, depth, kind, names)
            if depth >= MAX_DEPTH:
                return
            candidates = self._subdirs(fd)
        elif _GLOB.search(part):
            rx = re.compile(fnmatch.translate(part))
            candidates = [n for n in self._subdirs(fd) if rx.match(n)]
        else:
            candidates = [part]
        for name in candidates:
            sub = self._open(fd, name, rel, literal=not _GLOB.search(part) and part != "**")
            if sub is None:
                continue
            try:
                self._descend(sub, f"{rel}/{name}", parts, i + (0 if part == "**" else 1), depth + (1 if part == "**" else 0), kind, names)
            finally:
                os.close(sub)

    def _collect(self, fd: int, rel: str, kind: str, names: re.Pattern[str]) -> None:
        found: list[Item] = []
        try:
            dev = os.fstat(fd).st_dev
            with os.scandir(fd) as it:
                entries = [e for e in it if names.match(e.name)]
        except OSError as exc:
            self.notes.append(f"{self.root.label(rel or '/')}: cannot list ({exc.strerror}).")
            return
        # On tmpfs the directory entry's type and inode are the file's own (no overlay remaps them).
        lazy = kind in REGULAR and self.root.fstypes.get(dev) == "tmpfs"
        wanted = st_mod.S_IFSOCK if kind == "sockets" else st_mod.S_IFDIR if kind == "dirs" else st_mod.S_IFREG
        vmid, seen, all_names = self.root.vmid, self._seen, self.names
        for entry in entries:
            name = entry.name
            st = None
            if lazy:
                try:
                    if not entry.is_file(follow_symlinks=False):
                        continue
                except OSError:
                    continue
                key = (dev, entry.inode())
            else:
                try:
                    st = os.stat(name, dir_fd=fd, follow_symlinks=False)
                except OSError:
                    continue  # gone since the listing
                if st_mod.S_IFMT(st.st_mode) != wanted and not (kind == "sockets" and unbound_path(st)):
                    continue
                key = (st.st_dev, st.st_ino)
            mark = (kind, key[0], key[1])
            all_names.add(name)
            if mark in seen:
                continue
            seen.add(mark)
            item = Item(kind, rel, vmid, fd, name, key[0], key[1], st)
            if kind == "dirs" and not self._tree(fd, item):
                continue
            if kind == "dirs" and self._holding is not None and not holds_only(item, self._holding):
                continue
            found.append(item)
        if found:
            keep = os.dup(fd)
            self.kept.append(keep)
            for item in found:
                item.dir_fd = keep
            self.items.extend(found)

    def _tree(self, parent: int, item: Item) -> bool:
        """Every entry of a candidate directory (its keys, names and bytes); False when it cannot be judged whole."""
        holding = self._holding
        quiet = holding is not None  # a directory that is not what holding describes is no candidate: no note
        tree, tree_dirs, tree_names = {item.key}, {item.key}, {item.name}
        tree_sockets: dict[str, Key] = {}
        item.tree, item.tree_dirs, item.tree_names, item.tree_sockets = tree, tree_dirs, tree_names, tree_sockets

        class GiveUp(Exception):
            pass

        def visit(fd: int, dev: int, depth: int) -> None:
            with os.scandir(fd) as it:
                entries = [e.name for e in it]
            for child in entries:
                if holding is not None and not holding.match(child):
                    raise GiveUp("holds another file")  # not what holding describes: no need to look further
                try:
                    cst = os.stat(child, dir_fd=fd, follow_symlinks=False)
                except OSError:
                    continue
                if holding is not None and not st_mod.S_ISREG(cst.st_mode):
                    raise GiveUp("holds something that is no regular file")
                if st_mod.S_ISDIR(cst.st_mode) and cst.st_dev != dev:
                    raise GiveUp("contains a mount point")
                tree.add((cst.st_dev, cst.st_ino))
                tree_names.add(child)
                item.newest = max(item.newest, cst.st_mtime_ns, cst.st_ctime_ns)
                if st_mod.S_ISSOCK(cst.st_mode):
                    tree_sockets[child] = (cst.st_dev, cst.st_ino)
                item.nbytes += cst.st_blocks * 512
                if len(tree) > MAX_TREE:
                    raise GiveUp(f"has more than {MAX_TREE} entries")
                if st_mod.S_ISDIR(cst.st_mode):
                    tree_dirs.add((cst.st_dev, cst.st_ino))
                    if depth >= MAX_DEPTH:
                        raise GiveUp(f"is nested deeper than {MAX_DEPTH} levels")
                    sub = self._open(fd, child, "", literal=False)
                    if sub is None:
                        raise GiveUp("has a directory that cannot be opened")
                    try:
                        visit(sub, dev, depth + 1)
                    finally:
                        os.close(sub)

        top = self._open(parent, item.name, "", literal=False)
        if top is None:
            return False
        try:
            visit(top, item.dev, 1)
            return True
        except GiveUp as exc:
            if not quiet:
                self.notes.append(f"{self.root.label(item.path)} {exc}; it was left alone.")
            return False
        except OSError as exc:
            if not quiet:
                self.notes.append(f"{self.root.label(item.path)}: {exc.strerror}; it was left alone.")
            return False
        finally:
            os.close(top)

    def close(self) -> None:
        for fd in self.kept:
            os.close(fd)
        self.kept = []


def path_matches(glob: Glob, path: str) -> bool:
    """Whether ``path`` (absolute, as its scope sees it) is one ``glob`` matches, component by component (``**`` any
    number of directories), as the walker matches it."""
    parts = [p for p in path.split("/") if p]

    def match(i: int, j: int) -> bool:
        if i == len(glob.parts):
            return j == len(parts)
        if glob.parts[i] == "**":
            return any(match(i + 1, k) for k in range(j, min(len(parts), j + MAX_DEPTH) + 1))
        return j < len(parts) and fnmatch.fnmatchcase(parts[j], glob.parts[i]) and match(i + 1, j + 1)

    return match(0, 0)


def unbound_path(st: os.stat_result) -> bool:
    """A socket path made and never bound: a 0-byte regular file (``NamedTemporaryFile(delete=False).name`` handed to
    ZMQ, whose bind replaces it with the socket; a crash in between leaves it)."""
    return st_mod.S_ISREG(st.st_mode) and st.st_size == 0


def holds_only(item: Item, files: re.Pattern[str]) -> bool:
    """Whether a directory holds at least one entry and every entry is a name ``files`` matches (no subdirectory)."""
    names = item.tree_names - {item.name}
    return bool(names) and len(item.tree_dirs) == 1 and all(files.match(n) for n in names)


def mount_types(pid: int | None) -> dict[int, str]:
    """Device number -> file system type of every mount a process sees."""
    out: dict[int, str] = {}
    try:
        with open(f"/proc/{pid or 'self'}/mountinfo", encoding="utf-8", errors="replace") as fh:
            for line in fh:
                left, _sep, right = line.partition(" - ")
                major, _s, minor = left.split()[2].partition(":")
                out[os.makedev(int(major), int(minor))] = right.split(" ", 1)[0]
    except (OSError, ValueError, IndexError):
        pass
    return out


def open_roots(scopes: t.Sequence[_scope.Scope]) -> list[Root]:
    """The roots to walk: this host's, or each container's through its init."""
    if not scopes:
        return [Root(fd=os.open("/", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC), vmid=None, init_pid=None, scope=None, fstypes=mount_types(None))]
    roots: list[Root] = []
    for scope in scopes:
        try:
            fd = os.open(f"/proc/{scope.init_pid}/root", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as exc:
            for r in roots:
                os.close(r.fd)
            raise CleanSlateError(
                f"containers: cannot reach the file system of container {scope.vmid} through /proc/{scope.init_pid}/root ({exc.strerror});"
                " run the task on its hypervisor as root.",
                reason=_reasons.NOT_RUNNING,
                vmid=scope.vmid,
            ) from None
        roots.append(Root(fd=fd, vmid=scope.vmid, init_pid=scope.init_pid, scope=scope, fstypes=mount_types(scope.init_pid)))
    return roots


def collect(globs: t.Sequence[Glob], roots: list[Root], notes: list[str]) -> tuple[list[Item], list[Walker]]:
    """Every candidate of every glob under every root (directories with several globs are listed once per kind)."""
    groups: dict[tuple[str, tuple[str, ...], str | None], list[str]] = {}
    for g in globs:
        groups.setdefault((g.kind, tuple(g.parts[:-1]), g.holding), []).append(g.parts[-1])
    walkers = []
    items: list[Item] = []
    for root in roots:
        w = Walker(root, notes)
        walkers.append(w)
        for (kind, dir_parts, holding), lasts in groups.items():
            names = re.compile("|".join(f"(?:{fnmatch.translate(x)})" for x in lasts))
            w.walk(kind, list(dir_parts), names, holding)
        items.extend(w.items)
    return items, walkers
