"""A torch server on a real GPU, started and stopped as SGLang starts and stops itself (issue 41, run 1).

Used by stop_order.py (validate.py phase "stop"); every process carries GPUOPS41_TAG in its environment and the
launcher writes what the server made into $GPUOPS41_INFO/ready.json.

    stop_server.py launcher --http PORT --gib N    the launcher: its command line reads ``python3 -m sglang.launch_server``
                                                   (SGLang's root form), it listens on the HTTP port, registers a shared
                                                   memory segment with Python's resource tracker (which starts it), then
                                                   starts with ``spawn`` sglang::scheduler_TP0 (N GiB with torch) and
                                                   sglang::detokenizer; each registers a queue (SharedMemory, named as
                                                   SGLang names them) with the tracker and binds a ZMQ-style ipc socket
                                                   file in /tmp; the spawn context's Event is a POSIX semaphore
                                                   (/dev/shm/sem.mp-*) registered there too.
    stop_server.py next --http PORT --fraction F   the next start: binds the port and allocates F of the GPU.

On SIGTERM the launcher does what SGLang's does (managers/tokenizer_manager.py): a watchdog that polls every
POLL_S seconds (SGLang: 5 s) notices it, asks the workers to release their resources and exit (the Event: its
ShutdownReq), waits up to 15 s for them, SIGKILLs what is left and waits for it, then closes its own socket and exits;
the workers' queues are left to the resource tracker, which unlinks them once its last client is gone. The workers
install no SIGTERM handler: a TERM sent to them directly ends them at once, as SGLang's schedulers.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import multiprocessing as mp
import os
import secrets
import signal
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

POLL_S = 2.0
EXIT_WAIT_S = 15.0


def set_title(title: str) -> None:
    """setproctitle without the package: the argv block and comm."""
    with open("/proc/self/stat", "rb") as fh:
        fields = fh.read().rsplit(b")", 1)[1].split()
    a0, a1 = int(fields[45]), int(fields[46])
    data = title.encode()[: a1 - a0 - 1]
    ctypes.memmove(a0, data + b"\0" * (a1 - a0 - len(data)), a1 - a0)
    ctypes.CDLL(None).prctl(15, title.encode()[:15], 0, 0, 0)


def listen(port: int) -> socket.socket:
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1", port))
    s.listen(8)
    return s


def ipc_socket() -> tuple[socket.socket, str]:
    """A ZMQ ipc:// endpoint as SGLang makes one (PortArgs.init_new: a NamedTemporaryFile name, then bound)."""
    path = tempfile.NamedTemporaryFile(delete=False).name  # noqa: SIM115 - SGLang's own way: the file, then the bind
    os.unlink(path)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(path)
    s.listen(1)
    return s, path


def worker(kind: str, gib: float, shutdown: Any, ready: Any) -> None:
    set_title(f"sglang::{kind}")
    from multiprocessing import shared_memory

    queue = shared_memory.SharedMemory(create=True, size=1 << 20, name=f"sgl_shm_mq_{os.getpid()}_{secrets.token_hex(4)}")
    sock, path = ipc_socket()
    held = None
    if gib > 0:
        import torch

        held = torch.empty(int(gib * (1 << 30)), dtype=torch.uint8, device="cuda")
        held.fill_(1)
        torch.cuda.synchronize()
    ready.put({"kind": kind, "pid": os.getpid(), "queue": queue.name, "socket": path})
    shutdown.wait()
    # Its own teardown (ShutdownReq): release what it holds, close its socket and remove its path; its queue is closed
    # and left registered, for the resource tracker to unlink once every client is gone.
    del held
    sock.close()
    os.unlink(path)
    queue.close()
    sys.exit(0)


def launcher(http: int, gib: float, info: Path) -> None:
    set_title(f"python3 -m sglang.launch_server --model-path /models/x --port {http}")
    from multiprocessing import resource_tracker, shared_memory

    server = listen(http)
    own = shared_memory.SharedMemory(create=True, size=1 << 16, name=f"sgl_shm_mm_{os.getpid()}_{secrets.token_hex(4)}")
    ctx = mp.get_context("spawn")
    shutdown, ready = ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=worker, args=("scheduler_TP0", gib, shutdown, ready)), ctx.Process(target=worker, args=("detokenizer", 0.0, shutdown, ready))]
    for p in procs:
        p.start()
    workers = [ready.get(timeout=300) for _p in procs]
    tracker = getattr(resource_tracker._resource_tracker, "_pid", None)  # pylint: disable=protected-access
    sems = sorted(n for n in os.listdir("/dev/shm") if n.startswith("sem.mp-"))
    (info / "ready.json").write_text(json.dumps({"launcher": os.getpid(), "tracker": tracker, "own_queue": own.name, "workers": workers, "sems": sems}))
    asked = []
    signal.signal(signal.SIGTERM, lambda _s, _f: asked.append(time.monotonic()))
    while not asked:
        time.sleep(POLL_S)  # SGLang's sigterm_watchdog polls
    shutdown.set()
    deadline = time.monotonic() + EXIT_WAIT_S
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            os.kill(p.pid, signal.SIGKILL)  # kill_process_tree
            p.join()
    own.close()
    own.unlink()
    server.close()
    (info / "stopped.json").write_text(json.dumps({"after_s": round(time.monotonic() - asked[0], 3)}))


def next_start(http: int, fraction: float) -> int:
    out: dict[str, object] = {}
    try:
        listen(http).close()
        out["port"] = "bound"
    except OSError as exc:
        out["port"] = f"{exc.strerror}"
    try:
        import torch

        _free, total = torch.cuda.mem_get_info()
        x = torch.empty(int(total * fraction), dtype=torch.uint8, device="cuda")
        del x
        out["alloc"] = f"{fraction:.0%} of {total >> 30} GiB"
    except Exception as exc:  # noqa: BLE001 - what the start met, whatever it is
        out["alloc"] = f"failed: {str(exc)[:200]}"
    print(json.dumps(out), flush=True)
    return 0 if out.get("port") == "bound" and not str(out.get("alloc", "")).startswith("failed") else 1


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("role", choices=["launcher", "next"])
    ap.add_argument("--http", type=int, required=True)
    ap.add_argument("--gib", type=float, default=60.0)
    ap.add_argument("--fraction", type=float, default=0.9)
    a = ap.parse_args()
    if a.role == "next":
        return next_start(a.http, a.fraction)
    launcher(a.http, a.gib, Path(os.environ["GPUOPS41_INFO"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
