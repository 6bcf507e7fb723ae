"""Sandboxes: private PID namespaces standing in for LXC containers.

A sandbox is ``unshare --pid --fork --mount-proc`` running a small reaping
init (pid 1 inside, with its own /proc). Commands enter it with
``nsenter -t <init> -p -m``. With a vmid it also looks like a Proxmox
container from the host: its processes live in the cgroup ``lxc/<vmid>/ns``
(``/proc/PID/cgroup`` reads ``0::/lxc/<vmid>/ns``, as pve-container's
``lxc.cgroup.dir.container = lxc/<vmid>`` with ``.inner = ns`` makes it on
PVE 8 and 9), under a parent cgroup of the test run's own (:func:`cgroup_parent`:
the machine's cgroups are shared, and the lab's real LXC containers, with the
same vmids, make ``lxc/<vmid>`` at its root), their environment has
``container=lxc``, and
:meth:`Sandbox.register_pct` publishes it to the fake ``pct`` registry.

``unprivileged=True`` adds a user namespace whose uid/gid 0-65535 are host
ids 100000-165535 (Proxmox's default map for unprivileged containers): from
the host its processes belong to uid 100000, inside they are root.
"""

from __future__ import annotations

import json
import os
import select
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .node import merge_env
from .procfs import PidHandle, children, pidns_inode

if TYPE_CHECKING:
    from .node import Node, Worker

INIT_SCRIPT = Path(__file__).resolve().parent / "_sbinit.py"
NSVIEW_SCRIPT = Path(__file__).resolve().parent / "_nsview.py"
#: Moves the shell into the sandbox's cgroup ("0" = the writer), then execs the command.
CGROUP_JOIN = 'echo 0 > "$0" 2>/dev/null; exec "$@"'
#: Proxmox's default id map for unprivileged containers (/etc/subuid root:100000:65536).
UNPRIVILEGED_BASE = 100000
UNPRIVILEGED_COUNT = 65536


