"""The processes of a simulated SGLang or vLLM server, for gpusim.servers. Standard library only.

Each role is a real process, made and named the way the real server makes it (sources in
docs/simulator.md, "Server-shaped process trees"):

SGLang (``python3 -m sglang.launch_server``, python/sglang/srt/entrypoints/engine.py):

* the launcher: the tokenizer manager and the HTTP server in one process; listens on ``--port``,
  binds its ZMQ ``ipc://`` sockets (``tempfile.NamedTemporaryFile(delete=False).name``, unlinked and
  bound as libzmq does), attaches the load snapshot file, and with ``--tokenizer-worker-num`` > 1
  writes ``multi_tokenizer_args_<its pid>`` (``write_to_shared_memory``) and closes it;
* ``sglang::detokenizer``: its child, ``kill_itself_when_parent_died()`` (PR_SET_PDEATHSIG SIGKILL);
* ``sglang::data_parallel_controller`` when dp > 1: its child, also dying with it, which starts the
  schedulers;
* one ``sglang::scheduler_TP<k>`` (``sglang::scheduler_DP<d>_TP<k>`` when dp > 1) per GPU, each in a
  session of its own (``start_new_session``, sglang PR#31281): it makes its CUDA IPC segments
  (``torch_<pid>_<rand>_<n>``, torch's ref counter, held by nothing, and ``cuda.shm.0.<pid in
  hex>.<n>``, the driver's, held by its creator: both as the H200 showed, server-facts 2026-12-02);
  rank 0 of each TP group also makes the broadcast queue ``sgl_shm_mq_<pid>_<rand>``
  (``make_shm_name("mq")``, which the other ranks open), the load snapshot
  ``sglang_loads_<ipc name>_<blake2s>.shm`` (managers/load_snapshot.py), binds the scheduler's
  ``ipc://`` sockets, listens on the torch.distributed store port (derived from ``--port``, as
  SGLang's port plan does) and on the queue's ZMQ publisher port; then it *becomes* a CUDA process:
  it execs gpusim-worker for its GPU (the pid, session, open files and sockets stay), which holds
  the GPU's memory through the device files and tears down in the driver when it dies.

vLLM (``vllm serve``, vllm/entrypoints, vllm/v1/engine/core.py, vllm/v1/executor/multiproc_executor.py):

* the API server: listens on ``--port``, binds the engine's ``ipc://`` sockets (``/tmp/<uuid4>``),
  starts the engine core and exits when it dies ("EngineCore died unexpectedly");
* ``VLLM::EngineCore``: its child, in its session; makes the broadcast queue (``psm_<hex>``,
  ``multiprocessing.shared_memory``) and its ZMQ publisher port; starts the workers;
* ``VLLM::Worker_TP<k>``: its children, in the same session; each opens the broadcast queue, makes
  its response queue (``psm_<hex>``) and a CUDA IPC segment (custom all-reduce), rank 0 listens on
  the torch.distributed store port; then each becomes a CUDA process for its GPU (exec, as above).
  A worker does not die with the engine core: the orphaned workers of vllm#34643.

How each stops itself, as its source has it (round4-facts §1; the waits are the real ones unless a test shortens them
through the simulation's ``timing``):

* SGLang's launcher on SIGTERM: a watchdog that polls every 5 s notices it, sends ShutdownReq to every scheduler
  (here: a line on the scheduler's shutdown pipe; gpusim-worker ``--shutdown-fd``), waits up to 15 s for them to exit
  (a scheduler that gets it removes what its own teardown removes - its queue, its CUDA IPC segments, its sockets -
  and exits; its load snapshot stays, as SGLang never unlinks it), then SIGKILLs every descendant still there
  (kill_process_tree: the detokenizer, the resource tracker) and waits until they are reaped, closes its own sockets
  (libzmq unlinks a bound ipc path on close) and exits. Its schedulers, detokenizer and controller have no SIGTERM
  handler: a TERM to them is a raw crash.
* vLLM's API server on SIGTERM: TERMs the engine core, waits up to 5 s for it, SIGKILLs its tree if it is still
  there, closes its sockets and exits. The engine core on SIGTERM: tells its workers to stop (their death pipes), waits
  5 s, TERMs the rest, waits 4 s, SIGKILLs them, removes its queue and exits. A worker stops gracefully on its death
  pipe (its queue and IPC segment removed); a SIGTERM sent to it directly ends it at once (vLLM's worker would run its
  handler's teardown: not simulated, so such a stop leaves the raw crash's residue).
* Python's resource tracker of each server holds the names its spawn-context semaphores were registered under, and
  unlinks what is still registered when its last client is gone. (The servers' queues are not registered here:
  ``register`` does it for a test that wants them to be.)

Run as ``python -I _server_proc.py ROLE JSON`` (children) or through the ``sglang``/``vllm`` stubs
gpusim.servers writes (the launcher and the API server, so that their command lines are the real
ones). The launcher or API server prints one line, ``ready <json>`` (the tree, its residue, its
ports) or ``error <json>``, on stdout once every member is up (or one failed: then it ends the
members it started, as SGLang's launcher does, and exits 1).
"""

