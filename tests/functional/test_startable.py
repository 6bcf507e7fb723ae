"""gpu_mem_verify's startability probe and DCGM level 1's software checks through Ansible on the simulated node (issue
29): a CUDA start on every GPU through the simulated libcuda.so.1, each way the world makes one fail (a container
without nvidia-uvm, Exclusive_Process with a context held outside it, the fabric not up, an uncontained ECC error,
less allocatable than NVML reads free, a wedged GPU, no libcuda), named, and the probe itself never left behind."""

from __future__ import annotations

import datetime
import json
import os

from support.modules import ModuleRunner, assert_no_traceback

from ansible_collections.gpuops.clean_slate.plugins.module_utils import _findings

H200_CUDA_TOTAL_MIB = 143771 - 615


def verify(mod: ModuleRunner, check: bool = False, **args: object) -> dict:
    args.setdefault("kernel_log", str(mod.node.kernel_log))
    args.setdefault("timeout", 0)
    return mod("gpu_mem_verify", args, check=check)


def seconds(result: dict) -> float:
    return (datetime.datetime.fromisoformat(result["end"]) - datetime.datetime.fromisoformat(result["start"])).total_seconds()


def test_an_idle_node_is_proven_startable_and_the_probe_leaves_nothing(mod, node, sandbox) -> None:
    r = verify(mod)
    assert r["_status"] == "ok", r
    for g in r["gpus"]:
        s = g["startable"]
        assert s["ok"] is True and s["reason"] is None and s["context_only"] is False, s
        # 90 % of what CUDA reports total, in 2 MiB pages; the context's own 527 MiB was taken before.
        assert s["cuda_total_mib"] == H200_CUDA_TOTAL_MIB and s["cuda_free_mib"] == H200_CUDA_TOTAL_MIB - 527
        assert s["allocated_mib"] == int(H200_CUDA_TOTAL_MIB * 0.9 * (1 << 20)) >> 20
        assert next(iter(s["steps"])) == "cuInit" and list(s["steps"])[-1] == "cuDevicePrimaryCtxRelease"
        assert s["gone_after_s"] is not None
    assert (r["cuda_probe"]["probed"], r["cuda_probe"]["started"], r["cuda_probe"]["left_behind"]) == (8, 8, [])
    # Nothing of the probe is left: no context, no memory, and its helpers are gone.
    assert node.contexts() == [] and all(node.memory(i)["used_mib"] == 0 for i in range(8))
    # The module ran in the sandbox's PID namespace, which numbers the helpers: nothing is left there but its init.
    assert len({g["startable"]["pid"] for g in r["gpus"]}) == 8 and left_inside(sandbox) == []
    # The software checks: every device file is here and opens, the count matches, nothing to report.
    sw = r["software"]
    assert sw["devices"]["uvm"]["ok"] and sw["devices"]["uvm_tools"]["ok"] and sw["devices"]["gpu_files"] == 8
    assert sw["findings"] == [] and r["health"]["evidence"] == [] and sw["inforom"] == [{"index": i, "valid": True} for i in range(8)]
    assert "not visible" in sw["environment"]["not_visible"] and "the module's environment" in sw["environment"]["read"]
    # Check mode makes no start (a context and memory, for a moment), and says so.
    r = verify(mod, check=True)
    assert r["_status"] == "ok" and r["cuda_probe"]["probed"] == 0
    assert all(g["startable"]["ok"] is None and "check mode" in g["startable"]["skipped"] for g in r["gpus"])


