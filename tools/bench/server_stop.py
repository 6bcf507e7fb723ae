"""Benchmark: what a stop in the server's own order leaves, against the all-at-once TERM the kill sent before (issue 38).

Run with `tools/pidns-run .venv/bin/python tools/bench/server_stop.py [--tp 8] [--slow-teardown-ms 4000]`.

On the simulated 8 x H200 node, each scenario is a server tree made as the server makes it (gpusim.servers: spawned
members titled with setproctitle, SGLang's schedulers in sessions of their own dying with PR_SET_PDEATHSIG, a real
multiprocessing resource tracker holding the named semaphores its spawn context registered, the queues, CUDA IPC
segments and ZMQ sockets named as their sources name them), started afresh for each of the two kills:

* "in order": gpu_procs_kill with the role's server profiles (roles/clean_slate/profiles/: each root first, alone, with
  its server's grace; then the rest; the resource tracker spared while a client lives);
* "all at once": the same module with what it did before: no ``servers``, ``spare_trackers: false`` - SIGTERM to every
  target together, SIGKILL after the grace period.

Scenarios: a live SGLang server and a live vLLM server (each stops itself as its source does, with the servers' real
waits: SGLang's watchdog notices SIGTERM on its next 5 s poll); and each crashed - SGLang's launcher SIGKILLed (its
schedulers reparented), vLLM's API server SIGKILLed (vllm#55510: its engine core and workers left on the GPUs) - with a
teardown longer than the grace period (``--slow-teardown-ms``, a GB300-like GPU teardown), so that a resource tracker
ended after the grace dies before its last client. "left" counts what the tree made (segments, semaphores, sockets)
that is still there when the kill returns, before any residue phase: what the residue phase then has to judge. The
kill's grace period is 2 s; "s" is the kill module's own elapsed time.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import typing as t

from gpusim import Node
from gpusim.residue import private_shm
from gpusim.servers import Server, start_sglang, start_vllm
from support.ansible import ROOT
from support.modules import ModuleRunner

from ansible_collections.gpuops.clean_slate.plugins.plugin_utils import _profiles

PROFILES = _profiles.resolve(["sglang", "vllm"], str(ROOT / "roles" / "clean_slate"))
GRACE = 2.0
MODES = {
    "in order": {"servers": PROFILES["servers"], "spare_trackers": True},
    "all at once": {"servers": [], "spare_trackers": False},
}


def left(srv: Server) -> dict[str, int]:
    """What the tree made that is still there, by kind, and its bytes."""
    out = {"segments": 0, "semaphores": 0, "sockets": 0, "bytes": 0}
    for path in srv.shm + srv.sockets:
        p = srv.path(path)
        if not os.path.lexists(p):
            continue
        name = os.path.basename(path)
        out["semaphores" if name.startswith("sem.") else "sockets" if path in srv.sockets else "segments"] += 1
        out["bytes"] += os.lstat(p).st_blocks * 512
    return out


def scenario(name: str, node: Node, sandbox: t.Any, tmp: str, tp: int, slow_ms: int) -> Server:
    node.set_teardown(gradual=False)
    if name.startswith("SGLang"):
        srv = start_sglang(node, sandbox=sandbox, tmp=tmp, tp=tp, port=0, nccl_port=0, mib=20000, tokenizer_workers=2)
    else:
        srv = start_vllm(node, sandbox=sandbox, tmp=tmp, tp=tp, port=0, mib=20000)
    if "crashed" in name:
        srv.crash("launcher" if name.startswith("SGLang") else "api_server")
        # A GB300-like teardown: each rank's memory goes down for this long after its signal, past the grace period.
        node.set_release_timing(delay_ms=slow_ms, gap_ms=0, per_gib_ms=0)
        node.set_teardown(gradual=True)
    return srv


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n", maxsplit=1)[0])
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--slow-teardown-ms", type=int, default=4000)
    args = ap.parse_args()
    names = ["SGLang live", "vLLM live", "SGLang crashed (launcher SIGKILLed)", "vLLM crashed (API server SIGKILLed)"]
    rows = []
    with Node(gpus=8) as node:
        for name in names:
            for mode, opts in MODES.items():
                sandbox = node.sandbox()
                try:
                    private_shm(sandbox)
                    tmp = tempfile.mkdtemp(prefix="b-")
                    srv = scenario(name, node, sandbox, tmp, args.tp, args.slow_teardown_ms)
                    made = len(srv.shm) + len(srv.sockets)
                    mod = ModuleRunner(node, sandbox)
                    began = time.monotonic()
                    r = mod("gpu_procs_kill", {"patterns": PROFILES["patterns"], "grace_period": GRACE, "kill_timeout": 10, **opts})
                    wall = time.monotonic() - began
                    if r.get("_status") != "ok":
                        print(f"{name} / {mode}: {r.get('msg')}", file=sys.stderr)
                    rest = left(srv)
                    targets = r.get("targets", [])
                    rows.append(
                        {
                            "scenario": name,
                            "mode": mode,
                            "made": made,
                            **rest,
                            "signalled": sum(1 for x in targets if x["signals_sent"]),
                            "killed": sum(1 for x in targets if "KILL" in x["signals_sent"]),
                            "own": sum(1 for x in targets if x.get("ended_by") in ("own_stop", "server_stop", "own_exit")),
                            "s": r.get("elapsed_s", wall),
                        }
                    )
                    srv.stop()
                finally:
                    sandbox.stop()
                    node.set_release_timing(delay_ms=185, gap_ms=60, per_gib_ms=1.1)
    print(f"Simulated 8 x H200, tp={args.tp}, grace period {GRACE:g} s, slow teardown {args.slow_teardown_ms} ms (crashed scenarios).\n")
    print(
        "| scenario | kill | made | left | segments | semaphores | sockets | KiB left | processes signalled | SIGKILLed |"
        " ended by the server's own stop | kill s |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        n = r["segments"] + r["semaphores"] + r["sockets"]
        print(
            f"| {r['scenario']} | {r['mode']} | {r['made']} | {n} | {r['segments']} | {r['semaphores']} | {r['sockets']} | {r['bytes'] // 1024} |"
            f" {r['signalled']} | {r['killed']} | {r['own']} | {r['s']:.2f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
