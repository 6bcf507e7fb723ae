# Copyright (c) 2026, gpuops.clean_slate maintainers
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# Note: this module_util is PRIVATE to the collection; it may change without notice.

"""What a dead GPU job leaves behind besides GPU memory, and removing it safely.

Four kinds of residue, each found by absolute path globs:

* ``shm``: shared memory segments and POSIX semaphores in ``/dev/shm``
  (NCCL ``nccl-XXXXXX``, vLLM ``vllm*``, torch ``torch_<pid>_<n>``, Python
  ``psm_*`` and ``sem.mp-*``); regular files only.
* ``sockets``: ZMQ ``ipc://`` and other unix socket files; socket files only.
* ``locks``: lock files of JIT compile caches (flashinfer, torch extensions,
  triton, vLLM, inductor); regular files only. Reported, removed on request.
* ``dirs``: per-run directories (torchelastic's ``/tmp/torchelastic_*``),
  removed as a whole, on request.

An item goes only when it is provably orphaned: no live process has it (or,
for a directory, anything in it) open, mapped, locked, bound, or as its
working directory (:mod:`._holders`). Paths are walked one component at a
time from a directory fd (``openat`` with ``O_NOFOLLOW``), so no symlink is
followed and no pattern can leave the scope's root; in container scope the
root is the container's own (``/proc/<init>/root``), so the host's files are
never seen. Right before each unlink the item is stat'ed again through its
directory fd and must still be the very file that was judged.

It is also the gpu_job_residue module's logic (:class:`ModuleRun`).
"""

from __future__ import annotations

import errno
import fnmatch
import gc
import os
import re
import stat as st_mod
import time
import types
import typing as t
from dataclasses import dataclass, field

from ansible_collections.gpuops.clean_slate.plugins.module_utils import _checks, _holders, _ports, _procs, _proctable, _reasons, _scope
from ansible_collections.gpuops.clean_slate.plugins.module_utils._errors import CleanSlateError

# Sources for the defaults: docs/docsite/rst/guide_clean_slate.rst, "What the residue phase removes".
DEFAULT_SHM = (
    "/dev/shm/nccl-*",  # NCCL: mkstemp("/dev/shm/nccl-XXXXXX") (NVIDIA/nccl src/misc/shmutils.cc)
    "/dev/shm/vllm*",  # vLLM: vllm_offload_*.mmap (vllm#54002), vllm-* (prime-rl PR#2331)
    "/dev/shm/torch_*",  # torch: "/torch_<pid>_<n>" (pytorch aten/src/ATen/MapAllocator.cpp)
    "/dev/shm/psm_*",  # multiprocessing.shared_memory, used by vLLM's shm_broadcast
    "/dev/shm/sem.mp-*",  # multiprocessing semaphores (spawn context: named, unlinked at exit)
)
DEFAULT_SOCKETS = (
    "/tmp/tmp????????",  # SGLang: ipc://{NamedTemporaryFile(delete=False).name} (sglang server_args.py)
    "/tmp/????????-????-????-????-????????????",  # vLLM: ipc://{VLLM_RPC_BASE_PATH}/{uuid4()}
    "/tmp/*-????????-????-????-????-????????????",  # vLLM: ipc://{TMP_DIR}/{description}-{uuid4()}
    "/tmp/ray/session_*/sockets/*",  # Ray: plasma_store, raylet
    # torch_shm_manager (file_system sharing): a socket in mkdtemp(prefix="torch-shm-dir-"), left when it is killed
    # (seen on the H200: docs/validation.md, round 2); pytorch torch/lib/libshm/manager.cpp.
    "/tmp/torch-shm-dir-*/manager.sock",
)
DEFAULT_LOCKS = (
    "/root/.cache/flashinfer/**/*.lock",  # flashinfer JIT FileLock (flashinfer#972)
    "/home/*/.cache/flashinfer/**/*.lock",
    "/root/.cache/torch_extensions/**/lock",  # torch cpp_extension FileBaton (pytorch#189245)
    "/home/*/.cache/torch_extensions/**/lock",
    "/root/.triton/cache/**/*.lock",
    "/home/*/.triton/cache/**/*.lock",
    "/root/.cache/vllm/**/*.lock",  # vLLM compile cache (vllm#21858)
    "/home/*/.cache/vllm/**/*.lock",
    "/tmp/torchinductor_*/locks/*.lock",  # torch inductor's cache locks
)
DEFAULT_DIRS = (
    "/tmp/torchelastic_*",  # tempfile.mkdtemp(prefix="torchelastic_") (prime-rl PR#2331)
    "/tmp/torch-shm-dir-*",  # torch_shm_manager's directory, empty once its socket is gone
)
KINDS = ("shm", "sockets", "locks", "dirs")
# Locks and directories are only reported by default: a live compile's baton and a live torchelastic agent's
# log directory are not held open all the time, so "nothing holds it" does not prove the job is dead.
DEFAULT_REMOVE = ("shm", "sockets")
FAIL_ON = ("listening", "connected", "time_wait")

MAX_DEPTH = 16  # levels a "**" descends
MAX_TREE = 100000  # entries of one directory judged before it is given up as too big
_GLOB = re.compile(r"[*?[]")
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


