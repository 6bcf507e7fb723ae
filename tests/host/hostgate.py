"""Shared pieces of the host gate (see conftest.py for why it cannot harm the machine)."""

from __future__ import annotations

import typing as t
import uuid

from gpusim import Node
from support.ansible import run_module
from support.sigguard import SignalGuard

#: Only the victims' command lines carry it: the patterns of these tests can match nothing else.
TOKEN = f"gpuops-hostgate-{uuid.uuid4().hex[:16]}"


class Host:
    """A simulated node published under /dev, victims, and modules run under the signal guard."""

    def __init__(self, node: Node) -> None:
        self.node = node
        self.guard = SignalGuard()
        self.workers: list[t.Any] = []

    def victim(self, name: str, **kw: t.Any) -> t.Any:
        """A worker whose command line carries the gate's token; its pids become guard victims."""
        kw.setdefault("mib", 2000)
        w = self.node.spawn_worker(title=f"{TOKEN}-{name}", child_title=kw.pop("child_title", f"{TOKEN}-{name}-child"), **kw)
        self.guard.victims.add(w.pid)
        if w.child_pid:
            self.guard.victims.add(w.child_pid)
        self.workers.append(w)
        return w

    def module(self, name: str, args: dict[str, t.Any] | None = None, check: bool = False) -> dict[str, t.Any]:
        env = {**self.node.env()}
        result, run = run_module(f"gpuops.clean_slate.{name}", args or {}, env=env, check=check, runner=self.guard.run)
        result["_run"] = run
        return result
