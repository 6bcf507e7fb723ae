# Copyright (c) 2026, gpuops.clean_slate maintainers
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# Note: this module_util is PRIVATE to the collection; it may change without notice.

"""Each GPU's links, clocks and temperature (issue 39): what a tp=N server needs of every GPU it spans, as NVML reads it.

The best node-health tools check these apart from one another, in minutes (Azure/azurehpc-health-checks, facebookresearch/
gcm, IBM/autopilot, NVIDIA/deepops: ``../shared/research/round4-facts.md`` §5); here they are a handful of NVML calls per
GPU in the prober's helper (:meth:`._probe.Prober.each`), under its deadline like every other reading, and each one that
is wrong is a named finding (:mod:`._findings`) with its verdict:

* ``nvlink_inactive``: an NVLink link down while others of the GPU are up (aznhc fails any inactive link; a GPU whose
  links are all down has no NVLink in use, a PCIe card without its bridge, and is not a finding);
* ``nvlink_errors``: a link's replay, recovery or CRC counter above ``nvlink_error_threshold`` (gcm: 0). The counters
  count since the driver loaded or the GPU was last reset, and a reset clears them;
* ``pcie_width_degraded``: the link trained narrower than the GPU and its slot allow (a width does not drop at idle);
* ``pcie_gen_degraded``: the link runs a lower generation than the GPU and its slot allow *while the GPU is busy*. An
  idle GPU lowers its link's generation to save power (Gen1 at idle is normal), so the generation is read while the
  verification's own CUDA start keeps the GPU busy (:func:`read_pcie_gen`, called as the start announces its memset);
  read idle it is only reported, never judged;
* ``clocks_slowdown``: a clock event reason that halves the clocks or more (HW slowdown, HW thermal or power-brake
  slowdown) or the software thermal slowdown, read between jobs (autopilot fails ``hw_slowdown``; aznhc warns);
* ``temperature_high``: the GPU within :data:`TEMPERATURE_MARGIN_C` of its thermal limit between jobs (a warning).

It also says, for each pair of the selected GPUs, whether NVML puts them on NVLink (``nvmlDeviceGetP2PStatus``), and
the bandwidth each GPU's links allow, which :mod:`._peers` states a slow copy against.
"""

from __future__ import annotations

import typing as t

from ansible_collections.gpuops.clean_slate.plugins.module_utils import _findings

NVLINK_INACTIVE = "nvlink_inactive"
NVLINK_ERRORS = "nvlink_errors"
PCIE_WIDTH_DEGRADED = "pcie_width_degraded"
PCIE_GEN_DEGRADED = "pcie_gen_degraded"
CLOCKS_SLOWDOWN = "clocks_slowdown"
TEMPERATURE_HIGH = "temperature_high"
FINDINGS = (NVLINK_INACTIVE, NVLINK_ERRORS, PCIE_WIDTH_DEGRADED, PCIE_GEN_DEGRADED, CLOCKS_SLOWDOWN, TEMPERATURE_HIGH)

#: nvmlNvLinkErrorCounter_t: the counters read, by the names the result gives them.
NVLINK_COUNTERS = (("replay", 0), ("recovery", 1), ("crc_flit", 2), ("crc_data", 3))
#: Links a GPU may have at most (NVML_NVLINK_MAX_LINKS of the newest nvml.h); the GPU's own count ends the reading sooner.
MAX_LINKS = 36
#: GB/s one NVLink link moves in each direction, by nvmlNvlinkVersion_t (NVLink 1.0: 20; 2.x to 4.0: 25; 5.0: 50).
NVLINK_LINK_GBPS = {1: 20.0, 2: 25.0, 3: 25.0, 4: 25.0, 5: 25.0, 6: 25.0, 7: 50.0}
#: GB/s one PCIe lane moves in each direction, after encoding, by generation.
PCIE_LANE_GBPS = {1: 0.25, 2: 0.5, 3: 0.985, 4: 1.969, 5: 3.938, 6: 7.877}
#: nvmlClocksEventReason* bits (nvml.h) by the names the result gives them.
CLOCK_REASONS = {
    0x1: "gpu_idle",
    0x2: "applications_clocks_setting",
    0x4: "sw_power_cap",
    0x8: "hw_slowdown",
    0x10: "sync_boost",
    0x20: "sw_thermal_slowdown",
    0x40: "hw_thermal_slowdown",
    0x80: "hw_power_brake_slowdown",
    0x100: "display_clock_setting",
    0x200: "board_limit",
    0x400: "reliability",
}
#: The reasons that are a finding between jobs: the hardware ones cut the clocks by half or more (nvml.h), the software
#: thermal one means the GPU is too hot already. A power cap, idle, sync boost or an application clock setting is not.
SLOWDOWN = ("hw_slowdown", "hw_thermal_slowdown", "hw_power_brake_slowdown", "sw_thermal_slowdown")
#: A GPU this close to its thermal limit (nvmlDeviceGetMarginTemperature) between jobs slows down under the next load.
TEMPERATURE_MARGIN_C = 5
_NVML_ERROR_INVALID_ARGUMENT = 2
_NVML_ERROR_NOT_SUPPORTED = 3
_NVML_P2P_CAPS_INDEX_READ = 0
_NVML_P2P_CAPS_INDEX_NVLINK = 2
_NVML_FI_DEV_NVLINK_LINK_COUNT = 91
_NVLINK_REMOTE = {0: "gpu", 1: "ibmnpu", 2: "switch"}