def test_a_container_without_nvidia_uvm_is_red_while_nvml_reads_clean(node) -> None:
    sb = node.sandbox(vmid=105)  # a vmid of its own: a sandbox's cgroup (lxc/<vmid>) is shared by the test workers
    try:
        sb.pass_devices(omit=["nvidia-uvm", "nvidia-uvm-tools"])  # the LXC passthrough written for major 195 only
        r = verify(ModuleRunner(node, sb))
        assert (r["_status"], r["reason"]) == ("failed", "not_clean"), r
        for g in r["gpus"]:
            assert g["used_mib"] == 0 and g["processes"] == []  # NVML reads every GPU clean
            assert g["clean"] is False and g["diagnosis"] == "uvm_missing"
            s = g["startable"]
            assert (s["ok"], s["reason"], s["code"], s["error"], s["step"]) == (False, "uvm_missing", 999, "CUDA_ERROR_UNKNOWN", "cuInit")
            assert "nvidia-uvm is absent" in g["detail"] and "pass /dev/nvidia-uvm and /dev/nvidia-uvm-tools through" in g["detail"]
        names = [f["name"] for f in r["software"]["findings"]]
        assert names == ["uvm_missing", "uvm_tools_missing"]
        # A configuration fault, said as one: the eight GPUs in one line, its fix once, never a reset.
        assert r["health"]["verdict"] == "fix_config" and r["reset_plan"] is None
        assert ("uvm_missing", list(range(8)), "configuration") in [(f["name"], f["gpus"], f["where"]) for f in r["health"]["findings"]]
        assert r["lines"][:2] == ["8 of 8 GPU(s) not clean after " + r["lines"][0].split("after ")[1], r["lines"][1]] and len(r["lines"]) <= 6, r["lines"]
        assert r["lines"][1].startswith("GPUs 0-7: uvm_missing: CUDA error 999") and r["msg"].count("Fix:") == 1
        assert "nvidia-smi -r" not in r["msg"] and "reboot" not in r["msg"] and "reset the" not in r["msg"].lower(), r["msg"]
        assert_no_traceback(r)
        # Without the probe the software check alone still fails it (at the default fail_on, fix_config) ...
        r = verify(ModuleRunner(node, sb), cuda_probe=False)
        assert (r["_status"], r["reason"]) == ("failed", "unhealthy") and r["cuda_probe"] is None, r
        assert all(g["clean"] for g in r["gpus"]) and "uvm_missing" in r["msg"] and r["health"]["fail_on"] == "fix_config"
        # ... and from reset_gpu up it is only reported (the documented fail_on); its GPUs' start cannot have failed.
        r = verify(ModuleRunner(node, sb), cuda_probe=False, fail_on="reset_gpu")
        assert (r["_status"], r["clean"], r["health"]["verdict"]) == ("ok", True, "fix_config"), r
    finally:
        sb.stop()


