"""Residue for real: kill a distributed torch job, list what it left, let the role clean it, restart it.

Called by validate.py (phase "residue"). Only the job's own files are ever touched: its run
directory is /tmp/gpuops16-<random tag> (its TMPDIR), its shm files carry its ranks' pids in their
names, and the role's residue globs are narrowed to exactly those (the device's /dev/shm and /tmp
may hold other people's files). The processes killed are those whose environment carries the tag.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time
import typing as t
from pathlib import Path

import residue_job  # beside this file, imported by validate.py run as a script (its folder is sys.path[0])

HERE = Path(__file__).resolve().parent


def tagged_pids(tag: str) -> list[int]:
    """Every process whose environment carries GPUOPS16_TAG=<tag> (the job and all it started)."""
    want = f"GPUOPS16_TAG={tag}".encode()
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as fh:
                if want in fh.read().split(b"\0"):
                    found.append(int(name))
        except OSError:
            continue
    return found


def snapshot(base: Path) -> dict[str, t.Any]:
    """/dev/shm and /tmp entries, unix socket files under /tmp (3 levels), and everything under base."""

    def sockets(root: str, depth: int) -> list[str]:
        out: list[str] = []
        try:
            entries = list(os.scandir(root))
        except OSError:
            return out
        for e in entries:
            try:
                st = e.stat(follow_symlinks=False)
            except OSError:
                continue
            if stat.S_ISSOCK(st.st_mode):
                out.append(e.path)
            elif stat.S_ISDIR(st.st_mode) and depth > 0:
                out += sockets(e.path, depth - 1)
        return out

    tree = []
    if base.exists():
        for root, dirs, files in os.walk(base):
            for n in dirs + files:
                p = os.path.join(root, n)
                st = os.lstat(p)
                kind = "socket" if stat.S_ISSOCK(st.st_mode) else "dir" if stat.S_ISDIR(st.st_mode) else "file"
                tree.append(f"{p} ({kind})")
    return {
        "shm": sorted(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else [],
        "tmp": sorted(os.listdir("/tmp")),
        "sockets": sorted(sockets("/tmp", 3)),
        "tree": sorted(tree),
    }


def diff(before: dict[str, t.Any], after: dict[str, t.Any]) -> dict[str, list[str]]:
    return {k: sorted(set(after[k]) - set(before[k])) for k in ("shm", "tmp", "sockets", "tree")}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def port_listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


class Job:
    def __init__(self, backend: t.Any, tag: str, base: Path, info: Path, port: int) -> None:
        self.b, self.tag, self.base, self.info, self.port = backend, tag, base, info, port

    def start(self, steps: int = 0) -> subprocess.Popen[bytes]:
        for f in self.info.glob("ready.*"):
            f.unlink()
        env = dict(os.environ)
        env.update(self.b.env)
        env.update(TMPDIR=str(self.base), GPUOPS16_TAG=self.tag, GPUOPS16_INFO=str(self.info), NCCL_NVLS_ENABLE="0", PYTHONUNBUFFERED="1")
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")  # the device machines have no network but loopback
        env.pop("GPUOPS16_STEPS", None)
        if steps:
            env["GPUOPS16_STEPS"] = str(steps)
        job = str(HERE / "residue_job.py")
        if self.b.name == "real":
            argv = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port", str(self.port), job]
        else:
            worker = self.b.workload_argv({"gpu": 0, "gib": 2})
            argv = [sys.executable, job, "--launcher", "--port", str(self.port), "--sim-worker", json.dumps(worker)]
        log = open(self.info / "job.log", "ab")  # noqa: SIM115 (the child holds it)
        return subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def wait_ready(self, proc: subprocess.Popen[bytes], timeout: float = 180.0) -> list[dict[str, t.Any]] | None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            files = [self.info / f"ready.{r}" for r in range(2)]
            if all(f.exists() for f in files):
                return [json.loads(f.read_text()) for f in files]
            if proc.poll() is not None:
                return None
            time.sleep(0.05)
        return None

    def kill_all(self, proc: subprocess.Popen[bytes]) -> list[int]:
        """SIGKILL every process of the job at once, as the OOM killer or `kill -9` of a job does."""
        killed: list[int] = []
        for _round in range(5):
            pids = [p for p in tagged_pids(self.tag) if p not in killed]
            if not pids:
                break
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            killed += pids
            time.sleep(0.05)
        proc.wait()
        deadline = time.monotonic() + 30
        while tagged_pids(self.tag) and time.monotonic() < deadline:
            time.sleep(0.05)
        return killed

    def log_tail(self) -> str:
        try:
            return (self.info / "job.log").read_text(errors="replace")[-3000:]
        except OSError:
            return ""


def run(h: t.Any) -> dict[str, t.Any]:
    """h: validate.Harness (backend, ansible, checks)."""
    b, a = h.b, h.a
    tag = "gpuops16" + secrets.token_hex(4)
    base = Path("/tmp") / tag
    info = Path("/tmp") / (tag + "-info")
    base.mkdir(mode=0o700)
    info.mkdir(mode=0o700)
    port = free_port()
    job = Job(b, tag, base, info, port)
    out: dict[str, t.Any] = {"tag": tag, "port": port}
    before = snapshot(base)
    try:
        t0 = time.monotonic()
        proc = job.start()
        ranks = job.wait_ready(proc)
        out["start_s"] = round(time.monotonic() - t0, 2)
        if not h.check("residue: the job starts (2 ranks working)", ranks is not None, job.log_tail()):
            job.kill_all(proc)
            return out
        assert ranks is not None
        out["ranks"] = ranks
        out["port_listening_while_running"] = port_listening(port)
        out["killed"] = sorted(job.kill_all(proc))
        after = snapshot(base)
        left = diff(before, after)
        out["left"] = left
        print(f"    residue left by the killed job: {json.dumps(left, indent=1)}", flush=True)
        pids = [r["pid"] for r in ranks]
        ours_shm = [n for n in left["shm"] if any(n.startswith(f"torch_{pid}_") for pid in pids)]
        paths = residue_job._paths(base, tag)
        h.check("residue: the killed job left torch shm files in /dev/shm", bool(ours_shm), str(left["shm"]))
        h.check("residue: ... a torchelastic run directory", any("/torchelastic_" in x and x.endswith("(dir)") for x in left["tree"]), str(left["tree"]))
        h.check("residue: ... its ipc socket file", str(paths["ipc"]) in left["sockets"], str(left["sockets"]))
        h.check("residue: ... the JIT baton and the flock file", paths["baton"].exists() and paths["flock"].exists())
        out["shm_manager_sockets"] = [x for x in left["sockets"] if "/torch-shm-dir-" in x]
        # The residue matters: the same job cannot start while it is there.
        t1 = time.monotonic()
        blocked = job.start(steps=5)
        try:
            rc_blocked = blocked.wait(timeout=120)
        except subprocess.TimeoutExpired:
            job.kill_all(blocked)
            rc_blocked = None
        out["blocked_rc"], out["blocked_s"] = rc_blocked, round(time.monotonic() - t1, 2)
        h.check("residue: while it is there the same job cannot start (baton held or socket in use)", rc_blocked not in (0, None), job.log_tail())
        job.kill_all(blocked)  # nothing should be left, but the failed start may leave a rank behind
        # The role, with its residue globs narrowed to this job's files.
        shm_globs = [f"/dev/shm/torch_{pid}_*" for pid in pids]
        extra = {
            "clean_slate_residue_shm": shm_globs,
            # The role's default socket globs for SGLang and torch_shm_manager, under this job's TMPDIR.
            "clean_slate_residue_sockets": [str(base / "tmp????????"), str(base / "torch-shm-dir-*" / "manager.sock")],
            "clean_slate_residue_locks": [str(base / "cache" / "torch_extensions" / "**" / "lock"), str(base / "cache" / "flashinfer" / "**" / "*.lock")],
            # torch_shm_manager's directory ($TMPDIR/torch-shm-dir-XXXXXX, holding its manager.sock), left when
            # the manager is killed with the job: the first H200 run found it; the role's defaults now match it
            # (its socket in clean_slate_residue_sockets, the directory in clean_slate_residue_dirs), as here.
            "clean_slate_residue_dirs": [str(base / "torchelastic_*"), str(base / "torch-shm-dir-*")],
            "clean_slate_residue_remove": ["shm", "sockets", "locks", "dirs"],
            "clean_slate_residue_ports": [port],
            "clean_slate_report_dir": str(h.tmp / "reports-residue"),
        }
        rc, wall, records, text = a.run(a.playbook_path(), extra_vars=extra)
        out["playbook_s"] = round(wall, 2)
        h.check("residue: the clean_slate playbook succeeds", rc == 0, text)
        # The role runs the phase inside gpuops.clean_slate.clean_slate_node (issue 13): its result is under "residue".
        res = [r for r in records if r.get("action", "").endswith("gpu_job_residue")]
        res += [
            {"result": r["result"]["residue"]}
            for r in records
            if r.get("action", "").endswith(("clean_slate_node", "clean_slate_host")) and "residue" in r.get("result", {})
        ]
        if res:
            r = res[-1]["result"]
            out["module"] = {k: r.get(k) for k in ("changed", "summary", "removed", "stale", "held", "ports", "reason", "msg")}
            print(f"    gpu_job_residue: {json.dumps(out['module'], default=str)[:3000]}", flush=True)
        now = snapshot(base)
        remaining = diff(before, now)
        out["left_after_role"] = remaining
        h.check("residue: the role removed the shm files", not any(n in now["shm"] for n in ours_shm), str(remaining["shm"]))
        h.check(
            "residue: ... the socket files, the baton, the flock file and the run and shm-manager directories",
            not (
                paths["ipc"].exists()
                or paths["baton"].exists()
                or paths["flock"].exists()
                or list(base.glob("torchelastic_*"))
                or list(base.glob("torch-shm-dir-*"))
            ),
            str(remaining["tree"]),
        )
        h.check("residue: the role's result carries the residue phase", bool(res), str([r.get("action") for r in records]))
        if out["shm_manager_sockets"] and res:
            removed = {x.get("path") for x in (res[-1]["result"].get("removed") or []) if x.get("kind") == "sockets"}
            h.check(
                "residue: torch_shm_manager's socket was removed by the socket glob (the role's default shape)",
                set(out["shm_manager_sockets"]) <= removed,
                f"{out['shm_manager_sockets']} vs {sorted(removed)}",
            )
        h.check("residue: everything outside the job's files is untouched", set(before["shm"]) <= set(now["shm"]) and set(before["tmp"]) <= set(now["tmp"]))
        # The same job now starts and runs to its end.
        t2 = time.monotonic()
        again = job.start(steps=40)
        try:
            rc_again = again.wait(timeout=180)
        except subprocess.TimeoutExpired:
            job.kill_all(again)
            rc_again = None
        out["restart_rc"], out["restart_s"] = rc_again, round(time.monotonic() - t2, 2)
        h.check("residue: after the role the same job starts and runs to its end", rc_again == 0, job.log_tail())
        out["left_after_clean_exit"] = diff(before, snapshot(base))
    finally:
        for pid in tagged_pids(tag):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        # Only the job's own files: its directories and its ranks' shm files.
        for pid in [r["pid"] for r in out.get("ranks", [])]:
            for n in os.listdir("/dev/shm"):
                if n.startswith(f"torch_{pid}_"):
                    os.unlink(f"/dev/shm/{n}")
        shutil.rmtree(base, ignore_errors=True)
        shutil.rmtree(info, ignore_errors=True)
    return out
