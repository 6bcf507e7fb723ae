"""Real residue of dead GPU jobs on a simulated node: shared memory segments, semaphores, ZMQ-style unix
sockets, JIT compile locks, torchelastic directories, TCP listeners and TIME_WAIT sockets, zombies.

Everything is made by real processes (``_residue_job.py``) the way the real software makes it, inside
a gpusim :class:`~gpusim.Sandbox` or a residue :class:`Container`; killing a job orphans what it made.
Nothing here touches the machine's own ``/dev/shm`` or ``/tmp``: a sandbox gets a tmpfs of its own on
``/dev/shm`` (:func:`private_shm`), a container gets tmpfs on ``/dev/shm`` and ``/tmp`` and its own
network namespace, and other paths are test-owned directories passed as options.

    sb = node.sandbox(); private_shm(sb)
    dead = spawn(sb, "job", "--tmp", work, "--cache", cache)   # .info: the paths it made
    dead.kill()                                                 # now they are orphans
    daemon = spawn(sb, "hold", "--comm", "nv-hostengine", "--map", dead.info["shm"][0])

    with Container(vmid=129, registry=reg) as ct:               # own PID, mount and net namespaces
        ct.spawn("listen", "--port", "30000", "--comm", "sglang::schedul")
        ct.spawn("time-wait", "--port", "8000")
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Sequence

from .procfs import PidHandle, children, find_in_namespace, pidns_inode

JOB = Path(__file__).resolve().parent / "_residue_job.py"
READY_TIMEOUT = 20.0


class ResidueProc:
    """A residue process: ``pid`` in the caller's namespace, ``ns_pid`` as it sees itself, ``info`` from its ready line."""

    def __init__(self, popen: subprocess.Popen[bytes], pid: int, ns_pid: int, info: dict[str, Any]) -> None:
        self.popen = popen
        self.pid = pid
        self.ns_pid = ns_pid
        self.info = info
        self.handle = PidHandle(pid)

    def __repr__(self) -> str:
        return f"<ResidueProc pid={self.pid} info={self.info}>"

    def alive(self) -> bool:
        return self.handle.alive()

    def kill(self, sig: int = signal.SIGKILL, wait: float = 5.0) -> None:
        """Signal it (through its pidfd) and wait until it is gone, as a SIGKILLed job is."""
        self.handle.signal(sig)
        self.handle.wait_exit(wait)
        if self.popen.pid == self.pid and self.popen.returncode is None:
            try:
                self.popen.wait(timeout=wait)
            except subprocess.TimeoutExpired:
                pass


# Where copies of the job script live under a daemon's name (see _script): the build directory, which
# every sandbox sees (their private tmpfs cover /tmp and /dev/shm only).
DAEMON_BIN = JOB.parent.parent / "build" / "residue-bin"


def _script(args: Sequence[Any]) -> Path:
    """The script to run: the job itself, or, with ``--comm NAME``, a copy of it named NAME.

    The collection recognises a protected daemon by what it is (its executable, or for an interpreter the
    script it runs), never by the name a process gives itself; a stand-in for ``nv-hostengine`` must
    therefore *be* a program called nv-hostengine, as the real one is, not just call itself that.
    """
    words = [str(a) for a in args]
    if "--comm" not in words:
        return JOB
    name = words[words.index("--comm") + 1]
    if not name or "/" in name:
        return JOB
    DAEMON_BIN.mkdir(parents=True, exist_ok=True)
    target = DAEMON_BIN / name
    if not target.exists() or target.read_bytes() != JOB.read_bytes():
        tmp = DAEMON_BIN / f".{name}.{os.getpid()}"
        tmp.write_bytes(JOB.read_bytes())
        os.replace(tmp, target)
    return target


def start(mode: str, *args: Any, prefix: Sequence[str] = (), ns_inode: int | None = None, env: dict[str, str] | None = None) -> ResidueProc:
    """Run ``_residue_job.py MODE ARGS`` (after ``prefix``, e.g. an nsenter) and wait for its ready line."""
    argv = [*prefix, sys.executable, "-I", str(_script(args)), mode, *(str(a) for a in args)]
    popen = subprocess.Popen(argv, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, env=env, start_new_session=not prefix)
    assert popen.stdout is not None
    deadline = time.monotonic() + READY_TIMEOUT
    line = b""
    while not line.endswith(b"\n"):
        ready, _unused, _unused = select.select([popen.stdout], [], [], max(0.0, deadline - time.monotonic()))
        if not ready:
            popen.kill()
            raise RuntimeError(f"residue {mode} not ready after {READY_TIMEOUT} s")
        chunk = os.read(popen.stdout.fileno(), 65536)
        if not chunk:
            raise RuntimeError(f"residue {mode} exited before it was ready (status {popen.wait()})")
        line += chunk
    popen.stdout.close()
    if prefix:
        popen.wait(timeout=10)  # the nsenter (and setsid -f) that started it; the process itself lives on
    _word, ns_pid_text, payload = line.decode().strip().split(" ", 2)
    ns_pid = int(ns_pid_text)
    pid = ns_pid if ns_inode is None else (find_in_namespace(ns_inode, ns_pid) or 0)
    return ResidueProc(popen, pid, ns_pid, json.loads(payload))