def test_device_files_of_another_device_or_refused_are_configuration_faults_never_a_reset(node) -> None:
    """What a container gets from a passthrough that names the wrong node, made for real in its mount namespace: a GPU's
    node masked by /dev/null (NVML then lists no such GPU, as on an H100), nvidia-uvm masked (cuInit 999 while NVML reads
    the GPUs), nvidia-uvm and then nvidiactl refused by the container's device rules (a devices cgroup: EPERM at open).
    Each is named as the configuration fault it is (fix_config, device_missing), in a few lines, its fix once, never a
    reset or a reboot. (A node of another device's numbers is told by /proc/devices, which names no NVIDIA driver here:
    unit tests and the real-GPU runs hold that part.)"""
    sb = node.sandbox(vmid=131)
    try:
        sb.pass_devices()
        run = ModuleRunner(node, sb)

        def no_reset(r: dict) -> None:
            text = r["msg"].lower()
            assert "nvidia-smi -r" not in text and "reset the" not in text and "reboot" not in text and r["reset_plan"] is None, r["msg"]

        sb.bind_over("nvidia3", "/dev/null")
        r = verify(run, expected_count=8)
        assert (r["_status"], r["reason"], r["gpu_count"]) == ("failed", "missing_gpus", 7), r
        assert (
            r["lines"][0].startswith("expected 8 GPUs, found 7 healthy of 7: ") and "nvidia3 is present and opens, but NVML lists no GPU of minor 3" in r["msg"]
        )
        [f] = [f for f in r["health"]["findings"] if f["name"] == "device_missing"]
        assert (f["verdict"], f["where"], r["health"]["verdict"]) == ("fix_config", "configuration", "fix_config")
        no_reset(r)
        # With no count expected, a GPU device file here that NVML lists no GPU for is the same configuration fault.
        r = verify(run)
        assert (r["_status"], r["reason"], r["health"]["verdict"]) == ("failed", "unhealthy", "fix_config"), r
        done = sb.run(["umount", str(node.dev_dir / "nvidia3")], capture_output=True, text=True)
        assert done.returncode == 0, done.stderr

        sb.bind_over("nvidia-uvm", "/dev/null")
        r = verify(run)
        assert (r["_status"], r["reason"]) == ("failed", "not_clean"), r
        assert {(g["diagnosis"], g["startable"]["code"], g["startable"]["step"]) for g in r["gpus"]} == {("uvm_missing", 999, "cuInit")}
        assert "the unified-memory driver could not be used" in r["gpus"][0]["detail"] and r["health"]["verdict"] == "fix_config"
        assert len(r["lines"]) <= 5 and r["lines"][1].startswith("GPUs 0-7: uvm_missing: CUDA error 999") and r["msg"].count("Fix:") == 1, r["lines"]
        no_reset(r)
        done = sb.run(["umount", str(node.dev_dir / "nvidia-uvm")], capture_output=True, text=True)
        assert done.returncode == 0, done.stderr

        if not node.char_devices:
            return  # a device rule refuses character nodes only (the node's files are regular files here)
        sb.refuse("nvidia-uvm")
        r = verify(run)
        assert (r["_status"], r["reason"]) == ("failed", "not_clean"), r
        uvm = r["software"]["devices"]["uvm"]
        assert (uvm["ok"], uvm["fault"]) == (False, "refused") and "the device cgroup refuses it" in uvm["why"]
        assert {g["diagnosis"] for g in r["gpus"]} == {"uvm_missing"} and "the device cgroup refuses it" in r["gpus"][0]["detail"]
        no_reset(r)
        # nvidiactl refused as well: NVML cannot open at all; the failure is that configuration fault, not a driver to
        # load (NVML's own answer kept beside it).
        sb.refuse("nvidiactl")
        r = verify(run)
        assert (r["_status"], r["reason"], r.get("nvml_reason")) == ("failed", "device_missing", "no_permission"), r
        assert "nvidiactl is present but cannot be opened: the device cgroup refuses it" in r["msg"] and "reboot" not in r["msg"]
        assert r["msg"].endswith(_findings.FINDINGS["device_missing"].fix)
        assert node.contexts() == []
    finally:
        sb.stop()


def test_exclusive_process_with_a_context_held_outside_the_container_is_cuda_busy(node) -> None:
    node.set_compute_mode(2, "exclusive_process")
    held = node.spawn_worker(gpus=[2], mib=500)  # on the host: the container lists no process for it
    sb = node.sandbox(vmid=130)
    try:
        r = verify(ModuleRunner(node, sb))
        assert (r["_status"], r["reason"]) == ("failed", "not_clean"), r
        g2 = r["gpus"][2]
        assert g2["diagnosis"] == "held_outside_namespace" and g2["processes"] == []
        s = g2["startable"]
        assert (s["reason"], s["code"], s["error"], s["step"], s["context_only"]) == (
            "cuda_busy",
            46,
            "CUDA_ERROR_DEVICE_UNAVAILABLE",
            "cuDevicePrimaryCtxRetain",
            True,
        )
        assert "exclusive_process" in s["detail"] and "cannot see" in s["detail"]
        assert [f["name"] for f in g2["health"]["findings"]] == ["cuda_busy", "compute_mode"] and g2["health"]["verdict"] == "restart_app"
        assert all(g["startable"]["ok"] for i, g in enumerate(r["gpus"]) if i != 2)
        assert held.alive() and [c["pid"] for c in node.contexts()] == [held.pid]  # the holder is untouched, the probe gone
    finally:
        sb.stop()


