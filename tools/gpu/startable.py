"""Hardware harness for the startability probe (issue 29): what the collection's own CUDA probe (plugins/module_utils/_cuda.py)
costs on real GPUs, that NVML reads the GPU idle right after it, and what it answers while a real torch process holds
most of the memory or a context. Run with the machine's python3 (torch, nvidia-ml-py):

    python3 tools/gpu/startable.py [--repeat 3] [--hold-gib 120] > startable.json

Phases, each GPU's figures in the JSON on stdout, a summary on stderr:

* ``cold`` then ``warm``: one GPU at a time, the probe as the module makes it (a forked helper per GPU, 90 % of the
  memory allocated, set, freed, the context released), each step's seconds, the helper's whole life, and how long NVML
  took to list no process and the idle memory again;
* ``parallel``: every GPU at once, as gpu_mem_verify probes them (the projection for 8 GPUs is measured here on as
  many as the machine has);
* ``busy``: GPU 0 while a torch process holds ``--hold-gib`` GiB (the 90 % probe must be ``cuda_oom``, error 2) and
  while it holds a context only (the probe must work); nothing else is changed (no mode, clock or reset).

It needs no Ansible: the module's own functions are imported from the checkout.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HOLDER = r"""
import sys, time, torch
gib = float(sys.argv[2])
d = torch.device("cuda:%s" % sys.argv[1])
x = torch.empty(max(1, int(gib * (1 << 30))), dtype=torch.uint8, device=d)
x.fill_(1); torch.cuda.synchronize(d)
print("ready", flush=True)
time.sleep(3600)
"""


def collection() -> None:
    """Import the checkout as ansible_collections.gpuops.clean_slate (a symlink in a temporary tree)."""
    tree = Path(tempfile.mkdtemp(prefix="gpuops-startable-")) / "ansible_collections" / "gpuops"
    tree.mkdir(parents=True)
    (tree / "clean_slate").symlink_to(ROOT)
    sys.path.insert(0, str(tree.parent.parent))


def nvml_idle(pynvml, index: int, pid: int, idle_used: int, limit: float = 10.0) -> dict:
    handle = pynvml.nvmlDeviceGetHandleByIndex(index)
    start = time.monotonic()
    while True:
        used = int(pynvml.nvmlDeviceGetMemoryInfo(handle, version=pynvml.nvmlMemory_v2).used)
        procs = [p.pid for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle)]
        waited = time.monotonic() - start
        if (pid not in procs and used <= idle_used + (64 << 20)) or waited > limit:
            return {"idle_after_s": round(waited, 4) if waited <= limit else None, "used_mib": used >> 20, "helper_listed": pid in procs}
        time.sleep(0.002)


def run(targets, fraction: float, timeout: float, pynvml, idle: dict[int, int]) -> dict:
    from ansible_collections.gpuops.clean_slate.plugins.module_utils import _cuda

    began = time.monotonic()
    raw, left = _cuda.probe(targets, fraction, timeout)
    wall = time.monotonic() - began
    out = {"wall_s": round(wall, 4), "left_behind": left, "gpus": {}}
    for target in targets:
        r = raw[target.gpu]
        judged = _cuda.judge(r, target.gpu, fraction, timeout, {}, None, None)
        out["gpus"][target.gpu] = {
            "ok": judged["ok"],
            "reason": judged["reason"],
            "code": judged["code"],
            "elapsed_s": r.get("elapsed_s"),
            "steps": r.get("steps"),
            "allocated_mib": r.get("allocated_mib"),
            "after": nvml_idle(pynvml, target.gpu, r["pid"], idle[target.gpu]),
        }
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--hold-gib", type=float, default=120.0)
    ap.add_argument("--fraction", type=float, default=0.9)
    ap.add_argument("--timeout", type=float, default=30.0)
    a = ap.parse_args()
    collection()
    import pynvml

    from ansible_collections.gpuops.clean_slate.plugins.module_utils import _cuda

    pynvml.nvmlInit()
    count = pynvml.nvmlDeviceGetCount()
    handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
    uuids = [pynvml.nvmlDeviceGetUUID(h) for h in handles]
    uuids = [u.decode() if isinstance(u, bytes) else u for u in uuids]
    idle = {i: int(pynvml.nvmlDeviceGetMemoryInfo(h, version=pynvml.nvmlMemory_v2).used) for i, h in enumerate(handles)}
    report: dict = {
        "gpus": count,
        "persistence_mode": [pynvml.nvmlDeviceGetPersistenceMode(h) for h in handles],
        "compute_mode": [pynvml.nvmlDeviceGetComputeMode(h) for h in handles],
        "fraction": a.fraction,
        "runs": [],
    }
    targets = [_cuda.Target(i, uuids[i]) for i in range(count)]
    for label, repeat in (("cold", 1), ("warm", a.repeat)):
        for _attempt in range(repeat):
            for target in targets:
                r = run([target], a.fraction, a.timeout, pynvml, idle)
                report["runs"].append({"phase": label, **r})
                g = r["gpus"][target.gpu]
                print(label, target.gpu, r["wall_s"], g["ok"], g["code"], g["after"], file=sys.stderr, flush=True)
    for _attempt in range(a.repeat):
        r = run(targets, a.fraction, a.timeout, pynvml, idle)
        report["runs"].append({"phase": "parallel", **r})
        print("parallel", count, r["wall_s"], [g["ok"] for g in r["gpus"].values()], file=sys.stderr, flush=True)
    for gib, label in ((a.hold_gib, "busy_memory"), (0.0, "busy_context_only")):
        holder = subprocess.Popen([sys.executable, "-c", HOLDER, "0", str(gib)], stdout=subprocess.PIPE, text=True)
        try:
            assert holder.stdout is not None
            holder.stdout.readline()
            busy = {0: int(pynvml.nvmlDeviceGetMemoryInfo(handles[0], version=pynvml.nvmlMemory_v2).used)}
            r = run([targets[0]], a.fraction, a.timeout, pynvml, busy)
            report["runs"].append({"phase": label, "holder_gib": gib, **r})
            g = r["gpus"][0]
            print(label, r["wall_s"], g["ok"], g["reason"], g["code"], file=sys.stderr, flush=True)
        finally:
            holder.kill()
            holder.wait()
    json.dump(report, sys.stdout, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
