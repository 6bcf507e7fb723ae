"""The multi-host lab: Proxmox VE "hypervisors" with simulated GPUs and real LXC containers on them,
each a real SSH host or reached through ``pct``, on a private network.

Built from ``tests/sim/pvesim/clusters/lab.yml`` (the same description the Proxmox API simulator
serves to the inventory plugin), so the inventory describes exactly what runs. See docs/lab.md for the
picture. In short:

* network namespace ``gpuopslab`` (the controller's: pytest, ansible-playbook, the API simulator on
  127.0.0.1) holds the bridge ``gpuopslab0`` with 10.77.0.1/24; veth links go to the nodes' network
  namespaces, where each node's ``eth0`` is a port of its bridge ``vmbr0`` (its address is on it);
* a hypervisor is a network, PID, UTS and mount namespace whose first process (``node_init.py``) makes
  what a Proxmox VE node has (its host name, a ``/dev`` with the simulated GPUs at ``/dev/nvidia*``,
  ``/etc/pve`` with the cluster's container configurations, ``/var/lib/lxc``, ``/usr/sbin/pct``, its
  own cgroups) and becomes gpusim's reaping init; it runs its own ``sshd`` on its address, with a gpusim
  node (8 GPUs) whose sessions get ``GPUSIM_STATE``, ``GPUSIM_DEV_DIR=/dev``, ``LD_LIBRARY_PATH`` and
  ``PCTSIM_DIR``. Its Python is this machine's Debian ``/usr/bin/python3`` (EXTERNALLY-MANAGED), without
  the modules' dependencies: the role installs them into a virtual environment (pve1 from a package
  index the controller serves, pve2 from wheels shipped by the controller; neither reaches anything
  else), and pip reads no configuration of this machine (``PIP_CONFIG_FILE=/dev/null``);
* a container is a real LXC container (Debian's LXC 5), started on its node with ``lxc-start -n <vmid>``
  from the ``/var/lib/lxc/<vmid>/config`` that tests/lab/pvenode.py writes from its Proxmox VE
  configuration as pve-container does: unprivileged ones with PVE's id map (root is uid 100000 on the
  node), a privileged one, GPUs passed through as ``devN`` entries (pre-start and autodev hooks,
  ``lxc_pve_hook.py``) or raw ``lxc.mount.entry`` lines; LXC's ``init.lxc`` is its PID 1. ``pct`` on the
  node (tests/sim/bin/pct) reaches it with ``lxc-attach``; ct101 has its own sshd on its address.

Everything runs inside ``tools/pidns-run`` (private PID and mount namespaces, private /tmp), so the
named network namespaces live on a private tmpfs at /run/netns, every file of the run is in the
private /tmp, and nothing the lab starts can outlive the run. Names that would be shared with another
run on this machine are this run's own: the cgroups of the nodes and their containers live under
``gpuops-lab-<run id>/<node>`` (beside this process's cgroup, in every hierarchy), held by the run's lock
``/run/lock/gpuops-clean-slate-lab/<run id>.lock``. :meth:`Lab.teardown` removes it all; the empty cgroup
directories a killed run leaves are removed by the next lab (of any checkout) that finds their lock free.
"""

from __future__ import annotations

import fcntl
import glob
import http.server
import json
import os
import re
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
TESTS = HERE.parent
ROOT = TESTS.parent
from gpusim import BIN_DIR, LIB_DIR, Node  # noqa: E402
from gpusim.paths import CUDA_DIR, LIBCUDA  # noqa: E402
from lab import pvenode  # noqa: E402
from pvesim import PveSim, load_cluster  # noqa: E402
from pvesim.model import Cluster  # noqa: E402
from support.ansible import VENV, VENV_PYTHON, AnsibleRun, ansible_env, run_playbook  # noqa: E402

CLUSTER_FILE = TESTS / "sim" / "pvesim" / "clusters" / "lab.yml"
SIM_DIR = TESTS / "sim"
# A reaping init, the same as a gpusim sandbox's: the hypervisors' PID 1 (after node_init.py).
PID1 = SIM_DIR / "gpusim" / "_sbinit.py"
NODE_INIT = HERE / "node_init.py"
PCT = SIM_DIR / "bin" / "pct"
PLAYBOOK = ROOT / "playbooks" / "clean_slate.yml"
WORKER = BIN_DIR / "gpusim-worker"
SSHD = "/usr/sbin/sshd"
CONTROLLER_NS = "gpuopslab"
BRIDGE = "gpuopslab0"
NODE_BRIDGE = "vmbr0"
NETNS_DIR = Path("/run/netns")
LOCK_DIR = Path("/run/lock/gpuops-clean-slate-lab")
RUN_PREFIX = "gpuops-lab-"
TMP_PREFIX = "gpuops-lab-"
TARGET_VENV = ROOT / ".build" / "lab" / "py39"
#: Test-only downloads of `make setup` (tools/fetch_test_deps.py).
WHEELS = ROOT / ".build" / "wheels"
TEST_COLLECTIONS = ROOT / ".build" / "collections"
COMMUNITY_PROXMOX = TEST_COLLECTIONS / "ansible_collections" / "community" / "proxmox"
#: The hypervisors' Python: Debian's, as on Proxmox VE 8 (Debian 12).
SYSTEM_PYTHON = "/usr/bin/python3"
#: Which hypervisor installs the modules' dependencies from the controller's package index (the others
#: from wheels shipped with clean_slate_wheels_dir).
INDEX_NODE = "pve1"
DAEMONS = ("nvidia-persistenced", "nv-hostengine", "dcgm-exporter")
CONTAINER_DAEMONS = ("dcgm-exporter",)
#: Inside a container: the job binary, copied into its image.
CONTAINER_WORKER = "/usr/local/bin/gpusim-worker"
STD_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
LXC_TOOLS = ("lxc-start", "lxc-stop", "lxc-attach", "lxc-info")
INIT_PID_NS_INO = 0xEFFFFFFC
CRED = struct.Struct("3i")
TOKEN_ID = "root@pam!gpuops-lab"
#: How long pct takes per call in the lab (PCTSIM latency_ms): the real one's second unless told.
PCT_LATENCY_MS = int(os.environ.get("GPUOPS_LAB_PCT_LATENCY_MS", "1000"))


class LabError(RuntimeError):
    """The lab could not be built or changed."""


# ---------------------------------------------------------------------- small helpers
def sh(*argv: Any, check: bool = True, **kw: Any) -> subprocess.CompletedProcess[str]:
    """Run a command; a failure raises LabError with its output."""
    proc = subprocess.run([str(a) for a in argv], capture_output=True, text=True, check=False, **kw)
    if check and proc.returncode != 0:
        raise LabError(f"{' '.join(map(str, argv))} failed (rc {proc.returncode}): {proc.stderr.strip() or proc.stdout.strip()}")
    return proc


def in_private_pidns() -> bool:
    return os.stat("/proc/self/ns/pid").st_ino != INIT_PID_NS_INO


def nspid(pid: int) -> list[int]:
    """The pid of ``pid`` at each PID-namespace level, ours first (NSpid)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("NSpid:"):
                return [int(x) for x in line.split()[1:]]
    return [pid]


def pidns_inode(pid: int) -> int:
    return os.stat(f"/proc/{pid}/ns/pid").st_ino


def find_in_namespace(ns_inode: int, ns_pid: int) -> int | None:
    """Our pid of the process that is ``ns_pid`` in the PID namespace ``ns_inode``."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if nspid(int(entry))[-1] == ns_pid and pidns_inode(int(entry)) == ns_inode:
                return int(entry)
        except (FileNotFoundError, ProcessLookupError, PermissionError, IndexError):
            continue
    return None


