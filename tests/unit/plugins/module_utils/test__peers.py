"""_peers: what the verification checks of its GPUs together and how it judges what came back (issue 39): each pair's
status and finding, red only where the server cannot work (broken, unproven, unsupported when required), a hanging pair
named by its two GPUs, the room in /dev/shm, vLLM's stale cached answer."""

from __future__ import annotations

import types
import typing as t

from ansible_collections.gpuops.clean_slate.plugins.module_utils import _cuda, _peers

PARAMS = {
    "peers": True,
    "cuda_probe": True,
    "peers_required": False,
    "peers_copy_mib": 8,
    "peers_min_bandwidth": 0.25,
    "links": True,
    "nvlink_error_threshold": 0,
    "shm_min_mib": 1024,
    "peers_cache": "report",
    "peers_cache_dirs": ["/root/.cache/vllm"],
}
NVLINK = {"links": 18, "active": 18, "inactive": [], "version": 6, "remote": "switch", "errors": {}}
PCIE = {"gen": 5, "gen_max": 5, "gen_gpu_max": 5, "width": 16, "width_max": 16}


def check(gpus: t.Sequence[int] = (0, 1, 2), check_mode: bool = False, **over: t.Any) -> _peers.Check:
    c = _peers.Check({**PARAMS, **over}, check_mode)
    c.links = {g: {"nvlink": NVLINK, "pcie": dict(PCIE), "p2p": {str(o): {"nvlink": True, "status": 0} for o in gpus if o != g}} for g in gpus}
    c.peer_gpus = [[g, f"GPU-{g}"] for g in gpus]
    return c


def copy(a: int, b: int, gbps: float = 360.0, match: bool | None = True, code: int | None = None, call: str | None = None) -> dict[str, t.Any]:
    return {"from": a, "to": b, "gbps": gbps, "match": match, "code": code, "call": call}


def pair(a: int, b: int, can: t.Sequence[t.Any] = (True, True), enable: t.Sequence[t.Any] = (0, 0), copies: list | None = None) -> dict[str, t.Any]:
    return {"gpus": [a, b], "can": list(can), "enable": list(enable), "copies": [copy(a, b), copy(b, a)] if copies is None else copies}


def starts(*gpus: int, failed: t.Sequence[int] = ()) -> dict[int, dict[str, t.Any]]:
    return {g: {"ok": g not in failed} for g in gpus}


def names(together: dict[str, t.Any]) -> list[tuple[str, str, t.Any]]:
    return [(f["name"], f["verdict"], f.get("gpus", f["gpu"])) for f in together["findings"]]


def test_which_gpus_the_peer_check_covers_and_when_there_is_none() -> None:
    targets = [_cuda.Target(0, "GPU-0"), _cuda.Target(1, "GPU-1"), _cuda.Target(2, "GPU-2", context_only=True), _cuda.Target(3, "GPU-3")]
    modes = {3: {"compute_mode": "exclusive_process"}, 0: {"compute_mode": "default"}}
    c = _peers.Check(PARAMS, False)
    # A busy GPU's context-only start and a GPU in exclusive_process mode leave no room for the peer helper's context.
    assert c.request(targets, modes, {}) == {"gpus": [[0, "GPU-0"], [1, "GPU-1"]], "size": 8 << 20, "reps": _peers.REPS}
    for params, check_mode, why in (
        ({**PARAMS, "peers": False}, False, "peers: false"),
        (PARAMS, True, "check mode makes no CUDA call"),
        ({**PARAMS, "cuda_probe": False}, False, "cuda_probe: false"),
    ):
        c = _peers.Check(params, check_mode)
        assert c.request(targets, modes, {}) is None and why in str(c.why_not)
    c = _peers.Check(PARAMS, False)
    assert c.request(targets[:1], modes, {}) is None and "no pair to check" in str(c.why_not)
    # A GPU NVML reads not clean (busy, hung): the run is red already; the pairs wait for a run where every GPU is clean.
    c = _peers.Check(PARAMS, False)
    assert c.request(targets, modes, {}, not_clean=[5, 4]) is None and c.why_not is not None and c.why_not.startswith("GPU(s) 4, 5 not clean")


