# Copyright (c) 2026, gpuops.clean_slate maintainers
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# Note: this module_util is PRIVATE to the collection; it may change without notice.

"""Ready together (issue 39): the GPUs a tp=N server will use, proven to reach each other, and what the next start needs.

"Startable" proves each GPU alone. A tensor-parallel server needs its GPUs together: peer access between every two of
them (NCCL's P2P transport, vLLM's and SGLang's custom all-reduce), working (not reported supported and then corrupting
copies or hanging, the reason operators set ``NCCL_P2P_DISABLE=1``), at the speed their link allows. This file decides
what the verification checks (:class:`Check`: which GPUs, the options), and judges what came back:

* the peer check (:func:`._cuda_program.together`, one helper beside the CUDA starts): per pair what the driver says
  (``cuDeviceCanAccessPeer``), peer access enabled both ways, a known pattern copied both ways, read back and compared,
  and the copy's bandwidth against what the pair's link allows (:func:`._links.pair_link`). Findings:
  ``p2p_unsupported`` (reported; red only with ``peers_required``), ``p2p_broken`` (a copy that changed bytes, failed
  or hung, or enabling that failed where the driver offers it: red, the pair named by its two GPUs), ``p2p_slow``
  (below ``peers_min_bandwidth`` of the link's rate), ``peers_unproven`` (the check could not be made although every
  GPU's own start worked: red, since green means proven);
* the room in ``/dev/shm`` against ``shm_min_mib`` (``shm_low``): NCCL's segments and the servers' queues go there;
* vLLM's cached P2P answer (``~/.cache/vllm/gpu_p2p_access_cache_for_<devices>.json``), which vLLM trusts instead of
  testing again: one that says peer access works where the check found it does not is ``p2p_cache_stale``, and is
  removed with ``peers_cache: remove`` (the role's choice when residue removal is on).

The red ones make the verification fail with ``not_ready_together`` whatever ``fail_on`` says, as a failed start makes
its GPU not clean; every finding also joins the health verdict with its verdict (:mod:`._findings`).
"""

from __future__ import annotations

import time
import typing as t

from ansible_collections.gpuops.clean_slate.plugins.module_utils import _cuda, _cuda_program, _links

P2P_UNSUPPORTED = "p2p_unsupported"
P2P_BROKEN = "p2p_broken"
P2P_SLOW = "p2p_slow"
PEERS_UNPROVEN = "peers_unproven"
SHM_LOW = "shm_low"
P2P_CACHE_STALE = "p2p_cache_stale"
FINDINGS = (P2P_UNSUPPORTED, P2P_BROKEN, P2P_SLOW, PEERS_UNPROVEN, SHM_LOW, P2P_CACHE_STALE)
#: Findings that fail the verification (``not_ready_together``) whatever ``fail_on`` says; ``p2p_unsupported`` too with
#: ``peers_required``.
RED = (P2P_BROKEN, PEERS_UNPROVEN)
#: Copies of the pattern timed together in each direction (the bytes read back and compared are the last one's): the GPU
#: runs them back to back, so that the time between the two events is the link's and not the host's time to issue a copy
#: (a few microseconds each, which a single 2 MiB copy over NVLink, about 6 us, would not outweigh); they cost the host
#: nothing more, only the GPU's copy engines (8 x 2 MiB at 360 GB/s: 47 us).
REPS = 8
#: What ``peers_cache`` may say.
P2P_CACHE_CHOICES = ("report", "remove", "ignore")
#: Where vLLM's cached answers are looked for by default (``peers_cache_dirs``).
P2P_CACHE_DIRS = _cuda_program.P2P_CACHE_DIRS