def test_each_failure_is_named_with_its_code_and_a_hung_start_returns_on_time(mod, node) -> None:
    node.set_health(1, fabric_state="in_progress")
    node.ecc_error(3)
    node.set_fault(hidden={4: 30000}, hang={"functions": ["cuDevicePrimaryCtxRetain"], "gpus": [5]})
    r = verify(mod, cuda_probe_timeout=2, fail_on="never")
    assert (r["_status"], r["reason"]) == ("failed", "not_clean"), r
    named = {g["index"]: (g["diagnosis"], g["startable"]["code"], g["startable"]["step"]) for g in r["gpus"] if not g["clean"]}
    assert named == {
        1: ("fabric_not_ready", 802, "cuInit"),
        3: ("ecc_uncorrectable", 214, "cuDevicePrimaryCtxRetain"),
        4: ("cuda_oom", 2, "cuMemAlloc_v2"),
        5: ("cuda_hung", None, "cuDevicePrimaryCtxRetain"),
    }
    g4 = r["gpus"][4]
    assert g4["used_mib"] == 0 and g4["startable"]["cuda_free_mib"] == H200_CUDA_TOTAL_MIB - 527 - 30000
    assert "NVML reads 143156 MiB free" in g4["detail"]
    assert "systemctl start nvidia-fabricmanager" in r["gpus"][1]["detail"] and "reset it" in r["gpus"][3]["detail"]
    # The hung start was killed at its deadline; the run came back, and nothing of any probe is left.
    assert "within 2 s" in r["gpus"][5]["detail"] and seconds(r) <= 2 + 2 + 6, seconds(r)
    assert r["gpus"][5]["health"]["verdict"] == "reboot" and r["gpus"][4]["health"]["verdict"] == "reset_gpu"
    assert node.contexts() == [] and r["cuda_probe"]["left_behind"] == []
    assert [g["startable"]["ok"] for g in r["gpus"]] == [True, False, True, False, False, False, True, True]


def test_no_libcuda_and_the_software_findings(node) -> None:
    node.set_fault(cuda_absent=True)
    node.set_health(6, persistence=0, inforom_corrupt=1)
    sb = node.sandbox()
    try:
        args = {"timeout": 0, "kernel_log": str(node.kernel_log), "fail_on": "never"}
        r = ModuleRunner(node, sb)("gpu_mem_verify", args, env={"CUDA_INJECTION64_PATH": "/opt/hook.so"})
        assert (r["_status"], r["reason"]) == ("failed", "not_clean"), r
        assert {g["diagnosis"] for g in r["gpus"]} == {"no_libcuda"}
        assert "libcuda.so.1" in r["gpus"][0]["detail"] and r["gpus"][0]["startable"]["step"] == "dlopen"
        found = {(f["name"], f["verdict"], f["gpu"]) for f in r["software"]["findings"]}
        assert found == {("persistence_off", "ok", 6), ("cuda_env", "fix_config", None), ("inforom_corrupt", "drain", 6)}
        assert r["software"]["environment"]["found"][0]["where"] == "the module's environment"
        assert r["health"]["verdict"] == "drain"
    finally:
        sb.stop()


def test_bad_probe_options_are_refused_before_anything_runs(mod, node, sandbox) -> None:
    for option, value, says in (
        ("cuda_probe_memory_fraction", 1.5, "cuda_probe_memory_fraction"),
        ("cuda_probe_memory_fraction", "nan", "cuda_probe_memory_fraction"),
        ("cuda_probe_timeout", 0, "cuda_probe_timeout"),
        ("containers", [103, 104], "one container at a time"),
        ("containers", [42], "42 is not a valid Proxmox vmid"),
    ):
        r = verify(mod, **{option: value})
        assert (r["_status"], r["reason"], r["option"]) == ("failed", "bad_arguments", option), r
        assert says in r["msg"], r
    job = sandbox.spawn_worker(gpus=[0], mib=1000)
    r = mod("clean_slate_node", {"verify": {"cuda_probe_memory_fraction": -0.1}, "kill": {"gpus": [0]}})
    assert (r["_status"], r["reason"], r["phase"]) == ("failed", "bad_arguments", "preflight"), r
    assert "cuda_probe_memory_fraction" in r["msg"] and job.alive()  # refused before anything was signalled