def verdict(name: str) -> str:
    """A finding's verdict: its row of the findings table (:mod:`._findings`)."""
    return _findings.FINDINGS[name].verdict


def finding(name: str, text: str, gpu: int | None = None, gpus: list[int] | None = None, verdict_as: str | None = None) -> dict[str, t.Any]:
    """One finding in the shape every check reports (``_software.findings``): ``{name, verdict, gpu, text}``, and ``gpus``
    for a pair."""
    out: dict[str, t.Any] = {"name": name, "verdict": verdict_as or verdict(name), "gpu": gpu, "text": text}
    if gpus is not None:
        out["gpus"] = gpus
    return out


# ---------------------------------------------------------------------- the readings (NVML, in the prober's helper)
def _code(exc: BaseException) -> int:
    value = getattr(exc, "value", None)
    return int(value) if isinstance(value, int) else -1


def _nvlink(pynvml: t.Any, handle: t.Any) -> dict[str, t.Any] | None:
    """The GPU's NVLink links: how many, which are down, their version, what the first active one reaches, and every
    link's error counters that are not 0; None for a GPU without NVLink."""
    count = None
    try:
        value = pynvml.nvmlDeviceGetFieldValues(handle, [_NVML_FI_DEV_NVLINK_LINK_COUNT])[0]
        if value.nvmlReturn == 0:
            count = int(value.value.uiVal)
    except (pynvml.NVMLError, AttributeError, IndexError):
        count = None
    links: list[int] = []
    down: list[int] = []
    for link in range(count if count is not None else MAX_LINKS):
        try:
            active = pynvml.nvmlDeviceGetNvLinkState(handle, link)
        except pynvml.NVMLError as exc:
            if _code(exc) in (_NVML_ERROR_INVALID_ARGUMENT, _NVML_ERROR_NOT_SUPPORTED):
                break  # past the GPU's last link (or no NVLink at all)
            raise
        links.append(link)
        if not active:
            down.append(link)
    if not links:
        return None
    out: dict[str, t.Any] = {"links": len(links), "active": len(links) - len(down), "inactive": down, "version": None, "remote": None, "errors": {}}
    up = [link for link in links if link not in down]
    if up:
        try:
            out["version"] = int(pynvml.nvmlDeviceGetNvLinkVersion(handle, up[0]))
        except pynvml.NVMLError:
            pass
        try:
            kind = int(pynvml.nvmlDeviceGetNvLinkRemoteDeviceType(handle, up[0]))
            out["remote"] = _NVLINK_REMOTE.get(kind, "unknown")
        except (pynvml.NVMLError, AttributeError):
            pass
    for link in links:
        for name, counter in NVLINK_COUNTERS:
            try:
                n = int(pynvml.nvmlDeviceGetNvLinkErrorCounter(handle, link, counter))
            except pynvml.NVMLError:
                continue
            if n:
                out["errors"].setdefault(str(link), {})[name] = n
    return out


