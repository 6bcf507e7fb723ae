"""Ready together (issue 39): gpu_mem_verify on the simulated 8 x H200 node proves the GPUs a tp=8 server will use reach
each other (peer access, a pattern copied both ways, compared and timed, in one helper beside the CUDA starts) and reads
each GPU's links, clocks and temperature; each finding named with its verdict, a broken or hanging pair named by its two
GPUs, unsupported peer access red only when the server needs it, the room in /dev/shm, vLLM's stale cached answer. One
module run per scenario, several assertions each."""

from __future__ import annotations

import json
import os
import re
import subprocess
import time

from support.modules import ModuleRunner, assert_no_traceback

PAIRS = 28  # 8 GPUs


def verify(mod: ModuleRunner, check: bool = False, **args: object) -> dict:
    args.setdefault("kernel_log", str(mod.node.kernel_log))
    args.setdefault("timeout", 0)
    return mod("gpu_mem_verify", args, check=check)


def names(r: dict) -> list[tuple[str, str, object]]:
    """(name, verdict, gpu or gpus) of every finding of the check together."""
    return [(f["name"], f["verdict"], f.get("gpus", f["gpu"])) for f in r["together"]["findings"]]


def smi(node, *argv: str) -> str:
    env = {**os.environ, **node.env()}
    return subprocess.run(["nvidia-smi", *argv], env=env, capture_output=True, text=True, check=True).stdout


def smi_q(node) -> list[dict[str, str]]:
    """nvidia-smi -q's link, clock and temperature readings, GPU by GPU, as flat "section/key" -> value."""
    out: list[dict[str, str]] = []
    stack: list[tuple[int, str]] = []
    for line in smi(node, "-q").splitlines():
        if line.startswith("GPU "):
            out.append({})
            stack = []
            continue
        m = re.match(r"^( +)(\S.*?)\s*(?:: (.*))?$", line)
        if not m or not out:
            continue
        depth = len(m.group(1)) // 4
        stack = [(d, k) for d, k in stack if d < depth]
        key = "/".join([k for _d, k in stack] + [m.group(2)])
        if m.group(3) is None:
            stack.append((depth, m.group(2)))
        else:
            out[-1][key] = m.group(3)
    return out


def nvlink_status(node) -> dict[int, list[int]]:
    """nvidia-smi nvlink -s: each GPU's inactive links."""
    down: dict[int, list[int]] = {}
    gpu = -1
    for line in smi(node, "nvlink", "-s").splitlines():
        m = re.match(r"^GPU (\d+):", line)
        if m:
            gpu = int(m.group(1))
            down[gpu] = []
        m = re.match(r"^\s+Link (\d+): <inactive>", line)
        if m:
            down[gpu].append(int(m.group(1)))
    return down


def left_in(sandbox) -> list[int]:
    """Processes in the sandbox's PID namespace but its init: the module's helpers, if any were left."""
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.stat(f"/proc/{pid}/ns/pid").st_ino == sandbox.ns_inode and int(pid) != sandbox.init_pid:
                out.append(int(pid))
        except OSError:
            continue
    return out