def cgroup2_base() -> Path | None:
    """Where a cgroup v2 hierarchy is mounted: /sys/fs/cgroup/unified (hybrid
    layout, as on this machine) or /sys/fs/cgroup (pure v2)."""
    mounts = {}
    try:
        with open("/proc/self/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 3:
                    mounts[parts[1]] = parts[2]
    except OSError:
        return None
    for base in ("/sys/fs/cgroup/unified", "/sys/fs/cgroup"):
        if mounts.get(base) == "cgroup2":
            return Path(base)
    return None


def cgroup_parent() -> str:
    """The cgroup the sandboxes' ``lxc/<vmid>`` lie under: one per PID namespace of the tests (each pytest-xdist
    worker runs in its own), so two workers, or a worker and the lab's real containers, never share a vmid's
    cgroup. The collection finds a container by ``lxc/<vmid>`` anywhere in the path, as in a nested setup."""
    return f"gpuops-sim-{pidns_inode(os.getpid())}"


# Run inside the sandbox's mount namespace: a tmpfs over dev/, then a bind mount of each device passed.
_PASS_DEVICES = """
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
def mount(src, dst, fstype, flags, data):
    if libc.mount(src.encode(), dst.encode(), fstype.encode() if fstype else None, flags, data.encode() if data else None) != 0:
        err = ctypes.get_errno()
        raise SystemExit(f"mount {src} on {dst}: {os.strerror(err)}")
dev, driver = sys.argv[1], sys.argv[2]
mount("tmpfs", dev, "tmpfs", 0, "mode=0755")
for name in sys.argv[3:]:
    dst = os.path.join(dev, name)
    os.makedirs(os.path.dirname(dst), exist_ok=True)
    open(dst, "a").close()
    mount(os.path.join(driver, name), dst, None, 4096, None)  # MS_BIND
"""


class Sandbox:
    """A private PID namespace on a :class:`Node` (see module docstring)."""

    _count = 0

    def __init__(self, node: Node, name: str | None = None, vmid: int | None = None, cgroup: bool = True, unprivileged: bool = False) -> None:
        Sandbox._count += 1
        self.node = node
        self.vmid = vmid
        self.unprivileged = unprivileged
        #: host uid/gid of the container's root (None: privileged, root is root)
        self.root_uid: int | None = UNPRIVILEGED_BASE if unprivileged else None
        self.name = name or (f"ct{vmid}" if vmid is not None else f"sandbox{Sandbox._count}")
        self.want_cgroup = cgroup
        self.init_pid = 0  #: host-side (caller's namespace) pid of the sandbox's init
        self.ns_inode = 0  #: inode of the sandbox's PID namespace
        self.cgroup_path: Path | None = None  #: its cgroup directory, if one was joined
        self.devices_cgroup: Path | None = None  #: its devices cgroup (v1), once a device rule refuses a node (refuse())
        self._unshare: subprocess.Popen[bytes] | None = None
        self._init: PidHandle | None = None
        self._pct: tuple[Path, str] | None = None
        self.exit_log: Path | None = None  #: "<ns pid> <exit code>" of every process the init reaped
        self._stopped = False

    def __repr__(self) -> str:
        return f"<Sandbox {self.name} init={self.init_pid} vmid={self.vmid}>"

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ------------------------------------------------------------ life cycle
    def start(self) -> Sandbox:
        r, w = os.pipe()
        env = {"PATH": os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")}
        if self.vmid is not None:
            env["container"] = "lxc"  # what an LXC guest's /proc/1/environ says
        log = self.node.state_dir / "log" / f"sandbox-{self.name}.log"
        self.exit_log = log.with_suffix(".exits")
        argv = ["unshare", "--pid", "--fork", "--mount-proc", "--kill-child", sys.executable, "-I", "-S", str(INIT_SCRIPT), str(w), str(self.exit_log)]
        if self.unprivileged:
            # The user namespace first (unshare(1) here cannot map ranges without newuidmap), then the
            # PID and mount namespaces it owns; the init's exit log must be writable by its root.
            view = ["--expose", sys.executable, "--expose", os.path.realpath(sys.executable)]
            argv = [sys.executable, "-I", "-S", str(NSVIEW_SCRIPT), "--map", str(UNPRIVILEGED_BASE), str(UNPRIVILEGED_COUNT), *view, "--", *argv]
            self.exit_log.touch()
            os.chown(self.exit_log, UNPRIVILEGED_BASE, UNPRIVILEGED_BASE)
        try:
            with open(log, "ab") as logf:
                self._unshare = subprocess.Popen(argv, pass_fds=(w,), stdin=subprocess.DEVNULL, stdout=logf, stderr=logf, env=env, start_new_session=True)
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
            raise RuntimeError(f"sandbox {self.name} did not start: {log.read_text(errors='replace')}")
        self.init_pid = kids[0]
        self._init = PidHandle(self.init_pid)
        self.ns_inode = pidns_inode(self.init_pid)
        if self.vmid is not None and self.want_cgroup:
            self._join_cgroup()
        return self

    def _join_cgroup(self) -> None:
        """Put the init into lxc/<vmid>/ns (children inherit it); silently skipped
        where no cgroup v2 hierarchy is writable."""
        base = cgroup2_base()
        if base is None:
            return
        path = base / cgroup_parent() / "lxc" / str(self.vmid) / "ns"
        try:
            path.mkdir(parents=True, exist_ok=True)
            (path / "cgroup.procs").write_text(f"{self.init_pid}\n")
        except OSError:
            return
        self.cgroup_path = path

    def stop(self) -> None:
        """SIGKILL the init: the kernel then ends every process in the namespace (at once: the
        node's realistic exit teardown is paused meanwhile)."""
        if self._stopped:
            return
        self._stopped = True
        with self.node.teardown_paused():
            if self._init is not None:
                self._init.signal(signal.SIGKILL)
            if self._unshare is not None:
                try:
                    self._unshare.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    self._unshare.kill()
                    self._unshare.wait()
        if self._init is not None:
            self._init.wait_exit(5)
            self._init.close()
        for w in self._workers():
            try:
                w.popen.wait(timeout=5)  # the nsenter that started it
            except subprocess.TimeoutExpired:
                w.popen.kill()
        self._remove_cgroup()
        if self.devices_cgroup is not None:
            deadline = time.monotonic() + 2
            while self.devices_cgroup.exists() and time.monotonic() < deadline:
                try:
                    self.devices_cgroup.rmdir()  # once its last process is reaped
                except OSError:
                    time.sleep(0.01)
            for folder in list(self.devices_cgroup.parents)[:3]:  # lxc/, the run's parent, if unused
                try:
                    folder.rmdir()
                except OSError:
                    pass
        if self._pct is not None:
            self._write_pct(*self._pct, status="stopped")
        self.node._forget_sandbox(self)

    def _workers(self) -> list[Worker]:
        return [w for w in self.node._workers if w.sandbox is self]

    def _remove_cgroup(self) -> None:
        if self.cgroup_path is None:
            return
        deadline = time.monotonic() + 2
        while True:
            try:
                self.cgroup_path.rmdir()
                break
            except FileNotFoundError:
                break
            except OSError:
                if time.monotonic() > deadline:
                    return
                time.sleep(0.01)
        for parent in list(self.cgroup_path.parents)[:3]:  # lxc/<vmid>, lxc/, the run's parent, if unused
            try:
                parent.rmdir()
            except OSError:
                pass

    def alive(self) -> bool:
        return self._init is not None and self._init.alive()

    def pass_devices(self, omit: list[str] | tuple[str, ...] = ()) -> list[str]:
        """Give the sandbox only some of the node's device files, as an LXC container gets only those its
        configuration binds (``lxc.mount.entry: /dev/nvidia0 dev/nvidia0 none bind,...``; ``devN`` on Proxmox).
        Inside its mount namespace a tmpfs covers the node's ``dev/`` and each device file but those named in
        ``omit`` (``"nvidia-uvm"``, ``"nvidia3"``, ``"nvidia-caps/nvidia-cap1"``) is bind-mounted back from the
        driver's hard link (the same inode, so the same locks and contexts). Seen from inside, the omitted
        ones are simply not there; NVML, the workers and libcuda open what is. Returns the names passed."""
        names = [str(p.relative_to(self.node.dev_dir)) for p in self.node.device_files()]
        passed = [n for n in names if n not in set(omit)]
        argv = [sys.executable, "-I", "-S", "-c", _PASS_DEVICES, str(self.node.dev_dir), str(self.node.state_dir / "driver"), *passed]
        done = subprocess.run(self.nsenter_prefix() + argv, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"passing devices into sandbox {self.name} failed: {done.stderr.strip()}")
        return passed

    def bind_over(self, name: str, source: str | os.PathLike[str]) -> None:
        """Bind ``source`` over the node's ``dev/<name>`` inside the sandbox (its mount namespace only): a container
        given another device's node where the GPU's or nvidia-uvm's should be (a passthrough naming the wrong node, a
        mask of /dev/null). The driver's own node is untouched; outside the sandbox nothing changes."""
        target = self.node.dev_dir / name
        done = subprocess.run([*self.nsenter_prefix(), "mount", "--bind", str(source), str(target)], capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"binding {source} over {target} in sandbox {self.name} failed: {done.stderr.strip()}")

    def refuse(self, name: str, numbers: tuple[int, int] = (1, 7)) -> tuple[int, int]:
        """Make ``dev/<name>`` a node the container's device rules refuse, as LXC's devices cgroup does for a node its
        configuration does not allow (a passthrough rule written for major 195 only, while nvidia-uvm's is dynamic):
        a character node of ``numbers`` (/dev/full's by default, which no other part of the node uses) is bound over it,
        and a devices cgroup (cgroup v1's devices controller) denying those numbers holds every process of the sandbox,
        each started inside through nsenter_prefix() too. open() then fails with EPERM, as in such a container.
        Needs root, character nodes in the node's directory and the v1 devices controller: RuntimeError otherwise."""
        if not self.node.char_devices:
            raise RuntimeError("the node's device files are regular files here (no character nodes): a device rule cannot refuse one")
        base = Path("/sys/fs/cgroup/devices")
        if not (base / "devices.deny").exists():
            raise RuntimeError("no cgroup v1 devices controller at /sys/fs/cgroup/devices")
        source = self.node.state_dir / f"refused-{name.replace('/', '-')}"  # outside dev/, which the sandbox covers
        if not source.exists():
            os.mknod(source, stat.S_IFCHR | 0o666, os.makedev(*numbers))
        self.bind_over(name, source)
        path = base / cgroup_parent() / "lxc" / str(self.vmid if self.vmid is not None else self.name)
        path.mkdir(parents=True, exist_ok=True)
        (path / "devices.deny").write_text(f"c {numbers[0]}:{numbers[1]} rwm\n")
        (path / "cgroup.procs").write_text(f"{self.init_pid}\n")
        self.devices_cgroup = path
        return numbers

    # ------------------------------------------------------------ running things inside
    def nsenter_prefix(self, join_cgroup: bool = False, wd: str | None = None) -> list[str]:
        """``["nsenter", "-t", <init>, "-p", "-m", "--"]`` (``-U`` too for an unprivileged
        sandbox: the command runs as its root, host uid 100000): prefix a command to run it
        inside. join_cgroup=True also moves it into the sandbox's cgroup (from the host side,
        before entering: the container's root may not write the host's cgroup files); wd sets
        its working directory (entering the mount namespace resets it to /)."""
        prefix: list[str] = []
        if join_cgroup and self.cgroup_path is not None:
            prefix += ["/bin/sh", "-c", CGROUP_JOIN, str(self.cgroup_path / "cgroup.procs")]
        if self.devices_cgroup is not None:
            # The container's device rules hold everything that runs in it.
            prefix += ["/bin/sh", "-c", CGROUP_JOIN, str(self.devices_cgroup / "cgroup.procs")]
        prefix += ["nsenter", "-t", str(self.init_pid), "-p", "-m"]
        if self.unprivileged:
            prefix.append("-U")
        if wd:
            prefix.append(f"--wd={wd}")
        prefix.append("--")
        return prefix

    def _command(
        self, argv: list[Any], env: dict[str, str | None] | None, include_library: bool | None, cwd: str | os.PathLike[str] | None
    ) -> tuple[list[str], dict[str, str]]:
        if self._stopped:
            raise RuntimeError(f"sandbox {self.name} is stopped")
        lxc = {"container": "lxc"} if self.vmid is not None else None  # as lxc-attach / pct enter set it
        full = merge_env(os.environ, self.node.env(include_library), lxc, env)
        cmd = self.nsenter_prefix(join_cgroup=True, wd=str(cwd or os.getcwd())) + [str(a) for a in argv]
        return cmd, full

    def popen(
        self,
        argv: list[Any],
        env: dict[str, str | None] | None = None,
        include_library: bool | None = None,
        cwd: str | os.PathLike[str] | None = None,
        **kwargs: Any,
    ) -> subprocess.Popen[Any]:
        """Start a command inside (environment: ours + node.env() + env; a None
        value removes a variable). Popen.pid is nsenter's, in our namespace."""
        cmd, full = self._command(argv, env, include_library, cwd)
        return subprocess.Popen(cmd, env=full, **kwargs)

    def run(
        self,
        argv: list[Any],
        env: dict[str, str | None] | None = None,
        include_library: bool | None = None,
        cwd: str | os.PathLike[str] | None = None,
        **kwargs: Any,
    ) -> subprocess.CompletedProcess[Any]:
        """subprocess.run() inside the sandbox (same environment rules as popen)."""
        cmd, full = self._command(argv, env, include_library, cwd)
        check = kwargs.pop("check", False)
        return subprocess.run(cmd, env=full, check=check, **kwargs)

    def spawn_detached(self, argv: list[Any], env: dict[str, str | None] | None = None, **kwargs: Any) -> subprocess.Popen[Any]:
        """Start a long-lived process inside, detached (``setsid -f``): it gets
        its own session and, once the short-lived nsenter is gone, the sandbox
        init as parent, as an orphaned job in a container has. (Kept under
        nsenter, a process that stops itself would stop nsenter too: nsenter
        mirrors its child's job-control stops.) The Popen is nsenter's."""
        cmd, full = self._command(["setsid", "-f", *argv], env, None, None)
        return subprocess.Popen(cmd, env=full, **kwargs)

    def exit_status(self, ns_pid: int) -> int | None:
        """Exit code (negative: signal) of a process the sandbox init reaped."""
        try:
            lines = self.exit_log.read_text().split("\n") if self.exit_log else []
        except FileNotFoundError:
            return None
        for line in reversed(lines):
            pid, _unused, code = line.partition(" ")
            if pid == str(ns_pid):
                return int(code)
        return None

    def host_uid(self, uid: int) -> int:
        """The host uid of ``uid`` inside the sandbox (the uid map of an unprivileged one)."""
        return uid if self.root_uid is None else self.root_uid + uid

    def spawn_worker(self, **kwargs: Any) -> Worker:
        """node.spawn_worker(..., sandbox=self)."""
        return self.node.spawn_worker(sandbox=self, **kwargs)

    def spawn_daemon(self, name: str, nvml: bool = False) -> Worker:
        return self.node.spawn_daemon(name, sandbox=self, nvml=nvml)

    # ------------------------------------------------------------ fake pct
    def register_pct(self, registry_dir: str | os.PathLike[str], node_name: str = "pve1", status: str = "running") -> Path:
        """Write ``<registry_dir>/<vmid>.json`` for the fake ``pct`` (env PCTSIM_DIR):
        {"vmid", "status", "pid" (host pid of the init, null when stopped), "node", "hostname",
        "unprivileged" (and its "config" says so), "environment" (the node's driver as node.env() gives it now:
        what `pct exec` sets for every command, as LXC sets lxc.environment)}. Sandbox.stop() rewrites it as stopped."""
        if self.vmid is None:
            raise ValueError("register_pct needs a sandbox created with a vmid")
        reg = Path(registry_dir)
        self._pct = (reg, node_name)
        return self._write_pct(reg, node_name, status)

    def _write_pct(self, reg: Path, node_name: str, status: str) -> Path:
        reg.mkdir(parents=True, exist_ok=True)
        data = {
            "vmid": self.vmid,
            "status": status,
            "pid": self.init_pid if status == "running" and not self._stopped else None,
            "node": node_name,
            "hostname": self.name,
        }
        if self.cgroup_path is not None:
            data["cgroup"] = str(self.cgroup_path)
        # Its lxc.environment: the simulated driver's address and libraries, which `pct exec` gives every command
        # (the lab writes the same into its LXC containers' configuration); not PATH, which is the container's.
        data["environment"] = {k: v for k, v in self.node.env().items() if k != "PATH"}
        if self.unprivileged:
            data["unprivileged"] = 1
            data["config"] = {"unprivileged": 1}
        path = reg / f"{self.vmid}.json"
        tmp = reg / f".{self.vmid}.json.tmp"
        tmp.write_text(json.dumps(data) + "\n")
        os.replace(tmp, path)
        return path