import argparse
import ctypes
import fcntl
import hashlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(os.path.dirname(HERE), "build", "bin", "gpusim-worker")
PR_SET_PDEATHSIG = 1
PR_SET_NAME = 15
READY_TIMEOUT = 60.0
KEEP = []  # everything open stays referenced until the process dies (or execs: then the fds stay)
LIBC = ctypes.CDLL(None, use_errno=True)
#: The servers' own waits (SGLang's watchdog poll and ShutdownReq wait; vLLM's process manager and engine core waits),
#: in seconds; the simulation's ``timing`` may shorten them for a test.
TIMING = {"sigterm_poll_s": 5.0, "scheduler_exit_s": 15.0, "reap_s": 60.0, "api_shutdown_s": 5.0, "worker_wait_s": 5.0, "worker_term_s": 4.0}


class Stopping(Exception):
    """SIGTERM arrived (a handler that raises: the process leaves whatever blocking call it was in)."""


def raise_on_term():
    def handler(_sig, _frame):
        raise Stopping()

    signal.signal(signal.SIGTERM, handler)


def timing(cfg, key):
    return float(cfg.get("timing", {}).get(key, TIMING[key]))


def alive(pid):
    """Whether ``pid`` still runs: a child of ours is reaped when it has exited; another one counts until it is a zombie."""
    try:
        done, _status = os.waitpid(pid, os.WNOHANG)
        if done == pid:
            return False
    except ChildProcessError:
        pass
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            return fh.read().rsplit(b")", 1)[1].split()[0] not in (b"Z", b"X")
    except (OSError, IndexError):
        return False


def wait_gone(pids, seconds):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.02)
    return [p for p in pids if alive(p)]


