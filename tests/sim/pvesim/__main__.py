"""``python -m pvesim --cluster FILE --port N [--tls] [--latency-ms 20]``: serve until interrupted."""

from __future__ import annotations

import argparse
import signal
import sys
import threading

from . import PveSim, load_cluster
from .generate import benchmark_cluster


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pvesim", description="Serve a simulated Proxmox VE API on 127.0.0.1.")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--cluster", help="cluster description (.yml/.yaml/.json) or a bundled name such as gpu3")
    src.add_argument("--generate", metavar="NODESxGUESTS", help="generated benchmark cluster, for example 3x300")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8006)
    ap.add_argument("--tls", action="store_true", help="HTTPS with a throwaway self-signed certificate")
    ap.add_argument("--latency-ms", type=float, default=0.0, help="delay added to every request")
    ap.add_argument("--token", action="append", default=[], metavar="USER@REALM!ID=SECRET", help="accepted API token (repeatable)")
    ap.add_argument("--user", action="append", default=[], metavar="USER@REALM=PASSWORD", help="accepted login (repeatable)")
    args = ap.parse_args(argv)

    if args.cluster:
        desc = load_cluster(args.cluster)
    else:
        nodes, _unused, guests = args.generate.partition("x")
        desc = benchmark_cluster(nodes=int(nodes), guests_per_node=int(guests))
    tokens = dict(t.split("=", 1) for t in args.token) or None
    users = dict(u.split("=", 1) for u in args.user) or None
    sim = PveSim(desc, tls=args.tls, latency_ms=args.latency_ms, tokens=tokens, users=users, host=args.host, port=args.port)
    sim.start()
    token_id, secret = sim.token
    print(f"pvesim serving {len(sim.cluster.nodes)} nodes / {len(sim.cluster.guests)} guests at {sim.url}", flush=True)
    print(f"export PROXMOX_URL={sim.url} PROXMOX_TOKEN_ID='{token_id}' PROXMOX_TOKEN_SECRET='{secret}'", flush=True)
    if sim.ca_path:
        print(f"# certificate: {sim.ca_path}", flush=True)
    done = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_unused: done.set())
    done.wait()
    print(f"pvesim: {sim.request_count} requests served", file=sys.stderr)
    sim.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
