"""Facts for the real-server issue, read on a real GPU (issues 28/33): which shared-memory names a
torch server's process tree really creates, and how long a killed GPU worker takes to tear down.

    python3 tools/gpu/server_facts.py [--gpu 0] [--gib 40] > server-facts.json

Part 1, names. An inotify watch on /dev/shm and $TMPDIR records every name created and removed
(transient ones too) while a server-shaped tree starts: a launcher that listens on a TCP port and
binds a ZMQ-style ipc:// socket, a scheduler in a session of its own (start_new_session, renamed
sglang::scheduler_TP0 as setproctitle does) that takes GPU memory with torch and sends a CPU and a
CUDA tensor through torch.multiprocessing queues to a detokenizer child (spawn), as SGLang's
processes do. The launcher is then SIGKILLed: who is left, who is their parent, what NVML lists,
which names stay.

Part 2, teardown. A worker that holds --gib GiB (one tensor, then the same in 1 GiB pieces) is
SIGKILLed; the times until it is a zombie (pidfd readable), reaped, gone from NVML's process list
and its memory back. Nothing is reset; no mode, clock or power is changed.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time

IN_CREATE, IN_DELETE, IN_MOVED_TO = 0x100, 0x200, 0x80

WORKER = r"""
import ctypes, os, sys, time, json, socket
import torch, torch.multiprocessing as mp

def set_title(title):
    with open("/proc/self/stat", "rb") as fh:
        fields = fh.read().rsplit(b")", 1)[1].split()
    a0, a1 = int(fields[45]), int(fields[46])
    data = title.encode()[: a1 - a0 - 1]
    ctypes.memmove(a0, data + b"\0" * (a1 - a0 - len(data)), a1 - a0)
    ctypes.CDLL(None).prctl(15, title.encode()[:15], 0, 0, 0)

def detok(q_cpu, q_gpu, ready):
    set_title("sglang::detokenizer")
    a = q_cpu.get(); b = q_gpu.get()
    ready.put((os.getpid(), int(a.sum()), float(b.sum().item())))
    time.sleep(3600)

if __name__ == "__main__":
    gpu, gib = int(sys.argv[1]), float(sys.argv[2])
    ctx = mp.get_context("spawn")
    q_cpu, q_gpu, ready = ctx.Queue(), ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=detok, args=(q_cpu, q_gpu, ready), daemon=False)
    child.start()
    set_title("sglang::scheduler_TP%d" % gpu)
    d = torch.device("cuda:%d" % gpu)
    keep = torch.empty(int(gib * (1 << 30)), dtype=torch.uint8, device=d); keep.fill_(1)
    cpu = torch.ones(1 << 20).share_memory_()
    small = torch.ones(1 << 20, device=d)
    q_cpu.put(cpu); q_gpu.put(small)
    info = ready.get(timeout=120)
    torch.cuda.synchronize(d)
    print(json.dumps({"scheduler": os.getpid(), "detokenizer": info[0]}), flush=True)
    time.sleep(3600)