# ---------------------------------------------------------------------- a container cleaned from its node (container scope)
def registry_of(tmp_path) -> dict[str, str]:
    """The fake pct's registry (node pve1; pct answers at once here, the lab's takes its second) and the environment naming it."""
    registry = tmp_path / "pct"
    registry.mkdir()
    (registry / "node").write_text("pve1")
    (registry / "latency_ms").write_text("0")
    return {"PCTSIM_DIR": str(registry)}


def left_inside(sb) -> list[str]:
    """The command lines of the processes in the container's PID namespace but its init."""
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.stat(f"/proc/{pid}/ns/pid").st_ino == sb.ns_inode and int(pid) != sb.init_pid:
                with open(f"/proc/{pid}/cmdline", "rb") as fh:
                    out.append(fh.read().replace(b"\0", b" ").decode(errors="replace")[:80])
        except OSError:
            continue
    return out


def test_a_container_without_nvidia_uvm_is_red_from_its_node_where_nvml_and_the_node_read_clean(node, tmp_path) -> None:
    """ct103 of the lab, simulated: an unprivileged container with GPU 2 and nvidiactl passed through, not nvidia-uvm.
    Cleaned from its node (what the role runs in hypervisor mode), the CUDA start and the device files are the
    container's: red, uvm_missing, while NVML reads the GPU clean and the node itself is startable."""
    env = registry_of(tmp_path)
    ct = node.sandbox(vmid=103, unprivileged=True)
    try:
        ct.register_pct(env["PCTSIM_DIR"])
        ct.pass_devices(omit=[n for n in (str(p.relative_to(node.dev_dir)) for p in node.device_files()) if n not in ("nvidia2", "nvidiactl")])
        run = ModuleRunner(node, None)  # on the node
        verify_args = {"gpus": [2], "timeout": 0, "kernel_log": str(node.kernel_log), "device_dir": str(node.dev_dir)}
        r = run("clean_slate_node", {"containers": [103], "phases": ["verify"], "verify": verify_args}, env=env)
        assert (r["_status"], r["reason"], r["phase"]) == ("failed", "not_clean", "verify"), r
        [g] = r["verify"]["gpus"]
        assert g["used_mib"] == 0 and g["processes"] == []  # NVML reads it clean
        assert (g["clean"], g["diagnosis"]) == (False, "uvm_missing")
        s = g["startable"]
        assert (s["ok"], s["reason"], s["code"], s["step"]) == (False, "uvm_missing", 999, "cuInit"), s
        assert "nvidia-uvm is absent" in g["detail"] and "pass /dev/nvidia-uvm and /dev/nvidia-uvm-tools through" in g["detail"]
        probe = r["verify"]["cuda_probe"]
        assert probe["container"]["vmid"] == 103 and probe["container"]["ok"] is True and probe["container"]["python"], probe
        # The device files are the container's: GPU 2's and nvidiactl are there, nvidia-uvm is not.
        sw = r["verify"]["software"]
        assert sw["devices"]["container"] == 103 and sw["devices"]["gpus"][0]["ok"] and sw["devices"]["ctl"]["ok"] and not sw["devices"]["uvm"]["ok"]
        assert [f["name"] for f in sw["findings"]] == ["uvm_missing", "uvm_tools_missing"]  # one GPU file for one GPU: no count finding
        assert "uvm_missing" in r["msg"] and "nvidia-uvm" in r["msg"]
        assert_no_traceback(r)
        # The node's own /dev has nvidia-uvm (its GPUs start CUDA: test_an_idle_node_...): the red is the container's.
        assert (node.dev_dir / "nvidia-uvm").exists()
        assert node.contexts() == [] and left_inside(ct) == []
    finally:
        ct.stop()