def test_a_healthy_matrix_is_ready_and_each_pair_ok() -> None:
    c = check()
    c.raw = {"ok": True, "pairs": [pair(0, 1), pair(0, 2), pair(1, 2)], "matrix_s": 0.01, "pid": 42}
    tg = c.judge(starts(0, 1, 2), 10)
    assert tg["ready"] and tg["findings"] == [] and [p["status"] for p in tg["peers"]["pairs"]] == ["ok"] * 3
    assert tg["peers"]["pairs"][0]["link"] == "nvlink" and tg["peers"]["pairs"][0]["link_gbps"] == 450.0 and tg["peers"]["pid"] == 42


def test_unsupported_is_a_warning_unless_required_then_red() -> None:
    raw = {"ok": True, "pairs": [pair(0, 1, can=(False, False), enable=(None, None), copies=[])]}
    c = check((0, 1))
    c.raw = raw
    tg = c.judge(starts(0, 1), 10)
    assert tg["ready"] and names(tg) == [("p2p_unsupported", "ok", [0, 1])]
    assert "cuDeviceCanAccessPeer 0->1: no, 1->0: no" in tg["findings"][0]["text"]
    c = check((0, 1), peers_required=True)
    c.raw = raw
    tg = c.judge(starts(0, 1), 10)
    assert not tg["ready"] and names(tg) == [("p2p_unsupported", "fix_config", [0, 1])] and "peers_required" in _peers.message(tg)


def test_broken_pairs_are_red_and_named_by_their_two_gpus() -> None:
    c = check((0, 1, 2, 3))
    c.raw = {
        "ok": True,
        "pairs": [
            pair(0, 1, copies=[copy(0, 1, match=False), copy(1, 0)]),  # bytes changed on the way
            pair(0, 2, enable=(0, 999)),  # the driver offers it, enabling fails
            pair(0, 3, copies=[copy(0, 3, code=700, call="cuEventSynchronize"), copy(3, 0)]),  # the copy failed
            pair(1, 2, enable=(704, 0)),  # already enabled: fine
            pair(1, 3),
            pair(2, 3, can=(True, "CUresult 999"), enable=(None, None), copies=[]),  # the driver's answer was an error
        ],
    }
    tg = c.judge(starts(0, 1, 2, 3), 10)
    assert not tg["ready"]
    by = {tuple(p["gpus"]): p for p in tg["peers"]["pairs"]}
    assert "from 0 to 1 arrived changed" in by[(0, 1)]["detail"]
    assert "from 2 to 0 failed: CUDA error 999 (CUDA_ERROR_UNKNOWN)" in by[(0, 2)]["detail"]
    assert "CUDA error 700 (CUDA_ERROR_ILLEGAL_ADDRESS) in cuEventSynchronize" in by[(0, 3)]["detail"]
    assert by[(1, 2)]["status"] == "ok" and by[(1, 2)]["enabled"] == [True, True]
    assert by[(2, 3)]["status"] == "p2p_unsupported" and "CUresult 999" in by[(2, 3)]["detail"]
    assert names(tg) == [
        ("p2p_broken", "fix_config", [0, 1]),
        ("p2p_broken", "fix_config", [0, 2]),
        ("p2p_broken", "fix_config", [0, 3]),
        ("p2p_unsupported", "ok", [2, 3]),
    ]
    assert "GPUs 0 and 1" in _peers.message(tg) and "NCCL_P2P_DISABLE=1" in _peers.message(tg)


def test_slow_is_stated_against_the_pairs_link_and_zero_never_judges() -> None:
    c = check((0, 1))
    c.raw = {"ok": True, "pairs": [pair(0, 1, copies=[copy(0, 1, gbps=100.0), copy(1, 0, gbps=400.0)])]}
    tg = c.judge(starts(0, 1), 10)
    assert tg["ready"] and names(tg) == [("p2p_slow", "fix_config", [0, 1])]
    assert "moved 100 GB/s, below 0.25 (peers_min_bandwidth) of the 450 GB/s their NVLink links allow" in tg["findings"][0]["text"]
    c = check((0, 1), peers_min_bandwidth=0)
    c.raw = {"ok": True, "pairs": [pair(0, 1, copies=[copy(0, 1, gbps=1.0), copy(1, 0, gbps=1.0)])]}
    assert c.judge(starts(0, 1), 10)["findings"] == []