def descendants(root):
    """Every process below ``root`` (its children, theirs, ...), read from /proc."""
    parent = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat", "rb") as fh:
                    parent[int(name)] = int(fh.read().rsplit(b")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    out, todo = [], [root]
    while todo:
        p = todo.pop()
        kids = [c for c, pp in parent.items() if pp == p]
        out += kids
        todo += kids
    return out


def kill_process_tree(root, reap_s):
    """SGLang's kill_process_tree(include_parent=False, wait_timeout=...): SIGKILL every descendant, then wait until
    each is reaped (SIGKILL only queues a GPU process's teardown)."""
    pids = descendants(root)
    for p in pids:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
    wait_gone(pids, reap_s)


def register(cfg, name, rtype="shared_memory"):
    """Register ``name`` with the server's resource tracker, as multiprocessing.shared_memory (or a spawn-context
    semaphore) does from a spawned child, which inherits the tracker's pipe: only for the real /dev/shm."""
    if cfg.get("shm") != "/dev/shm" or cfg.get("tracker_fd") is None:
        return
    from multiprocessing import resource_tracker as rt

    rt._resource_tracker._fd = cfg["tracker_fd"]  # pylint: disable=protected-access
    rt.register(name, rtype)


class StartError(Exception):
    """A member could not start; the message says why, as the real server would."""


# ---------------------------------------------------------------------- process dressing
def set_title(title):
    """setproctitle: /proc/PID/cmdline reads exactly ``title``, comm its first 15 characters."""
    with open("/proc/self/stat", "rb") as fh:
        fields = fh.read().rsplit(b")", 1)[1].split()
    start, end = int(fields[45]), int(fields[46])  # arg_start, arg_end (stat fields 48 and 49)
    data = title.encode()[: end - start - 1]
    ctypes.memmove(start, data + b"\0" * (end - start - len(data)), end - start)
    LIBC.prctl(PR_SET_NAME, ctypes.c_char_p(title.encode()[:15]), 0, 0, 0)


def die_with_parent(parent):
    """SGLang's kill_itself_when_parent_died(): SIGKILL when the parent dies."""
    LIBC.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:  # it died before the prctl
        os._exit(1)


def keep(fd_or_obj):
    """Keep an fd (or socket) open, and open across the exec into gpusim-worker."""
    fd = fd_or_obj if isinstance(fd_or_obj, int) else fd_or_obj.fileno()
    os.set_inheritable(fd, True)
    KEEP.append(fd_or_obj)
    return fd_or_obj


# ---------------------------------------------------------------------- residue, made as the real code makes it
def segment(path, size, held):
    """A shared memory segment: open(O_CREAT|O_EXCL) as shm_open does, its pages reserved (a full
    /dev/shm fails here, ENOSPC, as the real start does), kept open by its creator or closed."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        if size:
            os.posix_fallocate(fd, 0, size)
    except OSError:
        os.close(fd)
        os.unlink(path)
        raise
    if held:
        keep(fd)
    else:
        os.close(fd)
    return path


def attach(path):
    """Open an existing segment by name (``SharedMemory(name=...)``): held while the process lives."""
    return keep(os.open(path, os.O_RDWR))


def ipc_name(tmp):
    """SGLang's ``ipc://{tempfile.NamedTemporaryFile(delete=False).name}``: the file is made, then
    libzmq's bind unlinks the path and binds a socket there."""
    with tempfile.NamedTemporaryFile(delete=False, dir=tmp) as named:
        return named.name


def bind_ipc(path):
    if os.path.lexists(path):
        os.unlink(path)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(path)
    s.listen(64)
    return keep(s)


def listen(port, what):
    """A TCP listener on 127.0.0.1 (SO_REUSEADDR, as uvicorn and torch's TCPStore set it); a port in
    use fails the start with the words the real servers print."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        s.bind(("127.0.0.1", port))
    except OSError as exc:
        s.close()
        raise StartError(f"{what} port {port} is used by a process already ({exc.strerror})") from None
    s.listen(128)
    keep(s)
    return s.getsockname()[1]


def loads_path(shm, ipc):
    """managers/load_snapshot.py shm_path_for(ipc_name)."""
    name = os.path.basename(ipc.rstrip("/")) or "default"
    safe = "".join(c if c.isalnum() or c in "._-" else "_" for c in name)
    digest = hashlib.blake2s(ipc.encode(), digest_size=4).hexdigest()
    return f"{shm}/sglang_loads_{safe}_{digest}.shm"


# ---------------------------------------------------------------------- children
def resource_tracker(tree, shm):
    """multiprocessing's resource tracker, as a spawn-context server starts it (``python -c 'from
    multiprocessing.resource_tracker import main;main(FD)'``, in the server's session and group), with the named
    semaphores of the server's queues (``sem.mp-*``) registered in it. It ignores SIGINT and SIGTERM, lives while
    any process holds its pipe (every member inherits it, as spawned children do) and unlinks what is still
    registered when the last one is gone: the H200's ``sem.mp-*`` vanished so (server-facts 2026-12-02)."""
    import multiprocessing
    from multiprocessing import resource_tracker as rt

    ctx = multiprocessing.get_context("spawn")
    locks = [ctx.Lock() for _unused in range(3)]  # SemLock(..., unlink=False) + register(name, "semaphore")
    KEEP.extend(locks)
    tree["shm"] += [f"{shm}/sem.{lock._semlock.name.lstrip('/')}" for lock in locks]  # pylint: disable=protected-access
    rt.ensure_running()
    tree["tracker"] = {"pid": rt._resource_tracker._pid}  # pylint: disable=protected-access
    return rt._resource_tracker._fd  # pylint: disable=protected-access


def spawn(role, cfg, new_session=False, log_dir=None):
    """Start a member: ``python -I _server_proc.py ROLE JSON`` with a pipe for its report lines (and the
    resource tracker's pipe, which a spawned child inherits, and its shutdown pipe when it has one)."""
    r, w = os.pipe()
    cfg = dict(cfg, report_fd=w, parent=os.getpid())
    log = open(os.path.join(log_dir, f"{cfg.get('title', role).replace(':', '_')}.log"), "ab") if log_dir else subprocess.DEVNULL  # noqa: SIM115
    fds = [w] + [cfg[k] for k in ("tracker_fd", "shutdown_fd") if cfg.get(k) is not None] + list(cfg.get("shutdown_fds", []))
    try:
        popen = subprocess.Popen(
            [sys.executable, "-I", os.path.abspath(__file__), role, json.dumps(cfg)],
            pass_fds=tuple(fds),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            start_new_session=new_session,
        )
    finally:
        os.close(w)
        if log is not subprocess.DEVNULL:
            log.close()
    return Member(popen, r, cfg.get("title", role))


class Member:
    """A started member: its report pipe read line by line."""

    def __init__(self, popen, fd, title):
        self.popen, self.fd, self.title = popen, fd, title
        self.buf = b""
        self.lines = []
        self.shutdown = None  # the write end of its shutdown pipe (a scheduler's ShutdownReq, a worker's death pipe)

    def ask_to_stop(self):
        if self.shutdown is not None:
            try:
                os.write(self.shutdown, b"shutdown\n")
            except OSError:
                pass  # it is gone

    def read_lines(self, count, deadline):
        while len(self.lines) < count:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.fd], [], [], left)[0]:
                raise StartError(f"{self.title} did not start within {READY_TIMEOUT:.0f} s")
            chunk = os.read(self.fd, 65536)
            if not chunk:
                try:
                    status = self.popen.wait(timeout=5)  # its pipe closes as it exits: its status follows
                except subprocess.TimeoutExpired:
                    status = None
                raise StartError(f"{self.title} exited during start-up (status {status}); see its log")
            self.buf += chunk
            while b"\n" in self.buf:
                line, self.buf = self.buf.split(b"\n", 1)
                self.lines.append(line.decode())
        return self.lines

    def report(self, deadline):
        """The member's report (a JSON line); an ``error`` line is its start failure."""
        line = self.read_lines(1, deadline)[0]
        word, _sep, payload = line.partition(" ")
        if word == "error":
            raise StartError(json.loads(payload)["error"])
        return json.loads(payload)

    def gpu_ready(self, deadline):
        """The second line, gpusim-worker's ``ready <pid>``: its contexts exist."""
        try:
            self.read_lines(2, deadline)
        except StartError as exc:
            # A worker the driver refused exits with status 3 (out of memory, lost GPU).
            if self.popen.poll() == 3 or "status 3" in str(exc):
                raise StartError(f"{self.title}: CUDA out of memory (the driver refused its context; another process holds the GPU)") from None
            raise

    def kill(self):
        try:
            self.popen.kill()
        except OSError:
            pass