def test_a_container_with_every_device_is_proven_startable_inside_a_hang_there_returns_on_time_and_without_python3_is_unproven(node, tmp_path) -> None:
    env = registry_of(tmp_path)
    ct = node.sandbox(vmid=102)
    try:
        ct.register_pct(env["PCTSIM_DIR"])
        ct.pass_devices(omit=[f"nvidia{i}" for i in (0, 1, 2, 3, 4, 5)])  # GPUs 6 and 7, as ct102
        run = ModuleRunner(node, None)
        r = run("gpu_mem_verify", {"containers": [102], "gpus": [6, 7], "timeout": 0, "kernel_log": str(node.kernel_log)}, env=env)
        assert r["_status"] == "ok", r
        for g in r["gpus"]:
            s = g["startable"]
            assert s["ok"] is True and s["allocated_mib"] == int(H200_CUDA_TOTAL_MIB * 0.9 * (1 << 20)) >> 20 and s["gone_after_s"] is not None, s
        assert r["cuda_probe"]["container"]["vmid"] == 102 and (r["cuda_probe"]["probed"], r["cuda_probe"]["started"]) == (2, 2)
        assert r["software"]["findings"] == [] and r["software"]["devices"]["gpu_files"] == 2
        # It ran in there: pct exec 102 with the container's own python3, nothing of it left, on the GPUs or in the container.
        calls = [json.loads(line)["argv"] for line in (tmp_path / "pct" / "calls.jsonl").read_text().splitlines()]
        assert [c[:4] for c in calls] == [["exec", "102", "--keep-env", "0"]] and "gpuops-cuda-probe" in calls[0]
        assert node.contexts() == [] and left_inside(ct) == []
        assert (r["cuda_probe"]["container"]["ended"], r["cuda_probe"]["container"]["left"]) == ([], []), r["cuda_probe"]  # nothing outlived pct
        # A GPU wedged in the driver: its start hangs inside the container, is killed there at its deadline, and the run returns.
        node.set_fault(hang={"functions": ["cuDevicePrimaryCtxRetain"], "gpus": [7]})
        r = run("gpu_mem_verify", {"containers": [102], "gpus": [6, 7], "timeout": 0, "kernel_log": str(node.kernel_log), "cuda_probe_timeout": 2}, env=env)
        assert (r["_status"], r["reason"]) == ("failed", "not_clean"), r
        assert [(g["diagnosis"], g["startable"]["step"]) for g in r["gpus"]] == [("clean", None), ("cuda_hung", "cuDevicePrimaryCtxRetain")]
        assert "within 2 s" in r["gpus"][1]["detail"] and seconds(r) <= 2 + 2 + 6, seconds(r)
        assert node.contexts() == [] and left_inside(ct) == []
        # An image without python3 (in the container's mount namespace its interpreter is no program): no start can be
        # made there, so its GPUs are not proven, red with what to do, though nothing is known against the GPUs.
        done = ct.run(["mount", "--bind", "/dev/null", os.path.realpath("/usr/bin/python3")], capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        r = run("gpu_mem_verify", {"containers": [102], "gpus": [6, 7], "timeout": 0, "kernel_log": str(node.kernel_log)}, env=env)
        assert (r["_status"], r["reason"]) == ("failed", "not_clean"), r
        for g in r["gpus"]:
            assert g["used_mib"] == 0 and (g["clean"], g["diagnosis"], g["startable"]["reason"]) == (False, "cuda_unproven", "cuda_unproven")
            assert "container 102 has no python3" in g["detail"] and "apt-get install python3-minimal" in g["detail"]
            assert g["health"]["verdict"] == "ok"
        assert [f["name"] for f in r["software"]["findings"]] == ["devices_unchecked"]
        assert r["cuda_probe"]["container"]["ok"] is False and "no python3" in r["cuda_probe"]["container"]["why"]
        # A reset for the container's GPU 7 is the node's to make, by the node's own bus ID (the container cannot).
        node.set_health(7, remap_pending=1)
        r = run("gpu_mem_verify", {"containers": [102], "gpus": [6, 7], "timeout": 0, "kernel_log": str(node.kernel_log)}, env=env)
        plan = r["reset_plan"]
        assert [(g["index"], g["pci_bus_id"], g["why"]) for g in plan["gpus"]] == [(7, r["gpus"][1]["pci_bus_id"], ["row_remap_pending"])], plan
        assert plan["where"] == "this node (container 102's GPUs, by this node's bus IDs)" and "nvidia-smi -r -i " + r["gpus"][1]["pci_bus_id"] in r["msg"]
    finally:
        ct.stop()
