"""A distributed torch job that leaves residue the way real jobs do when it is SIGKILLed.

Real GPUs: started by torchrun (``python3 -m torch.distributed.run --nproc-per-node 2``), two ranks
on cuda:0 with the gloo backend (NCCL refuses two ranks on one GPU). What each part leaves behind
when the job is killed mid-run:

* torchrun's agent: its run directory ``$TMPDIR/torchelastic_*`` and the TCPStore listening on the
  master port (gone with the process; the port must be free for the restart);
* every rank: CPU tensors shared with the ``file_system`` strategy, which torch keeps in
  ``/dev/shm/torch_<pid>_<random>_<n>`` files, and the torch_shm_manager it starts, listening on
  ``$TMPDIR/torch-shm-dir-XXXXXX/manager.sock``; the manager unlinks both when the ranks exit, but
  a kill of the whole job kills it too (found on the H200: the role's default globs miss that socket);
* rank 0: a ZMQ-style ``ipc://`` unix socket bound at ``$TMPDIR/tmpXXXXXXXX`` (SGLang's naming; a
  stale socket file makes the next bind fail with EADDRINUSE), and torch cpp_extension's JIT
  compile baton (``torch.utils.file_baton.FileBaton``: the lock is the file's existence, so a killed
  compile leaves it and the next compile waits forever; this job gives up instead and exits 3);
* rank 1: a flock-held ``.lock`` of a JIT cache (flashinfer/triton's filelock style).

Simulated node (--sim, or no torch): ``--launcher`` plays the agent (the same run directory and
listening port) and each rank holds simulated GPU memory through a gpusim-worker child; the shm
file is created as libshm does (an O_EXCL create under /dev/shm, sized and mapped), the manager's
socket directory as torch_shm_manager makes it, the baton as FileBaton does. Everything else is the same code.

Every process carries GPUOPS16_TAG in its environment, so the harness kills exactly the job's
processes. A rank writes ``$GPUOPS16_INFO/ready.<rank>`` (JSON: pid, shm files) once it is working;
with GPUOPS16_STEPS set the job runs that many steps, releases everything and exits 0.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import mmap
import os
import random
import signal
import socket
import subprocess
import sys
import time
import typing as t
from pathlib import Path

BATON_HELD = 3
SOCKET_IN_USE = 4


def _paths(base: Path, tag: str) -> dict[str, Path]:
    return {
        # SGLang: tempfile.NamedTemporaryFile(delete=False).name -> $TMPDIR/tmpXXXXXXXX (8 characters)
        "ipc": base / ("tmp" + tag[-8:]),
        "baton": base / "cache" / "torch_extensions" / "py312_cu130" / "gpuops16_ext" / "lock",
        "flock": base / "cache" / "flashinfer" / "jit" / "gpuops16.lock",
    }


def _write_ready(info: Path, rank: int, data: dict[str, t.Any]) -> None:
    tmp = info / f".ready.{rank}"
    tmp.write_text(json.dumps(data))
    tmp.rename(info / f"ready.{rank}")


def _shm_files(pid: int) -> list[str]:
    try:
        return sorted(f"/dev/shm/{n}" for n in os.listdir("/dev/shm") if n.startswith(f"torch_{pid}_"))
    except OSError:
        return []


class Baton:
    """torch.utils.file_baton.FileBaton's protocol (O_CREAT | O_EXCL, unlink to release)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def try_acquire(self) -> bool:
        try:
            os.close(os.open(self.path, os.O_CREAT | os.O_EXCL))
            return True
        except FileExistsError:
            return False

    def release(self) -> None:
        os.remove(self.path)