def end(members):
    """kill_process_tree of what a failed start made."""
    for m in members:
        m.kill()
    for m in members:
        try:
            m.popen.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass


def report(cfg, payload, word="ready"):
    os.write(cfg["report_fd"], f"{word} {json.dumps(payload)}\n".encode())


def fail(cfg, message):
    try:
        report(cfg, {"error": message}, "error")
    finally:
        os._exit(1)


def become_gpu_process(cfg, title, unlink=(), graceful_term=False):
    """Exec gpusim-worker for this rank's GPU: same pid, session and open files; the worker reports
    ``ready <pid>`` on the report pipe once its context exists. ``unlink``: what its own teardown removes when it
    stops gracefully (on its shutdown pipe, or on SIGTERM with ``graceful_term``)."""
    argv = [WORKER, "--state", cfg["state"], "--gpu", str(cfg["gpu"]), "--mib", str(cfg["mib"]), "--title", title, "--ready-fd", str(cfg["report_fd"])]
    if cfg.get("shutdown_fd") is not None:
        os.set_inheritable(cfg["shutdown_fd"], True)
        argv += ["--shutdown-fd", str(cfg["shutdown_fd"])]
    if graceful_term:
        argv += ["--term-delay-ms", "0"]
    for path in unlink:
        argv += ["--unlink", path]
    os.set_inheritable(cfg["report_fd"], True)
    os.execv(WORKER, argv)


def shutdown_pipe(cfg):
    """A member's shutdown pipe: the read end goes to it (``shutdown_fd``), the write end stays here."""
    r, w = os.pipe2(os.O_CLOEXEC)
    return dict(cfg, shutdown_fd=r), w


def rank_residue(cfg, info, pid):
    """What every GPU rank makes before it becomes a CUDA process: its CUDA IPC segments."""
    shm = cfg["shm"]
    if cfg.get("torch_ipc", True):
        # torch's CUDA IPC ref counter (aten MapAllocator NewProcessWideShmHandle): "/torch_<pid>_<rand>_<n>";
        # held by no file descriptor while its creator lives (the H200, server-facts 2026-12-02).
        info["shm"].append(segment(f"{shm}/torch_{pid}_{int.from_bytes(os.urandom(4), 'little')}_1", 4096, held=False))
    # The CUDA driver's IPC segment, "cuda.shm.0.<creator pid in hex>.<n>", held by its creator (the H200).
    info["shm"].append(segment(f"{shm}/cuda.shm.0.{pid:x}.1", cfg["ipc_kib"] * 1024, held=True))


