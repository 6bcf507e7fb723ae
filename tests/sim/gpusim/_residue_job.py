"""Real processes that leave (or hold) the residue of GPU jobs, for gpusim.residue. Standard library only.

Run as ``python -I _residue_job.py MODE [options]``; each mode prints one line
``ready <pid as it sees itself> <json>`` once its residue exists, then stays
alive until it is killed (except ``time-wait``, which exits). Created the way
the real software does it, so the files and sockets are the real thing:

* ``job``: a dead-job-to-be. NCCL's segment (glibc ``mkstemp`` of
  ``nccl-XXXXXX``, ``posix_fallocate``, ``mmap``), vLLM's ``vllm_offload_*.mmap``,
  torch's ``torch_<pid>_<n>``, Python's ``psm_*`` (``_posixshmem.shm_open``, as
  ``multiprocessing.shared_memory`` does) and ``sem.mp-*`` (``_multiprocessing.SemLock``,
  as a spawn-context semaphore is), ZMQ-style ``ipc://`` unix sockets (vLLM's
  UUID name, SGLang's ``NamedTemporaryFile`` name: unlinked, then bound, as
  libzmq does), torch cpp_extension's ``lock`` baton (``O_CREAT|O_EXCL``), a
  flashinfer ``filelock`` lock file (flock'ed) and a torchelastic run directory.
  SIGKILL it and all of that is orphaned.
* ``hold``: a live process that maps, opens, flocks, binds, or works in
  given paths, optionally under a protected daemon's name (``--comm``).
* ``listen``: a TCP listener on 127.0.0.1 (``--count`` of them with ``--reuseport``, as vLLM's API servers share
  their port; ``--title`` sets the command line, as setproctitle does).
* ``connected``: a server that closed its listener but keeps a connection on the port.
* ``time-wait``: a listener that serves ``--count`` connections, closes them
  first (so the server side goes to TIME_WAIT on its port) and exits.
* ``zombies``: a parent that never reaps ``--count`` exited children.
* ``creator``: a live process whose torch CUDA IPC ref counter (``torch_<pid>_<rand>_<n>``) nothing holds,
  as the H200 showed while its creator ran (a DataLoader or a server beside the one that crashed).
* ``handoff``: a process starting beside a run: when ``--after-pid`` has exited, it makes a segment, writes
  it and closes it (handing it to a reader by name, as ``multiprocessing.shared_memory`` users do), so that
  nothing holds it yet.
* ``server-files``: what SGLang and vLLM leave besides their queues (round4-facts §3), each made the way the
  server's code makes it: a torch FileStore (``file:///tmp/vllm_dist_<hex>``: opened, flocked, written and closed
  per operation), loky semaphores (``SemLock`` named ``/loky-<pid>-<rand>``), a Prometheus multiprocess directory
  (``tempfile.mkdtemp()`` with prometheus_client's mapped ``<type>_<pid>.db``), a ZMQ path never bound (the
  ``NamedTemporaryFile(delete=False)`` placeholder of a crash before bind), the forward-pass metrics socket
  (``<name>.<dp_rank>``), the fd-exchange directory and socket (``mkdtemp(prefix="sgl_ar_fd_")/rank_<r>.sock``),
  the load collector's and the weight-cache daemon's sockets and its ``.ready`` marker, vLLM's ``--uds`` socket
  (bound, never unlinked), torch build batons (``O_CREAT|O_EXCL``: ``symm_allocator/lock``,
  ``sgl_bump_arena/<pid>_<n>/lock``, ``lock``), SGLang's relocated JIT cache locks and vLLM's cached P2P answer.
  SIGKILL it and all of that is orphaned; alive, it holds what its source holds.
* ``init``: pid 1 of a residue container: mounts tmpfs on the given
  directories of its new mount namespace, brings the loopback up in its new
  network namespace, and reaps its children or (``--no-reap``) does not.
"""

import argparse
import ctypes
import fcntl
import json
import mmap
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
import uuid

KEEP = []  # everything mapped or open stays referenced until the process dies


def set_comm(name):
    if name:
        with open("/proc/self/comm", "w") as fh:
            fh.write(name[:15])


def ready(payload):
    sys.stdout.write(f"ready {os.getpid()} {json.dumps(payload)}\n")
    sys.stdout.flush()
    # Detach from the pipe: whoever reads the ready line may go away.
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 1)


def segment(fd, size):
    os.posix_fallocate(fd, 0, size)
    KEEP.append(mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE))