def rank_main(rank: int, sim_worker: list[str] | None) -> int:
    base = Path(os.environ["TMPDIR"])
    info = Path(os.environ["GPUOPS16_INFO"])
    steps = int(os.environ.get("GPUOPS16_STEPS", "0"))
    tag = os.environ["GPUOPS16_TAG"]
    paths = _paths(base, tag)
    torch: t.Any = None
    dist: t.Any = None
    if sim_worker is None:
        import torch  # only on the real node
        import torch.distributed as dist
        import torch.multiprocessing as tmp_mp
        from torch.utils.file_baton import FileBaton

        tmp_mp.set_sharing_strategy("file_system")
    held: dict[str, t.Any] = {}
    if rank == 0:
        # Rank 0 does the JIT compile (others wait on the baton) and binds the scheduler's ipc socket.
        paths["baton"].parent.mkdir(parents=True, exist_ok=True)
        baton = FileBaton(str(paths["baton"])) if sim_worker is None else Baton(paths["baton"])
        if not baton.try_acquire():
            print(f"rank 0: the JIT baton {paths['baton']} is held: a compile is running or one was killed", file=sys.stderr, flush=True)
            return BATON_HELD
        held["baton"] = baton
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(str(paths["ipc"]))
        except OSError as exc:
            print(f"rank 0: cannot bind ipc://{paths['ipc']}: {exc}", file=sys.stderr, flush=True)
            baton.release()
            return SOCKET_IN_USE
        sock.listen(8)
        held["sock"] = sock
    else:
        paths["flock"].parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(paths["flock"], os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(fd, fcntl.LOCK_EX)
        held["flock"] = fd
    worker = None
    shared: list[t.Any] = []
    if sim_worker is None:
        dist.init_process_group("gloo")
        gpu = torch.empty(int(float(os.environ.get("GPUOPS16_GIB", "2")) * (1 << 30)), dtype=torch.uint8, device="cuda:0")
        gpu.fill_(1)
        for _unused in range(2):
            shared.append(torch.ones(1 << 20).share_memory_())  # /dev/shm/torch_<pid>_* (file_system strategy)
        grad = torch.ones(1 << 16)
    else:
        # torch_shm_manager's part: a unix socket in mkdtemp(prefix="torch-shm-dir-") of $TMPDIR, which
        # the manager removes when its last client is gone (and nobody removes when it is killed).
        import tempfile

        mgr_dir = tempfile.mkdtemp(prefix="torch-shm-dir-")
        mgr = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        mgr.bind(os.path.join(mgr_dir, "manager.sock"))
        mgr.listen(8)
        held["manager"] = (mgr, mgr_dir)
        worker = subprocess.Popen(sim_worker, stdout=subprocess.PIPE, text=True)
        if worker.stdout is None or not worker.stdout.readline():
            return 5
        for n in range(2):
            # libshm's handle: /torch_<pid>_<random>_<counter>, shm_open(O_CREAT | O_EXCL), ftruncate, mmap.
            path = f"/dev/shm/torch_{os.getpid()}_{random.randrange(1 << 31)}_{n}"
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            os.ftruncate(fd, 4 << 20)
            shared.append(mmap.mmap(fd, 4 << 20))
            os.close(fd)
    step = 0
    ready = False
    while True:
        step += 1
        if sim_worker is None:
            dist.all_reduce(grad)
            shared[0].add_(1)
            torch.cuda.synchronize()
        else:
            shared[0][0:1] = bytes([step % 256])
            time.sleep(0.01)
        if step == 3 and not ready:
            _write_ready(info, rank, {"pid": os.getpid(), "shm": _shm_files(os.getpid()), "worker": worker.pid if worker else None})
            ready = True
        if steps and step >= steps:
            break
    # A clean end: what the job releases itself.
    if sim_worker is None:
        dist.destroy_process_group()
    if worker is not None:
        worker.kill()
        worker.wait()
        for path in _shm_files(os.getpid()):
            os.unlink(path)  # libshm's manager unlinks them when the last client is gone
    if "manager" in held:
        held["manager"][0].close()
        os.unlink(os.path.join(held["manager"][1], "manager.sock"))
        os.rmdir(held["manager"][1])
    if "sock" in held:
        held["sock"].close()
        os.unlink(paths["ipc"])
    if "baton" in held:
        held["baton"].release()
    if "flock" in held:
        os.close(held["flock"])
    return 0


def launcher_main(nproc: int, port: int, sim_worker: list[str]) -> int:
    """torchrun's part on the simulated node: run directory, rendezvous port, ranks, wait."""
    import tempfile

    run_dir = tempfile.mkdtemp(prefix="torchelastic_")  # in $TMPDIR, as torchrun's agent does
    store = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    store.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as c10d's TCPStore does
    store.bind(("127.0.0.1", port))
    store.listen(16)
    ranks = []
    for rank in range(nproc):
        log = open(os.path.join(run_dir, f"rank{rank}.log"), "w")  # noqa: SIM115 (held for the run)
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(nproc), MASTER_PORT=str(port))
        argv = [sys.executable, __file__, "--rank", str(rank), "--sim-worker", json.dumps(sim_worker)]
        ranks.append(subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT))
    codes = [p.wait() for p in ranks]
    store.close()
    bad = [c for c in codes if c]
    return bad[0] if bad else 0


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--launcher", action="store_true")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--port", type=int, default=29500)
    p.add_argument("--rank", type=int)
    p.add_argument("--sim-worker", help="JSON argv of the gpusim-worker that holds a rank's simulated GPU memory")
    a = p.parse_args()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    sim = json.loads(a.sim_worker) if a.sim_worker else None
    if a.launcher:
        return launcher_main(a.nproc, a.port, sim or [])
    rank = a.rank if a.rank is not None else int(os.environ["RANK"])
    return rank_main(rank, sim)


if __name__ == "__main__":
    sys.exit(main())
