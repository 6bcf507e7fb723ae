"""Server-shaped process trees on a simulated node: SGLang and vLLM as their source makes them.

``start_sglang`` and ``start_vllm`` start a real process tree (``_server_proc.py``): the same roles,
names, sessions, parents, ports, ZMQ sockets and shared memory segments as the real servers, and
ranks that are CUDA processes of the simulated driver (gpusim-worker after an exec), which tear
down in the driver as the H200 measured. ``crash()`` ends a server the way the seeds' did:

* SGLang: the launcher is SIGKILLed; its detokenizer (and data-parallel controller) die with it
  (PR_SET_PDEATHSIG), the schedulers, each in a session of its own, are reparented to PID 1 (or a
  subreaper) and keep their GPU memory, their store port and their queues (sglang#23627, PR#31645);
* vLLM: the engine core is SIGKILLed (the OOM killer's choice); the API server exits when it sees
  that, the workers are reparented and keep their GPUs (vllm#34643). ``crash("api_server")``: the API server
  is SIGKILLed (or OOM-killed) instead; the engine core has no parent-death detection (vLLM 0.34), so it and
  its workers stay, reparented, on the GPUs (vllm#55510): the port frees and the next start meets CUDA OOM.

Each also stops itself as its source does when its root gets SIGTERM (_server_proc.py says how: SGLang's
launcher sends ShutdownReq and kills the rest of its tree, vLLM's API server has its engine core stop its
workers); ``timing`` shortens the servers' own waits for a test (their real values by default: SGLang's
watchdog polls every 5 s, ``sigterm_poll_s``; it waits 15 s for its schedulers, ``scheduler_exit_s``; vLLM's
process manager waits 5 s, ``api_shutdown_s``, its engine core 5 s then 4 s, ``worker_wait_s``,
``worker_term_s``).

    sb = node.sandbox(); private_shm(sb)
    srv = start_sglang(node, sandbox=sb, tp=8, port=30000)      # ServerStartError if it cannot start
    srv.crash()
    srv.residue()                # {"shm": [...], "sockets": [...]} of the tree, as paths inside the sandbox
    start_sglang(node, sandbox=sb, tp=8, port=30000)            # the next start: fails while that is there

See docs/simulator.md, "Server-shaped process trees".
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
import types
import typing as t
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import paths
from .procfs import PidHandle, find_in_namespace

if TYPE_CHECKING:
    from .node import Node
    from .sandbox import Sandbox

PROC = Path(__file__).resolve().parent / "_server_proc.py"
STUBS = paths.BUILD_DIR / "server-bin"  #: the sglang package and vllm script stubs (every sandbox sees the build directory)
READY_TIMEOUT = 90.0
#: A SIGKILLed torch worker's memory is back 0.12-0.15 s after the signal with 40 GiB, 0.22 s with 120 GiB
#: (H200, docs/results/server-facts-h200x1-2026-12-02.json): 85 ms plus 1.1 ms per GiB fits both.
H200_TEARDOWN: t.Mapping[str, float] = types.MappingProxyType({"delay_ms": 85, "per_gib_ms": 1.1})


class ServerStartError(RuntimeError):
    """The server did not start; the message is the member's own (out of memory, port in use, ENOSPC)."""


@dataclass
class Member:
    """One process of the tree: ``pid`` in the caller's namespace, ``ns_pid`` as it sees itself."""

    role: str  #: launcher, detokenizer, data_parallel_controller, scheduler, api_server, engine_core, worker
    title: str  #: its full name (cmdline), e.g. sglang::scheduler_TP3
    pid: int
    ns_pid: int
    gpu: int | None = None
    handle: PidHandle | None = field(default=None, repr=False)

    def alive(self) -> bool:
        return self.handle is not None and self.handle.alive()