def job(args):
    size = args.kib * 1024
    shm, tmp, cache = args.shm, args.tmp, args.cache
    out = {"shm": [], "sockets": [], "locks": [], "dirs": [], "shm_bytes": 0}
    libc = ctypes.CDLL(None, use_errno=True)
    for _unused in range(args.segments):
        # NCCL: snprintf(shmPath, "/dev/shm/nccl-XXXXXX"); mkstemp(shmPath); fallocate; mmap.
        template = ctypes.create_string_buffer(f"{shm}/nccl-XXXXXX".encode())
        fd = libc.mkstemp(template)
        if fd < 0:
            raise OSError(ctypes.get_errno(), "mkstemp")
        segment(fd, size)
        out["shm"].append(template.value.decode())
    path = f"{shm}/vllm_offload_{uuid.uuid4().hex[:12]}.mmap"
    segment(os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600), size)
    out["shm"].append(path)
    path = f"{shm}/torch_{os.getpid()}_0"
    segment(os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600), size)
    out["shm"].append(path)
    if shm == "/dev/shm":
        import _multiprocessing
        import _posixshmem

        name = f"/psm_{os.urandom(4).hex()}"
        segment(_posixshmem.shm_open(name, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600), size)
        out["shm"].append("/dev/shm" + name)
        name = f"/mp-{os.urandom(4).hex()}"
        KEEP.append(_multiprocessing.SemLock(1, 1, 1, name, False))
        out["shm"].append(f"/dev/shm/sem.{name[1:]}")
    out["shm_bytes"] = sum(os.stat(p).st_blocks * 512 for p in out["shm"])
    if tmp:
        # SGLang's name: ipc://{tempfile.NamedTemporaryFile(delete=False).name}
        with tempfile.NamedTemporaryFile(delete=False, dir=tmp) as named:
            sglang = named.name
        for path in (f"{tmp}/{uuid.uuid4()}", f"{tmp}/engine_core-{uuid.uuid4()}", sglang):
            if os.path.exists(path):
                os.unlink(path)  # libzmq's ipc listener unlinks the path before bind()
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.bind(path)
            s.listen(8)
            KEEP.append(s)
            out["sockets"].append(path)
        run = tempfile.mkdtemp(prefix="torchelastic_", dir=tmp)
        attempt = os.path.join(run, f"{uuid.uuid4().hex[:8]}_x", "attempt_0", "0")
        os.makedirs(attempt)
        with open(os.path.join(attempt, "error.json"), "w") as fh:
            fh.write("{}\n")
        out["dirs"].append(run)
    if cache:
        tag = os.urandom(3).hex()  # one extension and one JIT module per job, so jobs never wait on each other
        baton = f"{cache}/torch_extensions/py311_cu124/fused_adam_{tag}/lock"
        os.makedirs(os.path.dirname(baton), exist_ok=True)
        os.close(os.open(baton, os.O_CREAT | os.O_EXCL))  # torch.utils.file_baton.FileBaton.try_acquire
        out["locks"].append(baton)
        lock = f"{cache}/flashinfer/0.2.3/90/cached_ops/batch_prefill_{tag}/batch_prefill_{tag}.lock"
        os.makedirs(os.path.dirname(lock), exist_ok=True)
        fh = open(lock, "a")  # noqa: SIM115 - held until death, as filelock holds it
        fcntl.flock(fh, fcntl.LOCK_EX)
        KEEP.append(fh)
        out["locks"].append(lock)
    set_comm(args.comm)
    ready(out)
    while True:
        signal.pause()