# ---------------------------------------------------------------------- SGLang
def sglang_scheduler(cfg):
    """A scheduler rank: its residue and ports, then exec into a CUDA process on its GPU."""
    pid = os.getpid()
    title = cfg["title"]
    info = {"pid": pid, "title": title, "gpu": cfg["gpu"], "shm": [], "sockets": [], "ports": {}}
    try:
        rank_residue(cfg, info, pid)
        if cfg["tp_rank"] == 0:
            # The TP group's broadcast queue (shm_broadcast.ShmRingBuffer, make_shm_name("mq")), its publisher port.
            info["mq"] = segment(f"{cfg['shm']}/sgl_shm_mq_{pid}_{uuid.uuid4().hex[:8]}", cfg["mq_kib"] * 1024, held=True)
            info["shm"].append(info["mq"])
            info["ports"]["zmq"] = listen(0, "the broadcast queue's publisher")
            loads = loads_path(cfg["shm"], cfg["scheduler_ipc"])
            # LoadSnapshotWriter: open(O_CREAT | O_RDWR), ftruncate, mmap; one slot per dp rank.
            fd = os.open(loads, os.O_CREAT | os.O_RDWR, 0o600)
            os.ftruncate(fd, 4096)
            keep(fd)
            info["loads"] = loads
            if cfg["dp_rank"] == 0:
                info["shm"].append(loads)
                # The scheduler's own sockets: requests from the tokenizer, RPCs.
                for name in ("scheduler_ipc", "rpc_ipc"):
                    bind_ipc(cfg[name])
                    info["sockets"].append(cfg[name])
            if cfg.get("store_port") is not None:
                info["ports"]["store"] = listen(cfg["store_port"], "the torch.distributed store (nccl_port)")
        else:
            attach(cfg["mq"])
    except StartError as exc:
        fail(cfg, f"{title}: {exc}")
    except OSError as exc:
        fail(cfg, f"{title}: {exc.strerror or exc} creating its queues in {cfg['shm']}")
    report(cfg, info)
    # On ShutdownReq its run_scheduler_process returns and the process exits: its queue (the creator unlinks it), its
    # CUDA IPC segments and its bound sockets go; the load snapshot stays (load_snapshot.py never unlinks it).
    own = [p for p in info["shm"] if p != info.get("loads")] + list(info["sockets"])
    become_gpu_process(cfg, title, unlink=own)


def start_schedulers(cfg, dp_ranks, members, deadline):
    """The schedulers of the given dp ranks, rank 0 of each TP group first (the others open its queue)."""
    out = []
    for d in dp_ranks:
        group = []
        for t in range(cfg["tp"]):
            title = f"sglang::scheduler_DP{d}_TP{t}" if cfg["dp"] > 1 else f"sglang::scheduler_TP{t}"
            sc = dict(cfg, title=title, gpu=d * cfg["tp"] + t, tp_rank=t, dp_rank=d)
            sc["store_port"] = cfg["store_port"] if d == 0 else None
            if t > 0:
                sc["mq"] = group[0][1]["mq"]
            sc, stop = shutdown_pipe(sc)
            try:
                m = spawn("sglang-scheduler", sc, new_session=True, log_dir=cfg["log_dir"])
            finally:
                os.close(sc["shutdown_fd"])
            m.shutdown = stop
            members.append(m)
            group.append((m, m.report(deadline) if t == 0 else None))
        for i, (m, info) in enumerate(group):
            if info is None:
                group[i] = (m, m.report(deadline))
        out.extend(group)
    for m, _info in out:
        m.gpu_ready(deadline)
    return [info for _m, info in out]


def sglang_dp_controller(cfg):
    die_with_parent(cfg["parent"])
    set_title("sglang::data_parallel_controller")
    members = []
    deadline = time.monotonic() + READY_TIMEOUT
    relay = cfg.pop("shutdown_fd", None)
    try:
        infos = start_schedulers(cfg, range(cfg["dp"]), members, deadline)
    except StartError as exc:
        end(members)
        fail(cfg, str(exc))
    report(cfg, {"pid": os.getpid(), "title": "sglang::data_parallel_controller", "schedulers": infos})
    # It forwards the tokenizer manager's ShutdownReq to its schedulers.
    while relay is not None:
        if os.read(relay, 64):
            for m in members:
                m.ask_to_stop()
        else:
            relay = None
    idle()