class Server:
    """A started server tree (see the module docstring)."""

    def __init__(self, kind: str, node: Node, sandbox: Sandbox | None, popen: subprocess.Popen[bytes], tree: dict[str, Any]) -> None:
        self.kind = kind
        self.node = node
        self.sandbox = sandbox
        self.popen = popen
        self.tree = tree
        self.ports: dict[str, int] = tree["ports"]
        self.shm: list[str] = tree["shm"]
        self.sockets: list[str] = tree["sockets"]
        launcher_role = "launcher" if kind == "sglang" else "api_server"
        self.members = [self._member(launcher_role, "", tree["launcher"]["pid"])]
        self.members += [self._member(m["role"], m["title"], m["pid"], m.get("gpu")) for m in tree["members"]]
        if "tracker" in tree:
            self.members.append(self._member("resource_tracker", "", tree["tracker"]["pid"]))
        for m in self.members:
            if not m.title:
                try:
                    with open(f"/proc/{m.pid}/cmdline", "rb") as fh:
                        m.title = fh.read().rstrip(b"\0").replace(b"\0", b" ").decode()
                except OSError:
                    pass

    def _member(self, role: str, title: str, ns_pid: int, gpu: int | None = None) -> Member:
        pid = ns_pid if self.sandbox is None else (find_in_namespace(self.sandbox.ns_inode, ns_pid) or 0)
        return Member(role, title, pid, ns_pid, gpu, PidHandle(pid) if pid else None)

    def __repr__(self) -> str:
        return f"<Server {self.kind} {[(m.title, m.pid) for m in self.members]}>"

    # ------------------------------------------------------------ members
    def role(self, role: str) -> list[Member]:
        return [m for m in self.members if m.role == role]

    @property
    def launcher(self) -> Member:
        return self.members[0]

    @property
    def ranks(self) -> list[Member]:
        """The GPU processes: SGLang's schedulers, vLLM's workers."""
        return [m for m in self.members if m.gpu is not None]

    def alive(self) -> list[Member]:
        return [m for m in self.members if m.alive()]

    def residue(self) -> dict[str, list[str]]:
        """What the tree made in /dev/shm and the temp directory, as the server's namespace sees the paths."""
        return {"shm": list(self.shm), "sockets": list(self.sockets)}

    def path(self, path: str) -> Path:
        """A path of the server's mount namespace, as the caller reaches it."""
        if self.sandbox is None:
            return Path(path)
        return Path(f"/proc/{self.sandbox.init_pid}/root") / path.lstrip("/")

    # ------------------------------------------------------------ ending it
    def crash(self, which: str | None = None, timeout: float = 10.0) -> list[Member]:
        """End the server as the seeds' servers ended (module docstring): ``which`` member is SIGKILLed (SGLang: the
        launcher; vLLM: ``engine_core`` by default, or ``api_server``); returns the survivors."""
        role = which or ("launcher" if self.kind == "sglang" else "engine_core")
        first = self.launcher if role in ("launcher", "api_server") else self.role(role)[0]
        assert first.handle is not None
        first.handle.signal(signal.SIGKILL)
        first.handle.wait_exit(timeout)
        # What dies with it (PR_SET_PDEATHSIG, or the API server's engine monitor) is gone once this returns.
        dies = ("detokenizer", "data_parallel_controller") if self.kind == "sglang" else ("api_server",) if role == "engine_core" else ()
        deadline = time.monotonic() + timeout
        for m in self.members:
            if m.role in dies and m.handle is not None:
                m.handle.wait_exit(max(0.0, deadline - time.monotonic()))
        self._reap()
        return self.alive()

    def stop(self) -> None:
        """SIGKILL every member still alive (test cleanup), the driver's teardown paused meanwhile."""
        with self.node.teardown_paused():
            for m in self.members:
                if m.handle is not None:
                    m.handle.signal(signal.SIGKILL)
            for m in self.members:
                if m.handle is not None:
                    m.handle.wait_exit(5.0)
        self._reap()
        for m in self.members:
            if m.handle is not None:
                m.handle.close()

    def _reap(self) -> None:
        if self.popen.poll() is None and self.popen.pid == self.launcher.pid:
            try:
                self.popen.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass


# ---------------------------------------------------------------------- starting
def _stubs() -> Path:
    """``sglang/launch_server.py`` and ``bin/vllm``: the real command lines, running _server_proc.py."""
    loader = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('gpusim_server_proc', {str(PROC)!r})\n"
        "proc = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(proc)\n"
    )
    files = {
        STUBS / "sglang" / "__init__.py": "",
        STUBS / "sglang" / "launch_server.py": loader + "proc.main('sglang')\n",
        STUBS / "bin" / "vllm": f"#!{sys.executable}\n" + loader + "sys.argv[0] = 'vllm'\nproc.main('vllm')\n",
    }
    for path, text in files.items():
        if not path.exists() or path.read_text() != text:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.{os.getpid()}")
            tmp.write_text(text)
            tmp.chmod(0o755)
            os.replace(tmp, path)
    return STUBS