def find_below(ns_inode: int, ns_pid: int) -> int | None:
    """Our pid of the process that has pid ``ns_pid`` in the PID namespace ``ns_inode`` and lives in a
    namespace nested in it (a container's init, as its node sees it): one of its ancestors is in it."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            levels = nspid(int(entry))
            own = pidns_inode(int(entry))
            if ns_pid not in levels[1:-1] or own == ns_inode:
                continue
            pid = int(entry)
            for _step in range(len(levels)):
                with open(f"/proc/{pid}/status") as f:
                    pid = int(next(line.split()[1] for line in f if line.startswith("PPid:")))
                if pid <= 1:
                    break
                if pidns_inode(pid) == ns_inode:
                    return int(entry) if nspid(int(entry))[len(nspid(pid)) - 1] == ns_pid else None
        except (FileNotFoundError, ProcessLookupError, PermissionError, IndexError, StopIteration, ValueError):
            continue
    return None


def recv_ready(sock: socket.socket, timeout: float, what: str) -> tuple[str, int]:
    """One line from a ready socket and the writer's pid in our PID namespace (SO_PASSCRED)."""
    deadline = time.monotonic() + timeout
    data, sender = b"", 0
    while not data.endswith(b"\n"):
        left = deadline - time.monotonic()
        readable, _unused, _unused = select.select([sock], [], [], max(0.0, left))
        if not readable:
            raise LabError(f"{what}: not ready after {timeout} s")
        chunk, anc, _unused, _unused = sock.recvmsg(256, socket.CMSG_SPACE(CRED.size))
        for level, kind, cdata in anc:
            if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS:
                sender = CRED.unpack(cdata[: CRED.size])[0]
        if not chunk:
            raise LabError(f"{what}: exited before it was ready")
        data += chunk
    sock.close()
    return data.decode().strip(), sender


def ready_pair() -> tuple[socket.socket, socket.socket]:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    ours.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
    return ours, theirs


# ---------------------------------------------------------------------- cgroups of a run
def cgroup_bases() -> list[Path]:
    """This process's cgroup directory in every mounted hierarchy (v1 controllers, named v1, v2)."""
    own: dict[str, str] = {}
    with open("/proc/self/cgroup", encoding="ascii") as f:
        for line in f:
            _hid, controllers, path = line.rstrip("\n").split(":", 2)
            own[controllers] = path
    bases: list[Path] = []
    with open("/proc/self/mountinfo", encoding="utf-8") as f:
        for line in f:
            left, _sep, right = line.partition(" - ")
            fields, rfields = left.split(), right.split()
            if len(rfields) < 3 or rfields[0] not in ("cgroup", "cgroup2"):
                continue
            root, mountpoint, options = fields[3], fields[4], set(rfields[2].split(","))
            # A v1 hierarchy is the /proc/self/cgroup line whose controllers its mount options name.
            v1 = next((k for k in own if k and set(k.split(",")) <= options), None)
            key = ("" if "" in own else None) if rfields[0] == "cgroup2" else v1
            if key is None or not (own[key] + "/").startswith(root.rstrip("/") + "/"):
                continue
            base = Path(mountpoint) / os.path.relpath(own[key], root)
            if base.resolve() not in [b.resolve() for b in bases]:
                bases.append(base)
    return bases


def make_cgroup(base: Path, rel: str) -> Path:
    """``base/rel`` (each level made; cpuset levels get their parent's CPUs and memory nodes)."""
    path = base
    for part in rel.split("/"):
        parent, path = path, path / part
        path.mkdir(exist_ok=True)
        for knob in ("cpuset.cpus", "cpuset.mems"):
            if (path / knob).exists() and not (path / knob).read_text().strip():
                (path / knob).write_text((parent / knob).read_text())
    return path


def remove_cgroup_tree(top: Path, timeout: float = 5.0) -> None:
    """rmdir ``top`` and everything under it, deepest first (cgroups empty as their last process exits)."""
    deadline = time.monotonic() + timeout
    while top.exists():
        dirs = sorted((Path(d) for d, _subdirs, _files in os.walk(top)), key=lambda p: len(p.parts), reverse=True)
        busy = None
        for d in dirs:
            try:
                d.rmdir()
            except FileNotFoundError:
                pass
            except OSError as exc:
                busy = exc
        if busy is None:
            return
        if time.monotonic() > deadline:
            raise busy
        time.sleep(0.05)