def test_a_healthy_node_is_ready_together_its_readings_are_nvidia_smis_and_check_mode_makes_no_cuda_call(mod, node, sandbox) -> None:
    node.set_links(5, pcie_gen_idle=1)  # GPU 5 lowers its link to Gen1 while idle: never a finding
    r = verify(mod)
    assert r["_status"] == "ok", r
    tg = r["together"]
    assert tg["ready"] is True and tg["findings"] == [], tg["findings"]
    peers = tg["peers"]
    assert peers["checked"] and peers["gpus"] == list(range(8)) and len(peers["pairs"]) == PAIRS and peers["skipped"] is None
    for pair in peers["pairs"]:
        assert pair["status"] == "ok" and pair["can_access"] == [True, True] and pair["enabled"] == [True, True], pair
        assert pair["link"] == "nvlink" and pair["link_gbps"] == 450.0  # 18 NVLink 4 links at 25 GB/s each way
        assert [(c["from"], c["to"], c["match"]) for c in pair["copies"]] == [
            (pair["gpus"][0], pair["gpus"][1], True),
            (pair["gpus"][1], pair["gpus"][0], True),
        ]
        assert all(300 < c["gbps"] <= 450 for c in pair["copies"]), pair  # the simulated copy engines' 80 % of the links' rate
    # The whole matrix: well under a second (the starts around it are measured in docs/benchmarks.md).
    assert peers["matrix_s"] < 1.0 and peers["copy_mib"] == 2 and peers["reps"] == 8
    # Every GPU is proven startable alone too, and nothing of either check is left: no context, no helper.
    assert all(g["clean"] and g["startable"]["ok"] for g in r["gpus"]) and r["cuda_probe"]["left_behind"] == []
    assert node.contexts() == [] and left_in(sandbox) == []
    # The readings are nvidia-smi's (nvidia-smi -q, nvidia-smi nvlink -s).
    q = smi_q(node)
    down = nvlink_status(node)
    for reading in tg["links"]:
        i, pcie = reading["index"], reading["pcie"]
        assert str(pcie["gen_max"]) == q[i]["PCI/GPU Link Info/PCIe Generation/Max"]
        assert str(pcie["gen_gpu_max"]) == q[i]["PCI/GPU Link Info/PCIe Generation/Device Max"]
        assert str(pcie["gen"]) == q[i]["PCI/GPU Link Info/PCIe Generation/Current"]  # both read idle
        assert f"{pcie['width']}x" == q[i]["PCI/GPU Link Info/Link Width/Current"] and f"{pcie['width_max']}x" == q[i]["PCI/GPU Link Info/Link Width/Max"]
        assert f"{reading['temperature']['gpu_c']} C" == q[i]["Temperature/GPU Current Temp"]
        assert f"{reading['temperature']['margin_c']} C" == q[i]["Temperature/GPU T.Limit Temp"]
        assert ("gpu_idle" in reading["clocks"]["reasons"]) == (q[i]["Clocks Event Reasons/Idle"] == "Active")
        assert reading["nvlink"]["links"] == 18 and reading["nvlink"]["inactive"] == down[i] == []
    # GPU 5 read Gen1 idle, Gen5 while its start kept it busy: judged on the second, no finding.
    g5 = tg["links"][5]["pcie"]
    assert (g5["gen"], g5["gen_under_load"], g5["gen_max"], g5["gen_judged"]) == (1, 5, 5, True)
    assert tg["shm"]["free_mib"] >= 1024 and tg["p2p_caches"] == []
    # Check mode makes no CUDA call: no start, no peer check; the NVML readings are still judged.
    r = verify(mod, check=True)
    assert r["_status"] == "ok" and r["cuda_probe"]["probed"] == 0
    assert r["together"]["peers"]["checked"] is False and "check mode" in r["together"]["peers"]["skipped"]
    assert r["together"]["links"][5]["pcie"]["gen_judged"] is False and r["together"]["findings"] == []


def test_one_broken_pair_reads_clean_per_gpu_and_red_together_and_vllms_stale_answer_is_reported_then_removed(mod, node, tmp_path) -> None:
    node.set_fault(p2p_corrupt=[(2, 5)])
    cache_dir = tmp_path / "home" / "ops" / ".cache" / "vllm"
    cache_dir.mkdir(parents=True)
    cache = cache_dir / "gpu_p2p_access_cache_for_0,1,2,3,4,5,6,7.json"
    cache.write_text(json.dumps({f"{a}->{b}": True for a in range(8) for b in range(8)}, indent=4))
    dirs = [str(tmp_path / "home" / "*" / ".cache" / "vllm")]
    r = verify(mod, peers_cache_dirs=dirs, fail_on="never")
    assert (r["_status"], r["reason"]) == ("failed", "not_ready_together"), r
    # Clean per GPU: NVML reads every GPU clean and every CUDA start works.
    assert all(g["clean"] and g["diagnosis"] == "clean" and g["startable"]["ok"] for g in r["gpus"])
    tg = r["together"]
    assert tg["ready"] is False
    [broken] = [p for p in tg["peers"]["pairs"] if p["status"] != "ok"]
    assert broken["gpus"] == [2, 5] and broken["status"] == "p2p_broken" and broken["can_access"] == [True, True]
    assert [c["match"] for c in broken["copies"]] == [False, False] and "arrived changed" in broken["detail"]
    assert sum(p["status"] == "ok" for p in tg["peers"]["pairs"]) == PAIRS - 1
    # Named by its two GPUs, with its verdict; vLLM's file, which says 2->5 works, is stale, and only reported here.
    assert names(r) == [("p2p_broken", "fix_config", [2, 5]), ("p2p_cache_stale", "restart_app", [2, 5])], names(r)
    [item] = tg["p2p_caches"]
    assert item["stale"] == [[2, 5]] and item["removed"] is False and cache.exists()
    assert "GPUs 2 and 5" in r["msg"] and "NCCL_P2P_DISABLE=1" in r["msg"]
    assert "p2p_broken" in [f["name"] for f in r["health"]["findings"]] and r["health"]["verdict"] == "fix_config"
    assert_no_traceback(r)
    # With removal asked (the role's choice when residue removal is on), the stale file goes; the pair stays red.
    r = verify(mod, peers_cache_dirs=dirs, peers_cache="remove", fail_on="never")
    assert (r["_status"], r["reason"]) == ("failed", "not_ready_together"), r
    [item] = r["together"]["p2p_caches"]
    assert item["removed"] is True and not cache.exists() and [n for n, _v, _g in names(r)] == ["p2p_broken"]


