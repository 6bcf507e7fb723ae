"""A crashed SGLang-shaped server and its restart, on a real GPU (issue 33, run 2; validate.py phase "crash").

The server (crash_server.py) is crashed the way the seeds' was: its launcher is SIGKILLed and the scheduler, in a
session of its own, is reparented and keeps its GPU memory, its store port and its queue. The next start is shown
blocked; then either the hand-run pipeline's effect on the job (every python3 of the job SIGKILLed, as
``ps aux | grep python3 | awk '{print $2}' | xargs kill -9`` does, then ``sleep 2`` and nvidia-smi; ``fuser -k
/dev/nvidia*`` would also kill this harness and the machine's daemons, so only the job's holders are killed for it) or
the clean_slate playbook with its default residue patterns runs, and the next start is tried again. Only the job's own
processes are ever signalled by the harness (GPUOPS33_TAG in their environment); the playbook finds them itself.
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
SERVER = HERE / "crash_server.py"


def tagged(tag: str) -> list[int]:
    want = f"GPUOPS33_TAG={tag}".encode()
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


def stat_of(pid: int) -> dict[str, t.Any]:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            rest = fh.read().rsplit(")", 1)[1].split()
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            cmd = fh.read().split(b"\0")[0].decode("utf-8", "replace")
        return {"state": rest[0], "ppid": int(rest[1]), "sid": int(rest[3]), "title": cmd}
    except OSError:
        return {"gone": True}


class Server:
    def __init__(self, tag: str, base: Path, http: int, store: int, gib: float) -> None:
        self.tag, self.base, self.http, self.store, self.gib = tag, base, http, store, gib
        self.info = base / "info"
        self.env = dict(os.environ, GPUOPS33_TAG=tag, GPUOPS33_INFO=str(self.info), TMPDIR=str(base), PYTHONUNBUFFERED="1", NCCL_NVLS_ENABLE="0")

    def start(self) -> dict[str, t.Any]:
        shutil.rmtree(self.info, ignore_errors=True)
        self.info.mkdir(parents=True)
        argv = [sys.executable, str(SERVER), "launcher", "--http", str(self.http), "--store", str(self.store), "--gib", str(self.gib)]
        log = open(self.base / "server.log", "ab")  # noqa: SIM115 (the launcher holds it)
        subprocess.Popen(argv, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)  # pylint: disable=consider-using-with
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and not (self.info / "ready.json").exists():
            time.sleep(0.05)
        ready = json.loads((self.info / "ready.json").read_text())
        return {**ready, "scheduler": json.loads((self.info / "scheduler.json").read_text())}

    def next_start(self, fraction: float) -> dict[str, t.Any]:
        argv = [sys.executable, str(SERVER), "next", "--http", str(self.http), "--store", str(self.store), "--fraction", str(fraction)]
        t0 = time.monotonic()
        done = subprocess.run(argv, env=self.env, capture_output=True, text=True, check=False, timeout=300)
        lines = [x for x in done.stdout.splitlines() if x.startswith("{")]
        out = json.loads(lines[-1]) if lines else {"error": done.stderr[-500:]}
        return {"ok": done.returncode == 0, "seconds": round(time.monotonic() - t0, 2), **out}

    def kill_everything(self) -> None:
        for _round in range(5):
            pids = tagged(self.tag)
            if not pids:
                return
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.2)


def crash(srv: Server, ready: dict[str, t.Any]) -> dict[str, t.Any]:
    """SIGKILL the launcher only, as the seeds' launcher died; what is left of the tree."""
    os.kill(ready["launcher"], signal.SIGKILL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not stat_of(ready["launcher"]).get("gone") and stat_of(ready["launcher"]).get("state") != "Z":
        time.sleep(0.02)
    time.sleep(0.5)
    sched = ready["scheduler"]
    return {"scheduler": stat_of(sched["pid"]), "detokenizer": stat_of(sched["detokenizer"]), "queue_exists": os.path.exists(f"/dev/shm/{sched['mq']}")}


def residue_names(ready: dict[str, t.Any]) -> list[str]:
    pid = ready["scheduler"]["pid"]
    return sorted(n for n in os.listdir("/dev/shm") if n == ready["scheduler"]["mq"] or n.startswith((f"torch_{pid}_", f"cuda.shm.0.{pid:x}.")))


def pipeline(srv: Server) -> dict[str, t.Any]:
    """The hand-run pipeline's effect on the job: SIGKILL every python3 of it, sleep 2, nvidia-smi."""
    t0 = time.monotonic()
    srv.kill_everything()
    time.sleep(2)
    smi = subprocess.run(["nvidia-smi", "--query-gpu=index,memory.used", "--format=csv,noheader"], capture_output=True, text=True, check=False)
    return {"seconds": round(time.monotonic() - t0, 2), "nvidia_smi": smi.stdout.strip()}


def run(h: t.Any) -> dict[str, t.Any]:
    """h: validate.Harness (backend, ansible, checks)."""
    if h.b.name != "real":
        return {"skipped": "the crash phase needs a real GPU (torch)"}
    tag = "gpuops33" + secrets.token_hex(4)
    base = Path("/tmp") / tag
    base.mkdir(mode=0o700)
    http = 30000 + secrets.randbelow(1000) * 2
    store = http + 1
    # 100 GiB of an H200's 140: the next start's 90 % cannot fit beside it (SGLang's schedulers keep ~100 GB per GPU).
    srv = Server(tag, base, http, store, gib=100.0)
    out: dict[str, t.Any] = {"tag": tag, "http": http, "store": store, "gib": srv.gib}
    try:
        for way in ("pipeline", "playbook"):
            rec: dict[str, t.Any] = {}
            out[way] = rec
            ready = srv.start()
            rec["tree"] = {"launcher": ready["launcher"], **ready["scheduler"]}
            rec["after_crash"] = crash(srv, ready)
            rec["residue"] = residue_names(ready)
            sched = rec["after_crash"]["scheduler"]
            alive = not sched.get("gone") and sched.get("ppid") != ready["launcher"]
            h.check(f"crash/{way}: the scheduler outlives its launcher, reparented, holding its GPU", alive, str(sched))
            rec["blocked"] = srv.next_start(0.9)
            h.check(f"crash/{way}: the next start is blocked (port, queue or memory)", not rec["blocked"]["ok"], str(rec["blocked"]))
            t0 = time.monotonic()
            if way == "pipeline":
                rec["cleanup"] = pipeline(srv)
            else:
                extra = {"clean_slate_residue_ports": [http, store], "clean_slate_report_dir": str(h.tmp / "reports-crash")}
                rc, wall, records, text = h.a.run(h.a.playbook_path(), extra_vars=extra)
                rec["cleanup"] = {"seconds": round(wall, 2), "rc": rc}
                h.check("crash/playbook: the clean_slate playbook succeeds", rc == 0, text)
                node = [r for r in records if r.get("action", "").endswith("clean_slate_node") and "kill" in (r.get("result") or {})]
                if node:
                    res = node[-1]["result"]
                    rec["ended"] = [(x.get("pid"), x.get("name") or x.get("cmdline", "")[:40], x.get("outcome")) for x in res["kill"].get("targets") or []]
                    rec["removed"] = [x.get("path") for x in (res.get("residue") or {}).get("removed") or []]
                    facts = [(r.get("result") or {}).get("ansible_facts") or {} for r in records]
                    rec["summary"] = next((f["clean_slate_result"]["summary"] for f in reversed(facts) if "clean_slate_result" in f), "")
                    print(f"    {rec['summary']}", flush=True)
            rec["left"] = residue_names(ready)
            rec["next"] = srv.next_start(0.9)
            rec["to_next_start_s"] = round(time.monotonic() - t0, 2)
            print(f"    crash/{way}: cleanup {rec['cleanup']}, next start {rec['next']}", flush=True)
            if way == "playbook":
                h.check("crash/playbook: the next start works (ports, queue by the same name, 90 % of the GPU)", rec["next"]["ok"], str(rec["next"]))
                h.check("crash/playbook: the crashed tree's segments are gone", not rec["left"], str(rec["left"]))
            srv.kill_everything()
            for n in residue_names(ready):
                os.unlink(f"/dev/shm/{n}")
    finally:
        srv.kill_everything()
        shutil.rmtree(base, ignore_errors=True)
    return out