def _start(kind: str, node: Node, sandbox: Sandbox | None, argv: list[str], sim: dict[str, Any]) -> Server:
    stubs = _stubs()
    env = {"GPUSIM_SERVER": json.dumps(sim), "PYTHONPATH": str(stubs)}
    # The launcher's stderr (and its resource tracker's: "leaked semaphore objects") goes to its log.
    with open(Path(sim["log_dir"]) / f"{kind}.log", "ab") as log:
        if sandbox is not None:
            popen = sandbox.spawn_detached(argv, env=env, stdout=subprocess.PIPE, stderr=log, stdin=subprocess.DEVNULL)
        else:
            from .node import merge_env

            popen = subprocess.Popen(
                argv, env=merge_env(os.environ, node.env(), env), stdout=subprocess.PIPE, stderr=log, stdin=subprocess.DEVNULL, start_new_session=True
            )
    assert popen.stdout is not None
    deadline = time.monotonic() + READY_TIMEOUT
    line = b""
    try:
        while not line.endswith(b"\n"):
            if not select.select([popen.stdout], [], [], max(0.0, deadline - time.monotonic()))[0]:
                raise ServerStartError(f"{kind} did not start within {READY_TIMEOUT:.0f} s")
            chunk = os.read(popen.stdout.fileno(), 65536)
            if not chunk:
                raise ServerStartError(f"{kind} exited before it was ready (status {popen.wait()})")
            line += chunk
    finally:
        popen.stdout.close()
    if sandbox is not None:
        popen.wait(timeout=10)  # the nsenter (and setsid -f) that started it; the launcher itself lives on
    word, _sep, payload = line.decode().strip().partition(" ")
    if word != "ready":
        raise ServerStartError(json.loads(payload)["error"])
    return Server(kind, node, sandbox, popen, json.loads(payload))


def _sim(
    node: Node,
    sandbox: Sandbox | None,
    mib: int,
    shm: str,
    tmp: str,
    mq_kib: int,
    ipc_kib: int,
    teardown: t.Mapping[str, float] | None,
    timing: t.Mapping[str, float] | None = None,
) -> dict[str, Any]:
    if teardown is not None:
        node.set_release_timing(**teardown)
    log_dir = Path(tempfile.mkdtemp(prefix="server-", dir=node.state_dir / "log"))
    log_dir.chmod(0o777)
    return {
        "state": str(node.state_dir),
        "mib": int(mib),
        "shm": shm,
        "tmp": tmp,
        "log_dir": str(log_dir),
        "mq_kib": int(mq_kib),
        "ipc_kib": int(ipc_kib),
        "timing": dict(timing or {}),
    }


def start_sglang(
    node: Node,
    sandbox: Sandbox | None = None,
    tp: int = 8,
    dp: int = 1,
    port: int = 30000,
    *,
    nccl_port: int | None = None,
    mib: int = 100000,
    tokenizer_workers: int = 1,
    model: str = "/models/Qwen3-235B-A22B",
    shm: str = "/dev/shm",
    tmp: str = "/tmp",
    mq_kib: int = 1024,
    ipc_kib: int = 64,
    teardown: t.Mapping[str, float] | None = H200_TEARDOWN,
    timing: t.Mapping[str, float] | None = None,
) -> Server:
    """``python3 -m sglang.launch_server --model-path MODEL --tp-size TP [--dp-size DP] --port PORT``: tp x dp
    schedulers on GPUs 0.., each holding ``mib``; the torch.distributed store on ``nccl_port`` (default
    ``port + 1``: SGLang derives its port plan from ``--port``, so the next start wants the same ports).
    ``teardown`` sets the node's release timing (the H200's by default; None leaves it). Raises
    :class:`ServerStartError` with the failing member's words."""
    argv = [sys.executable, "-m", "sglang.launch_server", "--model-path", model, "--tp-size", str(tp)]
    if dp > 1:
        argv += ["--dp-size", str(dp)]
    argv += ["--port", str(port)]
    if nccl_port is not None:
        argv += ["--nccl-port", str(nccl_port)]
    if tokenizer_workers > 1:
        argv += ["--tokenizer-worker-num", str(tokenizer_workers)]
    return _start("sglang", node, sandbox, argv, _sim(node, sandbox, mib, shm, tmp, mq_kib, ipc_kib, teardown, timing))


def start_vllm(
    node: Node,
    sandbox: Sandbox | None = None,
    tp: int = 8,
    port: int = 8000,
    *,
    mib: int = 129000,
    model: str = "/models/Llama-3.1-405B-FP8",
    shm: str = "/dev/shm",
    tmp: str = "/tmp",
    mq_kib: int = 1024,
    ipc_kib: int = 64,
    teardown: t.Mapping[str, float] | None = H200_TEARDOWN,
    timing: t.Mapping[str, float] | None = None,
) -> Server:
    """``vllm serve MODEL --tensor-parallel-size TP --port PORT``: an API server, ``VLLM::EngineCore`` and
    ``VLLM::Worker_TP<k>`` on GPUs 0..tp-1, each holding ``mib`` (gpu_memory_utilization 0.9 of an H200)."""
    argv = [sys.executable, str(_stubs() / "bin" / "vllm"), "serve", model, "--tensor-parallel-size", str(tp), "--port", str(port)]
    return _start("vllm", node, sandbox, argv, _sim(node, sandbox, mib, shm, tmp, mq_kib, ipc_kib, teardown, timing))


__all__ = ["H200_TEARDOWN", "Member", "Server", "ServerStartError", "start_sglang", "start_vllm"]
