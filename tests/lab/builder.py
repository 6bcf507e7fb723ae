"""The multi-host lab: two Proxmox "hypervisors" with simulated GPUs and three LXC
"containers", each a real SSH host or a real PID namespace, on a private network.

Built from ``tests/sim/pvesim/clusters/lab.yml`` (the same description the Proxmox API
simulator serves to the inventory plugin), so the inventory describes exactly what runs.
See docs/lab.md for the picture. In short:

* network namespace ``gpuopslab`` (the controller's: pytest, ansible-playbook, the API
  simulator on 127.0.0.1) holds the bridge ``gpuopslab0`` with 10.77.0.1/24; veth links go
  to the network namespaces ``pve1``, ``pve2`` and ``ct101``;
* a hypervisor is a network namespace + PID namespace (+ its own /proc and mount namespace) whose
  pid 1 is ``gpusim/_sbinit.py``, running its own ``sshd`` on its address, with a gpusim node (8 GPUs)
  whose sessions get ``GPUSIM_STATE``, ``LD_LIBRARY_PATH`` and ``PCTSIM_DIR``; the fake ``pct`` is at
  ``/usr/sbin/pct`` there (an overlay on ``/usr/sbin`` in its mount namespace), where Proxmox VE has it
  and where community.proxmox's ``proxmox_pct_remote`` calls it. Its Python is this machine's Debian
  ``/usr/bin/python3`` (EXTERNALLY-MANAGED), without the modules' dependencies: the role installs them
  into a virtual environment (pve1 from a package index the controller serves, pve2 from wheels
  shipped by the controller; neither reaches anything else), and pip reads no configuration of this
  machine (``PIP_CONFIG_FILE=/dev/null``);
* a container is a PID namespace nested in its hypervisor's (so the hypervisor's /proc sees
  its processes, with NSpid levels, as on Proxmox), in the cgroup ``lxc/<vmid>``, registered
  with its hypervisor's ``pct``; ct101 also has a network namespace and its own sshd;
  ct102 and ct201 have an empty network namespace and are reached only through ``pct``.

Everything runs inside ``tools/pidns-run`` (private PID and mount namespaces), so the
named network namespaces live on a private tmpfs at /run/netns and nothing the lab starts
can outlive the run. :meth:`Lab.teardown` also removes it all explicitly.
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
from pvesim import PveSim, load_cluster, parse_conf  # noqa: E402
from support.ansible import VENV, VENV_PYTHON, AnsibleRun, ansible_env, run_playbook  # noqa: E402

CLUSTER_FILE = TESTS / "sim" / "pvesim" / "clusters" / "lab.yml"
# A reaping init, the same as a gpusim sandbox's.
PID1 = HERE.parent / "sim" / "gpusim" / "_sbinit.py"
FAKE_PCT = TESTS / "sim" / "bin" / "pct"
PLAYBOOK = ROOT / "playbooks" / "clean_slate.yml"
WORKER = BIN_DIR / "gpusim-worker"
SSHD = "/usr/sbin/sshd"
CONTROLLER_NS = "gpuopslab"
BRIDGE = "gpuopslab0"
NETNS_DIR = Path("/run/netns")
LOCK_FILE = Path("/run/lock/gpuops-clean-slate-lab.lock")
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
STD_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
#: Moves the shell into a cgroup (cgroup v2: "0" means the writer), then execs the command.
CGROUP_JOIN = 'echo 0 > "$0" 2>/dev/null; exec "$@"'
INIT_PID_NS_INO = 0xEFFFFFFC
CRED = struct.Struct("3i")
TOKEN_ID = "root@pam!gpuops-lab"


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


def cgroup2_base() -> Path | None:
    """Where a writable cgroup v2 hierarchy is mounted (hybrid layout first)."""
    mounts = {}
    with open("/proc/self/mounts") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 3:
                mounts[parts[1]] = parts[2]
    for base in ("/sys/fs/cgroup/unified", "/sys/fs/cgroup"):
        if mounts.get(base) == "cgroup2" and os.access(base, os.W_OK):
            return Path(base)
    return None


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
    """A lab host: hypervisor ("node") or container ("lxc")."""

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
    conf: dict[str, Any] = field(default_factory=dict)
    init: Proc | None = None
    init_popen: subprocess.Popen[bytes] | None = None
    sshd: Proc | None = None
    cgroup: Path | None = None
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

    def enter(self, cgroup: bool = True) -> list[str]:
        """Prefix that runs a command inside this host (PID, mount and network namespaces)."""
        assert self.init is not None and self.init.alive(), f"{self.name} is not running"
        prefix = ["nsenter", "-t", str(self.init.pid), "-p", "-m", "-n", "--"]
        if cgroup and self.cgroup is not None:
            prefix += ["/bin/sh", "-c", CGROUP_JOIN, str(self.cgroup / "cgroup.procs")]
        return prefix

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

    def __init__(self) -> None:
        self.cluster = load_cluster(CLUSTER_FILE)
        meta = self.cluster.get("meta", {})
        self.subnet_prefix = int(str(meta.get("subnet", "10.77.0.0/24")).split("/")[1])
        self.controller_ip = str(meta.get("controller", "10.77.0.1"))
        self.workdir: Path | None = None
        self.hosts: dict[str, Host] = {}
        self.sim: PveSim | None = None
        self.token_secret = str(uuid.uuid4())
        self.inventory: Path | None = None
        self.target_python = VENV_PYTHON
        self.index: PackageIndex | None = None
        self._lock_fd = -1
        self._orig_netns = -1
        self._netns_mounted = False
        self._netns: list[str] = []
        self._cgroups: list[Path] = []
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

    # ------------------------------------------------------------------ build
    def build(self) -> Lab:
        if os.geteuid() != 0:
            raise LabError("the lab needs root (network namespaces, sshd, cgroups)")
        if not in_private_pidns() or os.environ.get("GPUOPS_PIDNS") != "1":
            raise LabError("the lab runs only inside tools/pidns-run (make lab)")
        tools = ("ip", "nsenter", "unshare", "ssh", "ssh-keygen", "setsid", "mount")
        if not os.path.exists(SSHD) or not all(shutil.which(tool) for tool in tools):
            # openssh-server, openssh-client, iproute2: installed when missing (Debian, root).
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
            self._remove_stale()
            self.workdir = Path(tempfile.mkdtemp(prefix=TMP_PREFIX))
            for sub in ("ssh", "cp", "inventory/host_vars", "inventory/group_vars", "bin", "hosts", "reports"):
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
        return self

    def _take_lock(self) -> None:
        """One lab at a time on this machine (they share cgroup paths and the lab's names)."""
        LOCK_FILE.parent.mkdir(parents=True, exist_ok=True)
        self._lock_fd = os.open(LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        deadline = time.monotonic() + 900
        while True:
            try:
                fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise LabError(f"another lab holds {LOCK_FILE}") from None
                time.sleep(0.5)

    def _remove_stale(self) -> None:
        """What a crashed run can leave behind, removed by name. (Processes and network
        namespaces die with the pidns-run that held them; named namespace files, a bridge in
        this network namespace, empty cgroups and temp dirs may stay.)"""
        names = [CONTROLLER_NS, *(n["name"] for n in self.cluster["nodes"]), *(f"ct{g['vmid']}" for g in self.cluster["guests"])]
        for name in names:
            if (NETNS_DIR / name).exists():
                sh("ip", "netns", "delete", name, check=False)
                try:
                    (NETNS_DIR / name).unlink()
                except OSError:
                    pass
        if Path(f"/sys/class/net/{BRIDGE}").exists():
            sh("ip", "link", "delete", BRIDGE, check=False)
        base = cgroup2_base()
        if base is not None:
            for g in self.cluster["guests"]:
                try:
                    (base / "lxc" / str(g["vmid"])).rmdir()
                except OSError:
                    pass
        for old in glob.glob(os.path.join(tempfile.gettempdir(), TMP_PREFIX + "*")):
            shutil.rmtree(old, ignore_errors=True)

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
        sh("ip", "netns", "add", name)
        self._netns.append(name)
        sh("ip", "-n", name, "link", "set", "lo", "up")
        if address is None:
            return
        veth = f"v{name}"[:15]
        sh("ip", "-n", CONTROLLER_NS, "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", name)
        sh("ip", "-n", CONTROLLER_NS, "link", "set", veth, "master", BRIDGE, "up")
        sh("ip", "-n", name, "addr", "add", f"{address}/{self.subnet_prefix}", "dev", "eth0")
        sh("ip", "-n", name, "link", "set", "eth0", "up")
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
            )
        for g in self.cluster["guests"]:
            meta = g.get("meta", {})
            name = g.get("name") or f"ct{g['vmid']}"
            d = self.workdir / "hosts" / name
            d.mkdir(parents=True)
            conf = {k: v for k, v in parse_conf(g.get("conf", ""), "lxc").items() if k not in ("digest", "description")}
            self.hosts[name] = Host(
                name=name,
                kind="lxc",
                depth=2,
                dir=d,
                gpus=list(meta["gpus"]),
                address=meta.get("address"),
                vmid=int(g["vmid"]),
                node=self.hosts[g["node"]],
                reach=meta.get("reach", "hypervisor"),
                netns=name if meta.get("reach") == "ssh" else None,
                python=self.target_python if meta.get("reach") == "ssh" else VENV_PYTHON,
                conf=conf,
            )
        for n in self.cluster["nodes"]:
            host = self.hosts[n["name"]]
            taken = {g for c in self.containers if c.node is host for g in c.gpus}
            if taken & set(host.gpus):
                raise LabError(f"{host.name}: its own GPUs {host.gpus} overlap its containers' {sorted(taken)}")

    # ------------------------------------------------------------------ hosts
    def _start_init(self, host: Host, prefix: list[str], unshare_net: bool) -> None:
        """pid 1 of a new PID namespace (own /proc) made from inside ``prefix``."""
        ours, theirs = ready_pair()
        argv = ["unshare", "--pid", "--fork", "--mount-proc", "--kill-child"]
        if unshare_net:
            argv.append("--net")
        argv += [sys.executable, "-I", "-S", str(PID1), str(theirs.fileno())]
        env = {"PATH": STD_PATH}
        if host.kind == "lxc":
            env["container"] = "lxc"  # what an LXC guest's /proc/1/environ says
        with open(host.dir / "init.log", "ab") as log:
            host.init_popen = subprocess.Popen(
                [*prefix, *argv], pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=env, start_new_session=True
            )
        theirs.close()
        _line, pid = recv_ready(ours, 10, f"{host.name} init")
        host.init = Proc(f"{host.name}-init", host.name, "init", pid)
        if host.init.levels[-1] != 1 or len(host.init.levels) != host.depth + 1:
            raise LabError(f"{host.name}: init has NSpid {host.init.levels}, expected depth {host.depth}")

    def _start_node(self, host: Host) -> None:
        assert self.workdir is not None
        gpus = next(int(n.get("meta", {}).get("gpus", 8)) for n in self.cluster["nodes"] if n["name"] == host.name)
        host.sim = Node(path=host.dir / "gpusim", gpus=gpus).start()
        self._add_netns(host.name, host.address)
        self._start_init(host, ["nsenter", f"--net={NETNS_DIR / host.name}", "--"], unshare_net=False)
        host.pct_dir.mkdir()
        (host.pct_dir / "node").write_text(host.name + "\n")
        # /usr/sbin/pct, in this node's mount namespace only (unshare made it private): a read-only overlay
        # of a directory holding the fake pct over this machine's /usr/sbin.
        (host.dir / "sbin").mkdir()
        (host.dir / "sbin" / "pct").symlink_to(FAKE_PCT)
        assert host.init is not None
        overlay = f"lowerdir={host.dir / 'sbin'}:/usr/sbin"
        sh("nsenter", "-t", host.init.pid, "-m", "--", "mount", "-t", "overlay", "-o", overlay, "gpuops-lab-sbin", "/usr/sbin")
        env = {
            "GPUSIM_STATE": str(host.sim.state_dir),
            "LD_LIBRARY_PATH": str(LIB_DIR),
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

    def _start_container(self, host: Host) -> None:
        assert host.node is not None and host.vmid is not None
        if host.netns and host.netns not in self._netns:
            self._add_netns(host.netns, host.address)
        node = host.node
        prefix = ["nsenter", "-t", str(node.init.pid), "-p", "-m"]  # type: ignore[union-attr]
        if host.netns:
            prefix.append(f"--net={NETNS_DIR / host.netns}")
        prefix.append("--")
        base = cgroup2_base()
        if base is not None:
            host.cgroup = base / "lxc" / str(host.vmid)
            host.cgroup.mkdir(parents=True, exist_ok=True)
            if host.cgroup not in self._cgroups:
                self._cgroups.append(host.cgroup)
            prefix += ["/bin/sh", "-c", CGROUP_JOIN, str(host.cgroup / "cgroup.procs")]
        self._start_init(host, prefix, unshare_net=host.netns is None)
        self._register_pct(host, "running")
        if host.reach == "ssh":
            sim = host.gpu_sim
            env = {
                "GPUSIM_STATE": str(sim.state_dir),
                "LD_LIBRARY_PATH": str(LIB_DIR),
                "PATH": f"{BIN_DIR}:{STD_PATH}",
                "container": "lxc",
            }
            self._start_sshd(host, env)
        for name in CONTAINER_DAEMONS:
            host.daemons[name] = self._spawn_daemon(host, name)

    def _register_pct(self, host: Host, status: str) -> None:
        """The container in its hypervisor's pct registry; ``pid`` is the init's pid as the
        hypervisor sees it (where pct runs)."""
        assert host.node is not None
        running = status == "running" and host.running()
        doc = {
            "vmid": host.vmid,
            "status": "running" if running else "stopped",
            "pid": host.init.pid_at(host.node.depth) if running and host.init else None,
            "node": host.node.name,
            "hostname": host.name,
            "config": host.conf,
        }
        path = host.node.pct_dir / f"{host.vmid}.json"
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(json.dumps(doc) + "\n")
        os.replace(tmp, path)

    # ------------------------------------------------------------------ sshd
    def _sshd_config(self, host: Host, env: dict[str, str]) -> Path:
        assert self.workdir is not None
        # Each host has its own root home, as separate machines do: sessions read none of this
        # machine's shell start-up files (bash sources ~/.bashrc for SSH commands).
        home = host.dir / "root"
        home.mkdir(mode=0o700, exist_ok=True)
        env = {"HOME": str(home), **env}
        key = host.dir / "ssh_host_ed25519_key"
        if not key.exists():
            sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"{host.name}-host", "-f", key)
        auth = host.dir / "authorized_keys"
        shutil.copy(self.workdir / "ssh" / "id_ed25519.pub", auth)
        conf = host.dir / "sshd_config"
        conf.write_text(
            "\n".join(
                [
                    f"# sshd of lab host {host.name} (written by tests/lab/builder.py)",
                    f"ListenAddress {host.address}:22",
                    f"HostKey {key}",
                    f"PidFile {host.dir / 'sshd.pid'}",
                    f"AuthorizedKeysFile {auth}",
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
        return conf

    def _start_sshd(self, host: Host, env: dict[str, str] | None = None) -> None:
        conf = host.dir / "sshd_config" if env is None else self._sshd_config(host, env)
        pidfile = host.dir / "sshd.pid"
        try:
            pidfile.unlink()
        except FileNotFoundError:
            pass
        with open(host.dir / "sshd.log", "ab") as log:  # never a pipe: sshd keeps its stdio
            rc = subprocess.run(
                [*host.enter(), "setsid", "-f", SSHD, "-D", "-f", str(conf), "-E", str(host.dir / "sshd.log")],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                env={"PATH": STD_PATH},
                check=False,
            ).returncode
        if rc != 0:
            raise LabError(f"{host.name}: starting sshd failed (rc {rc}): {(host.dir / 'sshd.log').read_text(errors='replace')[-2000:]}")
        deadline = time.monotonic() + 10
        while True:
            text = pidfile.read_text().strip() if pidfile.exists() else ""
            if text.isdigit():
                break
            if time.monotonic() > deadline:
                raise LabError(f"{host.name}: sshd did not start: {(host.dir / 'sshd.log').read_text(errors='replace')[-2000:]}")
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
    def _spawn(self, host: Host, argv: list[str], name: str, kind: str, gpus: list[int], executable: Path = WORKER, ignores_term: bool = False) -> list[Proc]:
        """Start a gpusim-worker inside ``host`` (detached: its parent is the host's init, as for a
        job in a container); returns the worker, or for --fork-child the child that kept the GPU."""
        sim = host.gpu_sim
        ours, theirs = ready_pair()
        full = [str(executable), "--state", str(sim.state_dir), *argv, "--ready-fd", str(theirs.fileno())]
        env = {"PATH": STD_PATH, "GPUSIM_STATE": str(sim.state_dir), "LD_LIBRARY_PATH": str(LIB_DIR)}
        if host.kind == "lxc":
            env["container"] = "lxc"
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
        procs = [Proc(name, host.name, kind, pid, gpus=gpus, ignores_term=ignores_term)]
        return procs

    def _spawn_daemon(self, host: Host, name: str) -> Proc:
        assert self.workdir is not None
        argv = ["--hold-only", "--title", name]
        gpus = list(range(len(host.gpu_sim.gpus))) if host.kind == "node" else host.gpus
        if host.kind == "lxc":
            for g in host.gpus:
                argv += ["--gpu", str(g)]
        return self._spawn(host, argv, name, "daemon", gpus, executable=self.workdir / "bin" / name)[0]

    def spawn_workload(self, host: Host) -> list[Proc]:
        procs: list[Proc] = []
        for w in workload_plan(host.gpus):
            argv = ["--mib", str(w["mib"]), "--title", w["title"]]
            for g in w["gpus"]:
                argv += ["--gpu", str(g)]
            if w.get("ignore_term"):
                argv.append("--ignore-term")
            if w.get("fork_child"):
                argv.append("--fork-child")
            procs += self._spawn(host, argv, w["title"], "worker", w["gpus"], ignores_term=bool(w.get("ignore_term")))
        host.workload = [p for p in procs if p.alive()]
        return host.workload

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
        for host in self.hosts.values():
            for p in host.workload:
                p.signal(signal.SIGKILL)
            for p in host.workload:
                p.wait_gone(5)
                p.close()
            host.workload = []
        for host in self.nodes:
            host.gpu_sim.wait_clean(timeout=10)
        if self.sim is not None:
            for g in self.cluster["guests"]:
                self.sim.cluster.guests[int(g["vmid"])].status = g.get("status", "running")
        for host in self.hosts.values():
            self.spawn_workload(host)

    def stop_container(self, host: Host) -> None:
        """Stop a container as Proxmox would: its init dies and the kernel ends everything in
        it; pct and the API say stopped."""
        assert host.init is not None
        if host.sshd is not None:
            host.sshd.close()
            host.sshd = None
        host.init.signal(signal.SIGKILL)
        host.init.wait_gone(5)
        if host.init_popen is not None:
            host.init_popen.wait(10)
        for p in [*host.workload, *host.daemons.values()]:
            p.wait_gone(5)
        self._register_pct(host, "stopped")
        if self.sim is not None and host.vmid is not None:
            self.sim.cluster.guests[host.vmid].status = "stopped"
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
        host.workload, host.daemons = [], {}
        self._start_container(host)
        if self.sim is not None and host.vmid is not None:
            self.sim.cluster.guests[host.vmid].status = "running"

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
        self.sim = PveSim(self.cluster, tls=True, tokens={TOKEN_ID: self.token_secret}).start()

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
        )
        for host in self.hosts.values():
            sim = host.gpu_sim
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
            lines += [
                "# The simulated node's device files stand in for /dev.",
                f"clean_slate_device_dir: {sim.dev_dir}",
            ]
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
        """ansible-playbook against the lab inventory (the real playbook by default)."""
        env = self.env()
        env.update(kw.pop("env", None) or {})
        return run_playbook(playbook, inventory=kw.pop("inventory", self.inventory), env=env, **kw)

    def pct_remote_inventory(self) -> Path:
        """The lab inventory with ``pct_remote: no_address``: the containers without an address (ct102,
        ct201) are reached through their node by community.proxmox's proxmox_pct_remote connection and clean
        themselves, so their host_vars are those of a host of its own: the container's Python, with the
        dependencies (as an image that has them; making a virtual environment inside the container through
        pct_remote works too, but costs the lab some 30 s), and their GPUs named. The other hosts' host_vars
        and the group_vars are the lab inventory's."""
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
                            f"clean_slate_device_dir: {host.gpu_sim.dev_dir}",
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
        for host in [*self.containers, *self.nodes]:  # containers first: they live inside their nodes
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
        for cg in self._cgroups:
            attempt(f"cgroup {cg}", _rmdir_retry, cg)
        if self._cgroups:
            try:
                self._cgroups[0].parent.rmdir()  # lxc/, unless something else uses it
            except OSError:
                pass
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
            os.close(self._lock_fd)
            self._lock_fd = -1
        if errors:
            raise LabError("teardown: " + "; ".join(errors))


def _rmdir_retry(path: Path) -> None:
    deadline = time.monotonic() + 3
    while True:
        try:
            path.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.02)