def sglang_detokenizer(cfg):
    die_with_parent(cfg["parent"])
    set_title("sglang::detokenizer")
    try:
        bind_ipc(cfg["detokenizer_ipc"])
    except OSError as exc:
        fail(cfg, f"sglang::detokenizer: {exc.strerror or exc}")
    report(cfg, {"pid": os.getpid(), "title": "sglang::detokenizer", "sockets": [cfg["detokenizer_ipc"]]})
    idle()


def sglang_launcher(argv):
    p = argparse.ArgumentParser(prog="sglang.launch_server")
    p.add_argument("--model-path", default="/models/Qwen3-235B")
    p.add_argument("--tp-size", type=int, default=1)
    p.add_argument("--dp-size", type=int, default=1)
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--nccl-port", type=int, default=None)
    p.add_argument("--tokenizer-worker-num", type=int, default=1)
    args = p.parse_args(argv)
    cfg = simulation()
    cfg.update(tp=args.tp_size, dp=args.dp_size, report_fd=1)
    pid = os.getpid()
    members = []
    deadline = time.monotonic() + READY_TIMEOUT
    tree = {"launcher": {"pid": pid, "sid": os.getsid(0)}, "members": [], "shm": [], "sockets": [], "ports": {}}
    try:
        tree["ports"]["http"] = listen(args.port, "the HTTP server's")
        cfg["store_port"] = args.nccl_port if args.nccl_port is not None else args.port + 1
        # The port plan is checked before anything starts (a survivor of the last run holds it: sglang PR#31645).
        if cfg["store_port"]:
            probe = socket.socket()
            try:
                probe.bind(("127.0.0.1", cfg["store_port"]))
            except OSError as exc:
                raise StartError(f"the torch.distributed store (nccl_port) port {cfg['store_port']} is used by a process already ({exc.strerror})") from None
            finally:
                probe.close()
        # PortArgs: every ZMQ endpoint an ipc:// name of its own.
        for name in ("tokenizer_ipc", "scheduler_ipc", "detokenizer_ipc", "rpc_ipc", "metrics_ipc"):
            cfg[name] = ipc_name(cfg["tmp"])
        for name in ("tokenizer_ipc", "metrics_ipc"):
            bind_ipc(cfg[name])
            tree["sockets"].append(cfg[name])
        if args.tokenizer_worker_num > 1:
            # write_data_for_multi_tokenizer: SharedMemory(create=True, name=f"multi_tokenizer_args_{pid}"), then close().
            tree["shm"].append(segment(f"{cfg['shm']}/multi_tokenizer_args_{pid}", 4096, held=False))
        cfg["tracker_fd"] = resource_tracker(tree, cfg["shm"])
        detok = spawn("sglang-detokenizer", cfg, log_dir=cfg["log_dir"])
        members.append(detok)
        info = detok.report(deadline)
        tree["members"].append({"role": "detokenizer", "pid": info["pid"], "title": info["title"]})
        tree["sockets"] += info["sockets"]
        if args.dp_size > 1:
            ctl_cfg, ctl_stop = shutdown_pipe(cfg)
            try:
                ctl = spawn("sglang-dp-controller", ctl_cfg, log_dir=cfg["log_dir"])
            finally:
                os.close(ctl_cfg["shutdown_fd"])
            ctl.shutdown = ctl_stop
            members.append(ctl)
            info = ctl.report(deadline)
            tree["members"].append({"role": "data_parallel_controller", "pid": info["pid"], "title": info["title"]})
            schedulers = info["schedulers"]
        else:
            schedulers = start_schedulers(cfg, [0], members, deadline)
        for s in schedulers:
            tree["members"].append({"role": "scheduler", "pid": s["pid"], "title": s["title"], "gpu": s["gpu"]})
            tree["shm"] += s["shm"]
            tree["sockets"] += s["sockets"]
            for key, port in s["ports"].items():
                tree["ports"].setdefault(key, port)
        # The tokenizer manager reads the load snapshot.
        loads = next(s["loads"] for s in schedulers if "loads" in s)
        attach(loads)
        flag = []
        signal.signal(signal.SIGTERM, lambda _sig, _frame: flag.append(1))  # SignalHandler.sigterm_handler
    except StartError as exc:
        end(members)
        print(f"error {json.dumps({'error': str(exc) if members else f'sglang.launch_server: {exc}'})}", flush=True)
        sys.exit(1)
    except OSError as exc:
        end(members)
        print(f"error {json.dumps({'error': f'sglang.launch_server: {exc.strerror or exc}'})}", flush=True)
        sys.exit(1)
    ready(tree)
    sglang_stop(cfg, flag, members, [s["pid"] for s in schedulers], [cfg["tokenizer_ipc"], cfg["metrics_ipc"]])


