"""Context records (``$GPUSIM_STATE/ctx/<id>.ctx``) and the memory they hold.

The daemon writes the records; the C library and :class:`gpusim.Node` read
them with the same rule: a context counts (its memory is used and its owner is
listed) while it has no ``release_ns``, or until ``release_ns`` (a
CLOCK_MONOTONIC time) has passed. When the daemon is not running, a record
without ``release_ns`` counts only while its OFD lock is still held.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from .description import Description
from .procfs import daemon_running, ofd_lock_held


@dataclass
class Context:
    """One GPU context: memory owned by an open file description."""

    id: int
    gpu: int
    minor: int
    mib: int
    lock: int  #: byte of dev/nvidia<minor> the owner read-locks
    pid: int  #: owner pid in the daemon's (outermost) PID namespace
    levels: list[tuple[int, int]] = field(default_factory=list)  #: (pid-ns inode, pid), outermost first
    created_ns: int = 0
    dead_ns: int | None = None  #: when the last holder closed the device
    release_ns: int | None = None  #: when the driver has freed the memory
    kind: str = "compute"  #: compute | graphics | mps: which NVML process list shows the owner

    @property
    def state(self) -> str:
        return "live" if self.release_ns is None else "releasing"

    def to_text(self) -> str:
        levels = ",".join(f"{ns}:{pid}" for ns, pid in self.levels)
        return (
            f"id={self.id}\ngpu={self.gpu}\nminor={self.minor}\nmib={self.mib}\nlock={self.lock}\n"
            f"pid={self.pid}\nlevels={levels}\ncreated_ns={self.created_ns}\n"
            f"dead_ns={'' if self.dead_ns is None else self.dead_ns}\n"
            f"release_ns={'' if self.release_ns is None else self.release_ns}\n"
            f"kind={self.kind}\n"
        )

    @classmethod
    def parse(cls, text: str) -> Context:
        kv = dict(line.split("=", 1) for line in text.splitlines() if "=" in line)
        levels = []
        for part in kv.get("levels", "").split(","):
            if ":" in part:
                ns, pid = part.split(":")
                levels.append((int(ns), int(pid)))
        return cls(
            id=int(kv["id"]),
            gpu=int(kv["gpu"]),
            minor=int(kv.get("minor", kv["gpu"])),
            mib=int(kv["mib"]),
            lock=int(kv.get("lock", kv["id"])),
            pid=int(kv.get("pid", "0")),
            levels=levels,
            created_ns=int(kv.get("created_ns") or 0),
            dead_ns=int(kv["dead_ns"]) if kv.get("dead_ns") else None,
            release_ns=int(kv["release_ns"]) if kv.get("release_ns") else None,
            kind=kv.get("kind") or "compute",
        )

    def as_dict(self) -> dict[str, object]:
        return {
            "id": self.id,
            "gpu": self.gpu,
            "minor": self.minor,
            "mib": self.mib,
            "pid": self.pid,
            "levels": list(self.levels),
            "state": self.state,
            "created_ns": self.created_ns,
            "dead_ns": self.dead_ns,
            "release_ns": self.release_ns,
            "kind": self.kind,
        }


def ctx_dir(state_dir: Path) -> Path:
    return Path(state_dir) / "ctx"


def write_record(state_dir: Path, ctx: Context) -> None:
    """Create or replace a record atomically (rename), as the library may read it at any time."""
    d = ctx_dir(state_dir)
    tmp = d / f".{ctx.id}.tmp"
    tmp.write_text(ctx.to_text())
    os.replace(tmp, d / f"{ctx.id}.ctx")


def remove_record(state_dir: Path, ctx_id: int) -> None:
    try:
        (ctx_dir(state_dir) / f"{ctx_id}.ctx").unlink()
    except FileNotFoundError:
        pass


def read_records(state_dir: Path) -> list[Context]:
    """Every record on disk, sorted by id (including released ones not yet deleted)."""
    out = []
    try:
        names = os.listdir(ctx_dir(state_dir))
    except FileNotFoundError:
        return []
    for name in names:
        if not name.endswith(".ctx") or name.startswith("."):
            continue
        try:
            out.append(Context.parse((ctx_dir(state_dir) / name).read_text()))
        except (FileNotFoundError, KeyError, ValueError):
            continue
    return sorted(out, key=lambda c: c.id)


def _lock_held(state_dir: Path, ctx: Context) -> bool:
    try:
        # driver/ holds hard links of the device files (same inode, same locks) in every setup.
        fd = os.open(Path(state_dir) / "driver" / f"nvidia{ctx.minor}", os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    try:
        return ofd_lock_held(fd, ctx.lock)
    finally:
        os.close(fd)


def counted_contexts(state_dir: Path) -> list[Context]:
    """The contexts that currently hold memory (live or still being released)."""
    now = time.monotonic_ns()
    daemon: bool | None = None
    out = []
    for ctx in read_records(state_dir):
        if ctx.release_ns is not None:
            if now >= ctx.release_ns:
                continue
        else:
            if daemon is None:
                daemon = daemon_running(state_dir)
            if not daemon and not _lock_held(state_dir, ctx):
                continue
        out.append(ctx)
    return out


def memory(state_dir: Path, desc: Description, gpu: int, contexts: list[Context] | None = None) -> dict[str, int]:
    """Memory of one GPU in MiB, computed like the library does.

    used_mib is NVML v2 "used" (contexts, their driver overhead and orphaned memory, without
    reserved); v1_used_mib is NVML v1 "used" (which adds the reserved memory)."""
    spec = desc.gpus[gpu]
    ctxs = counted_contexts(state_dir) if contexts is None else contexts
    mine = [c for c in ctxs if c.gpu == gpu]
    held = sum(c.mib for c in mine)
    overhead = desc.context_overhead_mib * len(mine)
    orphan = desc.faults.orphan.get(gpu, 0)
    used = min(held + overhead + orphan, spec.total_mib - spec.reserved_mib)
    return {
        "used_mib": used,
        "reserved_mib": spec.reserved_mib,
        "total_mib": spec.total_mib,
        "free_mib": spec.total_mib - spec.reserved_mib - used,
        "contexts_mib": held,
        "overhead_mib": overhead,
        "orphan_mib": orphan,
        "v1_used_mib": used + spec.reserved_mib,
    }
