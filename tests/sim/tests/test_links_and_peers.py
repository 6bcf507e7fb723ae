"""What a tp=N start needs of its GPUs together, as the simulated driver answers it (issue 39): NVML's NVLink, PCIe,
clock-event and temperature readings with the real return codes (an H100's answers, docs/results/round4-facts-
h100x1-2026-12-05.json), an idle GPU's lowered PCIe generation rising under a context, and libcuda's peer access,
peer copies that move real bytes at the pair's rate, events, and the per-pair faults (unsupported, corrupt, hang, rate)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

READ = r"""
import json, sys, pynvml
pynvml.nvmlInit()
h = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
def ask(fn, *a):
    try:
        return fn(*a)
    except pynvml.NVMLError as e:
        return {"error": e.value}
g = int(sys.argv[1])
print(json.dumps({
    "state": [ask(pynvml.nvmlDeviceGetNvLinkState, h[g], link) for link in range(20)],
    "count": ask(lambda: [(v.nvmlReturn, v.value.uiVal) for v in pynvml.nvmlDeviceGetFieldValues(h[g], [91])]),
    "replay2": ask(pynvml.nvmlDeviceGetNvLinkErrorCounter, h[g], 2, 0),
    "counter9": ask(pynvml.nvmlDeviceGetNvLinkErrorCounter, h[g], 0, 9),
    "gen": ask(pynvml.nvmlDeviceGetCurrPcieLinkGeneration, h[g]),
    "gen_max": ask(pynvml.nvmlDeviceGetMaxPcieLinkGeneration, h[g]),
    "width": ask(pynvml.nvmlDeviceGetCurrPcieLinkWidth, h[g]),
    "reasons": ask(pynvml.nvmlDeviceGetCurrentClocksEventReasons, h[g]),
    "temp": ask(pynvml.nvmlDeviceGetTemperature, h[g], 0),
    "thresholds": [ask(pynvml.nvmlDeviceGetTemperatureThreshold, h[g], t) for t in (0, 1, 2, 3)],
    "margin": ask(pynvml.nvmlDeviceGetMarginTemperature, h[g]),
    "p2p_self": ask(pynvml.nvmlDeviceGetP2PStatus, h[g], h[g], 0),
    "p2p_next": [ask(pynvml.nvmlDeviceGetP2PStatus, h[g], h[(g + 1) % len(h)], i) for i in (0, 2)],
}))
"""

# Peer access and copies between GPUs 0 and 1 (of CUDA_VISIBLE_DEVICES), as the collection's peer check makes them.
PEERS = r"""
import ctypes, json, sys, time
cu = ctypes.CDLL("libcuda.so.1")
out = {}
n = 4 << 20
ctx = [ctypes.c_void_p(), ctypes.c_void_p()]
buf = [ctypes.c_uint64(), ctypes.c_uint64()]
can = ctypes.c_int()
assert cu.cuInit(0) == 0
for d in (0, 1):
    assert cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx[d]), d) == 0
    cu.cuCtxSetCurrent(ctx[d])
    assert cu.cuMemAlloc_v2(ctypes.byref(buf[d]), ctypes.c_size_t(n)) == 0