Key = t.Tuple[int, int]
EMPTY_KEYS: frozenset[Key] = frozenset()
EMPTY_NAMES: frozenset[str] = frozenset()
EMPTY_SOCKETS: t.Mapping[str, Key] = types.MappingProxyType({})


# ---------------------------------------------------------------------- request
@dataclass
class Glob:
    """One path glob, split into components."""

    kind: str
    pattern: str
    parts: list[str]


@dataclass
class Request:
    """A validated request."""

    globs: list[Glob]
    remove: set[str]
    users: list[str] = field(default_factory=list)
    scopes: list[_scope.Scope] = field(default_factory=list)
    ports: list[int] = field(default_factory=list)
    time_wait_timeout: float = 0.0
    patterns: list[re.Pattern[str]] = field(default_factory=list)
    protect: list[str] = field(default_factory=list)
    fail_on: set[str] = field(default_factory=lambda: {"listening"})
    list_limit: int = 200


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


def validate_ports(ports: t.Sequence[int]) -> list[int]:
    """Distinct ports, each 1-65535."""
    out: list[int] = []
    for port in ports:
        if not 1 <= int(port) <= 65535:
            raise CleanSlateError(f"ports: {port} is not a TCP port (1-65535).", reason=_reasons.BAD_ARGUMENTS, option="ports")
        if int(port) not in out:
            out.append(int(port))
    return out


