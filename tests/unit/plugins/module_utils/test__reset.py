"""_reset: the advisory reset plan. Which GPUs go together (an NVLink fabric's), where the reset runs, what holds the
GPUs now (real processes holding the device files, a daemon found by its executable's name), and the commands in
order. Nothing is reset or stopped: the plan is text."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

from ansible_collections.gpuops.clean_slate.plugins.module_utils import _reset


def gpu(index: int, fabric: dict | None = None, name: str = "NVIDIA H200") -> dict:
    return {"index": index, "uuid": f"GPU-{index}", "pci_bus_id": f"00000000:{0x18 + index:02X}:00.0", "minor": index, "fabric": fabric, "name": name}


def test_a_gpu_is_reset_alone_but_on_an_ampere_nvswitch_system_without_fabric_manager() -> None:
    """nvidia-smi's rule: from Ampere on each GPU alone; an Ampere NVSwitch system without Fabric Manager running resets
    every GPU of its NVLink fabric in one command."""
    up = {"state": "completed", "status": 0, "cluster_uuid": "ab" * 16, "clique_id": 1}
    other = {**up, "clique_id": 2}
    a100 = [gpu(i, up if i < 4 else other, "NVIDIA A100-SXM4-80GB") for i in range(8)]
    assert _reset.group([2], a100, fabricmanager=False) == [0, 1, 2, 3]
    assert _reset.group([2, 5], a100, fabricmanager=False) == list(range(8))
    assert _reset.group([2], a100, fabricmanager=True) == [2]
    assert _reset.group([2], [gpu(i, up) for i in range(8)], fabricmanager=False) == [2]  # Hopper: alone
    pcie = [gpu(i, {"state": "not_supported", "status": 0, "cluster_uuid": "00" * 16, "clique_id": 0}, "NVIDIA A100-PCIE-40GB") for i in range(8)]
    assert _reset.group([2], pcie, fabricmanager=False) == [2] and _reset.group([3], [gpu(i) for i in range(8)], False) == [3]


def wait_for(predicate, what: str) -> None:
    deadline = time.monotonic() + 5
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def test_the_plan_names_the_holders_and_daemons_and_orders_the_commands(tmp_path: Path) -> None:
    dev = tmp_path / "dev"
    dev.mkdir()
    for name in ("nvidia0", "nvidia1", "nvidiactl"):
        (dev / name).write_bytes(b"\0" * 4096)
    # A job's process that still holds GPU 1's device file, and a daemon known by its executable's name.
    holder = subprocess.Popen([sys.executable, "-c", f"import time; f = open({str(dev / 'nvidia1')!r}, 'rb'); time.sleep(60)"])
    daemon_exe = tmp_path / "nvidia-persistenced"
    shutil.copy2(shutil.which("sleep") or "/bin/sleep", daemon_exe)
    daemon = subprocess.Popen([str(daemon_exe), "60"])
    try:
        wait_for(lambda: any(h["pid"] == holder.pid for h in _reset.holders(str(dev), [1])), "the holder was not seen")
        plan = _reset.plan({1: ["row_remap_pending"]}, [gpu(0), gpu(1)], str(dev), [])
        assert plan is not None and plan["advisory"] is True
        assert plan["gpus"] == [{"index": 1, "uuid": "GPU-1", "pci_bus_id": "00000000:19:00.0", "why": ["row_remap_pending"]}]
        assert plan["together"] == "" and plan["where"] in ("this host", _reset.plan({1: ["x"]}, [gpu(1)], str(dev), [])["where"])
        assert [h["minors"] for h in plan["holders"] if h["pid"] == holder.pid] == [[1]]
        assert {"name": "nvidia-persistenced", "service": "nvidia-persistenced", "pids": [daemon.pid]} in plan["daemons"]
        commands = plan["commands"]
        stop = commands.index(next(c for c in commands if c.startswith("systemctl stop")))
        reset = commands.index(next(c for c in commands if c.startswith("nvidia-smi -r -i 00000000:19:00.0  #")))
        start = commands.index(next(c for c in commands if c.startswith("systemctl start")))
        assert stop < reset < start and "nvidia-persistenced" in commands[stop]
        assert any(c.startswith(f"kill {holder.pid}") for c in commands[stop:reset])
        lines = _reset.lines(plan)
        assert lines[0].startswith("Reset plan (advisory: nothing was reset): reset GPU 1, on ") and f"PID {holder.pid}" in lines[0]
        assert "nvidia-smi -r -i 00000000:19:00.0" in lines[1]
        # Nothing was stopped or signalled.
        assert holder.poll() is None and daemon.poll() is None
    finally:
        for p in (holder, daemon):
            p.kill()
            p.wait()
    assert _reset.plan({}, [gpu(0)], str(dev), []) is None


def test_a_container_cleaned_from_its_node_is_reset_from_the_node_in_one_command(tmp_path: Path) -> None:
    plan = _reset.plan({0: ["fabric_error"], 3: ["row_remap_pending"]}, [gpu(i) for i in range(4)], str(tmp_path), [129])
    assert plan is not None and plan["where"].startswith("this node (container 129's GPUs, by this node's bus IDs)")
    assert [(g["index"], g["why"]) for g in plan["gpus"]] == [(0, ["fabric_error"]), (3, ["row_remap_pending"])] and plan["together"] == ""
    assert [c.split("  #")[0] for c in plan["commands"] if c.startswith("nvidia-smi -r")] == ["nvidia-smi -r -i 00000000:18:00.0,00000000:1B:00.0"]
    # Fabric Manager is never in the plan's stops: an Ampere NVSwitch system needs it to reset a GPU alone.
    assert not any("fabricmanager" in c for c in plan["commands"] if c.startswith("systemctl"))