cu.cuDeviceCanAccessPeer(ctypes.byref(can), 0, 1); out["can01"] = can.value
cu.cuDeviceCanAccessPeer(ctypes.byref(can), 0, 0); out["can00"] = can.value
cu.cuCtxSetCurrent(ctx[0])
out["disable_first"] = cu.cuCtxDisablePeerAccess(ctx[1])
out["enable_self"] = cu.cuCtxEnablePeerAccess(ctx[0], 0)
out["enable"] = cu.cuCtxEnablePeerAccess(ctx[1], 0)
out["again"] = cu.cuCtxEnablePeerAccess(ctx[1], 0)
pattern = bytes(range(256)) * (n // 256)
assert cu.cuMemcpyHtoD_v2(buf[0], pattern, ctypes.c_size_t(n)) == 0
ev = [ctypes.c_void_p(), ctypes.c_void_p()]
for e in ev:
    assert cu.cuEventCreate(ctypes.byref(e), 0) == 0
cu.cuEventRecord(ev[0], None)
print("copying", flush=True)
out["copy"] = cu.cuMemcpyPeer(buf[1], ctx[1], buf[0], ctx[0], ctypes.c_size_t(n))
cu.cuEventRecord(ev[1], None)
cu.cuEventSynchronize(ev[1])
ms = ctypes.c_float()
out["elapsed"] = cu.cuEventElapsedTime_v2(ctypes.byref(ms), ev[0], ev[1])
out["gbps"] = round(n / (ms.value / 1000) / 1e9, 1) if ms.value else None
back = ctypes.create_string_buffer(n)
cu.cuCtxSetCurrent(ctx[1])
out["dtoh"] = cu.cuMemcpyDtoH_v2(back, buf[1], ctypes.c_size_t(n))
out["match"] = back.raw == pattern
print(json.dumps(out), flush=True)
"""


def run(node, script: str, *argv: str, env: dict[str, str] | None = None) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", script, *argv], env={**os.environ, **node.env(), **(env or {})}, capture_output=True, text=True, timeout=60, check=False
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.splitlines()[-1])


def test_nvml_reads_links_clocks_and_temperature_with_the_real_return_codes(node) -> None:
    node.set_links(1, nvlink_down=[4], nvlink_errors={"replay": {2: 7}}, clocks_event_reasons=["hw_slowdown"], temperature=80)
    node.set_links(2, nvlinks=0, pcie_gen=4, pcie_width=8)  # a PCIe card (or an SXM module alone in a VM), downtrained
    r = run(node, READ, "1")
    assert r["state"][:5] == [1, 1, 1, 1, 0] and r["state"][18:] == [{"error": 2}, {"error": 2}]  # INVALID_ARGUMENT past link 17
    assert r["count"] == [[0, 18]] and r["replay2"] == 7 and r["counter9"] == {"error": 2}
    assert (r["gen"], r["gen_max"], r["width"]) == (5, 5, 16)
    assert r["reasons"] == 0x9  # HW slowdown, and idle (no context on it)
    assert (r["temp"], r["thresholds"], r["margin"]) == (80, [95, 89, {"error": 3}, 87], 7)  # the H100's thresholds
    assert r["p2p_self"] == 5 and r["p2p_next"] == [0, 5]  # itself: NOT_SUPPORTED, as the H100 answered; GPU 2 has no NVLink
    r = run(node, READ, "2")
    assert all(s == {"error": 3} for s in r["state"]) and r["count"] == [[3, 0]]  # no NVLink: NOT_SUPPORTED, as the H100 in a VM
    assert (r["gen"], r["width"]) == (4, 8) and r["p2p_next"] == [0, 5]  # peer reads fine, no NVLink to GPU 3


def test_an_idle_gpus_lowered_generation_goes_back_up_while_a_context_lives(node) -> None:
    node.set_links(0, pcie_gen_idle=1)
    assert run(node, READ, "0")["gen"] == 1
    worker = node.spawn_worker(gpus=[0], mib=1000)
    try:
        r = run(node, READ, "0")
        assert r["gen"] == 5 and r["reasons"] == 0  # busy: the trained generation, and no longer idle
    finally:
        worker.kill()
    smi = subprocess.run(["nvidia-smi", "nvlink", "-s"], env={**os.environ, **node.env()}, capture_output=True, text=True, check=True).stdout
    assert smi.count("GPU ") == 8 and "<inactive>" not in smi


def test_peer_access_copies_real_bytes_at_the_pairs_rate_with_cudas_codes(node) -> None:
    two = {"CUDA_VISIBLE_DEVICES": f"{node.gpus[0].uuid},{node.gpus[1].uuid}"}
    r = run(node, PEERS, env=two)
    assert (r["can01"], r["can00"]) == (1, 0)
    assert (r["disable_first"], r["enable_self"], r["enable"], r["again"]) == (705, 217, 0, 704)
    assert r["copy"] == 0 and r["dtoh"] == 0 and r["match"] is True
    assert 300 < r["gbps"] <= 360  # 18 NVLink 4 links at 80 % of 25 GB/s, measured by events
    node.set_fault(p2p_corrupt=[(0, 1)], p2p_gbps={(0, 1): 12.5})
    r = run(node, PEERS, env=two)
    assert r["match"] is False and r["gbps"] == 12.5
    node.set_fault(p2p_corrupt=None, p2p_gbps=None, p2p_unsupported=[(1, 0)])
    r = run(node, PEERS, env=two)
    # No peer access: the driver says so, enabling is refused, and a copy still works, staged through host memory.
    assert (r["can01"], r["enable"], r["match"]) == (0, 217, True) and r["gbps"] < 0.5 * 63


def test_a_hanging_pairs_copy_never_returns_and_sigkill_ends_it(node) -> None:
    node.set_fault(p2p_hang=[(0, 1)])
    proc = subprocess.Popen(
        [sys.executable, "-c", PEERS],
        env={**os.environ, **node.env(), "CUDA_VISIBLE_DEVICES": f"{node.gpus[0].uuid},{node.gpus[1].uuid}"},
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "copying"
        time.sleep(1.0)
        assert proc.poll() is None  # still in the copy
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
    assert proc.returncode == -signal.SIGKILL
    node.wait_clean(timeout=10)  # its two contexts torn down