def test_a_hanging_pair_ends_on_time_named_by_its_gpus_with_no_helper_left(mod, node, sandbox) -> None:
    node.set_fault(p2p_hang=[(1, 6)])
    began = time.monotonic()
    r = verify(mod, cuda_probe_timeout=3, fail_on="never")
    took = time.monotonic() - began
    assert (r["_status"], r["reason"]) == ("failed", "not_ready_together"), r
    pairs = {tuple(p["gpus"]): p for p in r["together"]["peers"]["pairs"]}
    hung = pairs[(1, 6)]
    assert hung["status"] == "p2p_broken" and "within 3 s" in hung["detail"] and "cuMemcpyPeer 1->6" in hung["detail"], hung
    # The pairs checked before it were answered; those after it were not checked (the helper was killed).
    assert pairs[(0, 1)]["status"] == "ok" and pairs[(1, 2)]["status"] == "ok" and pairs[(6, 7)]["status"] == "unchecked"
    assert names(r)[0] == ("p2p_broken", "fix_config", [1, 6])
    assert ("peers_unproven", "reset_gpu", [1, 2, 3, 4, 5, 6, 7]) in names(r), names(r)
    # On time: the deadline, the killed helper's teardown and Ansible's own second or two; nothing of it left.
    assert took < 3 + 10, took
    assert r["cuda_probe"]["left_behind"] == [] and node.contexts() == [] and left_in(sandbox) == []
    assert all(g["startable"]["ok"] for g in r["gpus"])


def test_unsupported_peer_access_is_reported_and_red_only_when_the_server_needs_it(mod, node) -> None:
    node.set_fault(p2p_unsupported=[(0, 1), (0, 2)])
    r = verify(mod)
    assert r["_status"] == "ok", r
    assert r["together"]["ready"] is True
    assert names(r) == [("p2p_unsupported", "ok", [0, 1]), ("p2p_unsupported", "ok", [0, 2])]
    pair = r["together"]["peers"]["pairs"][0]
    assert pair["can_access"] == [False, False] and pair["copies"] == [] and "cuDeviceCanAccessPeer 0->1: no" in pair["detail"]
    r = verify(mod, peers_required=True, fail_on="never")
    assert (r["_status"], r["reason"]) == ("failed", "not_ready_together"), r
    assert names(r) == [("p2p_unsupported", "fix_config", [0, 1]), ("p2p_unsupported", "fix_config", [0, 2])]
    assert "peers_required" in r["msg"]


