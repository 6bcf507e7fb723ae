"""_links: each GPU's links, clocks and temperature read from NVML and judged (issue 39): every finding with its verdict
from the findings table, an idle GPU's lowered PCIe generation never one, and what a pair's link allows."""

from __future__ import annotations

import types
import typing as t

import pytest

from ansible_collections.gpuops.clean_slate.plugins.module_utils import _findings, _links


def healthy(**over: t.Any) -> dict[str, t.Any]:
    r: dict[str, t.Any] = {
        "nvlink": {"links": 18, "active": 18, "inactive": [], "version": 6, "remote": "switch", "errors": {}},
        "pcie": {"gen": 5, "gen_max": 5, "gen_gpu_max": 5, "width": 16, "width_max": 16},
        "clocks": {"mask": 1, "reasons": ["gpu_idle"]},
        "temperature": {"gpu_c": 44, "margin_c": 43, "slowdown_c": 89},
        "p2p": {},
    }
    r.update(over)
    return r


def test_a_healthy_gpu_has_no_finding_and_every_finding_has_its_tables_verdict() -> None:
    assert _links.judge({0: healthy()}, {0: 5}, 0) == []
    for name in _links.FINDINGS:
        assert _links.finding(name, "x", 0)["verdict"] == _findings.FINDINGS[name].verdict
    assert _links.finding("p2p_broken", "x", gpus=[1, 2]) == {"name": "p2p_broken", "verdict": "fix_config", "gpu": None, "text": "x", "gpus": [1, 2]}


def test_each_reading_that_is_wrong_is_its_finding() -> None:
    readings = {
        1: healthy(nvlink={"links": 18, "active": 16, "inactive": [3, 7], "version": 6, "remote": "switch", "errors": {}}),
        2: healthy(nvlink={"links": 18, "active": 18, "inactive": [], "version": 6, "remote": "switch", "errors": {"5": {"replay": 9, "crc_data": 1}}}),
        3: healthy(pcie={"gen": 5, "gen_max": 5, "gen_gpu_max": 5, "width": 4, "width_max": 16}),
        4: healthy(pcie={"gen": 1, "gen_max": 5, "gen_gpu_max": 5, "width": 16, "width_max": 16}),
        5: healthy(clocks={"mask": 0x28, "reasons": ["hw_slowdown", "sw_thermal_slowdown"]}),
        6: healthy(temperature={"gpu_c": 85, "margin_c": 2, "slowdown_c": 89}),
    }
    found = _links.judge(readings, {4: 3}, 1)
    assert [(f["name"], f["verdict"], f["gpu"]) for f in found] == [
        ("nvlink_inactive", "reset_gpu", 1),
        ("nvlink_errors", "reset_gpu", 2),
        ("pcie_width_degraded", "drain", 3),
        ("pcie_gen_degraded", "reboot", 4),
        ("clocks_slowdown", "drain", 5),
        ("temperature_high", "ok", 6),
    ]
    assert "link 5: replay 9" in found[1]["text"] and "crc_data" not in found[1]["text"]  # 1 is not above the threshold of 1
    assert readings[4]["pcie"]["gen_under_load"] == 3 and readings[4]["pcie"]["gen_judged"] is True


def test_an_idle_gpus_lowered_generation_is_never_a_finding() -> None:
    readings = {0: healthy(pcie={"gen": 1, "gen_max": 5, "gen_gpu_max": 5, "width": 16, "width_max": 16})}
    # Not read while busy (check mode, a container's start, a GPU not started): reported, not judged.
    assert _links.judge(readings, {}, 0) == [] and readings[0]["pcie"]["gen_judged"] is False
    # Read while the start kept it busy: at its maximum, no finding, judged.
    assert _links.judge(readings, {0: 5}, 0) == [] and readings[0]["pcie"]["gen_judged"] is True


def test_links_all_down_are_no_nvlink_in_use_and_the_temperature_falls_back_to_the_slowdown_threshold() -> None:
    bridge_less = healthy(nvlink={"links": 18, "active": 0, "inactive": list(range(18)), "version": None, "remote": None, "errors": {}})
    assert _links.judge({0: bridge_less}, {0: 5}, 0) == []
    hot = healthy(temperature={"gpu_c": 86, "margin_c": None, "slowdown_c": 89})
    assert [f["name"] for f in _links.judge({0: hot}, {0: 5}, 0)] == ["temperature_high"]


