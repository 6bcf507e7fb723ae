"""An SGLang-shaped server on a real GPU, crashed as the seeds' crashed, and the next start that must follow it.

Used by crash_restart.py (validate.py phase "crash"); every process carries GPUOPS33_TAG in its environment and
writes what it made into $GPUOPS33_INFO.

    crash_server.py launcher --http PORT --store PORT --gib N   the launcher: listens on the HTTP port, binds a ZMQ-style
                                                                ipc:// socket in $TMPDIR, starts the scheduler in a
                                                                session of its own, writes ready.json
    crash_server.py scheduler ...                               sglang::scheduler_TP0: takes N GiB with torch, listens on
                                                                the store port, creates its broadcast queue
                                                                sgl_shm_mq_<pid>_<8 hex> (SharedMemory, as SGLang's
                                                                make_shm_name("mq") names it) and keeps it mapped, and
                                                                sends a CUDA tensor to its detokenizer (torch's CUDA IPC:
                                                                torch_<pid>_* and cuda.shm.0.<pid hex>.<n>)
    crash_server.py next --http PORT --store PORT --fraction F  the next start: binds both ports, creates the queue by the
                                                                name the crashed scheduler used, allocates F of the GPU;
                                                                prints what worked, exits 0 only when all did
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

INFO = Path(os.environ.get("GPUOPS33_INFO", tempfile.gettempdir()))


def set_title(title: str) -> None:
    """setproctitle without the package: the argv block and comm, as SGLang's workers show them."""
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


def detokenizer(q_gpu, ready) -> None:  # type: ignore[no-untyped-def]
    set_title("sglang::detokenizer")
    t = q_gpu.get()
    ready.put((os.getpid(), float(t.sum().item())))
    time.sleep(3600)


def scheduler(a: argparse.Namespace) -> int:
    from multiprocessing import shared_memory

    import torch
    import torch.multiprocessing as mp

    set_title("sglang::scheduler_TP0")
    store = listen(a.store)
    keep = torch.empty(int(a.gib * (1 << 30)), dtype=torch.uint8, device="cuda:0")
    keep.fill_(1)
    name = f"sgl_shm_mq_{os.getpid()}_{os.urandom(4).hex()}"
    mq = shared_memory.SharedMemory(name=name, create=True, size=1 << 20)
    # Python's resource tracker would unlink the segment when this process dies; SGLang's segments outlive a killed
    # scheduler (sglang#40723), so it is unregistered as theirs is by the time the crash comes.
    try:
        from multiprocessing import resource_tracker

        resource_tracker.unregister(mq._name, "shared_memory")  # type: ignore[attr-defined]  # pylint: disable=protected-access
    except Exception:  # noqa: BLE001  # pylint: disable=broad-exception-caught
        pass
    ctx = mp.get_context("spawn")
    q_gpu, ready = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=detokenizer, args=(q_gpu, ready))
    child.start()
    q_gpu.put(torch.ones(1 << 20, device="cuda:0"))
    detok = ready.get(timeout=120)[0]
    torch.cuda.synchronize()
    (INFO / "scheduler.json").write_text(json.dumps({"pid": os.getpid(), "detokenizer": detok, "mq": name, "store": a.store}))
    held = (store, keep, mq, child)  # the port, the memory, the queue's mapping and the child stay until the kill
    while held:
        time.sleep(3600)
    return 0


def launcher(a: argparse.Namespace) -> int:
    http = listen(a.http)
    ipc = tempfile.NamedTemporaryFile(delete=False).name  # noqa: SIM115 (SGLang's ipc:// names: $TMPDIR/tmpXXXXXXXX)
    os.unlink(ipc)
    zmq = socket.socket(socket.AF_UNIX)
    zmq.bind(ipc)
    zmq.listen(1)
    argv = [sys.executable, os.path.abspath(__file__), "scheduler", "--store", str(a.store), "--gib", str(a.gib)]
    subprocess.Popen(argv, start_new_session=True)  # pylint: disable=consider-using-with  # SGLang: start_new_session
    deadline = time.monotonic() + 180
    while not (INFO / "scheduler.json").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    (INFO / "ready.json").write_text(json.dumps({"launcher": os.getpid(), "ipc": ipc, "http": a.http}))
    held = (http, zmq)  # the HTTP port and the ipc socket stay until the kill
    while held:
        time.sleep(3600)
    return 0


def next_start(a: argparse.Namespace) -> int:
    """What the next server start needs, tried in order; every step reported."""
    out: dict[str, object] = {}
    for key, port in (("http_port", a.http), ("store_port", a.store)):
        try:
            listen(port).close()
            out[key] = "ok"
        except OSError as exc:
            out[key] = f"{exc.strerror} (errno {exc.errno})"
    sched = json.loads((INFO / "scheduler.json").read_text())
    try:
        fd = os.open(f"/dev/shm/{sched['mq']}", os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        os.close(fd)
        os.unlink(f"/dev/shm/{sched['mq']}")
        out["queue"] = "ok"
    except OSError as exc:
        out["queue"] = f"{exc.strerror} (errno {exc.errno})"
    import torch

    try:
        total = torch.cuda.get_device_properties(0).total_memory
        x = torch.empty(int(total * a.fraction), dtype=torch.uint8, device="cuda:0")
        x.fill_(0)
        torch.cuda.synchronize()
        del x
        out["gpu_memory"] = "ok"
    except Exception as exc:  # noqa: BLE001  # pylint: disable=broad-exception-caught
        out["gpu_memory"] = str(exc).splitlines()[0][:200]
    print(json.dumps(out), flush=True)
    return 0 if all(v == "ok" for v in out.values()) else 1


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("role", choices=["launcher", "scheduler", "next"])
    ap.add_argument("--http", type=int, default=30000)
    ap.add_argument("--store", type=int, default=30001)
    ap.add_argument("--gib", type=float, default=100.0)
    ap.add_argument("--fraction", type=float, default=0.9)
    a = ap.parse_args()
    return {"launcher": launcher, "scheduler": scheduler, "next": next_start}[a.role](a)


if __name__ == "__main__":
    sys.exit(main())
