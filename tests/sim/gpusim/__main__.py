"""gpusim command line (tests/sim/bin/gpusim).

    gpusim node start --state DIR [--gpus N] [...]   start a node; prints `export ...` lines
    gpusim node stop  --state DIR [--purge]          end its daemon and every holder of its devices
    gpusim status     --state DIR [--json]           per-GPU memory, contexts and faults
    gpusim env        --state DIR [--no-library]     the `export ...` lines again
    gpusim fault      --state DIR [--clear] KEY=VALUE ...
    gpusim worker     [--state DIR] WORKER-OPTIONS   run gpusim-worker (see its --help)

--state defaults to $GPUSIM_STATE. Fault keys: init_error=NAME, lost=3[,4],
timeout=FN[,FN] (with timeout_gpus=1,2 and timeout_delay_ms=N), hang=FN[,FN] (with
hang_gpus=1,2: those calls never return), orphan=GPU:MIB[,...],
recovery_action=GPU:N[,...], legacy_pids=1, memory_v2_unsupported=1,
process_api=v1|v2|v3, memory_na=1, library_absent=1, cuda_absent=1 (libcuda.so.1 off the path),
hidden=GPU:MIB[,...] (memory CUDA cannot allocate, NVML does not count), phantom_pids=GPU:PID[,...]; also
release_delay_ms=N, release_gap_ms=N, release_us_per_gib=N, teardown_hang_ms=N, context_overhead_mib=N and
mig=GPU[,...] (MIG mode on for those, off for the others). An empty value clears that fault.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import sys
from pathlib import Path
from typing import Any

from . import paths
from .description import Description
from .node import Node
from .procfs import daemon_running
from .state import counted_contexts, memory


def _state(args: argparse.Namespace) -> Path:
    state = args.state or os.environ.get("GPUSIM_STATE")
    if not state:
        raise SystemExit("gpusim: no state directory (--state DIR or GPUSIM_STATE)")
    return Path(state).resolve()


def _exports(node: Node, include_library: bool | None = None) -> str:
    return "".join(f"export {k}={shlex.quote(v)}\n" for k, v in node.env(include_library).items())


def cmd_node_start(args: argparse.Namespace) -> int:
    node = Node(
        path=_state(args),
        gpus=args.gpus,
        name=args.name,
        total_mib=args.total_mib,
        reserved_mib=args.reserved_mib,
        release_delay_ms=args.release_delay_ms,
        release_gap_ms=args.release_gap_ms,
        seed=args.seed,
        minors=[int(x) for x in args.minors.split(",")] if args.minors else None,
        context_overhead_mib=args.context_overhead_mib,
        teardown=not args.no_teardown,
    )
    node.start(detach=True)
    sys.stdout.write(_exports(node))
    return 0


def cmd_node_stop(args: argparse.Namespace) -> int:
    state = _state(args)
    if not (state / "node.conf").exists():
        raise SystemExit(f"gpusim: no node at {state}")
    Node.attach(state).stop()
    if args.purge:
        shutil.rmtree(state, ignore_errors=True)
    return 0


def cmd_env(args: argparse.Namespace) -> int:
    sys.stdout.write(_exports(Node.attach(_state(args)), False if args.no_library else None))
    return 0


def status_data(state: Path) -> dict[str, Any]:
    desc = Description.read(state)
    ctxs = counted_contexts(state)
    f = desc.faults
    faults = {k: v for k, v in vars(f).items() if v not in (False, "", [], {}, 0, "v3")}
    return {
        "state": str(state),
        "driver_version": desc.driver_version,
        "daemon_running": daemon_running(state),
        "release_delay_ms": desc.release_delay_ms,
        "release_gap_ms": desc.release_gap_ms,
        "faults": faults,
        "gpus": [
            {
                "index": g.index,
                "uuid": g.uuid,
                "pci_bus_id": g.pci_bus_id,
                **memory(state, desc, g.index, ctxs),
                "contexts": [c.as_dict() for c in ctxs if c.gpu == g.index],
            }
            for g in desc.gpus
        ],
    }


def cmd_status(args: argparse.Namespace) -> int:
    data = status_data(_state(args))
    if args.json:
        print(json.dumps(data, indent=2))
        return 0
    print(
        f"node {data['state']}: {len(data['gpus'])} GPUs, driver {data['driver_version']}, "
        f"daemon {'running' if data['daemon_running'] else 'NOT running'}, "
        f"release {data['release_delay_ms']} ms + {data['release_gap_ms']} ms/context"
    )
    if data["faults"]:
        print("faults: " + ", ".join(f"{k}={v}" for k, v in data["faults"].items()))
    print(f"{'GPU':>3}  {'used MiB':>9}  {'reserved':>8}  {'total':>7}  contexts")
    for g in data["gpus"]:
        ctx = ", ".join(f"#{c['id']} pid {'/'.join(str(p) for _ns, p in c['levels']) or c['pid']} {c['mib']} MiB {c['state']}" for c in g["contexts"])
        if g["orphan_mib"]:
            ctx = (ctx + ", " if ctx else "") + f"orphaned {g['orphan_mib']} MiB"
        print(f"{g['index']:>3}  {g['used_mib']:>9}  {g['reserved_mib']:>8}  {g['total_mib']:>7}  {ctx or '-'}")
    return 0


def _pairs(value: str) -> dict[int, int | None]:
    out: dict[int, int | None] = {}
    for part in filter(None, value.split(",")):
        gpu, _unused, n = part.partition(":")
        out[int(gpu)] = int(n) if n else None
    return out


def cmd_fault(args: argparse.Namespace) -> int:
    node = Node.attach(_state(args))
    if args.clear:
        node.clear_faults()
    kw: dict[str, Any] = {}
    timeout: dict[str, Any] = {}
    hang: dict[str, Any] = {}
    timing: dict[str, float] = {}
    for item in args.settings:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"gpusim fault: expected KEY=VALUE, got {item!r}")
        if key in ("lost",):
            kw[key] = [int(x) for x in value.split(",") if x]
        elif key == "timeout":
            timeout["functions"] = [x for x in value.split(",") if x]
        elif key == "timeout_gpus":
            timeout["gpus"] = [int(x) for x in value.split(",") if x]
        elif key == "timeout_delay_ms":
            timeout["delay_ms"] = int(value or 0)
        elif key == "hang":
            hang["functions"] = [x for x in value.split(",") if x]
        elif key == "hang_gpus":
            hang["gpus"] = [int(x) for x in value.split(",") if x]
        elif key in ("orphan", "recovery_action", "hidden"):
            kw[key] = _pairs(value) if value else None
        elif key in ("legacy_pids", "memory_v2_unsupported", "memory_na", "library_absent", "cuda_absent"):
            kw[key] = value.lower() in ("1", "true", "yes", "on")
        elif key in ("init_error", "process_api"):
            kw[key] = value or None
        elif key in ("release_delay_ms", "release_gap_ms"):
            timing[key.replace("release_", "")] = int(value)
        elif key == "release_us_per_gib":
            timing["per_gib_ms"] = int(value or 0) / 1000
        elif key == "phantom_pids":
            pids: dict[int, list[int]] = {}
            for part in filter(None, value.split(",")):
                gpu, _unused, pid = part.partition(":")
                pids.setdefault(int(gpu), []).append(int(pid))
            kw[key] = pids or None
        elif key == "teardown_hang_ms":
            node.set_teardown(hang_ms=int(value or 0))
        elif key == "context_overhead_mib":
            node.set_context_overhead(int(value or 0))
        elif key == "mig":
            on = {int(x) for x in value.split(",") if x}
            node.set_mig([g.index for g in node.gpus if g.index in on], True)
            node.set_mig([g.index for g in node.gpus if g.index not in on], False)
        else:
            raise SystemExit(f"gpusim fault: unknown key {key!r}")
    if timeout:
        current = node.desc.faults
        merged = {"functions": current.timeout_functions, "gpus": current.timeout_gpus, "delay_ms": current.timeout_delay_ms, **timeout}
        kw["timeout"] = merged if merged["functions"] else None
    if hang:
        current = node.desc.faults
        merged = {"functions": current.hang_functions, "gpus": current.hang_gpus, **hang}
        kw["hang"] = merged if merged["functions"] else None
    if kw:
        node.set_fault(**kw)
    if timing:
        node.set_release_timing(**timing)
    return 0


def cmd_worker(args: argparse.Namespace, rest: list[str]) -> int:
    paths.ensure_built()
    env = dict(os.environ)
    if args.state:
        env["GPUSIM_STATE"] = str(Path(args.state).resolve())
    os.execve(str(paths.WORKER), [str(paths.WORKER), *rest], env)
    return 0  # not reached


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="gpusim", description="simulated NVIDIA GPU node", formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)

    node_p = sub.add_parser("node", help="start or stop a node")
    node_sub = node_p.add_subparsers(dest="action", required=True)
    start = node_sub.add_parser("start", help="start a node (daemonised); prints export lines")
    start.add_argument("--state")
    start.add_argument("--gpus", type=int, default=8)
    start.add_argument("--name", default="NVIDIA H200")
    start.add_argument("--total-mib", type=int, default=143771)
    start.add_argument("--reserved-mib", type=int, default=615)
    start.add_argument("--release-delay-ms", type=int, default=185)
    start.add_argument("--release-gap-ms", type=int, default=60)
    start.add_argument("--seed", default="gpusim")
    start.add_argument("--minors", help="device minors in index order, e.g. 3,2,1,0 (default: minor = index)")
    start.add_argument("--context-overhead-mib", type=int, default=9)
    start.add_argument("--no-teardown", action="store_true", help="exiting workers leave at once (no FUSE teardown)")
    stop = node_sub.add_parser("stop", help="stop a node: its daemon and every holder of its devices")
    stop.add_argument("--state")
    stop.add_argument("--purge", action="store_true", help="also remove the state directory")

    st = sub.add_parser("status", help="per-GPU memory and contexts")
    st.add_argument("--state")
    st.add_argument("--json", action="store_true")

    env = sub.add_parser("env", help="print the export lines for NVML clients")
    env.add_argument("--state")
    env.add_argument("--no-library", action="store_true", help="the 'library absent' environment")

    fault = sub.add_parser("fault", help="switch faults (KEY=VALUE ...)")
    fault.add_argument("--state")
    fault.add_argument("--clear", action="store_true", help="clear all faults first")
    fault.add_argument("settings", nargs="*")

    worker = sub.add_parser("worker", help="run gpusim-worker", add_help=False)
    worker.add_argument("--state")

    args, rest = ap.parse_known_args(argv)
    if args.cmd == "worker":
        return cmd_worker(args, rest)
    if rest:
        ap.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.cmd == "node":
        return cmd_node_start(args) if args.action == "start" else cmd_node_stop(args)
    return {"status": cmd_status, "env": cmd_env, "fault": cmd_fault}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