"""

LAUNCHER = r"""
import json, os, socket, subprocess, sys, tempfile, time
srv = socket.socket(); srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind(("127.0.0.1", int(sys.argv[3]))); srv.listen(8)
ipc = tempfile.NamedTemporaryFile(delete=False).name
os.unlink(ipc)
u = socket.socket(socket.AF_UNIX); u.bind(ipc); u.listen(1)
w = subprocess.Popen([sys.executable, sys.argv[4], sys.argv[1], sys.argv[2]], stdout=subprocess.PIPE, text=True, start_new_session=True)
line = w.stdout.readline()
print(json.dumps({"launcher": os.getpid(), "ipc": ipc, "tree": json.loads(line)}), flush=True)
time.sleep(3600)
"""


class Watch(threading.Thread):
    def __init__(self, dirs: list[str]) -> None:
        super().__init__(daemon=True)
        self.libc = ctypes.CDLL(None, use_errno=True)
        self.fd = self.libc.inotify_init1(os.O_NONBLOCK)
        self.wd: dict[int, str] = {}
        for d in dirs:
            self.wd[self.libc.inotify_add_watch(self.fd, d.encode(), IN_CREATE | IN_DELETE | IN_MOVED_TO)] = d
        self.events: list[tuple[float, str, str]] = []
        self.t0 = time.monotonic()
        self.stop = False

    def run(self) -> None:
        while not self.stop:
            r = select.select([self.fd], [], [], 0.1)[0]
            if not r:
                continue
            data = os.read(self.fd, 65536)
            off = 0
            while off < len(data):
                wd, mask, size = struct.unpack_from("iIxxxxI", data, off)
                name = data[off + 16 : off + 16 + size].rstrip(b"\0").decode("utf-8", "replace")
                off += 16 + size
                kind = "create" if mask & (IN_CREATE | IN_MOVED_TO) else "delete"
                self.events.append((round(time.monotonic() - self.t0, 4), kind, os.path.join(self.wd.get(wd, "?"), name)))


def nvml(gpu: int) -> tuple[int, list[int]]:
    import pynvml

    h = pynvml.nvmlDeviceGetHandleByIndex(gpu)
    info = pynvml.nvmlDeviceGetMemoryInfo(h, version=pynvml.nvmlMemory_v2)
    return int(info.used), [p.pid for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h)]


def ps(pid: int) -> dict:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            rest = fh.read().rsplit(")", 1)[1].split()
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            cmd = fh.read().replace(b"\0", b" ").decode("utf-8", "replace").strip()
        return {"state": rest[0], "ppid": int(rest[1]), "pgid": int(rest[2]), "sid": int(rest[3]), "cmdline": cmd[:80]}
    except OSError:
        return {"gone": True}


def holders(path: str) -> list[int]:
    out = []
    try:
        st = os.stat(path)
    except OSError:
        return out
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                try:
                    s = os.stat(f"/proc/{pid}/fd/{fd}")
                except OSError:
                    continue
                if (s.st_dev, s.st_ino) == (st.st_dev, st.st_ino):
                    out.append(int(pid))
                    break
        except OSError:
            continue
    return out


def names_part(gpu: int, port: int) -> dict:
    tmp = tempfile.gettempdir()
    watch = Watch(["/dev/shm", tmp])
    watch.start()
    before_shm = sorted(os.listdir("/dev/shm"))
    # spawn pickles the child's target by module: the worker must be a file, not -c code.
    worker = os.path.join(tempfile.mkdtemp(prefix="gpuops-facts-"), "sglang_worker.py")
    with open(worker, "w") as fh:
        fh.write(WORKER)
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, str(gpu), "2", str(port), worker], stdout=subprocess.PIPE, text=True)
    assert launcher.stdout is not None
    line = launcher.stdout.readline()
    tree = json.loads(line)
    sched, detok = tree["tree"]["scheduler"], tree["tree"]["detokenizer"]
    live = sorted(set(os.listdir("/dev/shm")) - set(before_shm))
    running = {
        "launcher": ps(launcher.pid),
        "scheduler": ps(sched),
        "detokenizer": ps(detok),
        "nvml_procs": nvml(gpu)[1],
        "shm_live": {n: holders("/dev/shm/" + n) for n in live},
        "ipc_socket": tree["ipc"],
    }
    os.kill(launcher.pid, signal.SIGKILL)
    launcher.wait()
    time.sleep(1.0)
    after_launcher = {
        "scheduler": ps(sched),
        "detokenizer": ps(detok),
        "nvml_procs": nvml(gpu)[1],
        "port_listening": _listening(port),
        "ipc_socket_exists": os.path.exists(tree["ipc"]),
        "shm": {n: holders("/dev/shm/" + n) for n in sorted(set(os.listdir("/dev/shm")) - set(before_shm))},
    }
    for pid in (sched, detok):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and any(not ps(p).get("gone") and ps(p).get("state") != "Z" for p in (sched, detok)):
        time.sleep(0.05)
    time.sleep(1.0)
    left = sorted(set(os.listdir("/dev/shm")) - set(before_shm))
    tmp_left = tree["ipc"] if os.path.exists(tree["ipc"]) else None
    watch.stop = True
    watch.join()
    if tmp_left:
        os.unlink(tmp_left)
    return {
        "running": running,
        "after_launcher_killed": after_launcher,
        "left_after_all_killed": {"shm": left, "ipc_socket": tmp_left},
        "events": watch.events[:400],
    }


def _listening(port: int) -> bool:
    s = socket.socket()
    try:
        s.bind(("127.0.0.1", port))
        return False
    except OSError:
        return True
    finally:
        s.close()


HOLD = r"""
import sys, time, torch
gpu, gib, pieces = int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3])
d = torch.device("cuda:%d" % gpu)
each = int(gib * (1 << 30)) // pieces
keep = [torch.empty(each, dtype=torch.uint8, device=d) for _ in range(pieces)]
for k in keep: k.fill_(1)
torch.cuda.synchronize(d)
print("ready", flush=True)
time.sleep(3600)
"""


def teardown(gpu: int, gib: float, pieces: int, idle_used: int) -> dict:
    p = subprocess.Popen([sys.executable, "-c", HOLD, str(gpu), str(gib), str(pieces)], stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None
    p.stdout.readline()
    held_used = nvml(gpu)[0]
    pidfd = os.pidfd_open(p.pid)
    t0 = time.monotonic()
    os.kill(p.pid, signal.SIGKILL)
    out: dict = {"gib": gib, "pieces": pieces, "held_mib": (held_used - idle_used) >> 20}
    select.select([pidfd], [], [], 120)
    out["zombie_s"] = round(time.monotonic() - t0, 4)
    os.waitpid(p.pid, 0)
    out["reaped_s"] = round(time.monotonic() - t0, 4)
    os.close(pidfd)
    gone_nvml = back = None
    while time.monotonic() - t0 < 120 and (gone_nvml is None or back is None):
        used, procs = nvml(gpu)
        now = round(time.monotonic() - t0, 4)
        if gone_nvml is None and p.pid not in procs:
            gone_nvml = now
        if back is None and used <= idle_used + (64 << 20):
            back = now
        time.sleep(0.002)
    out["nvml_proc_gone_s"] = gone_nvml
    out["memory_back_s"] = back
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpu", type=int, default=0)
    ap.add_argument("--gib", type=float, default=40.0)
    ap.add_argument("--port", type=int, default=30000)
    a = ap.parse_args()
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    import pynvml

    pynvml.nvmlInit()
    idle_used = nvml(a.gpu)[0]
    report: dict = {"idle_used_mib": idle_used >> 20, "tmpdir": tempfile.gettempdir()}
    report["names"] = names_part(a.gpu, a.port)
    print("names done", file=sys.stderr, flush=True)
    report["teardown"] = []
    for gib, pieces in ((a.gib, 1), (a.gib, 1), (a.gib, 1), (a.gib, int(a.gib)), (120.0, 1)):
        r = teardown(a.gpu, gib, pieces, idle_used)
        report["teardown"].append(r)
        print("teardown", r, file=sys.stderr, flush=True)
    json.dump(report, sys.stdout, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