class Check:
    """What one verification checks of its GPUs together, and what it found.

    ``params`` are gpu_mem_verify's (``peers``, ``peers_required``, ``peers_copy_mib``, ``peers_min_bandwidth``,
    ``links``, ``nvlink_error_threshold``, ``shm_min_mib``, ``peers_cache``); ``in_container``: the starts are made inside
    a container (its /dev/shm and its vLLM cache are the container's, looked at by the program there)."""

    def __init__(self, params: t.Mapping[str, t.Any], check_mode: bool, in_container: bool = False) -> None:
        self.params = params
        self.check_mode = check_mode
        self.in_container = in_container
        self.links: dict[int, dict[str, t.Any]] = {}  # GPU index -> _links.read
        self.under_load: dict[int, int | None] = {}  # GPU index -> PCIe generation read while its start kept it busy
        self.peer_gpus: list[list[t.Any]] = []  # [index, uuid] of the GPUs the peer check covers
        self.why_not: str | None = None  # why there is no peer check
        self.raw: dict[str, t.Any] | None = None  # the peer helper's answer
        self.next: dict[str, t.Any] = {"shm": None, "p2p_caches": None}
        self.started = time.monotonic()

    # ------------------------------------------------------------------ what is checked
    def read_links(self, prober: t.Any, gpus: list[t.Any]) -> None:
        """Each readable GPU's links, clocks and temperature, and NVML's word on each pair (in the prober's helper)."""
        if not self.params.get("links", True):
            return
        readable = [g for g in gpus if g.error is None]
        indices = [g.index for g in readable]
        for g, answer in zip(readable, prober.each(_links.read, readable, indices)):
            if answer.error is None:
                self.links[g.index] = answer.value

    def request(
        self, targets: t.Sequence[_cuda.Target], modes: t.Mapping[int, dict[str, t.Any]], uuids: t.Mapping[int, str], not_clean: t.Sequence[int] = ()
    ) -> dict[str, t.Any] | None:
        """What the peer helper is asked (:func:`._cuda_program.probe_all`'s ``peers``), None for no peer check.

        The GPUs of the check are those whose full start is made (NVML reads them clean) in the default compute mode: in
        exclusive_process mode the start's own context leaves no room for the peer helper's. ``not_clean``: the selected
        GPUs NVML reads not clean (busy, unreadable, hung); with any, there is no peer check: the server that starts next
        needs every one of its GPUs, so the run is red already, and the check of what is left would only lengthen a red
        run (a hung GPU's run is bounded by its timeout: tests/functional/test_driver_hang.py); the next run checks them
        together once every GPU reads clean."""
        p = self.params
        if not p.get("peers", True):
            self.why_not = "the peer check is off (peers: false)"
            return None
        if self.check_mode:
            self.why_not = "check mode makes no CUDA call"
            return None
        if not p.get("cuda_probe", True):
            self.why_not = "the peer check is part of the CUDA start, which is off (cuda_probe: false)"
            return None
        if not_clean:
            self.why_not = f"GPU(s) {', '.join(map(str, sorted(not_clean)))} not clean: the GPUs are checked together once every one of them reads clean"
            return None
        chosen = [x for x in targets if not x.context_only and (modes.get(x.gpu, {}).get("compute_mode") in (None, "default"))]
        self.peer_gpus = [[x.gpu, uuids.get(x.gpu) or x.uuid] for x in chosen]
        if len(self.peer_gpus) < 2:
            self.why_not = f"{len(self.peer_gpus)} GPU(s) read clean in the default compute mode: no pair to check"
            return None
        return {"gpus": self.peer_gpus, "size": int(p.get("peers_copy_mib", 2)) << 20, "reps": REPS}

    def on_step(self, prober: t.Any, gpus: t.Mapping[int, t.Any]) -> t.Callable[[int, str], None]:
        """What the starts' announcements call: the GPU's PCIe generation read once while its start keeps it busy (its
        memset and after, while its context lives)."""

        def read(gpu: int, call: str) -> None:
            pcie = (self.links.get(gpu) or {}).get("pcie")
            if not pcie or gpu in self.under_load or call not in ("cuMemsetD8_v2", "cuCtxSynchronize", "cuMemFree_v2") or gpu not in gpus:
                return
            answer = prober.each(_links.read_pcie_gen, [gpus[gpu]])[0]
            self.under_load[gpu] = answer.value if answer.error is None else None

        return read

    def next_start_request(self, every: t.Sequence[t.Any]) -> dict[str, t.Any]:
        """What the program looks at for the next start (:func:`._cuda_program.next_start`): /dev/shm, and vLLM's cached
        answers with how their device lists map to the GPUs here (``every``: NVML's GPUs, in NVML's order)."""
        p = self.params
        cache = p.get("peers_cache", "report")
        asked: dict[str, t.Any] = {"shm": "/dev/shm" if int(p.get("shm_min_mib", 0) or 0) > 0 else None, "peers_cache": None}
        if cache != "ignore":
            asked["peers_cache"] = {
                "dirs": list(p.get("peers_cache_dirs") or _cuda_program.P2P_CACHE_DIRS),
                "remove": cache == "remove" and not self.check_mode,
                # A cache's CUDA ordinals are those of the GPUs the server saw: here every GPU, in a container its own.
                "ordinals": [g.index for g in every],
                "uuids": {str(g.uuid).lower(): g.index for g in every if g.uuid},
            }
        return asked

    def look_here(self, every: t.Sequence[t.Any]) -> None:
        """The next start's room and vLLM's cached answers on this host (host scope; in a container the program does it)."""
        self.next = _cuda_program.next_start("/", self.raw, self.next_start_request(every))

    # ------------------------------------------------------------------ judging
    def judge(self, starts: t.Mapping[int, dict[str, t.Any]], timeout: float) -> dict[str, t.Any]:
        """The ``together`` record: each GPU's readings, the pairs, the next start's room, vLLM's caches, every finding,
        and ``ready`` (False when a red finding fails the verification, ``not_ready_together``)."""
        p = self.params
        findings = _links.judge(self.links, self.under_load, int(p.get("nvlink_error_threshold", 0))) if self.links else []
        peers = self._pairs(starts, timeout, findings)
        shm = self.next.get("shm")
        need = int(p.get("shm_min_mib", 0) or 0)
        if shm and need and shm.get("free_mib") is not None and shm["free_mib"] < need:
            findings.append(
                _links.finding(
                    SHM_LOW,
                    f"{shm['path']} has {shm['free_mib']} MiB free of {shm['size_mib']} MiB where the next start needs {need} MiB (shm_min_mib): NCCL's"
                    " segments and the servers' queues fail there with 'No space left on device' or a bus error",
                )
            )
        caches = self.next.get("p2p_caches")
        for item in caches or []:
            if item.get("stale") and not item.get("removed"):
                pairs = ", ".join(f"{a}-{b}" for a, b in item["stale"])
                why = f" (not removed: {item['not_removed']})" if item.get("not_removed") else ""
                findings.append(
                    _links.finding(
                        P2P_CACHE_STALE,
                        f"{item['path']} says peer access works between GPUs {pairs}, where the check found it does not{why}: vLLM trusts the file"
                        " and would use its custom all-reduce there",
                        gpus=[g for pair in item["stale"] for g in pair],
                    )
                )
        red = [f for f in findings if f["name"] in RED or (f["name"] == P2P_UNSUPPORTED and p.get("peers_required"))]
        return {
            "ready": not red,
            "links": [{"index": i, **r} for i, r in sorted(self.links.items())],
            "peers": peers,
            "shm": shm,
            "p2p_caches": caches,
            "findings": findings,
            "elapsed_s": round(time.monotonic() - self.started, 4),
        }

    def _pairs(self, starts: t.Mapping[int, dict[str, t.Any]], timeout: float, findings: list[dict[str, t.Any]]) -> dict[str, t.Any]:
        """The peer check's record (``checked``, ``gpus``, ``pairs``, timings), its findings appended to ``findings``."""
        p = self.params
        raw = self.raw
        record: dict[str, t.Any] = {
            "checked": raw is not None,
            "gpus": [g for g, _uuid in self.peer_gpus],
            "copy_mib": int(p.get("peers_copy_mib", 2)),
            "reps": REPS,
            "min_bandwidth": float(p.get("peers_min_bandwidth", 0.25)),
            "pairs": [],
            "skipped": self.why_not,
        }
        if raw is None:
            return record
        record.update({k: raw.get(k) for k in ("setup_s", "matrix_s", "release_s", "elapsed_s", "pid")})
        failed_starts = {g for g in record["gpus"] if not (starts.get(g) or {}).get("ok")}
        answered = {tuple(sorted(pair["gpus"])): pair for pair in raw.get("pairs") or []}
        stuck = raw.get("hung") or raw.get("died") or raw.get("abandoned")
        stuck_pair = _pair_of(stuck) if stuck else None
        gpus = record["gpus"]
        for x, a in enumerate(gpus):
            for b in gpus[x + 1 :]:
                key = (min(a, b), max(a, b))
                kind, nominal = _links.pair_link(self.links.get(key[0]), self.links.get(key[1]), key[1])
                pair = self._pair(key, answered.get(key), kind, nominal)
                if key not in answered:
                    if stuck_pair == key and "hung" in raw:
                        pair.update(
                            status=P2P_BROKEN,
                            detail=f"a call between GPUs {key[0]} and {key[1]} did not return within {timeout:g} s (cuda_probe_timeout): the check's"
                            f" helper was killed in {stuck}",
                        )
                    elif key[0] in failed_starts or key[1] in failed_starts:
                        pair.update(status="unchecked", detail="not checked: the CUDA start of one of its GPUs failed (see that GPU)")
                    elif failed_starts:
                        # The check holds every GPU in one process: a GPU that fails its own start (its fabric not up, wedged
                        # in the driver) stops it for all; that GPU is red already, and the pairs are not proven either way.
                        pair.update(
                            status="unchecked",
                            detail=f"not checked: the check holds every GPU in one process, and GPU(s) {', '.join(map(str, sorted(failed_starts)))} failed"
                            " their own start",
                        )
                    else:
                        pair.update(status="unchecked", detail=f"not checked: {_unchecked(raw, stuck, timeout)}")
                record["pairs"].append(pair)
        for pair in record["pairs"]:
            a, b = pair["gpus"]
            if pair["status"] == P2P_UNSUPPORTED:
                required = bool(p.get("peers_required"))
                findings.append(
                    _links.finding(
                        P2P_UNSUPPORTED,
                        f"GPUs {a} and {b}: {pair['detail']}" + (" (peers_required)" if required else ""),
                        gpus=[a, b],
                        verdict_as=None if required else "ok",
                    )
                )
            elif pair["status"] == P2P_BROKEN:
                findings.append(_links.finding(P2P_BROKEN, f"GPUs {a} and {b}: {pair['detail']}", gpus=[a, b]))
            elif pair["status"] == P2P_SLOW:
                findings.append(_links.finding(P2P_SLOW, f"GPUs {a} and {b}: {pair['detail']}", gpus=[a, b]))
        unchecked = [pair for pair in record["pairs"] if pair["status"] == "unchecked" and not failed_starts]
        if unchecked:
            names = sorted({g for pair in unchecked for g in pair["gpus"]})
            findings.append(
                _links.finding(
                    PEERS_UNPROVEN,
                    f"{len(unchecked)} pair(s) of GPUs {', '.join(map(str, names))} were not checked although each GPU started:"
                    f" {unchecked[0]['detail'].removeprefix('not checked: ')}",
                    gpus=names,
                )
            )
        return record

    def _pair(self, key: tuple[int, int], answer: dict[str, t.Any] | None, kind: str | None, nominal: float | None) -> dict[str, t.Any]:
        """One pair's record from the helper's answer (None: not answered)."""
        a, b = key
        out: dict[str, t.Any] = {
            "gpus": [a, b],
            "link": kind,
            "link_gbps": nominal,
            "can_access": None,
            "enabled": None,
            "copies": [],
            "status": "unchecked",
            "detail": "",
        }
        if answer is None:
            return out
        can, enable = answer.get("can") or [None, None], answer.get("enable") or [None, None]
        out["can_access"] = can
        out["enabled"] = [None if code is None else code in (0, 704) for code in enable]
        out["copies"] = [
            {
                "from": c["from"],
                "to": c["to"],
                "gbps": c.get("gbps"),
                "match": c.get("match"),
                "error": None if c.get("code") is None else f"CUDA error {c['code']} ({_cuda.error_name(c['code'])}) in {c['call']}",
            }
            for c in answer.get("copies") or []
        ]
        works = _cuda_program.pair_works(answer)
        if can != [True, True]:
            said = [str(x) if isinstance(x, str) else ("yes" if x else "no") for x in can]
            out.update(
                status=P2P_UNSUPPORTED,
                detail=f"the driver does not offer peer access between them (cuDeviceCanAccessPeer {a}->{b}: {said[0]}, {b}->{a}: {said[1]}): a"
                " server falls back to copies through host memory (NCCL's SHM transport), or fails where it needs P2P",
            )
            return out
        bad_enable = [(k, code) for k, code in enumerate(enable) if code not in (0, 704)]
        if bad_enable:
            k, code = bad_enable[0]
            p, q = (a, b) if k == 0 else (b, a)
            out.update(
                status=P2P_BROKEN,
                detail=f"the driver offers peer access, but enabling it from {p} to {q} failed: CUDA error {code} ({_cuda.error_name(code)}) in"
                " cuCtxEnablePeerAccess",
            )
            return out
        for c in out["copies"]:
            if c["error"]:
                out.update(status=P2P_BROKEN, detail=f"the copy from {c['from']} to {c['to']} failed: {c['error']}")
                return out
            if c["match"] is False:
                out.update(
                    status=P2P_BROKEN,
                    detail=f"the pattern copied from {c['from']} to {c['to']} arrived changed, although the driver offers peer access both ways:"
                    " peer traffic between them corrupts data",
                )
                return out
        if works is None:
            return out
        floor = float(self.params.get("peers_min_bandwidth", 0.25))
        measured = [c["gbps"] for c in out["copies"] if c["gbps"] is not None]
        out["status"], out["detail"] = "ok", "peer access works both ways, the pattern arrived unchanged"
        if nominal and measured and min(measured) < floor * nominal:
            slowest = min(out["copies"], key=lambda c: c["gbps"] if c["gbps"] is not None else float("inf"))
            out.update(
                status=P2P_SLOW,
                detail=f"the copy from {slowest['from']} to {slowest['to']} moved {slowest['gbps']:g} GB/s, below {floor:g} (peers_min_bandwidth)"
                f" of the {nominal:g} GB/s their {_link_words(kind)} allows",
            )
        return out