def server_files(args):
    tmp, shm, cache, pid = args.tmp, args.shm, args.cache, os.getpid()
    out = {}
    # vLLM: get_file_store_init_method() -> file:///tmp/vllm_dist_<uuid4 hex>; torch's FileStore opens the file per
    # operation (O_RDWR|O_CREAT), flocks it, appends its key/value records and closes it.
    store = f"{tmp}/vllm_dist_{uuid.uuid4().hex}"
    with open(store, "ab") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        fh.write(struct.pack("<I", 8) + b"cnt_0000" + struct.pack("<I", 1) + b"1")
    out["filestore"] = store
    # loky: SemLock(kind, value, maxvalue, "/loky-<pid>-<rand>", unlink=False), mapped while its process lives.
    if shm == "/dev/shm":
        import _multiprocessing

        name = f"/loky-{pid}-{os.urandom(4).hex()}"
        KEEP.append(_multiprocessing.SemLock(1, 1, 1, name, False))
        out["loky"] = f"/dev/shm/sem.{name[1:]}"
    # The Prometheus multiprocess directory (--enable-metrics): mkdtemp(), PROMETHEUS_MULTIPROC_DIR, and
    # prometheus_client's MmapedDict files <type>_<pid>.db, each mapped while its process lives.
    metrics = tempfile.mkdtemp(dir=tmp)
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics
    try:
        import prometheus_client

        KEEP.append(prometheus_client.Counter("sglang_requests", "requests"))
        KEEP[-1].inc()
        KEEP.append(prometheus_client.Gauge("sglang_running", "running", multiprocess_mode="all"))
        KEEP[-1].set(1)
    except ImportError:  # as MmapedDict makes them: a 1 MiB file, its used-bytes header, mapped
        for kind in ("counter", "gauge_all"):
            fd = os.open(f"{metrics}/{kind}_{pid}.db", os.O_RDWR | os.O_CREAT, 0o644)
            os.ftruncate(fd, 1 << 20)
            m = mmap.mmap(fd, 1 << 20)
            m[0:8] = struct.pack("i", 8) + b"\0" * 4
            KEEP.append(m)
    out["prometheus"] = metrics
    # SGLang's PortArgs: ipc://{NamedTemporaryFile(delete=False).name}; a crash before the bind leaves the 0-byte file.
    with tempfile.NamedTemporaryFile(delete=False, dir=tmp) as named:
        out["unbound"] = named.name

    def bind(path, kind=socket.SOCK_STREAM):
        s = socket.socket(socket.AF_UNIX, kind)
        s.bind(path)
        s.listen(8)
        KEEP.append(s)
        return path

    # The forward-pass metrics ipc of dp rank 0: <NamedTemporaryFile name>.<dp_rank> (metrics_reporter.py).
    with tempfile.NamedTemporaryFile(delete=False, dir=tmp) as named:
        base = named.name
    os.unlink(base)
    out["metrics_ipc"] = bind(f"{base}.0")
    # The fd exchange (cuda_vmm_utils.py): mkdtemp(prefix="sgl_ar_fd_") and rank_<r>.sock, SOCK_SEQPACKET.
    fd_dir = tempfile.mkdtemp(prefix="sgl_ar_fd_", dir=tmp)
    out["ar_fd_dir"] = fd_dir
    out["ar_fd"] = bind(f"{fd_dir}/rank_0.sock", socket.SOCK_SEQPACKET)
    out["load_collector"] = bind(f"{tmp}/sglang_load_collector_{uuid.uuid4().hex[:12]}_{os.urandom(2).hex()}.sock")
    # The weight-cache daemon (weight_cache/daemon.py serve): its socket, then its .ready marker, written and closed.
    gpu = f"GPU-{uuid.uuid4()}"
    out["weight_cache"] = bind(f"{tmp}/sglang_weight_cache_{gpu}.sock")
    out["weight_ready"] = f"{tmp}/sglang_weight_cache_{gpu}.ready"
    with open(out["weight_ready"], "w") as fh:
        fh.write(f"pid={pid}\nconfig={{}}\n")
    if args.uds:
        out["uds"] = bind(args.uds)  # create_server_unix_socket: bind(path), never unlinking a stale one first
    # torch build batons (cpp_extension FileBaton.try_acquire: O_CREAT|O_EXCL), held by no descriptor.
    batons = {"symm": f"{tmp}/symm_allocator/lock", "bump": f"{tmp}/sgl_bump_arena/{pid}_0/lock", "lock": f"{tmp}/lock"}
    for key, path in batons.items():
        os.makedirs(os.path.dirname(path), exist_ok=True)
        os.close(os.open(path, os.O_CREAT | os.O_EXCL))
        out[key] = path
    if cache:
        # SGLang's relocated JIT caches (environ.py third_party_cache_defaults): a triton FileLock, flocked while held.
        lock = f"{cache}/sglang/triton/{os.urandom(8).hex()}/kernel.lock"
        os.makedirs(os.path.dirname(lock), exist_ok=True)
        fh = open(lock, "a")  # noqa: SIM115 - held until death, as filelock holds it
        fcntl.flock(fh, fcntl.LOCK_EX)
        KEEP.append(fh)
        out["jit_lock"] = lock
        # vLLM's cached P2P answer (all_reduce_utils.py): json.dump to VLLM_CACHE_ROOT/gpu_p2p_access_cache_for_<devices>.json.
        p2p = f"{cache}/vllm/gpu_p2p_access_cache_for_0,1,2,3.json"
        os.makedirs(os.path.dirname(p2p), exist_ok=True)
        with open(p2p, "w") as fh2:
            json.dump({"0->1": True, "1->0": True}, fh2)
        out["p2p"] = p2p
    set_comm(args.comm)
    ready(out)
    while True:
        signal.pause()


