"""An inference server's stand-in for the rolling restart test (tests/lab/test_rolling.py), run on a lab host by the
host's own python3: one worker per GPU named as SGLang names its schedulers (gpusim-worker: a CUDA context and
memory on the simulated driver, as a real scheduler holds its GPU), and ``GET /health`` on ``--port``: 503 while the
model loads (``--load-s`` seconds, and at least the first probe, the warm-up request), then 200 while every worker
lives, 503 otherwise. It exits when a worker
is gone (the clean slate ended it: its port is free for the next start) or on SIGTERM (ending its workers first).
Its pid is written to ``--pidfile``. Standard library only: the hosts' Pythons run it as they are."""

from __future__ import annotations

import argparse
import http.server
import os
import signal
import subprocess
import sys
import threading
import time


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--gpus", required=True, help="comma-separated GPU indices")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--load-s", type=float, default=1.5)
    parser.add_argument("--mib", type=int, default=20000)
    parser.add_argument("--pidfile", required=True)
    args = parser.parse_args()
    with open(args.pidfile, "w", encoding="ascii") as fh:
        fh.write(f"{os.getpid()}\n")
    workers = [
        subprocess.Popen(["gpusim-worker", "--gpu", gpu, "--mib", str(args.mib), "--title", f"sglang::scheduler_TP{rank}"], stdin=subprocess.DEVNULL)
        for rank, gpu in enumerate(args.gpus.split(","))
    ]

    def stop(_signum: int = 0, _frame: object = None) -> None:
        for w in workers:
            if w.poll() is None:
                w.terminate()
        for w in workers:
            try:
                w.wait(5)
            except subprocess.TimeoutExpired:
                w.kill()
        os._exit(0)

    signal.signal(signal.SIGTERM, stop)

    def watch() -> None:
        while all(w.poll() is None for w in workers):
            time.sleep(0.05)
        stop()

    threading.Thread(target=watch, daemon=True).start()
    loaded = time.monotonic() + args.load_s
    probes = []

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            probes.append(time.monotonic())
            ok = self.path == "/health" and len(probes) > 1 and time.monotonic() >= loaded and all(w.poll() is None for w in workers)
            self.send_response(200 if ok else 503)
            self.end_headers()
            self.wfile.write(b"ok\n" if ok else b"not ready\n")

        def log_message(self, format: str, *args: object) -> None:
            pass

    http.server.ThreadingHTTPServer(("0.0.0.0", args.port), Health).serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