def _ask(pynvml: t.Any, name: str, *args: t.Any) -> t.Any:
    """One reading, None where the GPU, the driver or this nvidia-ml-py does not have it."""
    fn = getattr(pynvml, name, None)
    if fn is None:
        return None
    try:
        return fn(*args)
    except pynvml.NVMLError:
        return None


def read(_session: t.Any, gpu: t.Any, peers: t.Sequence[int] = ()) -> dict[str, t.Any]:
    """The links, clocks and temperature of one GPU (in the prober's helper), and what NVML says of peer-to-peer between it
    and each of ``peers`` (GPU indexes): ``{nvlink, pcie, clocks, temperature, p2p}``, None for what is not there."""
    import pynvml  # pylint: disable=import-outside-toplevel

    h = gpu.handle
    out: dict[str, t.Any] = {"nvlink": _nvlink(pynvml, h)}
    pcie = {
        "gen": _ask(pynvml, "nvmlDeviceGetCurrPcieLinkGeneration", h),
        "gen_max": _ask(pynvml, "nvmlDeviceGetMaxPcieLinkGeneration", h),
        "gen_gpu_max": _ask(pynvml, "nvmlDeviceGetGpuMaxPcieLinkGeneration", h),
        "width": _ask(pynvml, "nvmlDeviceGetCurrPcieLinkWidth", h),
        "width_max": _ask(pynvml, "nvmlDeviceGetMaxPcieLinkWidth", h),
    }
    out["pcie"] = pcie if any(v is not None for v in pcie.values()) else None
    reasons = _ask(pynvml, "nvmlDeviceGetCurrentClocksEventReasons", h)
    if reasons is None:
        reasons = _ask(pynvml, "nvmlDeviceGetCurrentClocksThrottleReasons", h)  # its name before driver R535
    out["clocks"] = None if reasons is None else {"mask": int(reasons), "reasons": [n for bit, n in sorted(CLOCK_REASONS.items()) if int(reasons) & bit]}
    temp = _ask(pynvml, "nvmlDeviceGetTemperature", h, 0)  # NVML_TEMPERATURE_GPU
    margin = _ask(pynvml, "nvmlDeviceGetMarginTemperature", h)
    slowdown = _ask(pynvml, "nvmlDeviceGetTemperatureThreshold", h, 1)  # NVML_TEMPERATURE_THRESHOLD_SLOWDOWN
    out["temperature"] = None if temp is None and margin is None else {"gpu_c": temp, "margin_c": margin, "slowdown_c": slowdown}
    p2p: dict[str, t.Any] = {}
    for peer in peers:
        if peer == gpu.index:
            continue
        other = _ask(pynvml, "nvmlDeviceGetHandleByIndex", peer)
        if other is None:
            continue
        p2p[str(peer)] = {
            "nvlink": _ask(pynvml, "nvmlDeviceGetP2PStatus", h, other, _NVML_P2P_CAPS_INDEX_NVLINK) == 0,
            "status": _ask(pynvml, "nvmlDeviceGetP2PStatus", h, other, _NVML_P2P_CAPS_INDEX_READ),
        }
    out["p2p"] = p2p
    return out


def read_pcie_gen(_session: t.Any, gpu: t.Any) -> int | None:
    """The GPU's PCIe generation now (in the prober's helper): called while the verification's CUDA start keeps it busy."""
    import pynvml  # pylint: disable=import-outside-toplevel

    return t.cast("int | None", _ask(pynvml, "nvmlDeviceGetCurrPcieLinkGeneration", gpu.handle))