def hold(args):
    set_comm(args.comm)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    for path in args.map:
        # A raw mapping with the fd closed afterwards: only /proc/PID/maps shows it.
        fd = os.open(path, os.O_RDWR)
        addr = libc.mmap(None, 4096, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), f"mmap {path}")
        os.close(fd)
    for path in args.open:
        KEEP.append(os.open(path, os.O_RDONLY))
    for path in args.flock:
        fd = os.open(path, os.O_RDWR)
        fcntl.flock(fd, fcntl.LOCK_EX)
        KEEP.append(fd)
    for path in args.ofd:
        # An open file description lock: /proc/locks shows it with pid -1 (it belongs to no process).
        fd = os.open(path, os.O_RDWR)
        fcntl.fcntl(fd, 37, struct.pack("hhqqi", fcntl.F_WRLCK, os.SEEK_SET, 0, 0, 0) + b"\0" * 4)  # F_OFD_SETLK
        KEEP.append(fd)
    for path in args.bind:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.bind(path)
        s.listen(8)
        KEEP.append(s)
    if args.cwd:
        os.chdir(args.cwd)
    ready({"pid": os.getpid()})
    while True:
        signal.pause()


def listen(args):
    set_comm(args.comm)
    if args.title:
        # setproctitle, as vLLM names its API servers (VLLM::APIServer_<i>): the command line reads the title.
        with open("/proc/self/stat", "rb") as fh:
            fields = fh.read().rsplit(b")", 1)[1].split()
        start, end = int(fields[45]), int(fields[46])
        data = args.title.encode()[: end - start - 1]
        ctypes.memmove(start, data + b"\0" * (end - start - len(data)), end - start)
    port = args.port
    for _unused in range(args.count):
        # vLLM with --api-server-count > 1: every API server listens on the port with SO_REUSEPORT.
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if args.reuseport:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        s.bind(("127.0.0.1", port))
        s.listen(8)
        KEEP.append(s)
        port = s.getsockname()[1]
    ready({"port": port})
    while True:
        signal.pause()


def time_wait(args):
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind(("127.0.0.1", args.port))
    server.listen(args.count)
    port = server.getsockname()[1]
    clients = []
    for _unused in range(args.count):
        c = socket.create_connection(("127.0.0.1", port))
        conn, _addr = server.accept()
        clients.append((c, conn))
    for _c, conn in clients:
        conn.close()  # the server closes first: its side of the connection ends in TIME_WAIT
    time.sleep(0.05)
    for c, _conn in clients:
        c.close()
    server.close()
    time.sleep(0.05)
    ready({"port": port})


def connected(args):
    """A server that stopped listening but keeps a live connection on its port (an orphaned worker's)."""
    set_comm(args.comm)
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind(("127.0.0.1", args.port))
    server.listen(1)
    port = server.getsockname()[1]
    client = socket.create_connection(("127.0.0.1", port))
    conn, _addr = server.accept()
    server.close()
    KEEP.extend([client, conn])
    ready({"port": port})
    while True:
        signal.pause()


def zombies(args):
    set_comm(args.comm)
    kids = []
    for _unused in range(args.count):
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        kids.append(pid)
    ready({"children": kids})
    while True:
        signal.pause()