def sglang_stop(cfg, flag, members, schedulers, sockets):
    """The launcher's own stop (tokenizer_manager.py sigterm_watchdog): notice SIGTERM on the next 5 s poll, send
    ShutdownReq, wait up to 15 s for the schedulers, kill what is left of the tree and wait for it to be reaped,
    close its sockets and exit."""
    while not flag:
        time.sleep(timing(cfg, "sigterm_poll_s"))  # asyncio.sleep(5): a signal does not cut it short
    for m in members:
        m.ask_to_stop()  # ShutdownReq (the dp controller forwards it)
    wait_gone(schedulers, timing(cfg, "scheduler_exit_s"))
    kill_process_tree(os.getpid(), timing(cfg, "reap_s"))
    for path in sockets:
        try:
            os.unlink(path)  # libzmq removes a bound ipc path when the socket closes
        except FileNotFoundError:
            pass
    os._exit(0)


# ---------------------------------------------------------------------- vLLM
def vllm_worker(cfg):
    pid = os.getpid()
    title = f"VLLM::Worker_TP{cfg['tp_rank']}"
    info = {"pid": pid, "title": title, "gpu": cfg["gpu"], "shm": [], "ports": {}}
    try:
        attach(cfg["mq"])  # the engine's broadcast queue, as a reader
        # Its response queue: MessageQueue -> ShmRingBuffer -> SharedMemory(create=True): "psm_<hex>".
        info["shm"].append(segment(f"{cfg['shm']}/psm_{os.urandom(4).hex()}", cfg["mq_kib"] * 1024, held=True))
        rank_residue(dict(cfg, torch_ipc=False), info, pid)
        if cfg["tp_rank"] == 0:
            info["ports"]["store"] = listen(cfg["store_port"], "the torch.distributed store (distributed_init_method)")
    except StartError as exc:
        fail(cfg, f"{title}: {exc}")
    except OSError as exc:
        fail(cfg, f"{title}: {exc.strerror or exc} creating its queues in {cfg['shm']}")
    report(cfg, info)
    # Its death pipe closed by a stopping engine core: it stops gracefully, its queue (the creator unlinks it) and IPC
    # segment removed. A SIGTERM sent to it directly ends it at once here (its handler's teardown is not simulated: the
    # residue of such a stop is the raw crash's, the most a stop can leave).
    become_gpu_process(cfg, title, unlink=info["shm"])


def vllm_engine_core(cfg):
    set_title("VLLM::EngineCore")
    pid = os.getpid()
    info = {"pid": pid, "title": "VLLM::EngineCore", "shm": [], "ports": {}, "workers": []}
    members = []
    deadline = time.monotonic() + READY_TIMEOUT
    try:
        # rpc_broadcast_mq: the scheduler output to every worker.
        cfg["mq"] = segment(f"{cfg['shm']}/psm_{os.urandom(4).hex()}", cfg["mq_kib"] * 1024, held=True)
        info["shm"].append(cfg["mq"])
        info["ports"]["zmq"] = listen(0, "the broadcast queue's publisher")
        raise_on_term()  # EngineCore's signal handler (raises SystemExit in the busy loop)
        for t in range(cfg["tp"]):
            wc, death = shutdown_pipe(dict(cfg, title=f"VLLM::Worker_TP{t}", gpu=t, tp_rank=t))
            try:
                m = spawn("vllm-worker", wc, log_dir=cfg["log_dir"])
            finally:
                os.close(wc["shutdown_fd"])
            m.shutdown = death
            members.append(m)
        for m in members:
            info["workers"].append(m.report(deadline))
        for m in members:
            m.gpu_ready(deadline)
    except StartError as exc:
        end(members)
        fail(cfg, str(exc))
    except OSError as exc:
        end(members)
        fail(cfg, f"VLLM::EngineCore: {exc.strerror or exc}")
    report(cfg, info)
    try:
        idle()
    except Stopping:
        pass
    # Its own stop (multiproc_executor.py shutdown): the workers' death pipes, 5 s, TERM, 4 s, KILL; then its queue.
    for m in members:
        m.ask_to_stop()
    left = wait_gone([m.popen.pid for m in members], timing(cfg, "worker_wait_s"))
    for pid in left:
        os.kill(pid, signal.SIGTERM)
    left = wait_gone(left, timing(cfg, "worker_term_s"))
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    try:
        os.unlink(cfg["mq"])  # ShmRingBuffer's creator unlinks its segment
    except FileNotFoundError:
        pass
    os._exit(0)