def test_a_hanging_pair_is_broken_the_pairs_after_it_unproven() -> None:
    c = check((0, 1, 2))
    c.raw = {"ok": False, "hung": "cuMemcpyPeer 1->0", "pairs": [], "steps": {}}
    tg = c.judge(starts(0, 1, 2), 3)
    by = {tuple(p["gpus"]): p for p in tg["peers"]["pairs"]}
    assert by[(0, 1)]["status"] == "p2p_broken" and "within 3 s (cuda_probe_timeout)" in by[(0, 1)]["detail"] and "cuMemcpyPeer 1->0" in by[(0, 1)]["detail"]
    assert by[(0, 2)]["status"] == by[(1, 2)]["status"] == "unchecked"
    assert names(tg) == [("p2p_broken", "fix_config", [0, 1]), ("peers_unproven", "reset_gpu", [0, 1, 2])]


def test_a_gpu_whose_own_start_failed_explains_the_pairs_not_checked() -> None:
    c = check((0, 1, 2))
    c.raw = {"ok": False, "code": 802, "step": "cuInit", "pairs": [], "steps": {}}
    tg = c.judge(starts(0, 1, 2, failed=[1]), 3)
    assert tg["ready"] and tg["findings"] == []  # GPU 1 is red by its own start; the pairs are not proven either way
    assert {p["status"] for p in tg["peers"]["pairs"]} == {"unchecked"}
    assert "one of its GPUs failed" in tg["peers"]["pairs"][0]["detail"] and "GPU(s) 1 failed their own start" in tg["peers"]["pairs"][1]["detail"]
    # With every start fine, the same failure is the check's own: unproven, red.
    c.raw = {"ok": False, "code": 2, "step": "cuMemAlloc_v2", "pairs": [], "steps": {}, "gpus": {}}
    tg = c.judge(starts(0, 1, 2), 3)
    assert not tg["ready"] and names(tg) == [("peers_unproven", "reset_gpu", [0, 1, 2])]
    assert "CUDA error 2 (CUDA_ERROR_OUT_OF_MEMORY) in cuMemAlloc_v2" in tg["findings"][0]["text"]


def test_no_peer_check_says_why_and_the_readings_are_still_judged() -> None:
    c = check((0, 1), check_mode=True)
    c.request([_cuda.Target(0, "GPU-0"), _cuda.Target(1, "GPU-1")], {}, {})
    c.links[1]["pcie"]["width"] = 8
    tg = c.judge(starts(0, 1), 10)
    assert tg["peers"]["checked"] is False and "check mode" in tg["peers"]["skipped"] and names(tg) == [("pcie_width_degraded", "drain", 1)]


def test_the_room_in_dev_shm_and_vllms_stale_answer() -> None:
    c = check((0, 1))
    c.raw = {"ok": True, "pairs": [pair(0, 1)]}
    c.next = {
        "shm": {"path": "/dev/shm", "size_mib": 64, "free_mib": 60},
        "p2p_caches": [
            {"path": "/root/.cache/vllm/gpu_p2p_access_cache_for_0,1.json", "stale": [[0, 1]], "removed": False},
            {"path": "/home/a/.cache/vllm/gpu_p2p_access_cache_for_0,1.json", "stale": [[0, 1]], "removed": True},
            {"path": "/home/b/.cache/vllm/gpu_p2p_access_cache_for_2,3.json", "stale": [], "removed": False},
        ],
    }
    tg = c.judge(starts(0, 1), 10)
    assert names(tg) == [("shm_low", "fix_config", None), ("p2p_cache_stale", "restart_app", [0, 1])]
    assert "60 MiB free of 64 MiB" in tg["findings"][0]["text"] and tg["ready"]  # neither fails by itself
    assert c.next_start_request([types.SimpleNamespace(index=0, uuid="GPU-A"), types.SimpleNamespace(index=1, uuid=None)]) == {
        "shm": "/dev/shm",
        "peers_cache": {"dirs": ["/root/.cache/vllm"], "remove": False, "ordinals": [0, 1], "uuids": {"gpu-a": 0}},
    }
    assert _peers.Check({**PARAMS, "peers_cache": "remove", "shm_min_mib": 0}, True).next_start_request([]) == {
        "shm": None,
        "peers_cache": {"dirs": ["/root/.cache/vllm"], "remove": False, "ordinals": [], "uuids": {}},  # never removed in check mode
    }
    assert _peers.Check({**PARAMS, "peers_cache": "ignore"}, False).next_start_request([])["peers_cache"] is None
