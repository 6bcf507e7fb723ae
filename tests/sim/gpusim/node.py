"""A simulated NVIDIA GPU node: state directory, driver daemon, workers."""

from __future__ import annotations

import atexit
import ctypes
import os
import select
import shutil
import signal
import socket
import stat
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import paths
from .description import CONTEXT_OVERHEAD_MIB, FEATURES, HEALTH_FIELDS, LINK_FIELDS, NVLINK_COUNTERS, PROCESS_APIS, Description, Faults, GpuSpec
from .procfs import PidHandle, ancestors, children, daemon_running, find_in_namespace, holders
from .procfs import state as proc_state
from .state import counted_contexts, memory

if TYPE_CHECKING:
    from .sandbox import Sandbox

DEV_FILE_BYTES = 4096  #: device files must be mmappable
CHAR_DEVICE = (1, 5)  #: major, minor of the character device nodes: /dev/zero's driver
MS_BIND = 4096
#: Device files besides one per GPU: the control device, the unified-memory devices, the MIG capabilities.
EXTRA_DEVICES = ("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools", "nvidia-caps/nvidia-cap1", "nvidia-caps/nvidia-cap2")
CRED = struct.Struct("3i")  #: struct ucred: pid, uid, gid
READY_TIMEOUT = 10.0


class WorkerError(RuntimeError):
    """A worker exited (or hung) before reporting ready, e.g. OOM (exit code 3)."""

    def __init__(self, message: str, returncode: int | None, log: str) -> None:
        super().__init__(f"{message}\n{log}".rstrip())
        self.returncode = returncode
        self.log = log


