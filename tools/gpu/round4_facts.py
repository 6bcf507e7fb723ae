"""Round 4 facts, read on a real GPU machine (issues 39, 40, 41): what the real driver answers when a device file is
absent, is not the device it is named for, or is refused; the NVLink, PCIe, clock-event and temperature readings the
readiness checks use, beside nvidia-smi's; an idle GPU's PCIe generation against a busy one's; the peer-access calls
on the GPUs there are.

    python3 tools/gpu/round4_facts.py --out DIR     (as root; writes DIR/round4-facts.json and nvidia-smi's text)

The device-file scenarios run in a private mount namespace each (``unshare --mount``): /dev/nvidia-uvm, /dev/nvidia0
or /dev/nvidiactl made absent (a tmpfs /dev holding copies of every other node), bound over by /dev/null, by a node of
another device's numbers or by an empty regular file; the machine's own /dev is never changed. In each a fresh process
asks NVML (nvmlInit_v2, the count, each handle and its minor) and CUDA (cuInit, the count, a primary context, an
allocation) through ctypes, and records every return code. Nothing resets a GPU or changes its modes, clocks or power.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import textwrap
import time

# A fresh process in a scenario's mount namespace: it sets the scenario up, then asks NVML and CUDA.
PROBE = textwrap.dedent(
    r"""
    import ctypes, json, os, stat, subprocess, sys
    spec = json.loads(sys.argv[1])
    out = {"scenario": spec["name"], "setup": []}
    def run(*cmd):
        r = subprocess.run(list(cmd), capture_output=True, text=True)
        out["setup"].append([" ".join(cmd), r.returncode, r.stderr.strip()[-200:]])
    if spec.get("omit"):
        # A /dev without the omitted nodes: copies (mknod, same numbers and modes) of every other node on a tmpfs.
        os.makedirs("/tmp/r4-olddev", exist_ok=True)
        run("mount", "--bind", "/dev", "/tmp/r4-olddev")
        run("mount", "-t", "tmpfs", "-o", "mode=0755", "r4dev", "/dev")
        for name in os.listdir("/tmp/r4-olddev"):
            src = "/tmp/r4-olddev/" + name
            st = os.lstat(src)
            if name in spec["omit"]:
                continue
            if stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode):
                os.mknod("/dev/" + name, st.st_mode, st.st_rdev)
            elif stat.S_ISLNK(st.st_mode):
                os.symlink(os.readlink(src), "/dev/" + name)
            elif stat.S_ISDIR(st.st_mode):
                os.mkdir("/dev/" + name)
                run("mount", "--rbind", src, "/dev/" + name)
    for src, dst in spec.get("bind", []):
        if src == "REGULAR":
            src = "/tmp/r4-regular"
            open(src, "w").close()
        elif src.startswith("NODE:"):
            major, minor = map(int, src[5:].split(":"))
            src = "/tmp/r4-node-%d-%d" % (major, minor)
            if os.path.exists(src):
                os.unlink(src)
            os.mknod(src, stat.S_IFCHR | 0o666, os.makedev(major, minor))
        run("mount", "--bind", src, dst)
    nodes = {}
    for name in sorted(os.listdir("/dev")):
        if not name.startswith("nvidia"):
            continue
        path = "/dev/" + name
        st = os.stat(path)
        entry = {"mode": oct(st.st_mode), "chr": stat.S_ISCHR(st.st_mode)}
        if stat.S_ISCHR(st.st_mode):
            entry["rdev"] = [os.major(st.st_rdev), os.minor(st.st_rdev)]
        if not stat.S_ISDIR(st.st_mode):
            try:
                fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NONBLOCK)
                os.close(fd)
                entry["open"] = "ok"
            except OSError as exc:
                entry["open"] = exc.strerror
        nodes[name] = entry
    out["nodes"] = nodes
    nvml = {}
    try:
        lib = ctypes.CDLL("libnvidia-ml.so.1")
        nvml["init"] = lib.nvmlInit_v2()
        if nvml["init"] == 0:
            count = ctypes.c_uint()
            nvml["count_rc"] = lib.nvmlDeviceGetCount_v2(ctypes.byref(count))
            nvml["count"] = count.value
            nvml["devices"] = []
            for i in range(count.value):
                h = ctypes.c_void_p()
                rc = lib.nvmlDeviceGetHandleByIndex_v2(i, ctypes.byref(h))
                d = {"index": i, "handle_rc": rc}
                if rc == 0:
                    minor = ctypes.c_uint()
                    d["minor_rc"] = lib.nvmlDeviceGetMinorNumber(h, ctypes.byref(minor))
                    d["minor"] = minor.value
                    buf = ctypes.create_string_buffer(96)
                    d["uuid_rc"] = lib.nvmlDeviceGetUUID(h, buf, 96)
                    d["uuid"] = buf.value.decode()
                nvml["devices"].append(d)
            lib.nvmlErrorString.restype = ctypes.c_char_p
            nvml["init_text"] = lib.nvmlErrorString(nvml["init"]).decode()
            lib.nvmlShutdown()
        else:
            lib.nvmlErrorString.restype = ctypes.c_char_p
            nvml["init_text"] = lib.nvmlErrorString(nvml["init"]).decode()
    except OSError as exc:
        nvml["dlopen"] = str(exc)
    out["nvml"] = nvml
    cuda = {}
    try:
        cu = ctypes.CDLL("libcuda.so.1")
        cuda["init"] = cu.cuInit(0)
        n = ctypes.c_int()
        cuda["count_rc"] = cu.cuDeviceGetCount(ctypes.byref(n))
        cuda["count"] = n.value
        if cuda["init"] == 0 and n.value > 0:
            dev = ctypes.c_int(); ctx = ctypes.c_void_p(); ptr = ctypes.c_uint64()
            cuda["device_get"] = cu.cuDeviceGet(ctypes.byref(dev), 0)
            cuda["ctx_retain"] = cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev)
            if cuda["ctx_retain"] == 0:
                cuda["ctx_set"] = cu.cuCtxSetCurrent(ctx)
                cuda["alloc"] = cu.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(64 << 20))
                if cuda["alloc"] == 0:
                    cu.cuMemFree_v2(ptr)
                cu.cuDevicePrimaryCtxRelease(dev)
        name = ctypes.c_char_p()
        cu.cuGetErrorName(cuda["init"], ctypes.byref(name))
        cuda["init_name"] = name.value.decode() if name.value else None
    except OSError as exc:
        cuda["dlopen"] = str(exc)
    out["cuda"] = cuda
    print(json.dumps(out))
    """
)

SCENARIOS = [
    {"name": "baseline"},
    {"name": "uvm_absent", "omit": ["nvidia-uvm"]},
    {"name": "uvm_and_tools_absent", "omit": ["nvidia-uvm", "nvidia-uvm-tools"]},
    {"name": "uvm_is_dev_null", "bind": [["/dev/null", "/dev/nvidia-uvm"]]},
    {"name": "uvm_has_gpu0_numbers", "bind": [["NODE:195:0", "/dev/nvidia-uvm"]]},
    {"name": "uvm_is_regular_file", "bind": [["REGULAR", "/dev/nvidia-uvm"]]},
    {"name": "uvm_is_uvm_tools", "bind": [["/dev/nvidia-uvm-tools", "/dev/nvidia-uvm"]]},
    {"name": "gpu0_absent", "omit": ["nvidia0"]},
    {"name": "gpu0_is_dev_null", "bind": [["/dev/null", "/dev/nvidia0"]]},
    {"name": "gpu0_has_minor_1", "bind": [["NODE:195:1", "/dev/nvidia0"]]},
    {"name": "gpu0_is_regular_file", "bind": [["REGULAR", "/dev/nvidia0"]]},
    {"name": "ctl_absent", "omit": ["nvidiactl"]},
    {"name": "ctl_is_dev_null", "bind": [["/dev/null", "/dev/nvidiactl"]]},
]


def sh(cmd: str, timeout: float = 60) -> dict:
    t0 = time.monotonic()
    try:
        r = subprocess.run(cmd, shell=True, capture_output=True, text=True, timeout=timeout, check=False)
        return {"cmd": cmd, "rc": r.returncode, "out": r.stdout, "err": r.stderr[-2000:], "s": round(time.monotonic() - t0, 3)}
    except subprocess.TimeoutExpired:
        return {"cmd": cmd, "rc": None, "out": "", "err": "timeout", "s": timeout}


def scenario(spec: dict) -> dict:
    r = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", sys.executable, "-I", "-c", PROBE, json.dumps(spec)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    try:
        return json.loads(r.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        return {"scenario": spec["name"], "rc": r.returncode, "stdout": r.stdout[-2000:], "stderr": r.stderr[-2000:]}


def readings() -> dict:
    """NVML's readings for the readiness checks, each call timed (median of 20), per GPU."""
    import pynvml

    pynvml.nvmlInit()
    out = {"driver": pynvml.nvmlSystemGetDriverVersion(), "gpus": []}

    def ask(name, fn, *args):
        times = []
        value = None
        for _repeat in range(20):
            t0 = time.perf_counter()
            try:
                value = fn(*args)
            except pynvml.NVMLError as exc:
                value = {"error": str(exc), "code": getattr(exc, "value", None)}
            times.append(time.perf_counter() - t0)
        times.sort()
        if hasattr(value, "_fields_"):
            value = {f[0]: getattr(value, f[0]) for f in value._fields_ if not f[0].startswith("_")}
        try:
            json.dumps(value)
        except TypeError:
            value = repr(value)
        return {"value": value, "us": round(times[len(times) // 2] * 1e6, 1)}

    for i in range(pynvml.nvmlDeviceGetCount()):
        h = pynvml.nvmlDeviceGetHandleByIndex(i)
        g = {"index": i, "name": pynvml.nvmlDeviceGetName(h), "pci": pynvml.nvmlDeviceGetPciInfo(h).busId}
        g["pcie_gen_current"] = ask("curr gen", pynvml.nvmlDeviceGetCurrPcieLinkGeneration, h)
        g["pcie_gen_max"] = ask("max gen", pynvml.nvmlDeviceGetMaxPcieLinkGeneration, h)
        g["pcie_gen_gpumax"] = ask("gpu max gen", pynvml.nvmlDeviceGetGpuMaxPcieLinkGeneration, h)
        g["pcie_width_current"] = ask("curr width", pynvml.nvmlDeviceGetCurrPcieLinkWidth, h)
        g["pcie_width_max"] = ask("max width", pynvml.nvmlDeviceGetMaxPcieLinkWidth, h)
        g["pcie_link_max_speed"] = ask("max speed", pynvml.nvmlDeviceGetPcieLinkMaxSpeed, h)
        g["pcie_speed"] = ask("speed", pynvml.nvmlDeviceGetPcieSpeed, h)
        g["pcie_replay"] = ask("replay", pynvml.nvmlDeviceGetPcieReplayCounter, h)
        reasons = getattr(pynvml, "nvmlDeviceGetCurrentClocksEventReasons", None) or pynvml.nvmlDeviceGetCurrentClocksThrottleReasons
        supported = getattr(pynvml, "nvmlDeviceGetSupportedClocksEventReasons", None) or pynvml.nvmlDeviceGetSupportedClocksThrottleReasons
        g["clock_event_reasons"] = ask("reasons", reasons, h)
        g["clock_event_reasons_supported"] = ask("supported", supported, h)
        g["temperature_gpu"] = ask("temp", pynvml.nvmlDeviceGetTemperature, h, 0)
        g["temperature_thresholds"] = {
            k: ask(k, pynvml.nvmlDeviceGetTemperatureThreshold, h, v) for k, v in (("shutdown", 0), ("slowdown", 1), ("mem_max", 2), ("gpu_max", 3))
        }
        g["power_mw"] = ask("power", pynvml.nvmlDeviceGetPowerUsage, h)
        g["clocks"] = {k: ask(k, pynvml.nvmlDeviceGetClockInfo, h, v) for k, v in (("graphics", 0), ("sm", 1), ("mem", 2))}
        g["max_clocks"] = {k: ask(k, pynvml.nvmlDeviceGetMaxClockInfo, h, v) for k, v in (("graphics", 0), ("sm", 1), ("mem", 2))}
        links = []
        for link in range(18):
            state = ask("nvlink state", pynvml.nvmlDeviceGetNvLinkState, h, link)
            entry = {"link": link, "state": state}
            if not isinstance(state["value"], dict):
                entry["version"] = ask("version", pynvml.nvmlDeviceGetNvLinkVersion, h, link)
                entry["errors"] = {
                    k: ask(k, pynvml.nvmlDeviceGetNvLinkErrorCounter, h, link, v) for k, v in (("replay", 0), ("recovery", 1), ("crc_flit", 2), ("crc_data", 3))
                }
            links.append(entry)
        g["nvlink"] = links
        field = getattr(pynvml, "NVML_FI_DEV_NVLINK_LINK_COUNT", 91)
        g["nvlink_link_count_field"] = ask(
            "link count", lambda handle=h, fid=field: [(v.nvmlReturn, v.value.uiVal) for v in pynvml.nvmlDeviceGetFieldValues(handle, [fid])]
        )
        g["p2p_status_self"] = {
            k: ask(k, pynvml.nvmlDeviceGetP2PStatus, h, h, v) for k, v in (("read", 0), ("write", 1), ("nvlink", 2), ("atomics", 3), ("prop", 4))
        }
        out["gpus"].append(g)
    pynvml.nvmlShutdown()
    return out


def pcie_idle_busy() -> dict:
    """The PCIe generation and width read idle, while torch keeps the GPU busy, and idle again."""
    import pynvml

    pynvml.nvmlInit()
    h = pynvml.nvmlDeviceGetHandleByIndex(0)

    def read(tag):
        return {
            "when": tag,
            "gen": pynvml.nvmlDeviceGetCurrPcieLinkGeneration(h),
            "width": pynvml.nvmlDeviceGetCurrPcieLinkWidth(h),
            "sm_mhz": pynvml.nvmlDeviceGetClockInfo(h, 1),
            "reasons": pynvml.nvmlDeviceGetCurrentClocksEventReasons(h)
            if hasattr(pynvml, "nvmlDeviceGetCurrentClocksEventReasons")
            else pynvml.nvmlDeviceGetCurrentClocksThrottleReasons(h),
        }

    rows = [read("idle")]
    busy = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import torch,time\nx=torch.randn(8192,8192,device='cuda')\nt=time.time()\n"
            "while time.time()-t<4:\n  y=x@x\n  z=x.cpu() if int(time.time()*10)%5==0 else None\ntorch.cuda.synchronize()",
        ]
    )
    time.sleep(2.0)
    rows.append(read("busy (matmul and device-to-host copies)"))
    busy.wait()
    for wait in (0.5, 3.0):
        time.sleep(wait)
        rows.append(read(f"idle again (+{wait} s)"))
    pynvml.nvmlShutdown()
    return {"rows": rows}


PEER = textwrap.dedent(
    r"""
    import ctypes, json, time
    cu = ctypes.CDLL("libcuda.so.1")
    out = {}
    out["init"] = cu.cuInit(0)
    n = ctypes.c_int(); cu.cuDeviceGetCount(ctypes.byref(n)); out["count"] = n.value
    can = ctypes.c_int(-1)
    out["can_access_self_rc"] = cu.cuDeviceCanAccessPeer(ctypes.byref(can), 0, 0); out["can_access_self"] = can.value
    dev = ctypes.c_int(); ctx = ctypes.c_void_p()
    cu.cuDeviceGet(ctypes.byref(dev), 0)
    cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev); cu.cuCtxSetCurrent(ctx)
    out["enable_self_rc"] = cu.cuCtxEnablePeerAccess(ctx, 0)
    size = 256 << 20
    a = ctypes.c_uint64(); b = ctypes.c_uint64()
    cu.cuMemAlloc_v2(ctypes.byref(a), ctypes.c_size_t(size)); cu.cuMemAlloc_v2(ctypes.byref(b), ctypes.c_size_t(size))
    cu.cuMemsetD8_v2(a, ctypes.c_ubyte(0x5A), ctypes.c_size_t(size)); cu.cuCtxSynchronize()
    for label, fn in (("peer_same_ctx", lambda: cu.cuMemcpyPeer(b, ctx, a, ctx, ctypes.c_size_t(size))),
                      ("dtod", lambda: cu.cuMemcpyDtoD_v2(b, a, ctypes.c_size_t(size)))):
        times = []
        for _ in range(5):
            t0 = time.perf_counter(); rc = fn(); cu.cuCtxSynchronize(); times.append(time.perf_counter() - t0)
        out[label] = {"rc": rc, "best_s": min(times), "GBps": round(size / min(times) / 1e9, 1)}
    host = (ctypes.c_ubyte * 4096)()
    out["dtoh_rc"] = cu.cuMemcpyDtoH_v2(host, b, ctypes.c_size_t(4096))
    out["pattern_ok"] = all(x == 0x5A for x in host)
    cu.cuMemFree_v2(a); cu.cuMemFree_v2(b); cu.cuDevicePrimaryCtxRelease(dev)
    print(json.dumps(out))
    """
)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    facts: dict = {"time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    env = {
        k: sh(c)
        for k, c in {
            "uname": "uname -a",
            "proc_devices": "cat /proc/devices",
            "dev": "ls -la /dev/nvidia* /dev/nvidia-caps 2>&1",
            "driver": "cat /proc/driver/nvidia/version; cat /proc/driver/nvidia/gpus/*/information",
            "cgroup": "stat -fc %T /sys/fs/cgroup; ls /sys/fs/cgroup | head -40; cat /proc/self/cgroup",
            "shm": "df -k /dev/shm",
            "topo": "nvidia-smi topo -m",
            "nvlink_status": "nvidia-smi nvlink -s",
            "nvlink_errors": "nvidia-smi nvlink -e",
            "query": "nvidia-smi --query-gpu=index,pcie.link.gen.current,pcie.link.gen.max,pcie.link.gen.gpumax,pcie.link.width.current,"
            "pcie.link.width.max,clocks_event_reasons.active,clocks_event_reasons.hw_slowdown,clocks_event_reasons.sw_thermal_slowdown,"
            "clocks_event_reasons.hw_thermal_slowdown,clocks_event_reasons.hw_power_brake_slowdown,temperature.gpu,temperature.memory"
            " --format=csv",
        }.items()
    }
    facts["env"] = env
    q = sh("nvidia-smi -q")
    with open(os.path.join(args.out, "nvidia-smi-q.txt"), "w") as fh:
        fh.write(q["out"])
    facts["readings"] = readings()
    facts["pcie_idle_busy"] = pcie_idle_busy()
    r = subprocess.run([sys.executable, "-c", PEER], capture_output=True, text=True, timeout=120, check=False)
    facts["peer_one_gpu"] = json.loads(r.stdout) if r.returncode == 0 and r.stdout.strip() else {"rc": r.returncode, "err": r.stderr[-2000:]}
    facts["scenarios"] = [scenario(s) for s in SCENARIOS]
    path = os.path.join(args.out, "round4-facts.json")
    with open(path, "w") as fh:
        json.dump(facts, fh, indent=1)
    for s in facts["scenarios"]:
        n, c = s.get("nvml", {}), s.get("cuda", {})
        print(
            f"{s.get('scenario'):24} nvmlInit={n.get('init')} ({n.get('init_text')}) count={n.get('count')} "
            f"handles={[d.get('handle_rc') for d in n.get('devices', [])]} | cuInit={c.get('init')} ({c.get('init_name')}) "
            f"count={c.get('count')} ctx={c.get('ctx_retain')} alloc={c.get('alloc')}"
        )
    print(env["proc_devices"]["out"])
    print(env["dev"]["out"])
    print(env["query"]["out"])
    print(json.dumps(facts["pcie_idle_busy"]), json.dumps(facts["peer_one_gpu"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
