"""A torch server's stop in order, on a real GPU (issue 41, run 1; validate.py phase "stop").

The server (stop_server.py: a launcher that binds its HTTP port and starts sglang::scheduler_TP0, holding real GPU
memory with torch, and sglang::detokenizer with ``spawn``, Python's resource tracker beside them, queues and semaphores
registered with it, ipc socket files in /tmp) is cleaned five ways, each on a fresh server:

* crash/role, crash/pipeline: its launcher SIGKILLed first, as the seeds' died; then the clean_slate playbook, or the
  hand-run pipeline's effect on the job (every process of it SIGKILLed, then ``sleep 2``);
* live/role: the playbook on the live server (the profiles' stop in order: the launcher alone first, with its grace);
* live/all_at_once: the same with ``clean_slate_profiles: []`` (today's all-at-once SIGTERM to every target);
* live/pipeline.

For each: the next start before and after (bind the port, allocate 90 % of the GPU), the server's files left in
/dev/shm and /tmp, the seconds from the cleanup's start to a working next start, and how each process ended. Only the
job's own processes are ever signalled by the harness (GPUOPS41_TAG in their environment).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
import typing as t
from pathlib import Path

HERE = Path(__file__).resolve().parent
SERVER = HERE / "stop_server.py"
WAYS = (("crash", "role"), ("crash", "pipeline"), ("live", "role"), ("live", "all_at_once"), ("live", "pipeline"))


def tagged(tag: str) -> list[int]:
    want = f"GPUOPS41_TAG={tag}".encode()
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/environ", "rb") as fh:
                    if want in fh.read().split(b"\0"):
                        out.append(int(name))
            except OSError:
                continue
    return out


class Server:
    def __init__(self, tag: str, base: Path, http: int, gib: float) -> None:
        self.tag, self.base, self.http, self.gib = tag, base, http, gib
        self.info = base / "info"
        self.env = dict(os.environ, GPUOPS41_TAG=tag, GPUOPS41_INFO=str(self.info), PYTHONUNBUFFERED="1", NCCL_NVLS_ENABLE="0")

    def start(self) -> dict[str, t.Any]:
        shutil.rmtree(self.info, ignore_errors=True)
        self.info.mkdir(parents=True)
        argv = [sys.executable, str(SERVER), "launcher", "--http", str(self.http), "--gib", str(self.gib)]
        with open(self.base / "server.log", "ab") as log:
            proc = subprocess.Popen(argv, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)  # pylint: disable=consider-using-with
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and not (self.info / "ready.json").exists():
            if proc.poll() is not None:
                raise RuntimeError(f"the server's launcher exited with {proc.returncode}: {(self.base / 'server.log').read_text()[-2000:]}")
            time.sleep(0.05)
        return dict(json.loads((self.info / "ready.json").read_text()))

    def next_start(self) -> dict[str, t.Any]:
        argv = [sys.executable, str(SERVER), "next", "--http", str(self.http), "--fraction", "0.9"]
        done = subprocess.run(argv, env=self.env, capture_output=True, text=True, check=False, timeout=300)
        lines = [x for x in done.stdout.splitlines() if x.startswith("{")]
        return {"ok": done.returncode == 0, **(json.loads(lines[-1]) if lines else {"error": done.stderr[-300:]})}

    def kill_everything(self) -> None:
        for _round in range(10):
            pids = tagged(self.tag)
            if not pids:
                return
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.2)


def files_of(ready: dict[str, t.Any]) -> list[str]:
    """The server's files: its queues, its semaphores, its socket paths."""
    names = [f"/dev/shm/{ready['own_queue']}"] + [f"/dev/shm/{w['queue']}" for w in ready["workers"]]
    names += [w["socket"] for w in ready["workers"]] + [f"/dev/shm/{s}" for s in ready["sems"]]
    return names


def left(ready: dict[str, t.Any]) -> list[str]:
    return [p for p in files_of(ready) if os.path.exists(p)]


def run(h: t.Any) -> dict[str, t.Any]:
    """h: validate.Harness (backend, ansible, checks)."""
    if h.b.name != "real":
        return {"skipped": "the stop phase needs a real GPU (torch)"}
    tag = "gpuops41" + secrets.token_hex(4)
    base = Path("/tmp") / tag
    base.mkdir(mode=0o700)
    http = 31000 + secrets.randbelow(500) * 2
    # 60 GiB: the next start's 90 % of the GPU cannot fit beside it.
    srv = Server(tag, base, http, gib=60.0)
    out: dict[str, t.Any] = {"tag": tag, "http": http, "gib": srv.gib}
    try:
        for state, way in WAYS:
            name = f"{state}/{way}"
            rec: dict[str, t.Any] = {}
            out[name] = rec
            ready = srv.start()
            rec["server"] = ready
            if state == "crash":
                os.kill(ready["launcher"], signal.SIGKILL)
                time.sleep(0.5)
            rec["blocked"] = srv.next_start()
            h.check(f"stop/{name}: the next start is blocked before the clean", not rec["blocked"]["ok"], str(rec["blocked"]))
            t0 = time.monotonic()
            if way == "pipeline":
                srv.kill_everything()
                time.sleep(2)
            else:
                extra: dict[str, t.Any] = {"clean_slate_residue_ports": [http], "clean_slate_report_dir": str(h.tmp / f"reports-stop-{state}-{way}")}
                if way == "all_at_once":
                    extra["clean_slate_profiles"] = []
                rc, wall, records, text = h.a.run(h.a.playbook_path(), extra_vars=extra)
                rec["playbook"] = {"rc": rc, "seconds": round(wall, 2)}
                h.check(f"stop/{name}: the playbook succeeds", rc == 0, text)
                node = [r for r in records if r.get("action", "").endswith("clean_slate_node") and "kill" in (r.get("result") or {})]
                if node:
                    res = node[-1]["result"]
                    keys = ("pid", "name", "outcome", "step", "ended_by", "seconds", "signals_sent")
                    rec["ended"] = [{k: x.get(k) for k in keys} for x in res["kill"].get("targets") or []]
                    rec["removed"] = [x.get("path") for x in (res.get("residue") or {}).get("removed") or []]
                    rec["timings"] = res.get("timings")
            rec["cleanup_s"] = round(time.monotonic() - t0, 2)
            rec["left"] = left(ready)
            rec["next"] = srv.next_start()
            rec["to_next_start_s"] = round(time.monotonic() - t0, 2)
            rec["stopped_itself"] = (srv.info / "stopped.json").exists()
            print(f"    stop/{name}: cleanup {rec['cleanup_s']} s, files left {len(rec['left'])}/{len(files_of(ready))}, next start {rec['next']}", flush=True)
            for e in rec.get("ended", []):
                print(f"        {e}", flush=True)
            if way != "pipeline":
                h.check(f"stop/{name}: the next start works", rec["next"]["ok"], str(rec["next"]))
            srv.kill_everything()
            for p in left(ready):
                try:
                    os.unlink(p)
                except OSError:
                    pass
    finally:
        srv.kill_everything()
        shutil.rmtree(base, ignore_errors=True)
    return out