def vllm_api_server(argv):
    p = argparse.ArgumentParser(prog="vllm")
    p.add_argument("command", choices=["serve"])
    p.add_argument("model")
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--port", type=int, default=8000)
    args = p.parse_args(argv)
    cfg = simulation()
    cfg.update(tp=args.tensor_parallel_size, report_fd=1)
    members = []
    deadline = time.monotonic() + READY_TIMEOUT
    tree = {"launcher": {"pid": os.getpid(), "sid": os.getsid(0)}, "members": [], "shm": [], "sockets": [], "ports": {}}
    try:
        tree["ports"]["http"] = listen(args.port, "the API server's")
        # get_open_zmq_ipc_path(): ipc://{VLLM_RPC_BASE_PATH}/{uuid4()}, bound by the client.
        for _unused in range(2):
            path = f"{cfg['tmp']}/{uuid.uuid4()}"
            bind_ipc(path)
            tree["sockets"].append(path)
        cfg["store_port"] = cfg.get("store_port") or free_port()
        cfg["tracker_fd"] = resource_tracker(tree, cfg["shm"])
        core = spawn("vllm-engine-core", cfg, log_dir=cfg["log_dir"])
        members.append(core)
        info = core.report(deadline)
    except StartError as exc:
        end(members)
        print(f"error {json.dumps({'error': str(exc)})}", flush=True)
        sys.exit(1)
    tree["members"].append({"role": "engine_core", "pid": info["pid"], "title": info["title"]})
    tree["shm"] += info["shm"]
    tree["ports"].update(info["ports"])
    for w in info["workers"]:
        tree["members"].append({"role": "worker", "pid": w["pid"], "title": w["title"], "gpu": w["gpu"]})
        tree["shm"] += w["shm"]
        tree["ports"].update(w["ports"])
    ready(tree)
    raise_on_term()  # uvicorn's and the API server's SIGTERM handling
    # The API server's engine monitor: when the engine core dies, the server shuts down.
    try:
        while True:
            try:
                os.waitpid(core.popen.pid, 0)
            except InterruptedError:
                continue
            except ChildProcessError:
                pass
            os._exit(1)
    except Stopping:
        pass
    # Its own stop (engine_client.shutdown, v1/utils.py shutdown): TERM the engine core, join it up to the process
    # manager's window, kill its tree if it is still there; then close its sockets.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        os.kill(core.popen.pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    if wait_gone([core.popen.pid], timing(cfg, "api_shutdown_s")):
        kill_process_tree(core.popen.pid, timing(cfg, "reap_s"))
        try:
            os.kill(core.popen.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        wait_gone([core.popen.pid], timing(cfg, "reap_s"))
    for path in tree["sockets"]:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
    os._exit(0)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------- common
def simulation():
    """What the simulation needs besides the real options (state directory, GPU memory per rank,
    where /dev/shm and the temp directory are, sizes, the log directory): the GPUSIM_SERVER
    variable, taken out of the environment so that the members do not inherit it."""
    return json.loads(os.environ.pop("GPUSIM_SERVER"))


def ready(tree):
    sys.stdout.write(f"ready {json.dumps(tree)}\n")
    sys.stdout.flush()
    # Detach from the pipe: whoever reads the ready line may go away.
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 1)


def idle():
    while True:
        signal.pause()


CHILDREN = {
    "sglang-scheduler": sglang_scheduler,
    "sglang-detokenizer": sglang_detokenizer,
    "sglang-dp-controller": sglang_dp_controller,
    "vllm-engine-core": vllm_engine_core,
    "vllm-worker": vllm_worker,
}


def main(program=None):
    """``main("sglang")`` / ``main("vllm")`` from the stubs, else ``ROLE JSON``."""
    if program == "sglang":
        sglang_launcher(sys.argv[1:])
    elif program == "vllm":
        vllm_api_server(sys.argv[1:])
    else:
        cfg = json.loads(sys.argv[2])
        fcntl.fcntl(cfg["report_fd"], fcntl.F_SETFD, fcntl.FD_CLOEXEC)  # not inherited by its own children
        CHILDREN[sys.argv[1]](cfg)


if __name__ == "__main__":
    main()
