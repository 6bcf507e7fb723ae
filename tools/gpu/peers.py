"""Hardware harness for ready together (issue 39): what the collection's own peer check and link readings answer and cost
on real GPUs, beside nvidia-smi, so that the simulator's figures and the defaults can be checked. Run with the machine's
python3 (nvidia-ml-py; torch is not needed), nothing changed on the GPUs (no mode, clock, reset):

    python3 tools/gpu/peers.py [--repeat 3] [--sizes 1 2 4 8] > peers.json

Phases, the figures in the JSON on stdout, a summary on stderr:

* ``readings``: each GPU's links, clocks and temperature as the module reads them (``_links.read`` through the NVML
  helper, timed), beside ``nvidia-smi -q``'s PCIe, clock-event and temperature lines and ``nvidia-smi nvlink -s``/``-e``
  (the raw text kept), and whether they agree;
* ``contexts``: on every GPU, a primary context made (and released) by N processes, one GPU each (today's starts), by one
  process from N threads (the peer helper), and by one process one after the other: is context creation in one process
  serialised by the driver? (the simulator assumes threads make them side by side);
* ``starts``: the module's CUDA starts of every GPU alone, with the peer check beside them at each --sizes (its setup,
  matrix, release, each pair's GB/s both ways and whether the pattern came back equal), and with the helpers forked 0.5 s
  before they are told (what clean_slate_node's early fork saves);
* ``pcie_under_load``: each GPU's PCIe generation idle and as the start announces its memset (the module's reading).

With one GPU the pairs are none: the contexts, starts and readings phases still say what they cost. It needs no
Ansible; the module's own functions are imported from the checkout.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# Contexts on every GPU from one process, in threads or one after the other; prints each context's seconds and the whole.
CONTEXTS = r"""
import ctypes, json, sys, threading, time
mode, n = sys.argv[1], int(sys.argv[2])
cu = ctypes.CDLL("libcuda.so.1")
t0 = time.monotonic(); assert cu.cuInit(0) == 0; init = time.monotonic() - t0
ctx = [ctypes.c_void_p() for _ in range(n)]
took = [0.0] * n
def make(i):
    t = time.monotonic(); rc = cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx[i]), i); took[i] = time.monotonic() - t; assert rc == 0, rc
def drop(i):
    assert cu.cuDevicePrimaryCtxRelease_v2(i) == 0
t = time.monotonic()
if mode == "threads":
    th = [threading.Thread(target=make, args=(i,)) for i in range(n)]; [x.start() for x in th]; [x.join() for x in th]
else:
    [make(i) for i in range(n)]
made = time.monotonic() - t
t = time.monotonic()
if mode == "threads":
    th = [threading.Thread(target=drop, args=(i,)) for i in range(n)]; [x.start() for x in th]; [x.join() for x in th]
else:
    [drop(i) for i in range(n)]