def test_what_a_pairs_link_allows() -> None:
    a, b = healthy(p2p={"1": {"nvlink": True, "status": 0}}), healthy()
    assert _links.pair_link(a, b, 1) == ("nvlink", 450.0)  # 18 NVLink 4 links through the NVSwitches
    blackwell = healthy(nvlink={**a["nvlink"], "version": 7}, p2p=a["p2p"])
    assert _links.pair_link(blackwell, b, 1) == ("nvlink", 900.0)
    bridged = healthy(nvlink={**a["nvlink"], "remote": "gpu"}, p2p=a["p2p"])
    assert _links.pair_link(bridged, healthy(nvlink={**a["nvlink"], "remote": "gpu"}), 1) == ("nvlink", 25.0)
    pcie_a = healthy(nvlink=None, pcie={"gen": 1, "gen_max": 4, "gen_gpu_max": 4, "width": 16, "width_max": 16})
    pcie_b = healthy(nvlink=None, pcie={"gen": 1, "gen_max": 5, "gen_gpu_max": 5, "width": 8, "width_max": 8})
    assert _links.pair_link(pcie_a, pcie_b, 1) == ("pcie", 31.5)  # the narrower: x16 Gen4 (31.5) against x8 Gen5 (31.5)
    assert _links.pair_link(pcie_a, healthy(nvlink=None, pcie={"gen": None, "gen_max": None, "width": None, "width_max": None}), 1) == ("pcie", None)
    assert _links.pair_link(None, b, 1) == (None, None)


class NVMLError(Exception):
    def __init__(self, value: int) -> None:
        super().__init__(value)
        self.value = value


def fake_pynvml(links: int, down: t.Sequence[int] = (), field: bool = True) -> types.SimpleNamespace:
    """What nvidia-ml-py answers for a GPU with ``links`` NVLink links (0: none), as the driver does."""

    def state(_h: object, link: int) -> int:
        if links == 0:
            raise NVMLError(3)  # NVML_ERROR_NOT_SUPPORTED
        if link >= links:
            raise NVMLError(2)  # NVML_ERROR_INVALID_ARGUMENT
        return 0 if link in down else 1

    def counter(_h: object, link: int, c: int) -> int:
        return 4 if (link, c) == (2, 0) else 0

    def fields(_h: object, ids: list[int]) -> list[object]:
        if not field or links == 0:
            return [types.SimpleNamespace(nvmlReturn=3, value=None)]
        return [types.SimpleNamespace(nvmlReturn=0, value=types.SimpleNamespace(uiVal=links))]

    def unsupported(*_a: object) -> int:
        raise NVMLError(3)

    return types.SimpleNamespace(
        NVMLError=NVMLError,
        nvmlDeviceGetFieldValues=fields,
        nvmlDeviceGetNvLinkState=state,
        nvmlDeviceGetNvLinkVersion=lambda _h, _l: 6,
        nvmlDeviceGetNvLinkRemoteDeviceType=lambda _h, _l: 2,
        nvmlDeviceGetNvLinkErrorCounter=counter,
        nvmlDeviceGetCurrPcieLinkGeneration=lambda _h: 1,
        nvmlDeviceGetMaxPcieLinkGeneration=lambda _h: 5,
        nvmlDeviceGetGpuMaxPcieLinkGeneration=lambda _h: 5,
        nvmlDeviceGetCurrPcieLinkWidth=lambda _h: 16,
        nvmlDeviceGetMaxPcieLinkWidth=lambda _h: 16,
        nvmlDeviceGetCurrentClocksEventReasons=lambda _h: 0x9,
        nvmlDeviceGetTemperature=lambda _h, _s: 44,
        nvmlDeviceGetMarginTemperature=unsupported,
        nvmlDeviceGetTemperatureThreshold=lambda _h, _t: 89,
        nvmlDeviceGetHandleByIndex=lambda i: f"h{i}",
        nvmlDeviceGetP2PStatus=lambda _a, _b, index: 0 if index in (0, 2) else 1,
    )


@pytest.mark.parametrize("field", [True, False], ids=["link count field", "links counted until INVALID_ARGUMENT"])
def test_reading_a_gpu_with_nvlink(monkeypatch, field: bool) -> None:
    monkeypatch.setitem(__import__("sys").modules, "pynvml", fake_pynvml(18, down=[3], field=field))
    r = _links.read(None, types.SimpleNamespace(handle="h0", index=0), [0, 1])
    assert r["nvlink"] == {"links": 18, "active": 17, "inactive": [3], "version": 6, "remote": "switch", "errors": {"2": {"replay": 4}}}
    assert r["pcie"] == {"gen": 1, "gen_max": 5, "gen_gpu_max": 5, "width": 16, "width_max": 16}
    assert r["clocks"] == {"mask": 9, "reasons": ["gpu_idle", "hw_slowdown"]}
    assert r["temperature"] == {"gpu_c": 44, "margin_c": None, "slowdown_c": 89}  # no margin reading on this driver
    assert r["p2p"] == {"1": {"nvlink": True, "status": 0}}


def test_reading_a_pcie_card_without_nvlink(monkeypatch) -> None:
    fake = fake_pynvml(0)
    del fake.nvmlDeviceGetCurrentClocksEventReasons  # an nvidia-ml-py before R535 has only the old name
    fake.nvmlDeviceGetCurrentClocksThrottleReasons = lambda _h: 0
    monkeypatch.setitem(__import__("sys").modules, "pynvml", fake)
    r = _links.read(None, types.SimpleNamespace(handle="h0", index=0))
    assert r["nvlink"] is None and r["clocks"] == {"mask": 0, "reasons": []} and r["p2p"] == {}
    assert _links.read_pcie_gen(None, types.SimpleNamespace(handle="h0")) == 1