def run_lock_held(run: str) -> bool:
    """Does a live lab hold the lock of run ``run``?"""
    try:
        fd = os.open(LOCK_DIR / f"{run}.lock", os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def remove_stale_runs() -> list[str]:
    """Remove what killed labs left (their cgroup directories, empty since their processes died, and
    their lock files): every ``gpuops-lab-<run>`` whose lock no live lab holds. Returns those runs."""
    removed: list[str] = []
    for base in cgroup_bases():
        for d in base.glob(RUN_PREFIX + "*"):
            run = d.name[len(RUN_PREFIX) :]
            if d.is_dir() and not run_lock_held(run):
                try:
                    remove_cgroup_tree(d, timeout=1.0)
                except OSError:
                    continue  # still has processes: not ours to touch
                removed.append(run)
    if LOCK_DIR.is_dir():
        for lock in LOCK_DIR.glob("*.lock"):
            run = lock.name[: -len(".lock")]
            fd = os.open(lock, os.O_RDWR | os.O_CLOEXEC)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                lock.unlink(missing_ok=True)  # unlinked while held: a lab that opens it now sees it gone
                removed.append(run)
            except BlockingIOError:
                pass
            finally:
                os.close(fd)
    return sorted(set(removed))


# ---------------------------------------------------------------------- processes and hosts
@dataclass
class Proc:
    """A process the lab started, held by a pidfd: signals never reach a recycled pid."""

    name: str
    host: str
    kind: str  # init, sshd, worker, child, daemon
    pid: int  # in the lab's (pytest's) PID namespace
    levels: list[int] = field(default_factory=list)  # NSpid: our pid, then inwards
    gpus: list[int] = field(default_factory=list)
    ignores_term: bool = False
    _fd: int = -1

    def __post_init__(self) -> None:
        self._fd = os.pidfd_open(self.pid)
        if not self.levels:
            self.levels = nspid(self.pid)

    def pid_at(self, depth: int) -> int:
        """The pid as seen in the PID namespace ``depth`` levels below ours (0: ours)."""
        return self.levels[depth]

    def alive(self) -> bool:
        if self._fd < 0:
            return False
        readable, _unused, _unused = select.select([self._fd], [], [], 0)
        return not readable

    def signal(self, sig: int = signal.SIGKILL) -> None:
        if self._fd >= 0:
            try:
                signal.pidfd_send_signal(self._fd, sig)
            except ProcessLookupError:
                pass

    def wait_gone(self, timeout: float = 5.0) -> bool:
        if self._fd < 0:
            return True
        readable, _unused, _unused = select.select([self._fd], [], [], timeout)
        return bool(readable)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


@dataclass
class Host:
    """A lab host: hypervisor ("node") or LXC container ("lxc")."""

    name: str
    kind: str
    depth: int  # PID-namespace levels below the lab's: 1 for a hypervisor, 2 for a container
    dir: Path
    gpus: list[int]
    address: str | None = None
    vmid: int | None = None
    node: Host | None = None  # a container's hypervisor
    sim: Node | None = None
    reach: str = "ssh"  # ssh, or hypervisor (no network; pct from its node)
    netns: str | None = None
    python: str = VENV_PYTHON
    conf: dict[str, Any] = field(default_factory=dict)  # a container's Proxmox VE configuration, parsed
    unprivileged: bool = False
    has_workload: bool = True  # a job is started on it by Lab.reset()
    default_run: bool = True  # in the playbook runs that name no --limit
    init: Proc | None = None
    init_popen: subprocess.Popen[bytes] | None = None
    sshd: Proc | None = None
    cgroup_procs: list[Path] = field(default_factory=list)  # a node's cgroup.procs files (every hierarchy)
    workload: list[Proc] = field(default_factory=list)
    daemons: dict[str, Proc] = field(default_factory=dict)

    @property
    def gpu_sim(self) -> Node:
        sim = self.sim if self.sim is not None else (self.node.sim if self.node else None)
        assert sim is not None
        return sim

    @property
    def pct_dir(self) -> Path:
        return self.dir / "pct"

    @property
    def lxc_dir(self) -> Path:
        """A container's ``/var/lib/lxc/<vmid>`` (its config, disk and log), as seen from here."""
        assert self.node is not None and self.vmid is not None
        return self.node.dir / "lxc" / str(self.vmid)

    @property
    def rootfs(self) -> Path:
        return self.lxc_dir / "rootfs"

    def enter(self) -> list[str]:
        """Prefix that runs a command inside this host: a node's namespaces (nsenter), a container through
        ``lxc-attach --clear-env`` on its node (the command gets the container's environment only)."""
        if self.kind == "lxc":
            assert self.node is not None
            return [*self.node.enter(), "lxc-attach", "-n", str(self.vmid), "--clear-env", "--"]
        assert self.init is not None and self.init.alive(), f"{self.name} is not running"
        return ["nsenter", "-t", str(self.init.pid), "-p", "-m", "-n", "-u", "--"]

    def running(self) -> bool:
        return self.init is not None and self.init.alive()

    @property
    def venv(self) -> Path | None:
        """The modules' virtual environment the role makes where this host's modules run: on the node
        (for a container cleaned through it too); None for a host with its own interpreter (ct101)."""
        if self.kind == "node":
            return self.dir / "venv"
        if self.reach == "hypervisor" and self.node is not None:
            return self.node.dir / "venv"
        return None


def workload_plan(gpus: list[int]) -> list[dict[str, Any]]:
    """An SGLang-like job on these GPUs: renamed scheduler workers, one vLLM worker that
    ignores SIGTERM (on the last GPU) and a forked child that kept a GPU after its parent
    exited (on the one before, or beside the first scheduler when there are only two)."""
    plan: list[dict[str, Any]] = []
    vllm = gpus[-1]
    child_gpu = gpus[-2] if len(gpus) >= 3 else gpus[0]
    for tp, gpu in enumerate(gpus):
        if gpu == vllm:
            plan.append({"gpus": [gpu], "mib": 40000, "title": f"VLLM::Worker_TP{tp}", "ignore_term": True})
        elif gpu != child_gpu or len(gpus) < 3:
            plan.append({"gpus": [gpu], "mib": 60000, "title": f"sglang::scheduler_TP{tp}"})
    plan.append({"gpus": [child_gpu], "mib": 8000, "title": "sglang::data_worker", "fork_child": True})
    return plan


def target_python() -> str:
    """The interpreter of ct101 (the container with its own sshd): a venv on pyenv's Python 3.9 (the
    oldest target the collection supports), with the modules' dependencies pinned as in tests/requirements.txt.
    Built once under .build/lab; falls back to the controller's venv when there is no 3.9."""
    base = None
    try:
        root = subprocess.run(["pyenv", "root"], capture_output=True, text=True, check=False).stdout.strip()
    except FileNotFoundError:
        root = ""
    candidates = sorted(glob.glob(os.path.join(root or os.path.expanduser("~/.pyenv"), "versions", "3.9.*", "bin", "python3")))
    if candidates:
        base = candidates[-1]
    if base is None:
        return VENV_PYTHON
    pins = [
        line.split(";")[0].strip()
        for line in (TESTS / "requirements.txt").read_text().splitlines()
        if re.match(r"^(nvidia-ml-py|psutil|jmespath)==", line.strip())
    ]
    stamp = TARGET_VENV / ".stamp"
    want = json.dumps({"python": base, "pins": pins})
    py = TARGET_VENV / "bin" / "python"
    if stamp.exists() and stamp.read_text() == want and py.exists():
        return str(py)
    shutil.rmtree(TARGET_VENV, ignore_errors=True)
    TARGET_VENV.parent.mkdir(parents=True, exist_ok=True)
    sh(base, "-m", "venv", TARGET_VENV)
    sh(py, "-m", "pip", "install", "-q", "--disable-pip-version-check", *pins, timeout=600)
    stamp.write_text(want)
    return str(py)


def python_binds(python: str) -> list[tuple[str, str, bool]]:
    """What a container needs of this machine to run ``python``: its virtual environment and the
    installation the environment is made from, each bound read-only at its own path (``/usr`` is
    the container's already)."""
    exe = Path(python)
    binds: list[tuple[str, str, bool]] = []
    venv = exe.parent.parent
    cfg = venv / "pyvenv.cfg"
    if cfg.exists():
        binds.append((str(venv), str(venv), True))
        home = next((line.split("=", 1)[1].strip() for line in cfg.read_text().splitlines() if line.split("=")[0].strip() == "home"), "")
        prefix = Path(home).parent if home else Path(os.path.realpath(exe)).parent.parent
    else:
        prefix = Path(os.path.realpath(exe)).parent.parent
    if not str(prefix).startswith("/usr"):
        binds.append((str(prefix), str(prefix), True))
    return binds


class ContainerSandbox:
    """A lab container seen through what gpusim.servers uses of a gpusim Sandbox: ``init_pid`` and ``ns_inode``
    (the container's PID 1 and PID namespace, from here) and ``spawn_detached``, which starts a command in the
    container through ``lxc-attach --clear-env`` on its node, the given variables set (``-v``), detached with
    ``setsid -f``: its parent becomes the container's init, as for a server started inside."""

    def __init__(self, host: Host) -> None:
        assert host.kind == "lxc" and host.init is not None and host.node is not None
        self.host = host
        self.init_pid = host.init.pid
        self.ns_inode = pidns_inode(host.init.pid)

    def spawn_detached(self, argv: list[Any], env: dict[str, str | None] | None = None, **kwargs: Any) -> subprocess.Popen[Any]:
        assert self.host.node is not None
        sets = [x for k, v in (env or {}).items() if v is not None for x in ("-v", f"{k}={v}")]
        cmd = [*self.host.node.enter(), "lxc-attach", "-n", str(self.host.vmid), "--clear-env", *sets, "--", "setsid", "-f", *map(str, argv)]
        return subprocess.Popen(cmd, env={"PATH": STD_PATH}, **kwargs)


class PackageIndex:
    """A PEP 503 "simple" package index over HTTP on the controller's lab address, serving the wheels of
    .build/wheels: the mirror a Proxmox VE node's pip configuration (index-url) points at. pip reads the
    directory listings of http.server as index pages. Records which client asked for which path."""

    def __init__(self, root: Path, address: str) -> None:
        for whl in WHEELS.glob("*.whl"):
            project = re.sub(r"[-_.]+", "-", whl.name.split("-")[0]).lower()
            (root / "simple" / project).mkdir(parents=True, exist_ok=True)
            shutil.copy(whl, root / "simple" / project / whl.name)
        self.requests: list[tuple[str, str]] = []
        index = self

        class Handler(http.server.SimpleHTTPRequestHandler):
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                super().__init__(*args, directory=str(root), **kwargs)

            def log_message(self, format: str, *args: Any) -> None:
                index.requests.append((self.client_address[0], self.path))

        # Bound by this thread, which is in the lab network by now; the serving thread only accepts.
        self.server = http.server.ThreadingHTTPServer((address, 0), Handler)
        self.url = f"http://{address}:{self.server.server_address[1]}/simple/"
        self.thread = threading.Thread(target=self.server.serve_forever, name="lab-package-index", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


# ---------------------------------------------------------------------- the lab
class Lab:
    """The lab: build(), reset() (a fresh workload on every host), playbook(); teardown()."""

    def __init__(self, cluster: Path | dict[str, Any] = CLUSTER_FILE) -> None:
        """``cluster``: the description to build (a path, or a loaded dict: a smaller lab for a test)."""
        self.cluster = cluster if isinstance(cluster, dict) else load_cluster(cluster)
        meta = self.cluster.get("meta", {})
        self.subnet_prefix = int(str(meta.get("subnet", "10.77.0.0/24")).split("/")[1])
        self.controller_ip = str(meta.get("controller", "10.77.0.1"))
        #: This run's name: its cgroups are gpuops-lab-<run_id>/..., its lock <run_id>.lock.
        self.run_id = uuid.uuid4().hex[:12]
        self.workdir: Path | None = None
        self.hosts: dict[str, Host] = {}
        self.sim: PveSim | None = None
        self.token_secret = str(uuid.uuid4())
        self.inventory: Path | None = None
        self.target_python = VENV_PYTHON
        self.index: PackageIndex | None = None
        #: Timings of the build (seconds): "build", and "container <name>" for each container start.
        self.timings: dict[str, float] = {}
        self._lock_fd = -1
        self._orig_netns = -1
        self._netns_mounted = False
        self._netns: list[str] = []
        self._torn_down = False

    # ------------------------------------------------------------------ views
    @property
    def nodes(self) -> list[Host]:
        return [h for h in self.hosts.values() if h.kind == "node"]

    @property
    def containers(self) -> list[Host]:
        return [h for h in self.hosts.values() if h.kind == "lxc"]

    def __getitem__(self, name: str) -> Host:
        return self.hosts[name]

    @property
    def run_name(self) -> str:
        return RUN_PREFIX + self.run_id

    @property
    def cluster_dir(self) -> Path:
        """The cluster file system (``/etc/pve`` of every node; ``nodes/`` is shared as pmxcfs shares it)."""
        assert self.workdir is not None
        return self.workdir / "pve"

    def conf_path(self, host: Host) -> Path:
        """``/etc/pve/nodes/<node>/lxc/<vmid>.conf`` of a container, as seen from here."""
        assert host.node is not None
        return self.cluster_dir / "nodes" / host.node.name / "lxc" / f"{host.vmid}.conf"

    @property
    def default_limit(self) -> str | None:
        """The --limit of a playbook run that names none: the hosts whose scenarios are the lab's common
        ones (the seeds' node and container, and the container without nvidia-uvm, take part in their own)."""
        left_out = [h.name for h in self.hosts.values() if not h.default_run]
        return ":".join(["all", *(f"!{n}" for n in left_out)]) if left_out else None

    # ------------------------------------------------------------------ build
    def build(self) -> Lab:
        started = time.monotonic()
        if os.geteuid() != 0:
            raise LabError("the lab needs root (network namespaces, sshd, LXC, cgroups)")
        if not in_private_pidns() or os.environ.get("GPUOPS_PIDNS") != "1":
            raise LabError("the lab runs only inside tools/pidns-run (make lab)")
        tools = ("ip", "nsenter", "unshare", "ssh", "ssh-keygen", "setsid", "mount", *LXC_TOOLS)
        if not os.path.exists(SSHD) or not all(shutil.which(tool) for tool in tools):
            # openssh-server, openssh-client, iproute2, lxc: installed when missing (Debian, root).
            subprocess.run([str(ROOT / "tools" / "install-system-deps")], check=False)
        for tool in tools:
            if not shutil.which(tool):
                raise LabError(f"{tool} is missing: run tools/install-system-deps")
        if not os.path.exists(SSHD):
            raise LabError(f"{SSHD} is missing: run tools/install-system-deps")
        if not list(WHEELS.glob("*.whl")) or not (COMMUNITY_PROXMOX / "MANIFEST.json").exists():
            raise LabError(f"{WHEELS} or {COMMUNITY_PROXMOX} is missing: run make setup (tools/fetch_test_deps.py)")
        self._take_lock()
        try:
            self.target_python = target_python()  # may need PyPI: before leaving the host's network
            remove_stale_runs()
            for old in glob.glob(os.path.join(tempfile.gettempdir(), TMP_PREFIX + "*")):
                shutil.rmtree(old, ignore_errors=True)
            self.workdir = Path(tempfile.mkdtemp(prefix=TMP_PREFIX))
            # Traversable by an unprivileged container's root (uid 100000): its hooks read /var/lib/lxc.
            self.workdir.chmod(0o755)
            for sub in ("ssh", "cp", "inventory/host_vars", "inventory/group_vars", "bin", "hosts", "reports", "pve/nodes"):
                (self.workdir / sub).mkdir(parents=True, exist_ok=True)
            self._daemon_binaries()
            Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # sshd's privilege separation directory
            sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "gpuops-lab-controller", "-f", self.workdir / "ssh" / "id_ed25519")
            self._network()
            self.index = PackageIndex(self.workdir / "index", self.controller_ip)
            self._describe_hosts()
            for host in self.nodes:
                self._start_node(host)
            for host in self.containers:
                self._start_container(host)
            self._start_api()
            self._write_inventory()
            for host in self.hosts.values():
                if host.reach == "ssh":
                    self._wait_ssh(host)
        except BaseException:
            self.teardown()
            raise
        self.timings["build"] = time.monotonic() - started
        return self

    def _take_lock(self) -> None:
        """This run's lock: held while the run lives, so that no other lab removes its cgroups."""
        LOCK_DIR.mkdir(parents=True, exist_ok=True)
        path = LOCK_DIR / f"{self.run_id}.lock"
        while True:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                if os.stat(path).st_ino == os.fstat(fd).st_ino:
                    self._lock_fd = fd
                    return
            except FileNotFoundError:
                pass
            os.close(fd)  # a stale-run sweep unlinked it between our open and our lock: again

    def _daemon_binaries(self) -> None:
        """The protected daemons are copies of gpusim-worker under their exact names, so exe,
        argv[0] and comm read like the real ones."""
        assert self.workdir is not None
        for name in DAEMONS:
            dest = self.workdir / "bin" / name
            shutil.copy2(WORKER, dest)
            dest.chmod(0o755)

    def _network(self) -> None:
        """Private /run/netns, the controller's namespace with the bridge, and ours moved into it."""
        NETNS_DIR.mkdir(parents=True, exist_ok=True)
        sh("mount", "-t", "tmpfs", "-o", "size=1m,mode=0755", "gpuops-lab-netns", NETNS_DIR)
        self._netns_mounted = True
        self._add_netns(CONTROLLER_NS)
        sh("ip", "-n", CONTROLLER_NS, "link", "add", BRIDGE, "type", "bridge")
        sh("ip", "-n", CONTROLLER_NS, "addr", "add", f"{self.controller_ip}/{self.subnet_prefix}", "dev", BRIDGE)
        sh("ip", "-n", CONTROLLER_NS, "link", "set", BRIDGE, "up")
        # From here on this process (its main thread) and everything it starts live in the lab network.
        self._orig_netns = os.open("/proc/self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        fd = os.open(NETNS_DIR / CONTROLLER_NS, os.O_RDONLY | os.O_CLOEXEC)
        try:
            os.setns(fd, os.CLONE_NEWNET)
        finally:
            os.close(fd)

    def _add_netns(self, name: str, address: str | None = None) -> None:
        """A node's network namespace: ``eth0`` (a veth to the lab bridge) as a port of its ``vmbr0``,
        which carries the node's address, as on a Proxmox VE node; its containers' veths join ``vmbr0``."""
        sh("ip", "netns", "add", name)
        self._netns.append(name)
        sh("ip", "-n", name, "link", "set", "lo", "up")
        if address is None:
            return
        veth = f"v{name}"[:15]
        sh("ip", "-n", CONTROLLER_NS, "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", name)
        sh("ip", "-n", CONTROLLER_NS, "link", "set", veth, "master", BRIDGE, "up")
        sh("ip", "-n", name, "link", "add", NODE_BRIDGE, "type", "bridge")
        sh("ip", "-n", name, "link", "set", "eth0", "master", NODE_BRIDGE, "up")
        sh("ip", "-n", name, "addr", "add", f"{address}/{self.subnet_prefix}", "dev", NODE_BRIDGE)
        sh("ip", "-n", name, "link", "set", NODE_BRIDGE, "up")
        sh("ip", "-n", name, "route", "add", "default", "via", self.controller_ip)

    def _describe_hosts(self) -> None:
        assert self.workdir is not None
        for n in self.cluster["nodes"]:
            meta = n.get("meta", {})
            d = self.workdir / "hosts" / n["name"]
            d.mkdir(parents=True)
            self.hosts[n["name"]] = Host(
                name=n["name"],
                kind="node",
                depth=1,
                dir=d,
                gpus=list(meta["own_gpus"]),
                address=n["ip"],
                netns=n["name"],
                python=SYSTEM_PYTHON,
                has_workload=bool(meta["own_gpus"]),
                default_run=bool(meta.get("default_run", True)),
            )
        for g in self.cluster["guests"]:
            meta = g.get("meta", {})
            name = g.get("name") or f"ct{g['vmid']}"
            d = self.workdir / "hosts" / name
            d.mkdir(parents=True)
            host = Host(
                name=name,
                kind="lxc",
                depth=2,
                dir=d,
                gpus=list(meta["gpus"]),
                address=meta.get("address"),
                vmid=int(g["vmid"]),
                node=self.hosts[g["node"]],
                reach=meta.get("reach", "hypervisor"),
                python=self.target_python if meta.get("reach") == "ssh" else VENV_PYTHON,
                has_workload=bool(meta.get("workload", True)),
                default_run=bool(meta.get("default_run", True)),
            )
            self.hosts[name] = host
            # The container's configuration on the cluster file system: what pct, the hooks and the API read.
            path = self.conf_path(host)
            path.parent.mkdir(parents=True, exist_ok=True)
            (path.parent.parent / "qemu-server").mkdir(exist_ok=True)
            path.write_text(g["conf"])
            host.conf = {k: v for k, v in pvenode.read_conf(path).items() if k not in ("digest", "description")}
            host.unprivileged = pvenode.unprivileged(host.conf)
        for n in self.cluster["nodes"]:
            host = self.hosts[n["name"]]
            (self.cluster_dir / "nodes" / host.name / "lxc").mkdir(parents=True, exist_ok=True)
            (self.cluster_dir / "nodes" / host.name / "qemu-server").mkdir(exist_ok=True)
            taken = {g for c in self.containers if c.node is host for g in c.gpus}
            if taken & set(host.gpus):
                raise LabError(f"{host.name}: its own GPUs {host.gpus} overlap its containers' {sorted(taken)}")

    # ------------------------------------------------------------------ nodes
    def _start_node(self, host: Host) -> None:
        """The hypervisor: its gpusim node, network, cgroups, and its first process (node_init.py, which
        becomes the reaping init once the node's mounts are made), then its sshd and protected daemons."""
        assert self.workdir is not None
        gpus = next(int(n.get("meta", {}).get("gpus", 8)) for n in self.cluster["nodes"] if n["name"] == host.name)
        (host.dir / "gpusim").mkdir(mode=0o755)
        host.sim = Node(path=host.dir / "gpusim", gpus=gpus).start()
        self._add_netns(host.name, host.address)
        host.cgroup_procs = [make_cgroup(base, f"{self.run_name}/{host.name}") / "cgroup.procs" for base in cgroup_bases()]
        for sub in ("lxc", "etc-upper", "etc-work", "sbin", "scratch", "pct"):
            (host.dir / sub).mkdir()
        (host.dir / "sbin" / "pct").symlink_to(PCT)
        (host.pct_dir / "latency_ms").write_text(f"{PCT_LATENCY_MS}\n")
        ours, theirs = ready_pair()
        cfg = {
            "hostname": host.name,
            "cgroup_procs": [str(p) for p in host.cgroup_procs],
            "dev_dir": str(host.sim.dev_dir),
            "scratch": str(host.dir / "scratch"),
            "lxc_dir": str(host.dir / "lxc"),
            "etc_upper": str(host.dir / "etc-upper"),
            "etc_work": str(host.dir / "etc-work"),
            "cluster_nodes": str(self.cluster_dir / "nodes"),
            "sbin_dir": str(host.dir / "sbin"),
            "sbinit": str(PID1),
            "ready_fd": theirs.fileno(),
        }
        argv = ["nsenter", f"--net={NETNS_DIR / host.name}", "--", "unshare", "--pid", "--fork", "--mount-proc", "--uts", "--kill-child"]
        argv += [sys.executable, "-I", str(NODE_INIT), json.dumps(cfg)]
        with open(host.dir / "init.log", "ab") as log:
            host.init_popen = subprocess.Popen(
                argv, pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, stdout=log, stderr=log, env={"PATH": STD_PATH}, start_new_session=True
            )
        theirs.close()
        try:
            _line, pid = recv_ready(ours, 20, f"{host.name} init")
        except LabError as exc:
            raise LabError(f"{exc}: {(host.dir / 'init.log').read_text(errors='replace')[-2000:]}") from None
        host.init = Proc(f"{host.name}-init", host.name, "init", pid)
        if host.init.levels[-1] != 1 or len(host.init.levels) != host.depth + 1:
            raise LabError(f"{host.name}: init has NSpid {host.init.levels}, expected depth {host.depth}")
        env = {
            "GPUSIM_STATE": str(host.sim.state_dir),
            "GPUSIM_DEV_DIR": "/dev",
            # The simulated libnvidia-ml.so.1 and libcuda.so.1 (gpusim keeps them in two directories).
            "LD_LIBRARY_PATH": f"{LIB_DIR}:{CUDA_DIR}",
            "PCTSIM_DIR": str(host.pct_dir),
            "PATH": f"{BIN_DIR}:{STD_PATH}",
            # pip reads none of this machine's configuration files; the index node's pip is configured
            # through the environment, as /etc/pip.conf would configure it on a real node.
            "PIP_CONFIG_FILE": os.devnull,
        }
        if host.name == INDEX_NODE and self.index is not None:
            # A plain-HTTP mirror on the private network, as many sites run one: pip needs it named trusted.
            env["PIP_INDEX_URL"] = self.index.url
            env["PIP_TRUSTED_HOST"] = self.controller_ip
        self._start_sshd(host, env)
        for name in DAEMONS:
            host.daemons[name] = self._spawn_daemon(host, name)

    def _node_run(
        self, node: Host, argv: list[str], in_node_cgroup: bool = False, timeout: float = 60, env: dict[str, str] | None = None
    ) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` on ``node`` (its namespaces); ``in_node_cgroup``: in its cgroups too (lxc-start,
        whose container cgroups nest under its own: lxc.cgroup.relative)."""

        def join() -> None:
            for procs in node.cgroup_procs:
                with open(procs, "w", encoding="ascii") as fh:
                    fh.write(f"{os.getpid()}\n")

        return subprocess.run(
            [*node.enter(), *argv],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
            env={"PATH": STD_PATH, **(env or {})},
            preexec_fn=join if in_node_cgroup else None,
        )

    def pct(self, node: Host, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        """``pct`` on ``node`` (the real one's second per call unless ``env`` sets PCTSIM_LATENCY_MS)."""
        return self._node_run(node, ["pct", *args], env=env)

    # ------------------------------------------------------------------ containers
    def _container_env(self, host: Host) -> dict[str, str]:
        """The simulated driver's address for everything in the container (its ``lxc.environment``)."""
        return {"GPUSIM_STATE": str(host.gpu_sim.state_dir), "GPUSIM_DEV_DIR": "/dev"}

    def _make_image(self, host: Host) -> None:
        """The container's disk (tests/lab/pvenode.py): its own /etc and init, this machine's /usr under
        an overlay with the simulated driver's library and nvidia-smi where NVIDIA's hook puts them, the job
        binaries, its Python bound in, the simulated driver's state directory bound in."""
        sim = host.gpu_sim
        files = {
            "bin/nvidia-smi": BIN_DIR / "nvidia-smi",
            f"{pvenode.LIB_DIR}/libnvidia-ml.so.1": LIB_DIR / "libnvidia-ml.so.1",
            f"{pvenode.LIB_DIR}/libcuda.so.1": LIBCUDA,
            CONTAINER_WORKER[len("/usr/") :]: WORKER,
        }
        for name in CONTAINER_DAEMONS:
            files[f"bin/{name}"] = WORKER
        # gpusim's server trees (gpusim.servers) run from the simulation kit at its own path, with the venv's Python.
        binds = [*python_binds(host.python), (str(sim.state_dir), str(sim.state_dir), False), (str(SIM_DIR), str(SIM_DIR), True)]
        pvenode.make_image(host.lxc_dir, int(host.vmid or 0), host.name, host.unprivileged, files, binds, sim.desc.driver_version)

    def _start_container(self, host: Host) -> None:
        """``pct start`` as pve-container does it: the LXC config written anew from the PVE one, then
        ``lxc-start -n <vmid>`` on the node; the init's pid from ``lxc-info``."""
        assert host.node is not None and host.vmid is not None and host.node.init is not None
        started = time.monotonic()
        node = host.node
        conf = pvenode.read_conf(self.conf_path(host))
        host.conf = {k: v for k, v in conf.items() if k not in ("digest", "description")}
        host.unprivileged = pvenode.unprivileged(conf)
        if not host.rootfs.exists():
            host.lxc_dir.mkdir(parents=True, exist_ok=True)
            self._make_image(host)
        text = pvenode.lxc_config(host.vmid, conf, f"/proc/{node.init.pid}/root", self._container_env(host))
        (host.lxc_dir / "config").write_text(text)
        log = f"/var/lib/lxc/{host.vmid}/lxc.log"
        proc = self._node_run(node, ["lxc-start", "-n", str(host.vmid), "-d", "-o", log, "-l", "ERROR"], in_node_cgroup=True)
        if proc.returncode != 0:
            tail = (host.lxc_dir / "lxc.log").read_text(errors="replace")[-3000:] if (host.lxc_dir / "lxc.log").exists() else ""
            raise LabError(f"{host.name}: lxc-start failed (rc {proc.returncode}): {proc.stderr.strip()}\n{tail}")
        info = self._node_run(node, ["lxc-info", "-n", str(host.vmid), "-p", "-H"])
        if info.returncode != 0 or not info.stdout.strip().isdigit():
            raise LabError(f"{host.name}: lxc-info: {info.stdout}{info.stderr}")
        pid = find_below(pidns_inode(node.init.pid), int(info.stdout))
        if pid is None:
            raise LabError(f"{host.name}: init {info.stdout.strip()} not found")
        host.init = Proc(f"{host.name}-init", host.name, "init", pid)
        if host.init.levels[-1] != 1 or len(host.init.levels) != host.depth + 1:
            raise LabError(f"{host.name}: init has NSpid {host.init.levels}, expected depth {host.depth}")
        if host.reach == "ssh":
            self._start_sshd(host, {**self._container_env(host), "PATH": STD_PATH, "container": "lxc"})
        for name in CONTAINER_DAEMONS:
            host.daemons[name] = self._spawn_daemon(host, name)
        self.timings[f"container {host.name}"] = time.monotonic() - started

    def lxc_running(self, host: Host) -> bool:
        """pct's running check, from here: LXC's command socket of the container in its node's
        network namespace (PVE::LXC::list_active_containers)."""
        assert host.node is not None
        if not host.node.running():
            return False
        try:
            with open(f"/proc/{host.node.init.pid}/net/unix", encoding="utf-8", errors="replace") as fh:  # type: ignore[union-attr]
                return any(line.rstrip().endswith(f" @/var/lib/lxc/{host.vmid}/command") for line in fh)
        except OSError:
            return False

    def lxc(self, host: Host, *argv: str) -> subprocess.CompletedProcess[str]:
        """An LXC tool on the container's node, about the container: ``lab.lxc(ct, "lxc-info")``."""
        assert host.node is not None
        return self._node_run(host.node, [argv[0], "-n", str(host.vmid), *argv[1:]])

    def interfaces(self, host: Host) -> list[dict[str, Any]]:
        """The container's network interfaces as the API's ``/interfaces`` reports them (name, hwaddr,
        inet, inet6), read from its network namespace."""
        if not host.running():
            return []
        assert host.init is not None
        proc = sh("nsenter", "-t", host.init.pid, "-n", "ip", "-j", "addr", "show")
        out = []
        for link in json.loads(proc.stdout or "[]"):
            row: dict[str, Any] = {"name": link["ifname"], "hwaddr": link.get("address", "00:00:00:00:00:00")}
            for family, key in (("inet", "inet"), ("inet6", "inet6")):
                addrs = [a for a in link.get("addr_info", []) if a.get("family") == family]
                if addrs:
                    row[key] = f"{addrs[0]['local']}/{addrs[0]['prefixlen']}"
            out.append(row)
        return out

    # ------------------------------------------------------------------ sshd
    def _sshd_config(self, host: Host, env: dict[str, str]) -> Path:
        """sshd's files: a node's in its directory of the run (it sees this machine's file system), a
        container's in its own /etc/ssh and /root/.ssh. Returns the config's path as the host sees it."""
        assert self.workdir is not None
        inside = host.kind == "lxc"
        root = host.rootfs if inside else None

        def path(rel_inside: str, rel_dir: str) -> tuple[Path, str]:
            if root is not None:
                return root / rel_inside.lstrip("/"), rel_inside
            return host.dir / rel_dir, str(host.dir / rel_dir)

        if root is None:
            # Each node has its own root home, as separate machines do: sessions read none of this
            # machine's shell start-up files (bash sources ~/.bashrc for SSH commands).
            home = host.dir / "root"
            home.mkdir(mode=0o700, exist_ok=True)
            env = {"HOME": str(home), **env}
        key, key_at = path("/etc/ssh/ssh_host_ed25519_key", "ssh_host_ed25519_key")
        if not key.exists():
            sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"{host.name}-host", "-f", key)
        auth, auth_at = path("/root/.ssh/authorized_keys", "authorized_keys")
        shutil.copy(self.workdir / "ssh" / "id_ed25519.pub", auth)
        _pid, pid_at = path("/run/sshd.pid", "sshd.pid")
        conf, _conf_at = path("/etc/ssh/sshd_config", "sshd_config")
        conf.write_text(
            "\n".join(
                [
                    f"# sshd of lab host {host.name} (written by tests/lab/builder.py)",
                    f"ListenAddress {host.address}:22",
                    f"HostKey {key_at}",
                    f"PidFile {pid_at}",
                    f"AuthorizedKeysFile {auth_at}",
                    "PermitRootLogin prohibit-password",
                    "PubkeyAuthentication yes",
                    "PasswordAuthentication no",
                    "KbdInteractiveAuthentication no",
                    "UsePAM no",
                    "StrictModes no",
                    "UseDNS no",
                    "PrintMotd no",
                    "PrintLastLog no",
                    "MaxSessions 64",
                    "MaxStartups 64:30:128",
                    "SetEnv " + " ".join(f"{k}={v}" for k, v in env.items()),
                    "Subsystem sftp internal-sftp",
                    "",
                ]
            )
        )
        if inside and host.unprivileged:
            for p in (key, key.with_name(key.name + ".pub"), auth, conf):
                os.chown(p, pvenode.ID_BASE, pvenode.ID_BASE)
        return conf

    def _start_sshd(self, host: Host, env: dict[str, str] | None = None) -> None:
        inside = host.kind == "lxc"
        conf = (host.rootfs / "etc/ssh/sshd_config" if inside else host.dir / "sshd_config") if env is None else self._sshd_config(host, env)
        pidfile = host.rootfs / "run/sshd.pid" if inside else host.dir / "sshd.pid"
        log = host.rootfs / "var/log/sshd.log" if inside else host.dir / "sshd.log"
        try:
            pidfile.unlink()
        except FileNotFoundError:
            pass
        conf_at = "/etc/ssh/sshd_config" if inside else str(conf)
        log_at = "/var/log/sshd.log" if inside else str(log)
        with open(host.dir / "sshd.out", "ab") as out:  # never a pipe: sshd keeps its stdio
            rc = subprocess.run(
                [*host.enter(), "setsid", "-f", SSHD, "-D", "-f", conf_at, "-E", log_at],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=out,
                env={"PATH": STD_PATH},
                check=False,
            ).returncode
        if rc != 0:
            raise LabError(f"{host.name}: starting sshd failed (rc {rc}): {(host.dir / 'sshd.out').read_text(errors='replace')[-2000:]}")
        deadline = time.monotonic() + 10
        while True:
            text = pidfile.read_text().strip() if pidfile.exists() else ""
            if text.isdigit():
                break
            if time.monotonic() > deadline:
                raise LabError(f"{host.name}: sshd did not start: {log.read_text(errors='replace')[-2000:] if log.exists() else ''}")
            time.sleep(0.01)
        assert host.init is not None
        outer = find_in_namespace(pidns_inode(host.init.pid), int(text))
        if outer is None:
            raise LabError(f"{host.name}: sshd pid {text} not found")
        host.sshd = Proc(f"{host.name}-sshd", host.name, "sshd", outer)
        self._wait_ssh(host)

    def _wait_ssh(self, host: Host, timeout: float = 10) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                with socket.create_connection((str(host.address), 22), timeout=1) as s:
                    if s.recv(4).startswith(b"SSH-"):
                        return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise LabError(f"{host.name}: sshd on {host.address}:22 does not answer")
            time.sleep(0.02)

    def stop_sshd(self, host: Host) -> None:
        """The host becomes unreachable: its sshd and every session it serves end, and the
        controller's multiplexed connections are closed."""
        self.close_connections()
        if host.sshd is not None:
            host.sshd.signal(signal.SIGTERM)
            host.sshd.wait_gone(5)
            host.sshd.close()
            host.sshd = None
        assert host.init is not None
        ns = pidns_inode(host.init.pid)
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/comm") as f:
                    comm = f.read().strip()
                if comm == "sshd" and pidns_inode(int(entry)) == ns:
                    Proc("session", host.name, "sshd", int(entry)).signal(signal.SIGKILL)
            except (FileNotFoundError, ProcessLookupError):
                continue

    def start_sshd(self, host: Host) -> None:
        if host.sshd is None or not host.sshd.alive():
            self._start_sshd(host)

    # ------------------------------------------------------------------ processes
    def _spawn(
        self, host: Host, argv: list[str], name: str, kind: str, gpus: list[int], executable: str | Path = WORKER, ignores_term: bool = False
    ) -> list[Proc]:
        """Start a gpusim-worker inside ``host`` (detached: its parent is the host's init, as for a
        job in a container); returns the worker, or for --fork-child the child that kept the GPU.
        In a container it runs through ``lxc-attach --clear-env`` with the container's environment."""
        sim = host.gpu_sim
        ours, theirs = ready_pair()
        if host.kind == "lxc" and executable == WORKER:
            executable = CONTAINER_WORKER
        full = [str(executable), "--state", str(sim.state_dir), *argv, "--ready-fd", str(theirs.fileno())]
        env = {"PATH": STD_PATH, "GPUSIM_STATE": str(sim.state_dir), "GPUSIM_DEV_DIR": "/dev", "LD_LIBRARY_PATH": str(LIB_DIR)}
        with open(host.dir / "workers.log", "ab") as log:
            popen = subprocess.Popen(
                [*host.enter(), "setsid", "-f", *full], pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=env
            )
        theirs.close()
        try:
            line, sender = recv_ready(ours, 10, f"{host.name} {name}")
        finally:
            popen.wait(10)
        words = line.split()
        assert host.init is not None
        ns = pidns_inode(host.init.pid)
        if len(words) >= 4 and words[2] == "child":
            # --fork-child: the parent exits once its child holds the GPU; the child is what is left.
            child = find_in_namespace(ns, int(words[3]))
            if child is None:
                raise LabError(f"{host.name}: forked child {words[3]} of {name} not found")
            return [Proc(f"{name} (forked child)", host.name, "child", child, gpus=gpus)]
        pid = sender or find_in_namespace(ns, int(words[1]))
        if not pid:
            raise LabError(f"{host.name}: {name} ({line}) not found")
        return [Proc(name, host.name, kind, pid, gpus=gpus, ignores_term=ignores_term)]

    def _spawn_daemon(self, host: Host, name: str) -> Proc:
        assert self.workdir is not None
        argv = ["--hold-only", "--title", name]
        gpus = list(range(len(host.gpu_sim.gpus))) if host.kind == "node" else host.gpus
        if host.kind == "lxc":
            for g in host.gpus:
                argv += ["--gpu", str(g)]
        executable = f"/usr/bin/{name}" if host.kind == "lxc" else self.workdir / "bin" / name
        return self._spawn(host, argv, name, "daemon", gpus, executable=executable)[0]

    def spawn_job(self, host: Host, plan: list[dict[str, Any]]) -> list[Proc]:
        """Start the workers of ``plan`` (see :func:`workload_plan`) inside ``host``; the live ones."""
        procs: list[Proc] = []
        for w in plan:
            argv = ["--mib", str(w["mib"]), "--title", w["title"]]
            for g in w["gpus"]:
                argv += ["--gpu", str(g)]
            if w.get("ignore_term"):
                argv.append("--ignore-term")
            if w.get("fork_child"):
                argv.append("--fork-child")
            procs += self._spawn(host, argv, w["title"], "worker", w["gpus"], ignores_term=bool(w.get("ignore_term")))
        return [p for p in procs if p.alive()]

    def end_workload(self, hosts: list[Host]) -> None:
        """SIGKILL what is left of these hosts' workloads and wait until each process is gone."""
        for host in hosts:
            for p in host.workload:
                p.signal(signal.SIGKILL)
            for p in host.workload:
                p.wait_gone(5)
                p.close()
            host.workload = []

    def spawn_workload(self, host: Host) -> list[Proc]:
        host.workload = self.spawn_job(host, workload_plan(host.gpus)) if host.has_workload else []
        return host.workload

    def sandbox(self, host: Host) -> ContainerSandbox:
        """The container as gpusim.servers takes a sandbox: start SGLang or vLLM server trees in it."""
        return ContainerSandbox(host)

    # ------------------------------------------------------------------ state between tests
    def reset(self) -> None:
        """Back to the starting picture: every host running and reachable, no faults, every
        daemon up, and a fresh workload on every host."""
        for host in self.nodes:
            host.gpu_sim.clear_faults()
        for host in self.containers:
            if not host.running():
                self.start_container(host)
        for host in self.hosts.values():
            if host.reach == "ssh":
                self.start_sshd(host)
            for name, proc in list(host.daemons.items()):
                if not proc.alive():
                    host.daemons[name] = self._spawn_daemon(host, name)
        self.end_workload(list(self.hosts.values()))
        for host in self.nodes:
            host.gpu_sim.wait_clean(timeout=10)
        for host in self.hosts.values():
            self.spawn_workload(host)

    def stop_container(self, host: Host) -> None:
        """``pct stop``: ``lxc-stop -k`` on its node; its init dies and the kernel ends everything in it."""
        assert host.init is not None
        if host.sshd is not None:
            host.sshd.close()
            host.sshd = None
        proc = self.lxc(host, "lxc-stop", "-k")
        if proc.returncode != 0:
            raise LabError(f"{host.name}: lxc-stop: {proc.stderr.strip()}")
        host.init.wait_gone(5)
        for p in [*host.workload, *host.daemons.values()]:
            p.wait_gone(5)
        self.wait_free(host)

    def wait_free(self, host: Host, timeout: float = 10) -> None:
        """Wait until the simulated driver has released the memory on ``host``'s GPUs."""
        deadline = time.monotonic() + timeout
        while any(self.used_mib(host).values()):
            if time.monotonic() > deadline:
                raise LabError(f"{host.name}: GPUs still in use after {timeout} s: {self.used_mib(host)}")
            time.sleep(0.005)

    def start_container(self, host: Host) -> None:
        for p in [*host.workload, *host.daemons.values()]:
            p.close()
        if host.init is not None:
            host.init.close()
        host.workload, host.daemons = [], {}
        self._start_container(host)

    def close_connections(self) -> None:
        """Close the controller's multiplexed SSH connections (ControlPersist masters)."""
        if self.workdir is None:
            return
        for sock in (self.workdir / "cp").iterdir():
            subprocess.run(["ssh", "-o", f"ControlPath={sock}", "-O", "exit", "lab"], capture_output=True, check=False, timeout=10, stdin=subprocess.DEVNULL)
            try:
                sock.unlink()
            except FileNotFoundError:
                pass

    # ------------------------------------------------------------------ API and inventory
    def _start_api(self) -> None:
        """pvesim serving lab.yml, with each container's configuration read from its file on the cluster
        file system, its state from LXC and its interfaces from its network namespace, at every request."""
        cluster = Cluster(self.cluster)
        for host in self.containers:
            cluster.guests[int(host.vmid or 0)].interfaces = lambda host=host: self.interfaces(host)  # type: ignore[misc]
        self.sim = PveSim(cluster, tls=True, tokens={TOKEN_ID: self.token_secret}, refresh=self._refresh_api).start()

    def _refresh_api(self, cluster: Cluster) -> None:
        for host in self.containers:
            g = cluster.guests[int(host.vmid or 0)]
            text = self.conf_path(host).read_text()
            if text != g.meta.get("_conf_text"):
                cluster.set_conf(g.vmid, text)
                g.meta["_conf_text"] = text
            running = self.lxc_running(host) and host.running()
            g.status = "running" if running else "stopped"
            g.pid = host.init.pid_at(1) if running and host.init is not None else None

    def _write_inventory(self) -> None:
        """The inventory an operator would write: the plugin's source file (token from the
        environment), group_vars for the connection, host_vars for what differs per host."""
        assert self.workdir is not None and self.sim is not None
        inv = self.workdir / "inventory"
        self.inventory = inv / "lab.proxmox.yml"
        self.inventory.write_text(
            "# The lab's Proxmox VE API (tests/sim/pvesim serving clusters/lab.yml); the token comes\n"
            "# from PROXMOX_TOKEN_ID / PROXMOX_TOKEN_SECRET.\n"
            "plugin: gpuops.clean_slate.proxmox\n"
            f"url: {self.sim.url}\n"
            f"ca_path: {self.sim.ca_path}\n"
        )
        (inv / "group_vars" / "all.yml").write_text(
            "---\n"
            "# Every lab host: root over SSH with this run's key; host keys are new every run.\n"
            "ansible_user: root\n"
            f"ansible_ssh_private_key_file: {self.workdir / 'ssh' / 'id_ed25519'}\n"
            "ansible_ssh_common_args: -o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null -o ConnectTimeout=5 -o LogLevel=ERROR\n"
            "# Short waits: the simulated driver frees memory in about 0.1 s.\n"
            "clean_slate_grace_period: 1\n"
            "clean_slate_kill_timeout: 5\n"
            "clean_slate_verify_timeout: 10\n"
            "# The lab's crashed servers are seconds old: their residue goes at once (a real one's is older than the minute).\n"
            "clean_slate_residue_min_age: 0\n"
        )
        for host in self.hosts.values():
            lines = [
                "---",
                f"# {host.name}: {'Proxmox VE node' if host.kind == 'node' else f'LXC container {host.vmid} on {host.node.name}'}",  # type: ignore[union-attr]
            ]
            if host.kind == "node":
                lines += ["# No ansible_python_interpreter: Ansible finds Debian's python3, as on a Proxmox VE node."]
            else:
                lines += [f"ansible_python_interpreter: {host.python}"]
            if host.venv is not None:
                node = host if host.kind == "node" else host.node
                assert node is not None
                lines += [
                    "# The modules' dependencies go into a virtual environment on the node (for a container cleaned",
                    "# through it too), from the controller's package index or from its wheels.",
                    "clean_slate_install_dependencies: true",
                    f"clean_slate_venv_dir: {host.venv}",
                ]
                if node.name != INDEX_NODE:
                    lines += [f"clean_slate_wheels_dir: {WHEELS}"]
            if host.kind == "node":
                others = sorted({g for c in self.containers if c.node is host for g in c.gpus})
                lines += [f"# Its own GPUs; {others} are passed through to its containers, cleaned in their own scope.", f"clean_slate_gpus: {host.gpus}"]
            elif host.reach == "ssh":
                lines += ["# The simulated NVML shows a container every GPU of its node: name the passed-through ones.", f"clean_slate_gpus: {host.gpus}"]
            (inv / "host_vars" / f"{host.name}.yml").write_text("\n".join(lines) + "\n")

    def env(self) -> dict[str, str]:
        """Environment of the controller's Ansible runs (token for the inventory source)."""
        assert self.workdir is not None
        return {
            "PROXMOX_TOKEN_ID": TOKEN_ID,
            "PROXMOX_TOKEN_SECRET": self.token_secret,
            "ANSIBLE_SSH_CONTROL_PATH_DIR": str(self.workdir / "cp"),
            "ANSIBLE_TIMEOUT": "10",
            # community.proxmox (for proxmox_pct_remote), test-only, beside the checkout's collection.
            "ANSIBLE_COLLECTIONS_PATH": f"{ROOT}:{TEST_COLLECTIONS}",
        }

    def playbook(self, playbook: str | Path | list[dict[str, Any]] = PLAYBOOK, **kw: Any) -> AnsibleRun:
        """ansible-playbook against the lab inventory (the real playbook by default); without ``limit``,
        on the hosts of :attr:`default_limit`."""
        env = self.env()
        env.update(kw.pop("env", None) or {})
        if kw.get("limit") is None:
            kw["limit"] = self.default_limit
        return run_playbook(playbook, inventory=kw.pop("inventory", self.inventory), env=env, **kw)

    def pct_remote_inventory(self) -> Path:
        """The lab inventory with ``pct_remote: no_address``: the containers without an address are reached
        through their node by community.proxmox's proxmox_pct_remote connection and clean themselves, so
        their host_vars are those of a host of its own: the container's Python, with the dependencies (as an
        image that has them; making a virtual environment inside the container through pct_remote works
        too, but costs the lab some 30 s), and their GPUs named. The other hosts' host_vars and the
        group_vars are the lab inventory's."""
        assert self.workdir is not None and self.inventory is not None
        inv = self.workdir / "inventory-pct_remote"
        if not inv.exists():
            (inv / "host_vars").mkdir(parents=True)
            (inv / "group_vars").symlink_to(self.inventory.parent / "group_vars")
            for host in self.hosts.values():
                source = self.inventory.parent / "host_vars" / f"{host.name}.yml"
                if host.kind == "node" or host.reach == "ssh":
                    (inv / "host_vars" / source.name).symlink_to(source)
                    continue
                (inv / "host_vars" / source.name).write_text(
                    "\n".join(
                        [
                            "---",
                            f"# {host.name}: LXC container {host.vmid}, through its node with proxmox_pct_remote; cleans itself.",
                            f"ansible_python_interpreter: {host.python}",
                            "# The simulated NVML shows a container every GPU of its node: name the passed-through ones.",
                            f"clean_slate_gpus: {host.gpus}",
                            "",
                        ]
                    )
                )
            text = self.inventory.read_text()
            (inv / self.inventory.name).write_text(
                text + "# Containers without an address: through their node with community.proxmox.proxmox_pct_remote.\npct_remote: no_address\n"
            )
        return inv / self.inventory.name

    def ansible_inventory(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(VENV / "bin" / "ansible-inventory"), "-i", str(self.inventory), *args],
            env=ansible_env(self.env()),
            capture_output=True,
            text=True,
            timeout=120,
            cwd=str(ROOT),
            check=False,
        )

    # ------------------------------------------------------------------ observation
    def used_mib(self, host: Host) -> dict[int, int]:
        """Memory in use on each of the host's GPUs, straight from the simulator's state."""
        return {g: host.gpu_sim.memory(g)["used_mib"] for g in host.gpus}

    def pct_calls(self, node: Host) -> list[list[str]]:
        log = node.pct_dir / "calls.jsonl"
        return [json.loads(line)["argv"] for line in log.read_text().splitlines()] if log.exists() else []

    # ------------------------------------------------------------------ teardown
    def teardown(self) -> None:
        """Stop and remove everything the lab made. Idempotent; keeps going past errors."""
        if self._torn_down:
            return
        self._torn_down = True
        errors: list[str] = []

        def attempt(what: str, fn: Any, *args: Any) -> None:
            try:
                fn(*args)
            except Exception as exc:
                errors.append(f"{what}: {exc}")

        attempt("ssh connections", self.close_connections)
        if self.sim is not None:
            attempt("API simulator", self.sim.stop)
        if self.index is not None:
            attempt("package index", self.index.stop)
        # A node's init takes everything in its PID namespace with it: sshd, sessions, LXC's monitors and
        # the containers (their PID namespaces nest in the node's), whose mounts go with their namespaces.
        for host in self.nodes:
            if host.init is not None:
                host.init.signal(signal.SIGKILL)
                host.init.wait_gone(5)
            if host.init_popen is not None:
                try:
                    host.init_popen.wait(10)
                except subprocess.TimeoutExpired:
                    host.init_popen.kill()
        for host in self.hosts.values():
            for p in [host.init, host.sshd, *host.workload, *host.daemons.values()]:
                if p is not None:
                    if p.alive():
                        p.signal(signal.SIGKILL)
                        p.wait_gone(5)
                    p.close()
            if host.sim is not None:
                attempt(f"{host.name} gpusim", host.sim.stop)
        for base in cgroup_bases():
            attempt(f"cgroups {base / self.run_name}", remove_cgroup_tree, base / self.run_name)
        for name in reversed(self._netns):
            attempt(f"netns {name}", sh, "ip", "netns", "delete", name)
        if self._orig_netns >= 0:
            attempt("back to the original network namespace", os.setns, self._orig_netns, os.CLONE_NEWNET)
            os.close(self._orig_netns)
            self._orig_netns = -1
        if self._netns_mounted:
            attempt("unmount /run/netns", sh, "umount", "-l", NETNS_DIR)
        if self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)
        if self._lock_fd >= 0:
            (LOCK_DIR / f"{self.run_id}.lock").unlink(missing_ok=True)
            os.close(self._lock_fd)
            self._lock_fd = -1
        if errors:
            raise LabError("teardown: " + "; ".join(errors))
