"""`make demo`: the clean_slate job against the built-in simulated GPU node.

Builds a simulated 8 x H200 node with the mess an inference host has before a
restart (six renamed SGLang scheduler workers, a forked child that kept GPU 6
after its parent died, a vLLM worker on GPU 7 that ignores SIGTERM) next to the
daemons that must survive (nvidia-persistenced, nv-hostengine, dcgm-exporter),
then runs the real playbook, playbooks/clean_slate.yml, and prints the GPUs
before and after and the summary line. The SGLang job also leaves the residue
a real one does (gpusim.residue): NCCL, vLLM, torch and Python shared memory
segments in /dev/shm (one of them still mapped by nv-hostengine), ZMQ socket
files, JIT compile locks, a torchelastic directory, and an HTTP listener on
port 30000; the residue is shown before and after too. Everything runs inside
a private PID namespace, with /dev/shm and /tmp of its own, and is stopped at
the end.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from gpusim import Node
from gpusim.residue import ResidueProc, inside, private_shm, spawn
from support.ansible import ROOT, local_inventory, run_playbook

HERE = Path(__file__).resolve().parent


DAEMONS = ("nvidia-persistenced", "nv-hostengine", "dcgm-exporter")


def gpu_table(before: list[dict], after: list[dict]) -> str:
    rows = [f"{'GPU':>3}  {'before (MiB)':>12}  {'held by (before)':<44}  {'after (MiB)':>11}  {'after':<10}"]
    rows.append("-" * len(rows[0]))
    for b, a in zip(before, after):
        holders = ", ".join(f"{p['pid']} {p['name'] or '(exited: NVML still lists it)'}" for p in b["processes"]) or "-"
        if b["diagnosis"] == "busy" and not b["processes"]:
            holders = "device file holder"
        rows.append(f"{b['index']:>3}  {b['used_mib']:>12}  {holders[:44]:<44}  {a['used_mib']:>11}  {a['diagnosis']:<10}")
    return "\n".join(rows)


def residue_table(job: ResidueProc, http: ResidueProc, port: int, cache: str, result: dict) -> str:
    after = {r["path"]: "removed" for r in result["removed"]}
    after.update({r["path"]: "kept: held by " + ", ".join(f"{h['pid']} {h['name']}" for h in r["holders"]) for r in result["held"]})
    after.update({r["path"]: "reported (" + r["why"].split("; ")[1] + ")" for r in result["stale"]})
    rows = [f"{'residue':<58}  {'size':>9}  {'before':<26}  after", "-" * 118]
    for kind in ("shm", "sockets", "locks", "dirs"):
        for path in job.info[kind]:
            size = result_bytes(result, path)
            where = path.replace(cache, "~/.cache")
            if len(where) > 58:
                where = where[:27] + "..." + where[-28:]
            before = f"the job's (PID {job.ns_pid}, alive)"
            rows.append(f"{where:<58}  {size:>9}  {before:<26}  {after.get(path, '-')}")
    port_after = {p["port"]: p["state"] for p in result["ports"]}.get(port, "?")
    before = f"listening (PID {http.ns_pid})"
    rows.append(f"{'port ' + str(port):<58}  {'':>9}  {before:<26}  {port_after}")
    return "\n".join(rows)


def result_bytes(result: dict, path: str) -> str:
    for key in ("removed", "held", "stale"):
        for r in result[key]:
            if r["path"] == path:
                return f"{r['bytes'] // 1024} KiB"
    return "-"


def main() -> int:
    started = time.monotonic()
    with Node(gpus=8) as node:
        sandbox = node.sandbox(name="demo")
        workers = [sandbox.spawn_worker(gpus=[i], mib=60000, title=f"sglang::scheduler_TP{i}") for i in range(6)]
        orphan = sandbox.spawn_worker(gpus=[6], mib=30000, fork_child=True, title="sglang::data_worker")
        stubborn = sandbox.spawn_worker(gpus=[7], mib=70000, ignore_term=True, title="VLLM::Worker_TP7")
        daemons = {name: node.spawn_daemon(name, sandbox=sandbox) for name in DAEMONS}
        # What the job leaves besides GPU memory, made the way SGLang, vLLM, NCCL and torch make it.
        private_shm(sandbox)
        cache = tempfile.mkdtemp(prefix="gpuops-demo-cache-")
        job = spawn(sandbox, "job", "--tmp", "/tmp", "--cache", cache, "--segments", "2", "--kib", "32768", "--comm", "sglang::dp_work")
        try:
            http = spawn(sandbox, "listen", "--port", "30000", "--comm", "sglang::tokeniz")
        except RuntimeError:  # 30000 is taken on this machine: any free port shows the same
            http = spawn(sandbox, "listen", "--comm", "sglang::tokeniz")
        port = http.info["port"]
        holder = spawn(sandbox, "hold", "--comm", "nv-hostengine", "--map", job.info["shm"][0])
        print(f"Simulated node: 8 x NVIDIA H200 at {node.state_dir}")
        print(f"  {len(workers)} SGLang scheduler workers (GPUs 0-5), a forked child holding GPU 6 after its parent died,")
        print("  a vLLM worker on GPU 7 that ignores SIGTERM, and " + ", ".join(DAEMONS) + " (must survive).")
        print(f"  The job's residue: {len(job.info['shm'])} shared memory segments, {len(job.info['sockets'])} ZMQ sockets,")
        print(f"  {len(job.info['locks'])} JIT locks, a torchelastic directory, an HTTP listener on port {port}.\n")

        with tempfile.TemporaryDirectory(prefix="gpuops-demo-") as tmp:
            inventory = local_inventory(
                Path(tmp) / "inventory.yml",
                {
                    "gpu-node-1": {
                        "clean_slate_device_dir": str(node.dev_dir),
                        "clean_slate_expected_gpus": 8,
                        "clean_slate_grace_period": 3,
                        "clean_slate_residue_ports": [port],
                        # The demo's stand-in for ~/.cache (the defaults name /root/.cache and /home/*/.cache).
                        "clean_slate_residue_locks": [f"{cache}/**/*.lock", f"{cache}/torch_extensions/**/lock"],
                    }
                },
            )
            env = node.env()
            env["PATH"] = f"{node.bin_dir}:{os.environ.get('PATH', '')}"
            print("$ ansible-playbook playbooks/clean_slate.yml -i inventory.yml -l gpu_nodes")
            run = run_playbook(ROOT / "playbooks" / "clean_slate.yml", inventory=inventory, limit="gpu_nodes", env=env, wrapper=sandbox.nsenter_prefix())
        if run.rc != 0:
            print(run.output)
            print(f"playbook failed (rc {run.rc})")
            return 1
        before = run.phase("before")["gpus"]
        after = run.phase("verify")["gpus"]
        kill = run.phase("kill")
        print()
        print(gpu_table(before, after))
        print()
        for t in kill["targets"]:
            signals = "+".join(t["signals_sent"])
            name = t["name"] if t["cmdline"].startswith("/") else t["cmdline"]
            print(f"  ended {t['pid']:>5} {name[:28]:<28} {t['outcome']:<10} {signals:<12} after {t['seconds']:.2f} s  ({t['reasons'][0]})")
        for p in kill["protected"]:
            if p["why"].startswith("protected daemon"):
                print(f"  kept  {p['pid']:>5} {p['name']:<28} {p['why']}")
        print()
        print(residue_table(job, http, port, cache, run.phase("residue")))
        print()
        print(run.summary())
        alive = [name for name, d in daemons.items() if d.alive()]
        print(f"Protected daemons still running: {', '.join(alive)}; playbook wall time {run.elapsed:.1f} s (Ansible start-up included).")
        ok = len(alive) == len(DAEMONS) and not any(w.alive() for w in [*workers, stubborn]) and not orphan.child_alive()
        residue = run.phase("residue")
        gone = {r["path"] for r in residue["removed"]}
        ok = ok and holder.alive() and not job.alive() and gone == set(job.info["shm"][1:] + job.info["sockets"])
        ok = ok and not any(os.path.lexists(inside(sandbox, p)) for p in gone) and os.path.exists(inside(sandbox, job.info["shm"][0]))
        sandbox.stop()
        shutil.rmtree(cache, ignore_errors=True)
    print(f"Demo finished in {time.monotonic() - started:.1f} s.")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