print(json.dumps({"init_s": round(init, 4), "contexts_s": round(made, 4), "each_s": [round(x, 4) for x in took], "release_s": round(time.monotonic() - t, 4)}))
"""


def collection() -> None:
    """Import the checkout as ansible_collections.gpuops.clean_slate (a symlink in a temporary tree)."""
    tree = Path(tempfile.mkdtemp(prefix="gpuops-peers-")) / "ansible_collections" / "gpuops"
    tree.mkdir(parents=True)
    (tree / "clean_slate").symlink_to(ROOT)
    sys.path.insert(0, str(tree.parent.parent))


def sh(argv: list[str]) -> str:
    r = subprocess.run(argv, capture_output=True, text=True, check=False, timeout=60)
    return r.stdout + r.stderr


def log(*what: object) -> None:
    print(*what, file=sys.stderr, flush=True)


def readings(count: int) -> dict:
    from ansible_collections.gpuops.clean_slate.plugins.module_utils import _links, _probe

    with _probe.Prober(10) as prober:
        every = prober.start()
        began = time.monotonic()
        answers = prober.each(_links.read, every, [g.index for g in every])
        took = time.monotonic() - began
    read = {g.index: (a.value if a.error is None else {"error": str(a.error)}) for g, a in zip(every, answers)}
    q = sh(["nvidia-smi", "-q"])
    status, errors = sh(["nvidia-smi", "nvlink", "-s"]), sh(["nvidia-smi", "nvlink", "-e"])
    query = sh(
        [
            "nvidia-smi",
            "--query-gpu=index,pcie.link.gen.current,pcie.link.gen.max,pcie.link.gen.gpumax,pcie.link.width.current,pcie.link.width.max,"
            "clocks_event_reasons.active,temperature.gpu",
            "--format=csv,noheader,nounits",
        ]
    )
    agree = {}
    for line in query.splitlines():
        cells = [c.strip() for c in line.split(",")]
        if len(cells) < 8 or not cells[0].isdigit():
            continue
        r = read.get(int(cells[0])) or {}
        pcie, temp, clocks = r.get("pcie") or {}, r.get("temperature") or {}, r.get("clocks") or {}
        mask = int(cells[6], 16) if cells[6].startswith("0x") else None
        agree[cells[0]] = {
            "pcie": [str(pcie.get(k)) for k in ("gen", "gen_max", "gen_gpu_max", "width", "width_max")] == cells[1:6],
            "clocks_event_reasons": mask is None or mask == clocks.get("mask"),
            "temperature": str(temp.get("gpu_c")) == cells[7],
        }
    log("readings", round(took, 4), "s for", count, "GPU(s); agree with nvidia-smi:", agree)
    return {"read": read, "read_s": round(took, 4), "agree": agree, "smi_query": query, "smi_q": q, "nvlink_s": status, "nvlink_e": errors}


def contexts(count: int, repeat: int) -> dict:
    from ansible_collections.gpuops.clean_slate.plugins.module_utils import _cuda_program

    out: dict = {"processes": [], "threads": [], "sequential": []}
    uuids = gpu_uuids()
    for _run in range(repeat):
        began = time.monotonic()
        raw, _left = _cuda_program.probe([(i, uuids[i], True) for i in range(count)], 0.0, 60)  # a context each, no memory
        out["processes"].append(
            {"wall_s": round(time.monotonic() - began, 4), "ctx_s": [raw[i]["steps"].get("cuDevicePrimaryCtxRetain") for i in range(count)]}
        )
        for mode in ("threads", "sequential"):
            r = subprocess.run([sys.executable, "-c", CONTEXTS, mode, str(count)], capture_output=True, text=True, check=False, timeout=120)
            out[mode].append(json.loads(r.stdout) if r.returncode == 0 else {"error": r.stderr[-2000:]})
    log(
        "contexts on",
        count,
        "GPU(s): processes",
        [p["wall_s"] for p in out["processes"]],
        "threads",
        [t.get("contexts_s") for t in out["threads"]],
        "sequential",
        [t.get("contexts_s") for t in out["sequential"]],
    )
    return out


def gpu_uuids() -> list[str]:
    import pynvml

    pynvml.nvmlInit()
    out = []
    for i in range(pynvml.nvmlDeviceGetCount()):
        u = pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(i))
        out.append(u.decode() if isinstance(u, bytes) else u)
    return out


def starts(count: int, sizes: list[int], repeat: int) -> dict:
    from ansible_collections.gpuops.clean_slate.plugins.module_utils import _cuda_program, _peers

    uuids = gpu_uuids()
    gpus = [[i, uuids[i]] for i in range(count)]
    targets = [(i, uuids[i], False) for i in range(count)]
    out: dict = {"alone": [], "peers": {}, "early": []}
    gen: dict = {}

    def under_load(gpu: int, call: str) -> None:
        # The module's reading: the GPU's PCIe generation as its start announces the memset.
        if call == "cuMemsetD8_v2" and gpu not in gen:
            import pynvml

            gen[gpu] = pynvml.nvmlDeviceGetCurrPcieLinkGeneration(pynvml.nvmlDeviceGetHandleByIndex(gpu))

    for _run in range(repeat):
        began = time.monotonic()
        raw, _peer, left = _cuda_program.probe_all(targets, 0.9, 60, on_step=under_load)
        out["alone"].append({"wall_s": round(time.monotonic() - began, 4), "ok": all(r.get("ok") for r in raw.values()), "left": left})
        for size in sizes:
            began = time.monotonic()
            raw, peer, left = _cuda_program.probe_all(targets, 0.9, 60, {"gpus": gpus, "size": size << 20, "reps": _peers.REPS} if count > 1 else None)
            row = {"wall_s": round(time.monotonic() - began, 4), "ok": all(r.get("ok") for r in raw.values()), "left": left}
            if peer:
                row.update({k: peer.get(k) for k in ("setup_s", "matrix_s", "release_s", "elapsed_s", "steps")})
                row["pairs"] = [
                    {
                        "gpus": p["gpus"],
                        "can": p["can"],
                        "enable": p["enable"],
                        "copies": [(c["from"], c["to"], c["gbps"], c["match"], c["code"]) for c in p["copies"]],
                    }
                    for p in peer.get("pairs") or []
                ]
            out["peers"].setdefault(str(size), []).append(row)
        early = _cuda_program.Helpers(gpus, gpus if count > 1 else None)
        time.sleep(0.5)  # the kill and the residue phases, meanwhile
        began = time.monotonic()
        raw, peer, left = early.run(targets, 0.9, 60, {"gpus": gpus, "size": 2 << 20, "reps": _peers.REPS} if count > 1 else None)
        out["early"].append({"wall_s": round(time.monotonic() - began, 4), "ok": all(r.get("ok") for r in raw.values()), "left": left})
    out["pcie_under_load"] = gen
    log("starts alone", [r["wall_s"] for r in out["alone"]], "early", [r["wall_s"] for r in out["early"]])
    for size, rows in out["peers"].items():
        gbps = [c[2] for r in rows for p in r.get("pairs", []) for c in p["copies"] if c[2]]
        log(
            f"with the peer check, {size} MiB",
            [r["wall_s"] for r in rows],
            "matrix",
            [r.get("matrix_s") for r in rows],
            "GB/s median",
            statistics.median(gbps) if gbps else None,
        )
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4, 8])
    a = ap.parse_args()
    collection()
    import pynvml

    pynvml.nvmlInit()
    count = pynvml.nvmlDeviceGetCount()
    report = {"gpus": count, "driver": pynvml.nvmlSystemGetDriverVersion(), "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    report["topo"] = sh(["nvidia-smi", "topo", "-m"])
    report["readings"] = readings(count)
    report["contexts"] = contexts(count, a.repeat)
    report["starts"] = starts(count, a.sizes, a.repeat)
    ctypes.CDLL("libcuda.so.1")  # the machine has the driver's user space (a failure would have shown above)
    json.dump(report, sys.stdout, indent=1, default=str)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    sys.exit(main())
