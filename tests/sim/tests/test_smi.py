"""The nvidia-smi look-alike: formats, exit codes, speed."""

from __future__ import annotations

import os
import subprocess

import pytest
from gpusim import CONTEXT_OVERHEAD_MIB, Node, paths

pytestmark = pytest.mark.pidns

UUID0 = "GPU-c0c56364-2f10-dbf9-9d63-0ed44d93c14c"  # seed "gpusim", GPU 0


def smi(node: Node, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(paths.NVIDIA_SMI), *args], capture_output=True, text=True, env={**os.environ, **node.env(), **(env or {})}, check=False)


QUERY = "--query-gpu=index,name,uuid,pci.bus_id,memory.used,memory.total,memory.reserved,memory.free"


def test_query_gpu_csv_like_the_real_one(node) -> None:
    r = smi(node, QUERY, "--format=csv")
    assert r.returncode == 0
    lines = r.stdout.splitlines()
    assert lines[0] == ("index, name, uuid, pci.bus_id, memory.used [MiB], memory.total [MiB], memory.reserved [MiB], memory.free [MiB]")
    assert lines[1] == f"0, NVIDIA H200, {UUID0}, 00000000:18:00.0, 0 MiB, 143771 MiB, 615 MiB, 143156 MiB"
    assert len(lines) == 9
    assert node.gpus[0].uuid == UUID0


def test_noheader_nounits_and_gpu_selection(node) -> None:
    node.spawn_worker(gpus=[3], mib=20000)
    r = smi(node, "--query-gpu=index,memory.used,memory.free", "--format=csv,noheader,nounits", "-i", "3,0")
    used = 20000 + CONTEXT_OVERHEAD_MIB  # the device counts the context's overhead too
    assert r.stdout == f"3, {used}, {143156 - used}\n0, 0, 143156\n"
    r = smi(node, "--query-gpu=index", "--format=csv,noheader", f"--id={node.gpus[5].uuid}")
    assert r.stdout == "5\n"
    r = smi(node, "--query-gpu=memory.used", "--format=csv,nounits", "-i", "1")
    assert r.stdout == "memory.used [MiB]\n0\n"


def test_query_compute_apps(node) -> None:
    w = node.spawn_worker(gpus=[3], mib=20000, title="sglang::scheduler_TP0")
    fields = "--query-compute-apps=pid,process_name,used_memory,gpu_uuid,gpu_bus_id"
    r = smi(node, fields, "--format=csv")
    assert r.returncode == 0
    assert r.stdout.splitlines() == [
        "pid, process_name, used_gpu_memory [MiB], gpu_uuid, gpu_bus_id",
        f"{w.pid}, sglang::scheduler_TP0, 20000 MiB, {node.gpus[3].uuid}, 00000000:5D:00.0",
    ]
    w.kill()
    node.wait_clean(timeout=2)
    assert smi(node, fields, "--format=csv,noheader").stdout == ""


def test_forked_child_shows_the_dead_parent_as_not_found(node) -> None:
    w = node.spawn_worker(gpus=[6], mib=12000, fork_child=True)
    w.wait(timeout=2)
    r = smi(node, "--query-compute-apps=pid,process_name,used_memory", "--format=csv,noheader")
    assert r.stdout == f"{w.pid}, [Not Found], 12000 MiB\n"


def test_list_and_table(node) -> None:
    r = smi(node, "-L")
    assert r.returncode == 0
    assert r.stdout.splitlines()[0] == f"GPU 0: NVIDIA H200 (UUID: {UUID0})"
    assert len(r.stdout.splitlines()) == 8
    w = node.spawn_worker(gpus=[2], mib=4096, title="VLLM::Worker_TP1")
    t = smi(node).stdout
    assert "Driver Version: 580.159.04" in t and "CUDA Version: 13.0" in t
    assert f"{4096 + CONTEXT_OVERHEAD_MIB}MiB / 143771MiB" in t and "0MiB / 143771MiB" in t
    assert f"{w.pid}      C   VLLM::Worker_TP1" in t
    widths = {len(line) for line in t.splitlines()[1:] if line.startswith(("|", "+"))}
    assert widths == {91}


def test_exit_codes(node, tmp_path) -> None:
    assert smi(node, "-L", env={"GPUSIM_STATE": str(tmp_path)}).returncode == 9
    assert smi(node, "-L", env=node.env(include_library=False)).returncode == 12
    node.set_fault(lost=[1])
    assert smi(node, "-L").returncode == 15
    assert smi(node).returncode == 15
    node.clear_faults()
    r = smi(node, "--query-gpu=index,gpu_temperature_sensor", "--format=csv")
    assert r.returncode == 2 and 'Field "gpu_temperature_sensor" is not a valid field to query.' in r.stdout
    assert smi(node, "--query-gpu=index").returncode == 2  # --format is required
    assert smi(node, "--bogus").returncode == 2


def test_a_call_loads_the_library_and_exits(node) -> None:
    # It is a C program that dlopens libnvidia-ml.so.1 like the real one (how fast: tools/bench/sim.py).
    r = smi(node, QUERY, "--format=csv,noheader")
    assert r.returncode == 0 and len(r.stdout.splitlines()) == 8
    assert smi(node, QUERY, "--format=csv,noheader", env={"LD_LIBRARY_PATH": ""}).returncode == 12


def test_query_report_the_health_sections_in_the_real_layout(node) -> None:
    """nvidia-smi -q: the sections the health verdict reads, worded and aligned as driver 580 prints them
    (colon in column 55 at every depth; tools/gpu/health_compare.py parses the real and this one alike)."""
    node.set_mig([1], enabled=True)
    node.set_fault(recovery_action={2: 2})
    r = smi(node, "-q", "-i", "0,1,2")
    assert r.returncode == 0, r.stdout
    lines = r.stdout.splitlines()
    assert "==============NVSMI LOG==============" in lines
    blocks = r.stdout.split("\nGPU ")[1:]
    assert [b.splitlines()[0] for b in blocks] == [node.gpus[i].pci_bus_id for i in range(3)]
    for line in lines:
        if " : " in line or line.endswith(": "):
            assert line.index(": ") == 55, line
    gpu0, gpu1, gpu2 = blocks
    for section in ("MIG Mode", "ECC Errors", "Retired Pages", "Remapped Rows", "Fabric"):
        assert f"\n    {section}\n" in gpu0
    assert "    Persistence Mode" in gpu0 and "Enabled" in gpu0.split("Persistence Mode", 1)[1].splitlines()[0]
    assert "Current" in gpu0 and gpu0.split("MIG Mode", 1)[1].splitlines()[1].endswith(": Disabled")
    assert gpu1.split("MIG Mode", 1)[1].splitlines()[1].endswith(": Enabled")
    assert gpu0.split("Compute Mode", 1)[1].splitlines()[0].endswith(": Default")
    assert gpu0.split("GPU Recovery Action", 1)[1].splitlines()[0].endswith(": None")
    assert gpu2.split("GPU Recovery Action", 1)[1].splitlines()[0].endswith(": Reboot")
    # What the simulated library does not model reads N/A, as on a GPU without the feature.
    assert gpu0.split("Single Bit ECC", 1)[1].splitlines()[0].endswith(": N/A")