def _pair_of(call: str) -> tuple[int, int] | None:
    """The pair a call of the peer helper was about (``cuMemcpyPeer 0->3``), else None."""
    _name, _sep, rest = call.partition(" ")
    a, sep, b = rest.partition("->")
    if not sep or not a.isdigit() or not b.isdigit():
        return None
    return (min(int(a), int(b)), max(int(a), int(b)))


def _unchecked(raw: dict[str, t.Any], stuck: str | None, timeout: float) -> str:
    """Why the peer helper answered no more pairs: a sentence."""
    if "hung" in raw:
        return f"the check's helper did not finish within {timeout:g} s (cuda_probe_timeout) and was killed in {stuck}"
    if "died" in raw:
        return f"the check's helper died in {stuck}; check dmesg for Xid errors and segfaults"
    if "abandoned" in raw:
        return f"the check's helper was killed in {stuck}: the run that asked for it went away"
    if "dlopen_error" in raw:
        return f"libcuda.so.1 could not be loaded ({raw['dlopen_error']})"
    if raw.get("code"):
        return f"CUDA error {raw['code']} ({_cuda.error_name(raw['code'])}) in {raw.get('step')}"
    bad = {g: s for g, s in (raw.get("gpus") or {}).items() if not s.get("ok")}
    if bad:
        g, s = next(iter(bad.items()))
        what = s.get("why") or f"CUDA error {s.get('code')} ({_cuda.error_name(s.get('code'))}) in {s.get('step')}"
        return f"the check could not hold GPU {g} beside the others: {what}"
    return "the check's helper answered no more"


def _link_words(kind: str | None) -> str:
    return {"nvlink": "NVLink links", "pcie": "PCIe links"}.get(kind or "", "link")


def message(together: dict[str, t.Any]) -> str:
    """The sentence a verification that is not ready together fails with: each red finding, and what to do."""
    red = [f for f in together["findings"] if f["name"] in RED or (f["name"] == P2P_UNSUPPORTED and f["verdict"] != "ok")]
    said = "; ".join(f"{f['name']}: {f['text']}" for f in red)
    return (
        f"The GPUs are clean one by one, but not ready together: {said}. A tensor-parallel server across them hangs in NCCL's"
        " initialisation or computes on corrupted data: fix the peer path (the findings say how), or until then start it with"
        " NCCL_P2P_DISABLE=1 (and vLLM's --disable-custom-all-reduce)."
    )