class Worker:
    """A gpusim-worker process (fake CUDA job or management client).

    Attributes: ``pid`` (as seen from the caller's PID namespace), ``child_pid``
    (the --fork-child child), ``ns_pid``/``child_ns_pid`` (inside the sandbox),
    ``popen`` (for a sandboxed worker: the nsenter that started it).
    """

    def __init__(self, node: Node, popen: subprocess.Popen[bytes], ready: socket.socket, log: Path, sandbox: Sandbox | None, stops: bool = False) -> None:
        self.node = node
        self.popen = popen
        self.sandbox = sandbox
        self.log_path = log
        self.child_pid: int | None = None
        self.ns_pid: int | None = None
        self.child_ns_pid: int | None = None
        self.worker_pid: int | None = None  #: --supervise: the first worker it started
        self.worker_ns_pid: int | None = None
        self._pid: int | None = None if sandbox else popen.pid
        self._handle: PidHandle | None = None if sandbox else PidHandle(popen.pid)
        self._child: PidHandle | None = None
        self._ready: socket.socket | None = ready
        self._stops = stops  # --stop: ready once it sits in state T
        self.ready = False

    def __repr__(self) -> str:
        return f"<Worker pid={self._pid} child={self.child_pid} ns_pid={self.ns_pid}>"

    @property
    def pid(self) -> int:
        """Pid in the caller's namespace (for a sandboxed worker: known once ready)."""
        if self._pid is None:
            self.wait_ready()
        assert self._pid is not None
        return self._pid

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def wait_ready(self, timeout: float = READY_TIMEOUT) -> Worker:
        """Wait for "ready <pid>[ child <pid>]": the contexts exist from then on.

        The ready channel is a unix socket with SO_PASSCRED: the kernel attaches
        the writer's pid translated into *our* PID namespace, so a sandboxed
        worker's host pid is known even if it exits right after writing."""
        if self.ready:
            return self
        assert self._ready is not None
        deadline = time.monotonic() + timeout
        data = b""
        sender = 0
        while not data.endswith(b"\n"):
            left = deadline - time.monotonic()
            r, _unused, _unused = select.select([self._ready], [], [], max(0.0, left))
            if not r:
                raise WorkerError(f"worker not ready after {timeout}s", self.popen.poll(), self.log())
            chunk, anc, _unused, _unused = self._ready.recvmsg(256, socket.CMSG_SPACE(CRED.size))
            for level, kind, cdata in anc:
                if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS:
                    sender = CRED.unpack(cdata[: CRED.size])[0]
            if not chunk:
                try:
                    rc = self.popen.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    rc = None
                raise WorkerError(f"worker exited with status {rc} before it was ready", rc, self.log())
            data += chunk
        self._ready.close()
        self._ready = None
        words = data.split()
        pid = int(words[1])
        child = int(words[3]) if len(words) >= 4 and words[2] == b"child" else None
        supervised = int(words[3]) if len(words) >= 4 and words[2] == b"worker" else None
        if self.sandbox is None:
            self.child_pid = child
            self.worker_pid = supervised
        else:
            ns = self.sandbox.ns_inode
            self.ns_pid, self.child_ns_pid, self.worker_ns_pid = pid, child, supervised
            self._pid = sender or find_in_namespace(ns, pid, children(self.sandbox.init_pid)) or find_in_namespace(ns, pid)
            self._handle = PidHandle(self._pid) if self._pid else None
            if child is not None:
                near = children(self._pid or 0) + children(self.sandbox.init_pid)
                self.child_pid = find_in_namespace(ns, child, near) or find_in_namespace(ns, child)
            if supervised is not None:
                self.worker_pid = find_in_namespace(ns, supervised, children(self._pid or 0)) or find_in_namespace(ns, supervised)
        if self.child_pid:
            self._child = PidHandle(self.child_pid)
            # --fork-child: the parent exits right after reporting; "ready" means
            # the child alone holds the contexts, so wait for that exit too.
            if self._handle is not None:
                self._handle.wait_exit(max(0.0, deadline - time.monotonic()))
        if self._stops:
            self._wait_stopped(self.child_pid or self._pid, deadline)
        self.ready = True
        return self

    @staticmethod
    def _wait_stopped(pid: int | None, deadline: float) -> None:
        while pid and proc_state(pid) not in ("T", None) and time.monotonic() < deadline:
            time.sleep(0.001)

    def alive(self) -> bool:
        """The worker process has not exited (a stopped one is alive; a zombie is not)."""
        if self._handle is None and self.sandbox is not None and not self.ready:
            self.wait_ready()
        if self._handle is None:
            return self.popen.poll() is None
        return self._handle.alive()

    def child_alive(self) -> bool:
        return self._child is not None and self._child.alive()

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Signal the worker (pidfd: never a recycled pid)."""
        if self._handle is None:
            self.wait_ready()
        if self._handle is not None:
            self._handle.signal(sig)

    def kill_child(self, sig: int = signal.SIGKILL) -> None:
        if self._child is not None:
            self._child.signal(sig)

    def wait(self, timeout: float | None = None) -> int | None:
        """Wait for the worker to exit; its exit status (negative: signal), like
        Popen.wait (subprocess.TimeoutExpired on timeout). A sandboxed worker is
        reaped by the sandbox init, which reports the status (None if unknown)."""
        if self.sandbox is None:
            return self.popen.wait(timeout)
        if not self.ready:
            self.wait_ready()
        if self._handle is not None and not self._handle.wait_exit(1e9 if timeout is None else timeout):
            raise subprocess.TimeoutExpired(str(self.popen.args), timeout or 0)
        self.popen.wait()
        deadline = time.monotonic() + 2
        while time.monotonic() < deadline:
            status = self.sandbox.exit_status(self.ns_pid or 0)
            if status is not None:
                return status
            time.sleep(0.002)
        return None

    def wait_gone(self, timeout: float = 5.0) -> bool:
        """Wait until the worker and its forked child (if any) have exited."""
        deadline = time.monotonic() + timeout
        return all(not (h is not None and not h.wait_exit(deadline - time.monotonic())) for h in (self._handle, self._child))

    def _terminate(self) -> None:
        """SIGKILL everything this worker started and reap it (Node.stop)."""
        for h in (self._handle, self._child):
            if h is not None:
                h.signal(signal.SIGKILL)
        if self._handle is None and self.popen.poll() is None:
            self.popen.kill()
        try:
            self.popen.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        for h in (self._handle, self._child):
            if h is not None:
                h.wait_exit(2.0)
                h.close()
        if self._ready is not None:
            self._ready.close()
            self._ready = None


class Node:
    """A simulated GPU node (see docs/simulator.md).

    ``Node(...).start()`` writes the description and device files and starts
    the driver daemon in the caller's PID namespace; ``stop()`` ends every
    process it started. Also a context manager.
    """

    def __init__(
        self,
        path: str | os.PathLike[str] | None = None,
        gpus: int = 8,
        name: str = "NVIDIA H200",
        total_mib: int = 143771,
        reserved_mib: int = 615,
        release_delay_ms: int = 185,
        release_gap_ms: int = 60,
        *,
        driver_version: str = "580.159.04",
        nvml_version: str = "13.580.159.04",
        cuda_driver_version: int = 13000,
        seed: str = "gpusim",
        minors: list[int] | None = None,
        context_overhead_mib: int = CONTEXT_OVERHEAD_MIB,
        teardown: bool = True,
        char_devices: bool | None = None,
    ) -> None:
        if not 1 <= gpus <= 64:
            raise ValueError("gpus must be between 1 and 64")
        self.want_teardown = teardown
        self.teardown = False  #: exiting workers wait in the kernel for their teardown (FUSE mounted)
        self.want_char_devices = char_devices
        self.char_devices = False  #: the device files are character devices (mknod worked)
        self.published: Path | None = None  #: where publish_devices() put the device files
        self._owns_dir = path is None
        self.state_dir = Path(tempfile.mkdtemp(prefix="gpusim-") if path is None else path).resolve()
        if path is None:
            # Other users reach the node as on a real host (the device files are 0666): an
            # unprivileged container's root or a test user must be able to walk the directory.
            os.chmod(self.state_dir, 0o755)
        self.dev_dir = self.state_dir / "dev"
        self.lib_dir = paths.LIB_DIR
        self.bin_dir = paths.BIN_DIR
        self.desc = Description.create(
            gpus,
            name,
            total_mib,
            reserved_mib,
            seed=seed,
            driver_version=driver_version,
            nvml_version=nvml_version,
            cuda_driver_version=cuda_driver_version,
            release_delay_ms=release_delay_ms,
            release_gap_ms=release_gap_ms,
            minors=minors,
            context_overhead_mib=context_overhead_mib,
        )
        self._daemon: subprocess.Popen[bytes] | None = None
        self._daemon_handle: PidHandle | None = None
        self._workers: list[Worker] = []
        self._sandboxes: list[Sandbox] = []
        self._started = False
        self._stopped = False
        self._seq = 0
        atexit.register(self.stop)  # also removes the temp dir of a node never started

    # ------------------------------------------------------------ life cycle
    @classmethod
    def attach(cls, path: str | os.PathLike[str]) -> Node:
        """A Node for an existing state directory (e.g. one the CLI started)."""
        state = Path(path).resolve()
        node = cls.__new__(cls)
        node._owns_dir = False
        node.state_dir = state
        node.dev_dir = state / "dev"
        node.lib_dir, node.bin_dir = paths.LIB_DIR, paths.BIN_DIR
        node.desc = Description.read(state)
        node.want_teardown = node.teardown = os.path.ismount(state / "teardown")
        try:
            node.char_devices = stat.S_ISCHR(os.stat(state / "dev" / "nvidiactl").st_mode)
        except OSError:
            node.char_devices = False
        node.want_char_devices = node.char_devices
        node.published = None
        node._daemon = node._daemon_handle = None
        node._workers, node._sandboxes = [], []
        node._started, node._stopped, node._seq = True, False, 0
        return node

    def __enter__(self) -> Node:
        if not self._started:
            self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self, detach: bool = False) -> Node:
        """Create the state and start the daemon. With detach=True (the CLI) the
        daemon outlives this process and stop() is not registered at exit."""
        if self._started:
            return self
        paths.ensure_built()
        if daemon_running(self.state_dir):
            raise RuntimeError(f"a gpusim driver already runs for {self.state_dir}")
        for sub in ("dev", "driver", "ctx", "bin", "log", "teardown"):
            (self.state_dir / sub).mkdir(parents=True, exist_ok=True)
        self.char_devices = self._char_devices_work() if self.want_char_devices is not False else False
        if self.want_char_devices and not self.char_devices:
            raise RuntimeError("char_devices=True, but character device nodes cannot be made and mapped here (mknod needs root outside a user namespace)")
        for old in (self.state_dir / "ctx").iterdir():
            old.unlink()  # a fresh node has no contexts
        for old in self.state_dir.glob("compute_mode.*"):
            old.unlink()  # nor settings of an earlier run (the driver's are lost at unload)
        self.desc.write(self.state_dir)
        if not self.kernel_log.exists():
            # What the driver prints at load, before anything goes wrong.
            self.kernel_message("nvidia: loading out-of-tree module taints kernel.", prio=4)
            self.kernel_message(f"NVRM: loading NVIDIA UNIX Open Kernel Module for x86_64  {self.desc.driver_version}  Release Build")
        # What the driver's modules and nvidia-modprobe make on a host: a node per GPU, the control device, the
        # unified-memory devices (every CUDA start needs nvidia-uvm) and the MIG capability devices.
        for dev in [f"nvidia{g.minor}" for g in self.desc.gpus] + list(EXTRA_DEVICES):
            self._make_device(dev)
        self._start_daemon(detach)
        self.teardown = os.path.ismount(self.state_dir / "teardown")
        if self.want_teardown and not self.teardown and os.environ.get("GPUSIM_REQUIRE_TEARDOWN"):
            raise RuntimeError(f"the driver could not mount {self.state_dir}/teardown (FUSE): {self._daemon_log()}")
        self._started = True
        if detach:
            atexit.unregister(self.stop)  # the CLI leaves the node running
        return self

    def _char_devices_work(self) -> bool:
        """Can this machine give the node real character device files? They stand on /dev/zero's
        driver (1:5: no driver serves NVIDIA's major 195 here), which needs mknod (root outside a
        user namespace, a file system without nodev) and a kernel that keeps a private mapping
        of the node file-backed, so /proc/PID/maps names the node as it names /dev/nvidia0."""
        probe = self.dev_dir / ".probe"
        try:
            probe.unlink(missing_ok=True)
            os.mknod(probe, stat.S_IFCHR | 0o666, os.makedev(*CHAR_DEVICE))
            fd = os.open(probe, os.O_RDWR | os.O_CLOEXEC)
        except OSError:
            probe.unlink(missing_ok=True)
            return False
        try:
            import mmap

            with mmap.mmap(fd, DEV_FILE_BYTES, flags=mmap.MAP_PRIVATE), open("/proc/self/maps", encoding="utf-8", errors="replace") as fh:
                return any(line.rstrip("\n").endswith(str(probe)) for line in fh)
        except OSError:
            return False
        finally:
            os.close(fd)
            probe.unlink(missing_ok=True)

    def _make_device(self, name: str) -> None:
        """dev/<name>: a character device where the machine allows it (see
        _char_devices_work), else a mappable regular file; and the daemon's hard
        link to it in driver/ (same inode, hence the same locks, but another path).
        Always a new inode, as after a driver reload: processes left over from
        an earlier node on this directory keep the old one, and their locks
        cannot be mistaken for this node's contexts."""
        dev = self.dev_dir / name
        link = self.state_dir / "driver" / name
        for folder in (dev.parent, link.parent):
            folder.mkdir(parents=True, exist_ok=True)
        for old in (dev, link):
            try:
                old.unlink()
            except FileNotFoundError:
                pass
        if self.char_devices:
            os.mknod(dev, stat.S_IFCHR | 0o666, os.makedev(*CHAR_DEVICE))
        else:
            with open(dev, "wb") as f:
                f.truncate(DEV_FILE_BYTES)
        os.chmod(dev, 0o666)  # crw-rw-rw- like the real nodes
        os.link(dev, link)

    def publish_devices(self, directory: str | os.PathLike[str] = "/dev") -> Path:
        """Make the device files appear as ``<directory>/nvidia*`` (bind mounts of dev/*, so the
        same inodes and locks), for code that uses the default ``/dev``. Only ever do this in a
        private mount namespace whose ``directory`` is a tmpfs of its own (tests/host does): it
        changes what every process of that mount namespace sees. Workers, NVML clients and
        nvidia-smi started afterwards open the files there (GPUSIM_DEV_DIR in env())."""
        target = Path(directory)
        libc = ctypes.CDLL(None, use_errno=True)
        for dev in self.device_files():
            dest = target / dev.relative_to(self.dev_dir)
            dest.parent.mkdir(exist_ok=True)
            if not dest.exists():
                dest.touch(mode=0o666)
            if libc.mount(os.fsencode(str(dev)), os.fsencode(str(dest)), None, MS_BIND, None) != 0:
                err = ctypes.get_errno()
                raise OSError(err, f"bind-mounting {dev} on {dest}: {os.strerror(err)}")
        self.published = target
        return target

    def device_files(self) -> list[Path]:
        """The node's device files (``dev/nvidia*``, and the MIG capabilities under ``dev/nvidia-caps``)."""
        if not self.dev_dir.is_dir():
            return []
        out = []
        for dev in sorted(self.dev_dir.iterdir()):
            if not dev.name.startswith("nvidia"):
                continue
            out += sorted(dev.iterdir()) if dev.is_dir() else [dev]
        return out

    @contextmanager
    def teardown_paused(self) -> Iterator[None]:
        """Exits are answered at once meanwhile (used while tearing a sandbox down, so that the
        test suite does not wait out every worker's realistic teardown)."""
        paused = self._driver_command("teardown pause") == "ok"
        try:
            yield
        finally:
            if paused:
                self._driver_command("teardown resume")

    def _driver_command(self, line: str) -> str | None:
        if not self.teardown or self._stopped:
            return None
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.settimeout(5)
                s.connect(str(self.state_dir / "driver.sock"))
                s.sendall(line.encode() + b"\n")
                return s.makefile("rb").readline().decode().strip()
        except OSError:
            return None

    def _daemon_log(self) -> str:
        try:
            return (self.state_dir / "log" / "driver.log").read_text(errors="replace")
        except OSError:
            return ""

    def _start_daemon(self, detach: bool) -> None:
        r, w = os.pipe()
        code = f"import sys; sys.path.insert(0, {str(paths.SIM_ROOT)!r}); from gpusim.driver import main; sys.exit(main())"
        argv = [sys.executable, "-I", "-c", code, "--state", str(self.state_dir), "--ready-fd", str(w)]
        if not detach:
            argv.append("--watch-parent")
        if self.want_teardown:
            argv.append("--teardown")
        with open(self.state_dir / "log" / "driver.log", "ab") as log:
            self._daemon = subprocess.Popen(
                argv,
                pass_fds=(w,),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                start_new_session=True,
                cwd="/",
            )
        os.close(w)
        try:
            ready, _unused, _unused = select.select([r], [], [], READY_TIMEOUT)
            line = os.read(r, 64) if ready else b""
        finally:
            os.close(r)
        if line.strip() != b"ready":
            self._daemon.kill()
            self._daemon.wait()
            log_text = (self.state_dir / "log" / "driver.log").read_text(errors="replace")
            raise RuntimeError(f"gpusim driver daemon did not start:\n{log_text}")
        self._daemon_handle = PidHandle(self._daemon.pid)

    def stop(self) -> None:
        """End everything this node started: sandboxes (and all inside them),
        workers and their children, any other holder of its device files,
        and the daemon; remove the state directory if the node created it.
        Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        try:
            atexit.unregister(self.stop)
        except Exception:  # pragma: no cover - interpreter shutting down
            pass
        # The daemon goes first: that aborts every teardown in progress, so what is killed
        # below exits at once instead of waiting out its realistic teardown one after another.
        self._stop_daemon()
        for sb in list(self._sandboxes):
            sb.stop()
        for w in self._workers:
            w._terminate()
        self._kill_holders()
        self._unpublish()
        if os.path.ismount(self.state_dir / "teardown"):
            from .teardown import unmount

            unmount(self.state_dir / "teardown")
        if self._owns_dir:
            shutil.rmtree(self.state_dir, ignore_errors=True)

    def _unpublish(self) -> None:
        if self.published is None:
            return
        from .teardown import unmount

        for dev in self.published.glob("nvidia*"):
            if dev.is_dir():
                for sub in dev.iterdir():
                    unmount(sub)
            else:
                unmount(dev)
        self.published = None

    def _kill_holders(self) -> None:
        """Whatever still holds this node's device files was started against
        it (the state directory is private): workers spawned by the CLI,
        grandchildren, NVML clients. Never ourselves or our ancestors."""
        mine = ancestors(os.getpid())
        # This node's own files (the published names are bind mounts of them: the same inodes).
        files = [str(f) for f in self.device_files()]
        for _unused in range(3):
            pids = holders(files) - mine
            if not pids:
                return
            handles = [PidHandle(p) for p in pids]
            for h in handles:
                h.signal(signal.SIGKILL)
            for h in handles:
                h.wait_exit(2.0)
                h.close()

    def stop_driver(self) -> None:
        """Stop only the driver daemon (as if it crashed): contexts stay while
        their holders live; the library then judges them by their OFD locks and
        frees them at once when the holders go; new contexts are refused."""
        self._stop_daemon()
        self._daemon = self._daemon_handle = None

    def start_driver(self) -> None:
        """(Re)start the driver daemon; it adopts the existing context records."""
        if daemon_running(self.state_dir):
            return
        self._start_daemon(detach=False)

    def _stop_daemon(self) -> None:
        if self._daemon is not None and self._daemon_handle is not None:
            self._daemon_handle.signal(signal.SIGTERM)
            try:
                self._daemon.wait(timeout=3)
            except subprocess.TimeoutExpired:
                self._daemon_handle.signal(signal.SIGKILL)
                self._daemon.wait(timeout=3)
            self._daemon_handle.close()
            return
        # attached node: the daemon is not our child; find it by its pid file
        try:
            pid = int((self.state_dir / "driver.pid").read_text())
        except (FileNotFoundError, ValueError):
            return
        if daemon_running(self.state_dir):
            h = PidHandle(pid)
            h.signal(signal.SIGTERM)
            if not h.wait_exit(3.0):
                h.signal(signal.SIGKILL)
                h.wait_exit(3.0)
            h.close()

    # ------------------------------------------------------------ environment
    def env(self, include_library: bool | None = None, include_cuda: bool | None = None) -> dict[str, str]:
        """Environment for NVML clients of this node: GPUSIM_STATE, and
        LD_LIBRARY_PATH with the simulated libnvidia-ml first (or, with
        include_library=False or the library_absent fault, without it: the
        "library absent" environment). PATH gets the bin dir (nvidia-smi)."""
        faults = self.description.faults
        if include_library is None:
            include_library = not faults.library_absent
        if include_cuda is None:
            include_cuda = include_library and not faults.cuda_absent

        def strip(var: str, drop: Path) -> list[str]:
            return [p for p in os.environ.get(var, "").split(":") if p and Path(p).resolve() != drop]

        libs = [p for p in strip("LD_LIBRARY_PATH", self.lib_dir) if Path(p).resolve() != paths.CUDA_DIR]
        if include_cuda:
            libs.insert(0, str(paths.CUDA_DIR))
        if include_library:
            libs.insert(0, str(self.lib_dir))
        env = {
            "GPUSIM_STATE": str(self.state_dir),
            "LD_LIBRARY_PATH": ":".join(libs),
            "PATH": ":".join([str(self.bin_dir), *strip("PATH", self.bin_dir)]),
        }
        if self.published is not None:
            env["GPUSIM_DEV_DIR"] = str(self.published)
        return env

    # ------------------------------------------------------------ description & faults
    @property
    def description(self) -> Description:
        """node.conf as it is on disk now."""
        return Description.read(self.state_dir)

    @property
    def gpus(self) -> list[GpuSpec]:
        return self.desc.gpus

    def set_fault(self, **kw: Any) -> None:
        """Switch faults on (at runtime: every NVML client sees them on its next call).

        init_error="LIB_RM_VERSION_MISMATCH" | "DRIVER_NOT_LOADED" | any NVML error name or number;
        lost=[i, ...]; timeout={"functions": [...], "gpus": [...], "delay_ms": n} (or a list of
        function names); hang={"functions": [...], "gpus": [...]} (or a list of names): those calls never
        return, on those GPUs (empty: all), as in a driver hang; orphan={gpu: mib} and recovery_action={gpu: action} (merged; 0 / None
        removes); legacy_pids=True; memory_v2_unsupported=True; process_api="v1"|"v2"|"v3";
        memory_na=True; library_absent=True (node.env() drops the library); cuda_absent=True (node.env() drops
        libcuda.so.1 and keeps NVML); hidden={gpu: mib} (memory CUDA cannot allocate although NVML does not count
        it as used; merged, 0 / None removes); phantom_pids={gpu: [pid, ...]}
        (the compute list also reports these pids, holding 0 bytes, as a skewed driver/binding does).
        Peers (issue 39), pairs of GPU indexes in either order: p2p_unsupported=[(0, 1)] (no peer access: CUDA's
        cuDeviceCanAccessPeer 0, cuCtxEnablePeerAccess 217, NVML's P2P status CHIPSET_NOT_SUPPORTED), p2p_corrupt=[...]
        (a copy over the peer path arrives with changed bytes), p2p_hang=[...] (a peer copy never completes),
        p2p_gbps={(0, 1): 12.5} (what a copy between them moves per second).
        None resets a fault.
        """
        f = self.desc.faults
        for key, value in kw.items():
            if key == "init_error":
                f.init_error = "" if value is None else _error_name(value)
            elif key == "lost":
                f.lost = [] if value is None else sorted({int(i) for i in _as_list(value)})
            elif key == "timeout":
                if not value:
                    f.timeout_functions, f.timeout_gpus, f.timeout_delay_ms = [], [], 0
                elif isinstance(value, dict):
                    f.timeout_functions = list(_as_list(value.get("functions", ["*"])))
                    f.timeout_gpus = [int(i) for i in _as_list(value.get("gpus", []))]
                    f.timeout_delay_ms = int(value.get("delay_ms", 0))
                else:
                    f.timeout_functions, f.timeout_gpus = list(_as_list(value)), []
            elif key == "hang":
                if not value:
                    f.hang_functions, f.hang_gpus = [], []
                elif isinstance(value, dict):
                    f.hang_functions = list(_as_list(value.get("functions", ["*"])))
                    f.hang_gpus = [int(i) for i in _as_list(value.get("gpus", []))]
                else:
                    f.hang_functions, f.hang_gpus = list(_as_list(value)), []
            elif key == "phantom_pids":
                f.phantom_pids = {} if value is None else {int(g): [int(p) for p in _as_list(pids)] for g, pids in dict(value).items()}
            elif key in ("orphan", "recovery_action", "hidden"):
                target: dict[int, int] = getattr(f, key)
                if value is None:
                    target.clear()
                    continue
                for gpu, n in dict(value).items():
                    if n is None or (key in ("orphan", "hidden") and not n):
                        target.pop(int(gpu), None)
                    else:
                        target[int(gpu)] = int(n)
            elif key == "process_api":
                api = "v3" if value is None else f"v{str(value).lower().lstrip('v')}"
                if api not in PROCESS_APIS:
                    raise ValueError(f"process_api must be one of {PROCESS_APIS}")
                f.process_api = api
            elif key in ("legacy_pids", "memory_v2_unsupported", "memory_na", "library_absent", "cuda_absent"):
                setattr(f, key, bool(value))
            elif key in ("p2p_unsupported", "p2p_corrupt", "p2p_hang"):
                setattr(f, key, [] if value is None else sorted({tuple(sorted((int(a), int(b)))) for a, b in value}))
            elif key == "p2p_gbps":
                f.p2p_gbps = {} if value is None else {tuple(sorted((int(a), int(b)))): float(g) for (a, b), g in dict(value).items()}
            else:
                raise TypeError(f"unknown fault {key!r}")
        pairs = [g for pair in (*f.p2p_unsupported, *f.p2p_corrupt, *f.p2p_hang, *f.p2p_gbps) for g in pair]
        for gpu in (
            pairs + list(f.lost) + list(f.orphan) + list(f.hidden) + list(f.recovery_action) + list(f.timeout_gpus) + list(f.hang_gpus) + list(f.phantom_pids)
        ):
            if not 0 <= gpu < len(self.desc.gpus):
                raise ValueError(f"no GPU {gpu} on this node")
        self.desc.write(self.state_dir)

    def clear_faults(self) -> None:
        self.desc.faults = Faults()
        self.desc.write(self.state_dir)

    def set_release_timing(self, delay_ms: int | None = None, gap_ms: int | None = None, per_gib_ms: float | None = None) -> None:
        """Change the teardown delay / serialisation gap, and the delay added per GiB a context held
        (applies to later deaths)."""
        if delay_ms is not None:
            self.desc.release_delay_ms = int(delay_ms)
        if gap_ms is not None:
            self.desc.release_gap_ms = int(gap_ms)
        if per_gib_ms is not None:
            self.desc.release_us_per_gib = round(float(per_gib_ms) * 1000)
        self.desc.write(self.state_dir)

    def set_teardown(self, hang_ms: int | None = None, gradual: bool | None = None) -> None:
        """How long an exiting worker stays in the driver (state D) after its memory is freed:
        0 (the H200's behaviour) by default; seconds model a task stuck in the driver. ``gradual``: a dying
        context's memory goes down step by step until its release (a long teardown that makes progress, with
        ``set_release_timing(delay_ms=...)`` as its length) instead of all at once at the release."""
        if hang_ms is not None:
            self.desc.teardown_hang_ms = int(hang_ms)
        if gradual is not None:
            self.desc.release_gradual = int(bool(gradual))
        self.desc.write(self.state_dir)

    def set_mig(self, gpus: list[int] | int, enabled: bool = True) -> None:
        """Switch MIG mode on (or off) for these GPUs: nvmlDeviceGetMigMode reports it, process
        entries carry GPU instance 1 / compute instance 0 and no per-process memory (N/A)."""
        for g in [gpus] if isinstance(gpus, int) else gpus:
            self.desc.gpus[int(g)].mig_mode = int(bool(enabled))
        self.desc.write(self.state_dir)

    # ------------------------------------------------------------ health (issue 12)
    def set_health(self, gpus: list[int] | int, **kw: Any) -> None:
        """Change what NVML reports about these GPUs' health: persistence (0/1), mig_pending (0/1, None:
        none pending), remap_correctable/remap_uncorrectable (rows), remap_pending/remap_failure (0/1),
        retired_sbe/retired_dbe (pages), retired_pending (0/1), ecc_volatile_uncorrected (count),
        fabric_state (0 not supported .. 3 completed, or its name), fabric_status (an NVML return code),
        features (a list of "ecc", "remap", "retired", "fabric", "mig"; None: what the model has)."""
        states = {"not_supported": 0, "not_started": 1, "in_progress": 2, "completed": 3}
        for g in [gpus] if isinstance(gpus, int) else gpus:
            spec = self.desc.gpus[int(g)]
            for key, value in kw.items():
                if key == "features":
                    if value is not None and not set(value) <= set(FEATURES):
                        raise ValueError(f"features must be among {FEATURES}")
                    spec.features = None if value is None else list(value)
                elif key == "fabric_state" and isinstance(value, str):
                    spec.fabric_state = states[value]
                elif key == "mig_pending":
                    spec.mig_pending = None if value is None else int(value)
                elif key in HEALTH_FIELDS:
                    setattr(spec, key, int(value))
                else:
                    raise TypeError(f"unknown health field {key!r}")
        self.desc.write(self.state_dir)

    def set_links(self, gpus: list[int] | int, **kw: Any) -> None:
        """Change what NVML reports about these GPUs' links, clocks and temperature (issue 39): nvlinks (how many; 0:
        none), nvlink_version, nvlink_remote, nvlink_down (inactive links), nvlink_errors ({"replay"|"recovery"|
        "crc_flit"|"crc_data": {link: count}}), pcie_gen_gpu_max, pcie_gen_max (the GPU's and the slot's), pcie_gen
        (what the link trained at, read while busy), pcie_gen_idle (what an idle GPU lowers it to; 0: never),
        pcie_width_max, pcie_width, clocks_event_reasons (nvmlClocksEventReason bits, or names: "hw_slowdown",
        "sw_thermal", "hw_thermal", "hw_power_brake", "sw_power_cap"), temperature, temp_limit. None: the model's."""
        bits = {"sw_power_cap": 0x4, "hw_slowdown": 0x8, "sw_thermal": 0x20, "hw_thermal": 0x40, "hw_power_brake": 0x80}
        for g in [gpus] if isinstance(gpus, int) else gpus:
            spec = self.desc.gpus[int(g)]
            for key, value in kw.items():
                if key not in LINK_FIELDS:
                    raise TypeError(f"unknown link field {key!r}")
                if key == "nvlink_down":
                    value = sorted({int(i) for i in value or []})
                elif key == "nvlink_errors":
                    if value and not set(value) <= set(NVLINK_COUNTERS):
                        raise ValueError(f"nvlink_errors counters must be among {NVLINK_COUNTERS}")
                    value = {c: {int(link): int(n) for link, n in links.items()} for c, links in (value or {}).items()}
                elif key == "clocks_event_reasons" and not isinstance(value, int):
                    value = sum(bits[name] for name in value or [])
                setattr(spec, key, value)
        self.desc.write(self.state_dir)

    def ecc_error(self, gpu: int, contained: bool = False) -> str:
        """An uncorrectable ECC error on GPU ``gpu``, as the driver records one: the Xid line (94 contained, 95
        uncontained), one more volatile uncorrectable error, the failing row marked for remapping (pending until a
        reset). Uncontained, the GPU also refuses every new context with CUDA_ERROR_ECC_UNCORRECTABLE until a
        reset, while NVML keeps listing it. Returns the Xid line."""
        spec = self.desc.gpus[int(gpu)]
        line = self.xid(gpu, 94 if contained else 95)
        self.set_health(
            gpu,
            ecc_volatile_uncorrected=spec.ecc_volatile_uncorrected + 1,
            remap_uncorrectable=spec.remap_uncorrectable + 1,
            remap_pending=1,
            ecc_uncontained=int(not contained) or spec.ecc_uncontained,
        )
        return line

    def set_cuda_timing(
        self,
        init_ms: int | None = None,
        ctx_ms: int | None = None,
        release_ms: int | None = None,
        memset_gbps: int | None = None,
        free_us_per_gib: int | None = None,
    ) -> None:
        """How long the simulated libcuda's cuInit, cuDevicePrimaryCtxRetain and cuDevicePrimaryCtxRelease take, how fast a
        memset is set (which the next synchronize waits for) and how long a free takes per GiB."""
        for name, value in (
            ("cuda_init_ms", init_ms),
            ("cuda_ctx_ms", ctx_ms),
            ("cuda_release_ms", release_ms),
            ("cuda_memset_gbps", memset_gbps),
            ("cuda_free_us_per_gib", free_us_per_gib),
        ):
            if value is not None:
                setattr(self.desc, name, int(value))
        self.desc.write(self.state_dir)

    def set_compute_mode(self, gpu: int, mode: int | str) -> None:
        """Set GPU ``gpu``'s compute mode as ``nvidia-smi -c`` would (0 default, 2 prohibited, 3 exclusive_process):
        the same file the library's nvmlDeviceSetComputeMode writes."""
        modes = {"default": 0, "prohibited": 2, "exclusive_process": 3}
        value = modes[mode] if isinstance(mode, str) else int(mode)
        path = self.state_dir / f"compute_mode.{int(gpu)}"
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(f"{value}\n")
        os.replace(tmp, path)

    def compute_mode(self, gpu: int) -> int:
        """GPU ``gpu``'s compute mode as the library reads it (no NVML)."""
        try:
            return int((self.state_dir / f"compute_mode.{int(gpu)}").read_text().strip() or 0)
        except FileNotFoundError:
            return 0

    @property
    def kernel_log(self) -> Path:
        """The node's kernel log: a file in /dev/kmsg's record format (``prio,seq,usec,flags;message``,
        usec in CLOCK_MONOTONIC microseconds), which the modules read as they read /dev/kmsg."""
        return self.state_dir / "kmsg"

    def kernel_message(self, message: str, prio: int = 6) -> None:
        """Append one record to the kernel log, stamped now, as printk does."""
        path = self.kernel_log
        try:
            seq = sum(1 for _line in path.open("rb"))
        except FileNotFoundError:
            seq = 0
        usec = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
        with path.open("a", encoding="utf-8") as fh:
            fh.write(f"{prio},{seq},{usec},-;{message}\n")

    XID_TEXT = {
        13: "Graphics SM Warp Exception on (GPC 0, TPC 0, SM 0): Out Of Range Address",
        31: "Ch 00000008, intr 00000000. MMU Fault: ENGINE GRAPHICS GPCCLIENT_T1_0 faulted @ 0x7f12_34560000. Fault is of type FAULT_PDE ACCESS_TYPE_VIRT_READ",
        43: "Ch 00000008",
        45: "Ch 00000008",
        48: "An uncorrectable double bit error (DBE) has been detected on GPU in the framebuffer at partition 0, subpartition 0.",
        63: "Row Remapper: New row marked for remapping, reset gpu to activate.",
        64: "Row Remapper: Failed to mark a row for remapping.",
        79: "GPU has fallen off the bus.",
        94: "Contained: SM (0x1). RST: No, D-RST: No",
        95: "Uncontained: FBHUB. RST: Yes, D-RST: No",
        119: "Timeout after 6s of waiting for RPC response from GPU0 GSP! Expected function 76 (GSP_RM_CONTROL) (0x20802a02 0x8).",
    }

    def xid(self, gpu: int, xid: int, text: str | None = None, pid: int | None = None, name: str | None = None) -> str:
        """Log Xid ``xid`` for GPU ``gpu`` in the kernel log as the NVIDIA driver prints it; returns the message."""
        spec = self.desc.gpus[int(gpu)]
        domain, bus, dev = (int(x, 16) for x in spec.pci_bus_id.split(".")[0].split(":"))
        who = f"pid={pid}, name={name}" if pid is not None else "pid='<unknown>', name=<unknown>"
        body = text if text is not None else self.XID_TEXT.get(int(xid), "Unknown error")
        message = f"NVRM: Xid (PCI:{domain:04x}:{bus:02x}:{dev:02x}): {int(xid)}, {who}, {body}"
        self.kernel_message(message, prio=4)
        return message

    def set_context_overhead(self, mib: int) -> None:
        """Device memory each live context costs beyond what its process is charged (9 MiB default)."""
        self.desc.context_overhead_mib = int(mib)
        self.desc.write(self.state_dir)

    # ------------------------------------------------------------ observation
    def memory(self, i: int) -> dict[str, int]:
        """GPU i's memory in MiB straight from the state (no NVML), for assertions:
        {"used_mib" (NVML v2 "used"), "reserved_mib", "total_mib"}."""
        m = memory(self.state_dir, self.description, i)
        return {k: m[k] for k in ("used_mib", "reserved_mib", "total_mib")}

    def memory_info(self, i: int) -> dict[str, int]:
        """memory() plus free_mib, v1_used_mib (NVML v1 "used", reserved included),
        contexts_mib and orphan_mib."""
        return memory(self.state_dir, self.description, i)

    def contexts(self) -> list[dict[str, Any]]:
        """Contexts that hold memory now (state "live", or "releasing" until release_ns)."""
        return [c.as_dict() for c in counted_contexts(self.state_dir)]

    def wait_clean(self, timeout: float = 10.0, poll: float = 0.002) -> float:
        """Wait until no GPU holds a context (orphaned memory is ignored: no wait
        ends it); returns the seconds waited. TimeoutError if it does not happen."""
        t0 = time.monotonic()
        while counted_contexts(self.state_dir):
            if time.monotonic() - t0 > timeout:
                raise TimeoutError(f"GPUs still hold contexts after {timeout}s: {self.contexts()}")
            time.sleep(poll)
        return time.monotonic() - t0

    # ------------------------------------------------------------ processes
    def spawn_worker(
        self,
        gpus: list[int] | int | None = None,
        mib: int = 20000,
        title: str | None = None,
        ignore_term: bool = False,
        term_delay_ms: int | None = None,
        stop: bool = False,
        fork_child: bool = False,
        hold_only: bool = False,
        nvml: bool = False,
        sandbox: Sandbox | None = None,
        wait_ready: bool = True,
        *,
        child_title: str | None = None,
        exit_after_ms: int | None = None,
        executable: str | os.PathLike[str] | None = None,
        argv0: str | None = None,
        env: dict[str, str | None] | None = None,
        kind: str = "compute",
        fork_on_term: bool = False,
        supervise: int | None = None,
        respawn_delay_ms: int | None = None,
        user: int | None = None,
    ) -> Worker:
        """Start a gpusim-worker. gpus None means [0] for a compute worker and
        every GPU for a hold_only / nvml management client. Each worker gets its
        own session (process group), as a job started by a scheduler does.

        kind: "graphics" or "mps" puts its contexts in NVML's graphics or MPS process list.
        fork_on_term: on SIGTERM it forks a child (titled child_title) that keeps its contexts,
        then exits. supervise=N: the process is a supervisor holding no GPU (titled title) that
        runs the worker (titled child_title) and restarts it N times, respawn_delay_ms after each
        exit; ``worker_pid`` is the first worker. user: run it as this uid (and gid), without
        supplementary groups, like a job of that user (setpriv; the node must be reachable by it)."""
        if not self._started or self._stopped:
            raise RuntimeError("node is not running")
        gpu_list = [gpus] if isinstance(gpus, int) else list(gpus or [])
        if not gpu_list and not (hold_only or nvml):
            gpu_list = [0]
        argv = [argv0 or str(paths.WORKER), "--state", str(self.state_dir), "--mib", str(mib)]
        for g in gpu_list:
            argv += ["--gpu", str(g)]
        flags = (
            ("--ignore-term", ignore_term),
            ("--stop", stop),
            ("--fork-child", fork_child),
            ("--hold-only", hold_only),
            ("--nvml", nvml),
            ("--fork-on-term", fork_on_term),
        )
        for flag, on in flags:
            if on:
                argv.append(flag)
        if kind != "compute":
            argv += ["--kind", kind]
        options = (
            ("--title", title),
            ("--child-title", child_title),
            ("--term-delay-ms", term_delay_ms),
            ("--exit-after-ms", exit_after_ms),
            ("--supervise", supervise),
            ("--respawn-delay-ms", respawn_delay_ms),
        )
        for opt, val in options:
            if val is not None:
                argv += [opt, str(val)]
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        ours.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        w = theirs.fileno()
        argv += ["--ready-fd", str(w)]
        self._seq += 1
        log_path = self.state_dir / "log" / f"worker-{self._seq}.log"
        exe = str(executable or paths.WORKER)
        setpriv = ["setpriv", f"--reuid={user}", f"--regid={user}", "--clear-groups", "--"] if user is not None else []
        try:
            with open(log_path, "wb") as log:
                common: dict[str, Any] = {"pass_fds": (w,), "stdin": subprocess.DEVNULL, "stdout": log, "stderr": subprocess.STDOUT, "start_new_session": True}
                if sandbox is not None:
                    common["start_new_session"] = False  # setsid -f gives the worker its own session
                    popen = sandbox.spawn_detached([*setpriv, exe, *argv[1:]], env=env, **common)  # --title names it
                elif setpriv:
                    popen = subprocess.Popen([*setpriv, exe, *argv[1:]], env=merge_env(os.environ, self.env(), env), **common)
                else:
                    popen = subprocess.Popen(argv, executable=exe, env=merge_env(os.environ, self.env(), env), **common)
        finally:
            theirs.close()
        worker = Worker(self, popen, ours, log_path, sandbox, stops=stop)
        self._workers.append(worker)
        if wait_ready:
            worker.wait_ready()
        return worker

    def spawn_daemon(self, name: str, sandbox: Sandbox | None = None, nvml: bool = False) -> Worker:
        """A protected daemon look-alike (nvidia-persistenced, nv-hostengine,
        dcgm-exporter): an executable copy of gpusim-worker named `name`, so exe
        basename, argv0 and comm all read `name`; it holds every device file
        (fds, no mmaps), or with nvml=True is an NVML client."""
        exe = self.state_dir / "bin" / name
        if not exe.exists():
            shutil.copy2(paths.WORKER, exe)
            exe.chmod(0o755)
        return self.spawn_worker(hold_only=not nvml, nvml=nvml, title=name, sandbox=sandbox, executable=exe, argv0=name)

    def sandbox(self, name: str | None = None, vmid: int | None = None, cgroup: bool = True, unprivileged: bool = False) -> Sandbox:
        """A private PID namespace (+ mount namespace with its own /proc): the
        stand-in for an LXC container or a test sandbox; unprivileged=True adds a
        user namespace (root inside is host uid 100000). See gpusim.Sandbox."""
        from .sandbox import Sandbox

        sb = Sandbox(self, name=name, vmid=vmid, cgroup=cgroup, unprivileged=unprivileged)
        self._sandboxes.append(sb)
        sb.start()
        return sb

    def _forget_sandbox(self, sb: Sandbox) -> None:
        if sb in self._sandboxes:
            self._sandboxes.remove(sb)


def merge_env(*layers: Mapping[str, str | None] | None) -> dict[str, str]:
    """Later layers win; a None value removes the variable."""
    out: dict[str, str] = {}
    for layer in layers:
        for k, v in (layer or {}).items():
            if v is None:
                out.pop(k, None)
            else:
                out[k] = v
    return out


def _as_list(value: Any) -> list[Any]:
    if isinstance(value, (list, tuple, set, frozenset)):
        return list(value)
    if isinstance(value, str):
        return [v for v in value.split(",") if v]
    return [value]


def _error_name(value: Any) -> str:
    """Normalise an NVML error given as a number or (short or full) name."""
    if isinstance(value, int):
        return str(value)
    name = str(value).strip().upper()
    return name if name.startswith("NVML_") or name.isdigit() else f"NVML_ERROR_{name}"


__all__ = ["Node", "Worker", "WorkerError"]