def test_each_link_finding_with_its_verdict_and_a_slow_pair_against_its_link(mod, node) -> None:
    node.set_links(1, nvlink_down=[4, 9])
    node.set_links(2, nvlink_errors={"replay": {3: 12}, "crc_flit": {3: 2}})
    node.set_links(3, pcie_width=8)
    node.set_links(4, pcie_gen=3, pcie_gen_idle=1)  # trained at Gen3 where Gen5 is allowed: seen while busy
    node.set_links(6, clocks_event_reasons=["hw_slowdown", "hw_power_brake"])
    node.set_links(7, temperature=84)  # 3 C from its 87 C limit
    node.set_fault(p2p_gbps={(0, 7): 40.0})
    r = verify(mod, fail_on="never", nvlink_error_threshold=5, shm_min_mib=1 << 29)
    assert r["_status"] == "ok", r  # none of them is red by itself with fail_on: never
    found = names(r)
    assert found == [
        ("nvlink_inactive", "reset_gpu", 1),
        ("nvlink_errors", "reset_gpu", 2),
        ("pcie_width_degraded", "drain", 3),
        ("pcie_gen_degraded", "reboot", 4),
        ("clocks_slowdown", "drain", 6),
        ("temperature_high", "ok", 7),
        ("p2p_slow", "fix_config", [0, 7]),
        ("shm_low", "fix_config", None),
    ], found
    text = {f["name"]: f["text"] for f in r["together"]["findings"]}
    assert "link(s) 4, 9 of its 18" in text["nvlink_inactive"] and "link 3: replay 12" in text["nvlink_errors"]
    assert "crc_flit" not in text["nvlink_errors"]  # 2 is not above the threshold of 5
    assert "x8 where the GPU and its slot allow x16" in text["pcie_width_degraded"]
    assert "generation 3 while busy" in text["pcie_gen_degraded"] and "hw_slowdown, hw_power_brake_slowdown" in text["clocks_slowdown"]
    assert "40 GB/s, below 0.25 (peers_min_bandwidth) of the 450 GB/s their NVLink links allow" in text["p2p_slow"]
    assert "shm_min_mib" in text["shm_low"]
    # The readings say the same as nvidia-smi: the down links, the width, the event reasons.
    q = smi_q(node)
    assert nvlink_status(node)[1] == [4, 9] and q[3]["PCI/GPU Link Info/Link Width/Current"] == "8x"
    assert q[6]["Clocks Event Reasons/HW Slowdown"] == "Active" and q[6]["Clocks Event Reasons/HW Power Brake Slowdown"] == "Active"
    assert q[4]["PCI/GPU Link Info/PCIe Generation/Current"] == "1" and r["together"]["links"][4]["pcie"]["gen_under_load"] == 3
    # Each joins the host's health verdict with its verdict (the worst: drain).
    assert r["health"]["verdict"] == "drain" and [f["gpus"] for f in r["health"]["findings"] if f["name"] == "clocks_slowdown"] == [[6]]


def test_bad_thresholds_and_sizes_are_refused_before_anything_runs(mod, node, sandbox) -> None:
    for option, value, says in (
        ("peers_copy_mib", 0, "peers_copy_mib"),
        ("peers_min_bandwidth", 1.5, "peers_min_bandwidth"),
        ("peers_cache_dirs", ["relative/vllm"], "not an absolute directory"),
    ):
        r = verify(mod, **{option: value})
        assert (r["_status"], r["reason"], r["option"]) == ("failed", "bad_arguments", option), r
        assert says in r["msg"], r
    assert node.contexts() == [] and left_in(sandbox) == []


def test_in_a_container_cleaned_from_its_node_the_pair_is_checked_inside_and_its_stale_answer_removed_there(node, tmp_path) -> None:
    """ct102 of the lab, simulated: GPUs 6 and 7 passed through. The peer check runs inside the container, where the
    server starts (the same program as the start, through pct exec), its /dev/shm and vLLM's cache are the container's,
    and the cache's CUDA ordinals 0 and 1 are the container's two GPUs."""
    registry = tmp_path / "pct"
    registry.mkdir()
    (registry / "node").write_text("pve1")
    (registry / "latency_ms").write_text("0")
    env = {"PCTSIM_DIR": str(registry)}
    node.set_fault(p2p_corrupt=[(6, 7)])
    cache = tmp_path / "ct" / "root" / ".cache" / "vllm" / "gpu_p2p_access_cache_for_0,1.json"
    cache.parent.mkdir(parents=True)
    cache.write_text(json.dumps({"0->1": True, "1->0": True}))
    ct = node.sandbox(vmid=102)
    try:
        ct.register_pct(env["PCTSIM_DIR"])
        ct.pass_devices(omit=[f"nvidia{i}" for i in range(6)])
        args = {"containers": [102], "gpus": [6, 7], "timeout": 0, "kernel_log": str(node.kernel_log), "fail_on": "never"}
        args.update(peers_cache="remove", peers_cache_dirs=[str(tmp_path / "ct" / "root" / ".cache" / "vllm")])
        r = ModuleRunner(node, None)("gpu_mem_verify", args, env=env)
        assert (r["_status"], r.get("reason")) == ("failed", "not_ready_together"), {k: r.get(k) for k in ("_status", "msg")}
        assert all(g["clean"] and g["startable"]["ok"] for g in r["gpus"])
        [pair] = r["together"]["peers"]["pairs"]
        assert pair["gpus"] == [6, 7] and pair["status"] == "p2p_broken" and pair["link"] == "nvlink"
        [item] = r["together"]["p2p_caches"]
        assert item["stale"] == [[6, 7]] and item["removed"] is True and not cache.exists()
        assert r["together"]["shm"]["free_mib"] > 0 and r["cuda_probe"]["container"]["vmid"] == 102
        assert node.contexts() == []
    finally:
        ct.stop()