def _write_and_close(path):
    """A 4 KiB segment made, written and closed: on disk, held by nothing."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    os.posix_fallocate(fd, 0, 4096)
    os.close(fd)


def creator(args):
    set_comm(args.comm)
    path = f"{args.shm}/torch_{os.getpid()}_{int.from_bytes(os.urandom(4), 'little')}_0"
    _write_and_close(path)
    ready({"path": path})
    while True:
        signal.pause()


def handoff(args):
    set_comm(args.comm)
    path = f"{args.shm}/psm_{os.urandom(4).hex()}"
    ready({"path": path})
    if args.after_pid:
        select.select([os.pidfd_open(args.after_pid)], [], [])
    _write_and_close(path)
    while True:
        signal.pause()


def lo_up():
    """ip link set lo up, without iproute2: SIOCGIFFLAGS / SIOCSIFFLAGS."""
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        ifreq = struct.pack("16sH14s", b"lo", 0, b"")
        flags = struct.unpack("16sH14s", fcntl.ioctl(s, 0x8913, ifreq))[1]
        fcntl.ioctl(s, 0x8914, struct.pack("16sH14s", b"lo", flags | 1, b""))
    finally:
        s.close()


def _kept(path):
    """The directories under ``path`` the container must keep seeing: the checkout and interpreter it runs from.

    A checkout under /tmp (CI clones there) would otherwise vanish under the container's fresh tmpfs, and with
    it the Python that the container's processes are started with.
    """
    out = []
    for cand in (os.path.abspath(__file__), sys.executable, os.getcwd()):
        if cand.startswith(path.rstrip("/") + "/"):
            top = os.path.join(path, os.path.relpath(cand, path).split(os.sep, maxsplit=1)[0])
            if os.path.isdir(top) and top not in out:
                out.append(top)
    return out


def init(args):
    for path in args.tmpfs:
        keep = [(top, os.open(top, os.O_PATH | os.O_DIRECTORY)) for top in _kept(path)]
        subprocess.run(["mount", "-t", "tmpfs", "-o", "mode=1777,size=4g", "tmpfs", path], check=True)
        for top, fd in keep:
            # Bound back through a descriptor opened before the mount; --no-canonicalize keeps mount(8) from
            # resolving the /proc link's text in the new view (which would bind the tmpfs onto itself).
            os.mkdir(top)
            subprocess.run(["mount", "--no-canonicalize", "--bind", f"/proc/{os.getpid()}/fd/{fd}", top], check=True)
            os.close(fd)
    if args.lo_up:
        lo_up()
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})
    os.write(args.ready_fd, b"ready\n")
    os.close(args.ready_fd)
    while True:
        signal.sigwait({signal.SIGCHLD})
        if args.no_reap:
            continue  # a container init that does not reap: every orphan that exits stays a zombie
        while True:
            try:
                pid, _status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break


def main():
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="mode", required=True)
    p = sub.add_parser("job")
    p.add_argument("--shm", default="/dev/shm")
    p.add_argument("--tmp", default="")
    p.add_argument("--cache", default="")
    p.add_argument("--segments", type=int, default=3)
    p.add_argument("--kib", type=int, default=64)
    p.add_argument("--comm", default="")
    p = sub.add_parser("hold")
    for opt in ("map", "open", "flock", "ofd", "bind"):
        p.add_argument(f"--{opt}", action="append", default=[])
    p.add_argument("--cwd", default="")
    p.add_argument("--comm", default="")
    p = sub.add_parser("listen")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--comm", default="")
    p.add_argument("--title", default="")
    p.add_argument("--count", type=int, default=1)
    p.add_argument("--reuseport", action="store_true")
    p = sub.add_parser("time-wait")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--count", type=int, default=2)
    p = sub.add_parser("connected")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--comm", default="")
    p = sub.add_parser("zombies")
    p.add_argument("--count", type=int, default=3)
    p.add_argument("--comm", default="")
    p = sub.add_parser("creator")
    p.add_argument("--shm", default="/dev/shm")
    p.add_argument("--comm", default="")
    p = sub.add_parser("handoff")
    p.add_argument("--shm", default="/dev/shm")
    p.add_argument("--after-pid", type=int, default=0)
    p.add_argument("--comm", default="")
    p = sub.add_parser("server-files")
    p.add_argument("--shm", default="/dev/shm")
    p.add_argument("--tmp", required=True)
    p.add_argument("--cache", default="")
    p.add_argument("--uds", default="")
    p.add_argument("--comm", default="")
    p = sub.add_parser("init")
    p.add_argument("--tmpfs", action="append", default=[])
    p.add_argument("--lo-up", action="store_true")
    p.add_argument("--no-reap", action="store_true")
    p.add_argument("--ready-fd", type=int, required=True)
    args = parser.parse_args()
    {
        "job": job,
        "hold": hold,
        "listen": listen,
        "time-wait": time_wait,
        "connected": connected,
        "zombies": zombies,
        "creator": creator,
        "handoff": handoff,
        "server-files": server_files,
        "init": init,
    }[args.mode](args)


if __name__ == "__main__":
    main()