# ---------------------------------------------------------------------- judging
def judge(readings: t.Mapping[int, dict[str, t.Any]], under_load: t.Mapping[int, int | None], nvlink_error_threshold: int) -> list[dict[str, t.Any]]:
    """Every finding of the GPUs' readings; each GPU's reading gets ``pcie.gen_under_load`` and ``pcie.gen_judged`` on the way."""
    out: list[dict[str, t.Any]] = []
    for index in sorted(readings):
        r = readings[index]
        nv = r.get("nvlink")
        if nv and nv["inactive"] and nv["active"]:
            out.append(
                finding(
                    NVLINK_INACTIVE,
                    f"GPU {index}: NVLink link(s) {', '.join(map(str, nv['inactive']))} of its {nv['links']} are down: the GPU reaches its peers"
                    " with less bandwidth, or not at all through them",
                    index,
                )
            )
        if nv:
            over = {
                link: {k: n for k, n in counters.items() if n > nvlink_error_threshold}
                for link, counters in sorted(nv["errors"].items(), key=lambda kv: int(kv[0]))
                if any(n > nvlink_error_threshold for n in counters.values())
            }
            if over:
                said = "; ".join(f"link {link}: " + ", ".join(f"{k} {n}" for k, n in counters.items()) for link, counters in over.items())
                out.append(
                    finding(
                        NVLINK_ERRORS,
                        f"GPU {index}: NVLink error counters above {nvlink_error_threshold} (nvlink_error_threshold) since the driver loaded or the"
                        f" GPU was last reset ({said})",
                        index,
                    )
                )
        pcie = r.get("pcie")
        if pcie:
            width, width_max = pcie.get("width"), pcie.get("width_max")
            if width is not None and width_max is not None and width < width_max:
                out.append(
                    finding(
                        PCIE_WIDTH_DEGRADED,
                        f"GPU {index}: its PCIe link trained at x{width} where the GPU and its slot allow x{width_max}: every transfer to and from the"
                        " host, and peer traffic over PCIe, runs at that width",
                        index,
                    )
                )
            gen, gen_max = pcie.get("gen"), pcie.get("gen_max")
            busy = under_load.get(index)
            pcie["gen_under_load"] = busy
            pcie["gen_judged"] = gen_max is not None and (busy is not None or gen == gen_max)
            if gen_max is not None and busy is not None and busy < gen_max:
                out.append(
                    finding(
                        PCIE_GEN_DEGRADED,
                        f"GPU {index}: its PCIe link runs at generation {busy} while busy (read during the verification's CUDA start) where the GPU"
                        f" and its slot allow {gen_max}",
                        index,
                    )
                )
        clocks = r.get("clocks")
        slow = [n for n in (clocks or {}).get("reasons", []) if n in SLOWDOWN]
        if slow:
            out.append(
                finding(
                    CLOCKS_SLOWDOWN,
                    f"GPU {index}: its clocks are held down between jobs ({', '.join(slow)}): the next server runs slowly on it",
                    index,
                )
            )
        temp = r.get("temperature")
        if temp:
            margin = temp.get("margin_c")
            if margin is None and temp.get("gpu_c") is not None and temp.get("slowdown_c") is not None:
                margin = temp["slowdown_c"] - temp["gpu_c"]
            if margin is not None and margin < TEMPERATURE_MARGIN_C:
                out.append(
                    finding(
                        TEMPERATURE_HIGH,
                        f"GPU {index}: {temp.get('gpu_c')} C between jobs, {margin} C from its thermal limit: under load it will slow down",
                        index,
                    )
                )
    return out


# ---------------------------------------------------------------------- what a pair's link allows
def pair_link(a: dict[str, t.Any] | None, b: dict[str, t.Any] | None, index_b: int) -> tuple[str | None, float | None]:
    """``(kind, GB/s)``: the link NVML puts the pair on (``nvlink`` or ``pcie``) and what it moves in one direction at the
    links' full width and generation (None where the readings do not say). ``a`` and ``b`` are the two GPUs' readings."""
    if not a or not b:
        return None, None
    on_nvlink = (a.get("p2p") or {}).get(str(index_b), {}).get("nvlink")
    na, nb = a.get("nvlink"), b.get("nvlink")
    if on_nvlink and na and nb:
        per_link = NVLINK_LINK_GBPS.get(na.get("version") or 0, 25.0)
        # Through the NVSwitches every link of both GPUs carries the pair's traffic; over a direct bridge which of the links
        # reach this peer is not read, and one is the least it has.
        links = min(na["links"], nb["links"]) if na.get("remote") == "switch" and nb.get("remote") == "switch" else 1
        return "nvlink", round(per_link * links, 1)
    rates = []
    for r in (a, b):
        pcie = r.get("pcie") or {}
        gen, width = pcie.get("gen_max"), pcie.get("width_max")
        if gen is None or width is None:
            return "pcie", None
        rates.append(PCIE_LANE_GBPS.get(int(gen), 0.25) * int(width))
    return "pcie", round(min(rates), 1)