def private_shm(sandbox: Any, size: str = "4g") -> None:
    """Mount a tmpfs of the sandbox's own on its /dev/shm (its mount namespace is private), as large as a GPU node's
    (a size is a limit, not memory taken): the next start's room there is a finding below 1 GiB (shm_min_mib)."""
    subprocess.run([*sandbox.nsenter_prefix(), "mount", "-t", "tmpfs", "-o", f"mode=1777,size={size}", "tmpfs", "/dev/shm"], check=True)


def spawn(sandbox: Any, mode: str, *args: Any) -> ResidueProc:
    """A residue process inside a gpusim Sandbox, detached (``setsid -f``) so that its parent is the sandbox's init."""
    return start(mode, *args, prefix=[*sandbox.nsenter_prefix(join_cgroup=True), "setsid", "-f"], ns_inode=sandbox.ns_inode)


def inside(sandbox: Any, path: str | os.PathLike[str]) -> Path:
    """A path of the sandbox's (or container's) mount namespace, seen from outside through its init's root."""
    return Path(f"/proc/{sandbox.init_pid}/root") / str(path).lstrip("/")


class Container:
    """A stand-in LXC container for residue tests: PID, mount and (optionally) network namespaces of its own,
    tmpfs on ``/dev/shm`` and ``/tmp``, an init that reaps or (``reap=False``) does not, registered with the
    fake ``pct`` (``<registry>/<vmid>.json``) so that the modules' container scope resolves it."""

    def __init__(self, vmid: int, registry: str | os.PathLike[str], node_name: str = "pve1", reap: bool = True, net: bool = True) -> None:
        self.vmid = vmid
        self.registry = Path(registry)
        self.node_name = node_name
        self.reap = reap
        self.net = net
        self.init_pid = 0
        self.ns_inode = 0
        self._unshare: subprocess.Popen[bytes] | None = None
        self._init: PidHandle | None = None
        self._procs: list[ResidueProc] = []

    def __enter__(self) -> Container:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> Container:
        r, w = os.pipe()
        argv = ["unshare", "--pid", "--fork", "--mount-proc", "--kill-child"]
        if self.net:
            argv.append("--net")
        argv += [sys.executable, "-I", str(JOB), "init", "--ready-fd", str(w), "--tmpfs", "/dev/shm", "--tmpfs", "/tmp"]
        if self.net:
            argv.append("--lo-up")
        if not self.reap:
            argv.append("--no-reap")
        try:
            self._unshare = subprocess.Popen(argv, pass_fds=(w,), stdin=subprocess.DEVNULL, start_new_session=True)
        finally:
            os.close(w)
        try:
            ready, _unused, _unused = select.select([r], [], [], 10)
            line = os.read(r, 64) if ready else b""
        finally:
            os.close(r)
        kids = children(self._unshare.pid)
        if line.strip() != b"ready" or len(kids) != 1:
            self._unshare.kill()
            self._unshare.wait()
            raise RuntimeError(f"residue container {self.vmid} did not start")
        self.init_pid = kids[0]
        self._init = PidHandle(self.init_pid)
        self.ns_inode = pidns_inode(self.init_pid)
        self._register("running")
        return self

    def _register(self, status: str) -> None:
        self.registry.mkdir(parents=True, exist_ok=True)
        if not (self.registry / "node").exists():
            (self.registry / "node").write_text(self.node_name)
        data = {
            "vmid": self.vmid,
            "status": status,
            "pid": self.init_pid if status == "running" else None,
            "node": self.node_name,
            "hostname": f"ct{self.vmid}",
        }
        tmp = self.registry / f".{self.vmid}.json.tmp"
        tmp.write_text(json.dumps(data) + "\n")
        os.replace(tmp, self.registry / f"{self.vmid}.json")

    @property
    def prefix(self) -> list[str]:
        return ["nsenter", "-t", str(self.init_pid), "-p", "-m", *(["-n"] if self.net else []), "--"]

    def spawn(self, mode: str, *args: Any) -> ResidueProc:
        """A residue process inside, detached so that its parent is the container's init."""
        proc = start(mode, *args, prefix=[*self.prefix, "setsid", "-f"], ns_inode=self.ns_inode)
        self._procs.append(proc)
        return proc

    def path(self, path: str) -> Path:
        return inside(self, path)

    def stop(self) -> None:
        if self._init is not None:
            self._init.signal(signal.SIGKILL)
            self._init.wait_exit(5)
            self._init.close()
            self._init = None
        if self._unshare is not None:
            try:
                self._unshare.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._unshare.kill()
                self._unshare.wait()
            self._unshare = None
        for proc in self._procs:
            try:
                proc.popen.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.popen.kill()
        if self.init_pid:
            self._register("stopped")