# ---------------------------------------------------------------------- items
class Item:
    """One candidate: a file or directory a glob matched.

    A plain class with slots: items are made by the ten thousand (a full /dev/shm), and each one
    costs its construction.
    """

    __slots__ = (
        "dev",
        "dir_fd",
        "holders",
        "ino",
        "kind",
        "name",
        "nbytes",
        "parent",
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
        self.verdict = "remove"  # remove, held, stale, skipped, removed, vanished, error
        self.why = ""

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
        if self.holders:
            rec["holders"] = self.holders
        if self.why:
            rec["why"] = self.why
        return rec


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
            return os.open(name, _DIR_FLAGS, dir_fd=fd)
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

    def walk(self, kind: str, dir_parts: list[str], names: re.Pattern[str]) -> None:
        """Visit every directory matching ``dir_parts`` and collect its entries matching ``names``."""
        top = os.dup(self.root.fd)
        try:
            self._descend(top, "", dir_parts, 0, 0, kind, names)
        finally:
            os.close(top)

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
        lazy = kind in ("shm", "locks") and self.root.fstypes.get(dev) == "tmpfs"
        wanted = {"shm": st_mod.S_IFREG, "locks": st_mod.S_IFREG, "sockets": st_mod.S_IFSOCK, "dirs": st_mod.S_IFDIR}[kind]
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
                if st_mod.S_IFMT(st.st_mode) != wanted:
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
            found.append(item)
        if found:
            keep = os.dup(fd)
            self.kept.append(keep)
            for item in found:
                item.dir_fd = keep
            self.items.extend(found)

    def _tree(self, parent: int, item: Item) -> bool:
        """Every entry of a candidate directory (its keys, names and bytes); False when it cannot be judged whole."""
        tree, tree_dirs, tree_names = {item.key}, {item.key}, {item.name}
        tree_sockets: dict[str, Key] = {}
        item.tree, item.tree_dirs, item.tree_names, item.tree_sockets = tree, tree_dirs, tree_names, tree_sockets

        class GiveUp(Exception):
            pass

        def visit(fd: int, dev: int, depth: int) -> None:
            with os.scandir(fd) as it:
                entries = [e.name for e in it]
            for child in entries:
                try:
                    cst = os.stat(child, dir_fd=fd, follow_symlinks=False)
                except OSError:
                    continue
                if st_mod.S_ISDIR(cst.st_mode) and cst.st_dev != dev:
                    raise GiveUp("contains a mount point")
                tree.add((cst.st_dev, cst.st_ino))
                tree_names.add(child)
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
            self.notes.append(f"{self.root.label(item.path)} {exc}; it was left alone.")
            return False
        except OSError as exc:
            self.notes.append(f"{self.root.label(item.path)}: {exc.strerror}; it was left alone.")
            return False
        finally:
            os.close(top)

    def close(self) -> None:
        for fd in self.kept:
            os.close(fd)
        self.kept = []


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


def collect(req: Request, roots: list[Root], notes: list[str]) -> tuple[list[Item], list[Walker]]:
    """Every candidate of every glob under every root (directories with several globs are listed once per kind)."""
    groups: dict[tuple[str, tuple[str, ...]], list[str]] = {}
    for g in req.globs:
        groups.setdefault((g.kind, tuple(g.parts[:-1])), []).append(g.parts[-1])
    walkers = []
    items: list[Item] = []
    for root in roots:
        w = Walker(root, notes)
        walkers.append(w)
        for (kind, dir_parts), lasts in groups.items():
            names = re.compile("|".join(f"(?:{fnmatch.translate(x)})" for x in lasts))
            w.walk(kind, list(dir_parts), names)
        items.extend(w.items)
    return items, walkers


# ---------------------------------------------------------------------- users
def _passwd(root: Root) -> dict[str, int]:
    """User names of a scope: /etc/passwd read through the root fd, never following a symlink."""
    users: dict[str, int] = {}
    try:
        etc = os.open("etc", _DIR_FLAGS, dir_fd=root.fd)
    except OSError:
        return users
    try:
        fd = os.open("passwd", os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=etc)
        with os.fdopen(fd, encoding="utf-8", errors="replace") as fh:
            for line in fh:
                fields = line.split(":")
                if len(fields) >= 3 and fields[2].isdigit():
                    users.setdefault(fields[0], int(fields[2]))
    except OSError:
        pass
    finally:
        os.close(etc)
    return users


def _uid_map(pid: int | None) -> list[tuple[int, int, int]]:
    if pid is None:
        return []
    try:
        with open(f"/proc/{pid}/uid_map", encoding="ascii") as fh:
            return [(int(a), int(b), int(c)) for a, b, c in (line.split() for line in fh if line.strip())]
    except (OSError, ValueError):
        return []


def resolve_users(users: t.Sequence[str], root: Root) -> set[int] | None:
    """Owners (uids as this host sees them) to keep to in one scope; None when any owner goes.

    In a container, names come from its /etc/passwd and its uids are mapped to the
    host's through its init's uid_map (an unprivileged Proxmox container's root is 100000).
    """
    if not users:
        return None
    names = _passwd(root) if root.init_pid is not None else {}
    mapping = _uid_map(root.init_pid)
    out = set()
    for user in users:
        text = str(user)
        if text.isdigit():
            uid = int(text)
        elif root.init_pid is None:
            uid = next(iter(t.cast(t.Set[int], _procs.resolve_users([text]))))
        elif text in names:
            uid = names[text]
        else:
            raise CleanSlateError(f"users: no user named {text!r} in container {root.vmid}.", reason=_reasons.BAD_ARGUMENTS, option="users")
        for inside, outside, count in mapping:
            if inside <= uid < inside + count:
                uid = outside + (uid - inside)
                break
        out.add(uid)
    return out


# ---------------------------------------------------------------------- holders
class Holders:
    """Describes holder processes once each: name, protection, container."""

    def __init__(self, protect: list[str], patterns: list[re.Pattern[str]]) -> None:
        self.protect = protect
        self.patterns = patterns
        self._cache: dict[int, dict[str, t.Any]] = {}
        self.guarded = {os.getpid(), *_proctable.ancestors(os.getpid())}

    def describe(self, pid: int) -> dict[str, t.Any]:
        if pid in self._cache:
            return dict(self._cache[pid])
        facts = _procs.read_facts(pid) if pid > 0 else None
        rec: dict[str, t.Any] = {"pid": pid if pid > 0 else None, "name": None, "cmdline": None, "protected": False, "container": None}
        if facts is not None:
            nspid = _proctable.nspids(pid)
            protected = _procs.protected_name(facts, self.protect)
            why = None
            if pid <= 1 or (nspid and nspid[-1] == 1):
                why = "PID 1 of its namespace"
            elif facts.kernel:
                why = "kernel thread"
            elif pid in self.guarded:
                why = "this module or its ancestor"
            elif protected:
                why = f"protected daemon ({protected})"
            rec.update(name=facts.comm, cmdline=facts.cmdline[:200], protected=why is not None, container=_proctable.container_of(pid))
            if why:
                rec["protected_why"] = why
        self._cache[pid] = rec
        return dict(rec)


def judge(
    items: list[Item],
    scan: _holders.Scan,
    locks: dict[Key, list[_holders.Hold]],
    bound: dict[Key, list[_holders.Hold]],
    unbound_names: dict[str, list[str]],
    holders: Holders,
) -> None:
    """Mark every item held (with its holders) or leave it orphaned."""
    held_keys = scan.holds.keys() | locks.keys() | bound.keys()
    for item in items:
        if item.verdict == "skipped":
            continue
        if item.kind != "dirs" and item.key not in held_keys and item.name not in scan.name_holds and item.name not in unbound_names:
            continue  # the common case, made cheap: nothing holds it
        keys = item.tree if item.kind == "dirs" else {item.key}
        found: dict[tuple[int, str], None] = {}
        for key in keys:
            for hold in (*scan.holds.get(key, ()), *locks.get(key, ()), *bound.get(key, ())):
                found[(hold.pid, hold.how)] = None
        names = item.tree_names if item.kind == "dirs" else {item.name}
        for name in names:
            for hold in scan.name_holds.get(name, ()):
                found[(hold.pid, hold.how)] = None
        records = []
        by_pid: dict[int, dict[str, t.Any]] = {}
        for pid, how in found:
            if pid in by_pid:
                by_pid[pid]["how"].append(how)
                continue
            rec = holders.describe(pid)
            rec["how"] = [how]
            by_pid[pid] = rec
            records.append(rec)
        for name in item.tree_sockets if item.kind == "dirs" else (item.name,) if item.kind == "sockets" else ():
            for path in unbound_names.get(name, ()):
                records.append({"pid": None, "name": None, "how": ["bound"], "protected": False, "container": None, "path": path})
        if records:
            item.verdict = "held"
            item.holders = records[:10]


def socket_files(items: list[Item]) -> tuple[set[Key], set[str]]:
    """Keys and names of the socket files judged: socket items and the sockets inside candidate directories."""
    keys, names = set(), set()
    for item in items:
        if item.kind == "sockets":
            keys.add(item.key)
            names.add(item.name)
        elif item.tree_sockets:
            keys.update(item.tree_sockets.values())
            names.update(item.tree_sockets)
    return keys, names


def bound_sockets(scan: _holders.Scan, keys: set[Key], names: set[str]) -> tuple[dict[Key, list[_holders.Hold]], dict[str, list[str]]]:
    """Socket files with a live socket bound to them, in any network namespace.

    The unix tables give the path as it was passed to bind(); it is resolved in
    the binder's own root (``/proc/<binder>/root``), so the same path in two
    mount namespaces is not confused. When no binder can be found the name alone
    decides, on the safe side: the file counts as held.
    """
    bound: dict[Key, list[_holders.Hold]] = {}
    unresolved: dict[str, list[str]] = {}
    if not keys:
        return bound, unresolved
    for pid in scan.netns.values():
        for inode, path in _holders.read_unix(pid):
            base = path.rpartition("/")[2]
            if base not in names:
                continue
            resolved = False
            if path.startswith("/"):
                for owner in scan.socket_owners.get(inode, []):
                    try:
                        st = os.stat(f"/proc/{owner}/root{path}")
                    except OSError:
                        continue
                    resolved = True
                    key = (st.st_dev, st.st_ino)
                    if key in keys:
                        bound.setdefault(key, []).append(_holders.Hold(owner, "bound"))
                    break
            if not resolved:
                unresolved.setdefault(base, []).append(path)
    return bound, unresolved


# ---------------------------------------------------------------------- removal
class Changed(Exception):
    """The item is no longer what was judged."""


def _same(a: os.stat_result, b: os.stat_result) -> bool:
    return (a.st_dev, a.st_ino, st_mod.S_IFMT(a.st_mode), a.st_ctime_ns) == (b.st_dev, b.st_ino, st_mod.S_IFMT(b.st_mode), b.st_ctime_ns)


def _rmtree(parent: int, name: str, item: Item, delete: bool) -> None:
    """Walk a judged directory (never following a symlink): every entry must be one judged orphaned.

    Called twice: first to check the whole tree (``delete=False``), so that a
    file that appeared since the judgement stops the removal before anything
    is gone, then to delete it bottom-up.
    """
    fd = os.open(name, _DIR_FLAGS, dir_fd=parent)
    try:
        fst = os.fstat(fd)
        if (fst.st_dev, fst.st_ino) not in item.tree_dirs:
            raise Changed(f"{name} was replaced")
        with os.scandir(fd) as it:
            entries = [e.name for e in it]
        for child in entries:
            # An entry gone since the listing is no change that matters: the socket glob of the same run
            # may have removed it (torch-shm-dir-*/manager.sock and its directory are both defaults).
            try:
                cst = os.stat(child, dir_fd=fd, follow_symlinks=False)
            except FileNotFoundError:
                continue
            if (cst.st_dev, cst.st_ino) not in item.tree:
                raise Changed(f"{child} appeared since it was judged")
            if st_mod.S_ISDIR(cst.st_mode):
                _rmtree(fd, child, item, delete)
            elif delete:
                try:
                    os.unlink(child, dir_fd=fd)
                except FileNotFoundError:
                    pass
    finally:
        os.close(fd)
    if delete:
        os.rmdir(name, dir_fd=parent)


def remove(item: Item) -> None:
    """Remove one orphaned item; set its verdict to removed, vanished or error."""
    try:
        now = os.stat(item.name, dir_fd=item.dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        item.verdict, item.why = "vanished", "gone before it was removed"
        return
    except OSError as exc:
        item.verdict, item.why = "error", exc.strerror or str(exc)
        return
    if item.st is None:
        # Found by its directory entry: it must still be that inode, and a regular file.
        same = (now.st_dev, now.st_ino) == item.key and st_mod.S_ISREG(now.st_mode)
        if same:
            item.st, item.nbytes = now, now.st_blocks * 512
    elif item.kind == "dirs":
        # A directory's ctime changes with every entry removed or added (a socket of this run's included);
        # _rmtree checks its entries one by one instead.
        same = (now.st_dev, now.st_ino, st_mod.S_IFMT(now.st_mode)) == (item.st.st_dev, item.st.st_ino, st_mod.S_IFDIR)
    else:
        same = _same(now, item.st)
    if not same:
        item.verdict, item.why = "skipped", "changed since it was judged (another file under this name, or written to); left alone"
        return
    if item.kind != "dirs" and now.st_nlink > 1:
        # Another name for it may be the one a process opened: only the maps and locks were matched by inode.
        item.verdict, item.why = "skipped", f"has {now.st_nlink} hard links; left alone"
        return
    try:
        if item.kind == "dirs":
            try:
                _rmtree(item.dir_fd, item.name, item, delete=False)
            except Changed as exc:
                item.verdict, item.why = "skipped", f"changed since it was judged ({exc}); left alone"
                return
            _rmtree(item.dir_fd, item.name, item, delete=True)
        else:
            os.unlink(item.name, dir_fd=item.dir_fd)
        item.verdict = "removed"
    except Changed as exc:
        item.verdict, item.why = "error", f"partly removed: {exc}"
    except FileNotFoundError:
        item.verdict, item.why = "vanished", "gone before it was removed"
    except OSError as exc:
        item.verdict, item.why = "error", exc.strerror or str(exc)


def remove_all(items: list[Item]) -> None:
    """Remove orphaned items, one after the other.

    Directories go last, after the files: a file a glob matched inside a directory another glob matched is
    then reported as removed by its own glob, and the directory's removal finds it gone. One thread: unlinks
    in one directory take that directory's lock in turn, and more threads only added their own cost (9 000
    files in /dev/shm on a 16-CPU H200 node: 66 ms with one thread, 91 ms with two, 130 ms with four).
    """
    for item in items:
        if item.kind != "dirs":
            remove(item)
    for item in items:
        if item.kind == "dirs":
            remove(item)


# ---------------------------------------------------------------------- zombies and ports
def scope_of(pid: int, scopes: list[_scope.Scope]) -> _scope.Scope | None:
    """The container of ``scopes`` a process belongs to, read from its /proc entry."""
    return _scope.member_of(scopes, _proctable.pidns_inode(pid), _proctable.container_of(pid))


def zombies(scan: _holders.Scan, roots: list[Root], holders: Holders) -> tuple[list[dict[str, t.Any]], list[dict[str, t.Any]]]:
    """Zombies in scope, and the parents that do not reap them."""
    scopes = [r.scope for r in roots if r.scope is not None]
    found: list[dict[str, t.Any]] = []
    parents: dict[int, dict[str, t.Any]] = {}
    for pid, ppid, comm in scan.zombies:
        if scopes:
            inside = scope_of(ppid, scopes)
            if inside is None:
                continue
            vmid: int | None = inside.vmid
        else:
            vmid = _proctable.container_of(ppid)
        found.append({"pid": pid, "name": comm, "ppid": ppid, "container": vmid})
        if ppid not in parents:
            parent = holders.describe(ppid)
            nspid = _proctable.nspids(ppid)
            init = bool(nspid and nspid[-1] == 1)
            parents[ppid] = {"pid": ppid, "name": parent["name"], "init": init, "container": vmid, "zombies": 0, "protected": parent["protected"]}
        parents[ppid]["zombies"] += 1
    for p in parents.values():
        if p["init"]:
            where = f"container {p['container']}" if p["container"] is not None else "its PID namespace"
            p["why"] = f"PID 1 of {where} ({p['name']}) does not reap its children: {p['zombies']} zombie(s)"
        else:
            p["why"] = f"PID {p['pid']} ({p['name']}) has not reaped {p['zombies']} exited child(ren)"
    return found, list(parents.values())


def port_record(ps: _ports.PortState, root: Root, holders: Holders, owners: dict[int, list[int]], waited: float) -> dict[str, t.Any]:
    """The result entry of one port, with the owners of its sockets."""
    rec: dict[str, t.Any] = {"port": ps.port, "state": ps.state, "container": root.vmid, "owners": [], "connections": len(ps.connections)}
    rec["time_wait"] = len(ps.closing)
    rec["remaining_s"] = ps.remaining_s if ps.state == "time_wait" else None
    rec["waited_s"] = waited
    seen: set[int] = set()
    for sock in ps.listeners + ps.connections:
        for pid in owners.get(sock.inode, []):
            if pid in seen:
                continue
            seen.add(pid)
            owner = holders.describe(pid)
            owner["address"] = sock.address
            owner["listening"] = sock.state == _ports.LISTEN
            facts = _procs.read_facts(pid)
            match = _procs.matches_patterns(facts, holders.patterns) if facts is not None else None
            in_scope = root.scope is None or scope_of(pid, [root.scope]) is not None
            owner["kill_target"] = bool(match) and in_scope and not owner["protected"]
            if match:
                owner["matches"] = match
            rec["owners"].append(owner)
    return rec


# ---------------------------------------------------------------------- report
def human(nbytes: int) -> str:
    """Bytes for people: 512 B, 4.0 KiB, 3.1 GiB."""
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{int(value)} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{nbytes} B"


_NOUNS = {"shm": ("segment", "segments"), "sockets": ("socket", "sockets"), "locks": ("lock", "locks"), "dirs": ("directory", "directories")}


def _counted(counts: dict[str, int]) -> str:
    words = [f"{n} {_NOUNS[k][0] if n == 1 else _NOUNS[k][1]}" for k, n in counts.items() if n]
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " and " + words[-1]


def message(summary: dict[str, t.Any], ports: list[dict[str, t.Any]], check_mode: bool) -> str:
    """One line: "12 stale segments (3.1 GiB) removed, port 30000 free"."""
    parts = []
    kinds = summary["kinds"]
    removed = {k: v["removed"] for k, v in kinds.items()}
    if summary["removed"]:
        counted = _counted(removed)
        counted = counted.replace(" ", " stale ", 1)
        parts.append(f"{counted} ({human(summary['removed_bytes'])}) {'would be removed' if check_mode else 'removed'}")
    else:
        parts.append("no stale residue")
    if summary["held"]:
        parts.append(f"{summary['held']} held by live processes (kept)")
    if summary["stale"]:
        parts.append(f"{_counted({k: v['stale'] for k, v in kinds.items()}).replace(' ', ' stale ', 1)} reported (removal not enabled)")
    if summary["errors"]:
        parts.append(f"{summary['errors']} could not be removed")
    by_state: dict[str, list[str]] = {}
    for p in ports:
        label = str(p["port"]) if p["container"] is None else f"{p['port']} (ct {p['container']})"
        if p["state"] == "listening":
            owners = [o for o in p["owners"] if o.get("listening")]
            who = f"{owners[0]['pid']} {owners[0]['name']}" if owners else "owner not visible"
            parts.append(f"port {label} listening (PID {who})" if owners else f"port {label} listening ({who})")
        elif p["state"] == "time_wait":
            left = f", ~{p['remaining_s']:.0f} s left" if p["remaining_s"] is not None else ""
            parts.append(f"port {label} in TIME_WAIT ({p['time_wait']} socket(s){left})")
        elif p["state"] == "connected":
            parts.append(f"port {label} still has {p['connections']} connection(s)")
        else:
            by_state.setdefault("free", []).append(label)
    if by_state.get("free"):
        free = by_state["free"]
        parts.append(f"port {free[0]} free" if len(free) == 1 else f"ports {', '.join(free)} free")
    if summary["zombies"]:
        parts.append(f"{summary['zombies']} zombie(s) under {len(summary['non_reaping'])} non-reaping parent(s)")
    return ", ".join(parts)


# ---------------------------------------------------------------------- the whole run
def run(req: Request, check_mode: bool) -> dict[str, t.Any]:
    """Find, judge and (unless check mode) remove residue; classify ports; report zombies."""
    notes: list[str] = []
    roots = open_roots(req.scopes)
    walkers: list[Walker] = []
    # A full /dev/shm makes tens of thousands of small objects and no reference cycles: the cyclic collector
    # would run a few dozen times, the older generations over the whole heap (Ansible's modules included), for
    # nothing: 10-40 ms of a 0.3 s run (tools/bench/residue.py).
    collecting = gc.isenabled()
    gc.disable()
    try:
        return _run(req, check_mode, roots, walkers, notes)
    finally:
        if collecting:
            gc.enable()
        for w in walkers:
            w.close()
        for r in roots:
            os.close(r.fd)


def _run(req: Request, check_mode: bool, roots: list[Root], walkers: list[Walker], notes: list[str]) -> dict[str, t.Any]:
    items, found_walkers = collect(req, roots, notes)
    walkers.extend(found_walkers)
    for root in roots:
        uids = resolve_users(req.users, root)
        if uids is None:
            continue
        for item in items:
            if item.vmid != root.vmid:
                continue
            st = item.stat()
            if st is None:
                item.verdict, item.why = "skipped", "gone while it was being judged"
            elif st.st_uid not in uids:
                item.verdict, item.why = "skipped", f"owned by uid {st.st_uid}, not one of users"
    judged = [i for i in items if i.verdict != "skipped"]

    # Ports first: their socket inodes are looked up in the same pass over /proc.
    port_socks: list[tuple[Root, list[_ports.Sock]]] = [(root, _ports.read_tcp(root.netdir, set(req.ports))) for root in roots] if req.ports else []
    port_inodes = {s.inode for _root, socks in port_socks for s in socks if s.inode}
    sock_keys, sock_names = socket_files(judged)

    watch = _holders.Watch(sockets=None if sock_keys else port_inodes, netns=bool(sock_keys))
    # In bulk: a full /dev/shm is ten thousand items, and a set made per item costs more than the rest of this.
    files = [i for i in judged if i.kind != "dirs"]
    watch.keys.update([(i.dev, i.ino) for i in files])
    # Another name for a file may be the one a process opened.
    watch.any_name = any(i.st is not None and i.st.st_nlink > 1 for i in files)
    for item in judged:
        if item.kind == "dirs":
            watch.keys |= item.tree
            watch.names |= item.tree_names
            watch.cwd_keys |= item.tree_dirs
    for walker in walkers:
        watch.names |= walker.names  # every matched name, the files' own included
    watch.name_only = _overlay_names(judged, roots)
    scan = _holders.scan(watch)
    locks = _holders.read_locks(watch.keys)
    bound, unbound_names = bound_sockets(scan, sock_keys, sock_names)
    holders = Holders(req.protect, req.patterns)
    judge(judged, scan, locks, bound, unbound_names, holders)

    for item in judged:
        if item.verdict == "remove" and item.kind not in req.remove:
            item.verdict, item.why = "stale", f"orphaned; removal of {item.kind} is not enabled"
    orphans = [i for i in judged if i.verdict == "remove"]
    incomplete = bool(scan.unreadable) and bool(orphans)
    if incomplete:
        why = f"{len(scan.unreadable)} process(es) could not be inspected (permission), so nothing can be proven orphaned"
        for item in orphans:
            item.verdict, item.why = "skipped", why
        notes.append(why + "; run the module as root (become: true).")
    elif not check_mode:
        remove_all(orphans)

    ports_out: list[dict[str, t.Any]] = []
    for root, socks in port_socks:
        states = {p: _ports.classify(p, socks) for p in req.ports}
        waited = _ports.wait_closing(root.netdir, states, req.time_wait_timeout) if req.time_wait_timeout > 0 else 0.0
        if any(s.state != "free" for s in states.values()) and waited:
            # A listener may have appeared while waiting: look up owners of the sockets seen now.
            fresh = {s.inode for ps in states.values() for s in ps.listeners + ps.connections if s.inode not in scan.socket_owners}
            if fresh:
                scan.socket_owners.update(_holders.scan(_holders.Watch(sockets=fresh, zombies=False)).socket_owners)
        for port in req.ports:
            ports_out.append(port_record(states[port], root, holders, scan.socket_owners, waited))
    zombie_list, non_reaping = zombies(scan, roots, holders)
    return report(req, check_mode, items, ports_out, zombie_list, non_reaping, notes, scan, incomplete)


def _overlay_names(items: list[Item], roots: list[Root]) -> set[str]:
    """Names of candidates on overlayfs (in whichever scope): their mappings show another inode."""
    devs = {dev for root in roots for dev, fstype in root.fstypes.items() if fstype == "overlay"}
    return {n for i in items if i.dev in devs for n in (i.tree_names if i.kind == "dirs" else {i.name})} if devs else set()


def report(
    req: Request,
    check_mode: bool,
    items: list[Item],
    ports: list[dict[str, t.Any]],
    zombie_list: list[dict[str, t.Any]],
    non_reaping: list[dict[str, t.Any]],
    notes: list[str],
    scan: _holders.Scan,
    incomplete: bool,
) -> dict[str, t.Any]:
    """The module result; raises CleanSlateError (carrying the result) for a failure."""
    gone = ("remove", "removed") if check_mode else ("removed",)
    lists: dict[str, list[Item]] = {"removed": [], "held": [], "stale": [], "ignored": [], "errors": []}
    for item in items:
        if item.verdict in gone:
            lists["removed"].append(item)
        elif item.verdict == "held":
            lists["held"].append(item)
        elif item.verdict == "stale":
            lists["stale"].append(item)
        elif item.verdict == "error":
            lists["errors"].append(item)
        elif item.verdict in ("skipped", "vanished"):
            lists["ignored"].append(item)
    for item in lists["removed"]:
        item.stat()  # in check mode, items found by their directory entry get their size here
    kinds = {k: {"removed": 0, "bytes": 0, "held": 0, "stale": 0} for k in KINDS}
    for name in ("removed", "held", "stale"):
        for item in lists[name]:
            kinds[item.kind][name] += 1
            if name == "removed":
                kinds[item.kind]["bytes"] += item.nbytes
    limit = req.list_limit
    summary: dict[str, t.Any] = {
        "removed": len(lists["removed"]),
        "removed_bytes": sum(i.nbytes for i in lists["removed"]),
        "held": len(lists["held"]),
        "stale": len(lists["stale"]),
        "ignored": len(lists["ignored"]),
        "errors": len(lists["errors"]),
        "kinds": kinds,
        "ports": {(str(p["port"]) if p["container"] is None else f"{p['container']}:{p['port']}"): p["state"] for p in ports},
        "zombies": len(zombie_list),
        "non_reaping": [p["why"] for p in non_reaping],
        "paths": {
            "removed": [i.path for i in lists["removed"][:limit]],
            "held": [f"{i.path} ({', '.join(str(h['pid']) + ' ' + str(h['name']) for h in i.holders[:3])})" for i in lists["held"][:limit]],
            "stale": [i.path for i in lists["stale"][:limit]],
        },
    }
    summary["msg"] = message(summary, ports, check_mode)
    result: dict[str, t.Any] = {
        "changed": bool(lists["removed"]),
        "msg": summary["msg"],
        "summary": summary,
        "removed": [i.record() for i in lists["removed"][:limit]],
        "held": [i.record() for i in lists["held"][:limit]],
        "stale": [i.record() for i in lists["stale"][:limit]],
        "ignored": [i.record() for i in lists["ignored"][:limit]],
        "errors": [i.record() for i in lists["errors"][:limit]],
        "truncated": any(len(v) > limit for v in lists.values()),
        "ports": ports,
        "zombies": zombie_list[:limit],
        "non_reaping": non_reaping,
        "processes": scan.processes,
        "notes": notes,
    }
    failures = problems(req, lists["errors"], incomplete, notes, ports)
    if failures:
        reason, msg = failures[0]
        if len(failures) > 1:
            msg += f" ({len(failures) - 1} more problem(s) in the result.)"
        details = {k: v for k, v in result.items() if k not in ("msg",)}
        raise CleanSlateError(msg, reason=reason, **details)
    return result


def problems(req: Request, errors: list[Item], incomplete: bool, notes: list[str], ports: list[dict[str, t.Any]]) -> list[tuple[str, str]]:
    """(reason, sentence) of everything that fails the run, most serious first: removals that failed, a scan that
    could not prove anything orphaned, then each port the next server could not bind (as ``fail_on`` asks)."""
    failures = []
    if errors:
        e = errors[0]
        failures.append(
            (
                _reasons.REMOVE_FAILED,
                f"{len(errors)} orphaned item(s) could not be removed (first: {e.path}: {e.why}); remove them by hand or fix the file system.",
            )
        )
    if incomplete:
        failures.append((_reasons.SCAN_INCOMPLETE, f"{notes[-1]} Nothing was removed."))
    for p in ports:
        label = f"port {p['port']}" + (f" in container {p['container']}" if p["container"] is not None else "")
        if p["state"] == "listening" and "listening" in req.fail_on:
            owners = [o for o in p["owners"] if o.get("listening")]
            who = ", ".join(f"PID {o['pid']} ({o['name']})" for o in owners) or "a process this host cannot see"
            hint = (
                "it matches the kill patterns: run the kill phase (gpu_procs_kill) first"
                if any(o.get("kill_target") for o in owners)
                else "stop that service or add a pattern that matches it"
            )
            failures.append((_reasons.PORT_IN_USE, f"{label} is still listened on by {who}; the next server cannot bind it: {hint}."))
        elif p["state"] == "connected" and "connected" in req.fail_on:
            failures.append((_reasons.PORT_CONNECTED, f"{label} still has {p['connections']} live connection(s); end their owners before starting the server."))
        elif p["state"] == "time_wait" and "time_wait" in req.fail_on:
            failures.append(
                (
                    _reasons.PORT_TIME_WAIT,
                    f"{label} is still in TIME_WAIT (about {p['remaining_s']} s left); wait, raise time_wait_timeout, or use SO_REUSEADDR.",
                )
            )
    return failures


# ---------------------------------------------------------------------- the gpu_job_residue module
#: The most entries one list of the result may be asked to hold.
MAX_LIST_LIMIT = 1_000_000


def build_request(p: t.Mapping[str, t.Any], scopes_of: t.Callable[[], list[_scope.Scope]]) -> Request:
    """Validate every option; raises before anything is looked at or removed.

    ``scopes_of`` resolves the ``containers`` option (through pct), once the rest is known good.
    """
    globs = [parse_glob(kind, pattern) for kind in KINDS for pattern in p[kind]]
    _checks.number("time_wait_timeout", p["time_wait_timeout"], 0, _checks.MAX_SECONDS, unit="seconds")
    _checks.number("list_limit", p["list_limit"], 0, MAX_LIST_LIMIT)
    for vmid in p["containers"]:
        _checks.vmid("containers", vmid)
    _checks.executable("pct_path", p["pct_path"])
    ports = validate_ports(p["ports"])
    patterns = _procs.compile_patterns(p["patterns"])
    protect = _procs.protect_list(p["protect"], [])
    return Request(
        globs=globs,
        remove=set(p["remove"]),
        users=p["users"],
        scopes=scopes_of(),
        ports=ports,
        time_wait_timeout=p["time_wait_timeout"],
        patterns=patterns,
        protect=protect,
        fail_on=set(p["fail_on"]),
        list_limit=p["list_limit"],
    )


def diff(result: dict[str, t.Any], check_mode: bool) -> dict[str, str]:
    """The orphaned items before, and those still there after (none in check mode, which only predicts)."""
    gone = [r["path"] for r in result["removed"]]
    left = [] if check_mode else [r["path"] for r in result["errors"]]
    return {"before": "".join(p + "\n" for p in gone + left), "after": "" if check_mode else "".join(p + "\n" for p in left)}


def argument_spec() -> dict[str, dict[str, t.Any]]:
    """The options of gpu_job_residue, without the containers scope (``_pct.SCOPE_OPTIONS``): one source for it and the umbrella's residue phase."""
    return {
        "shm": {"type": "list", "elements": "str", "default": list(DEFAULT_SHM)},
        "sockets": {"type": "list", "elements": "str", "default": list(DEFAULT_SOCKETS)},
        "locks": {"type": "list", "elements": "str", "default": list(DEFAULT_LOCKS)},
        "dirs": {"type": "list", "elements": "str", "default": list(DEFAULT_DIRS)},
        "remove": {"type": "list", "elements": "str", "choices": list(KINDS), "default": list(DEFAULT_REMOVE)},
        "users": {"type": "list", "elements": "str", "default": []},
        "ports": {"type": "list", "elements": "int", "default": []},
        "time_wait_timeout": {"type": "float", "default": 0},
        "patterns": {"type": "list", "elements": "str", "default": []},
        "protect": {"type": "list", "elements": "str", "default": []},
        "fail_on": {"type": "list", "elements": "str", "choices": list(FAIL_ON), "default": ["listening"]},
        "list_limit": {"type": "int", "default": 200},
    }


class ModuleRun:
    """One run of the gpu_job_residue module; every failure carries ``summary`` and ``elapsed_s``.

    :param scopes_of: resolves the ``containers`` option (through pct, which this file does not need to know).
    """

    def __init__(self, scopes_of: t.Callable[[], list[_scope.Scope]], clock: t.Callable[[], float] = time.monotonic) -> None:
        self.scopes_of = scopes_of
        self.clock = clock
        self.start = clock()

    def details(self, _reason: str) -> dict[str, t.Any]:
        return {"summary": {}, "elapsed_s": round(self.clock() - self.start, 4)}

    def __call__(self, module: t.Any) -> dict[str, t.Any]:
        result = run(build_request(module.params, self.scopes_of), module.check_mode)
        result["elapsed_s"] = round(self.clock() - self.start, 4)
        if module._diff:  # pylint: disable=protected-access
            result["diff"] = diff(result, module.check_mode)
        return result
