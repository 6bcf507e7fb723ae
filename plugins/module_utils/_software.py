# Copyright (c) 2026, gpuops.clean_slate maintainers
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# Note: this module_util is PRIVATE to the collection; it may change without notice.

"""The software checks of DCGM's level 1 (``dcgmi diag -r 1``) that the health verdict did not have, each a named finding.

NVIDIA's quick diagnostic (NVIDIA/DCGM, nvvs/plugin_src/software/Software.cpp) checks the node's software before any
GPU work; the health verdict already reads page retirement, row remapping, the fabric state and the processes, so
this adds the rest, all cheap (a stat and an open per device file, three environment reads, one NVML call per GPU):

* ``devices``: the device file of every selected GPU, ``nvidiactl``, ``nvidia-uvm``, ``nvidia-uvm-tools`` and, where
  MIG is on, ``nvidia-caps``: present and openable (inside a container this is the passthrough check, as the device
  cgroup refuses at open, not at stat), and the number of GPU device files against the GPUs NVML lists;
* ``persistence``: persistence mode off on a selected GPU (every start then re-initialises the GPU);
* ``environment``: the variables DCGM flags (``CUDA_INJECTION64_PATH``, ...) where the module can see them: its own
  environment, ``/etc/environment`` and PID 1's; a job's own environment (its unit, its launcher) it cannot see;
* ``inforom``: the infoROM's checksum (``nvmlDeviceValidateInforom``).
"""

from __future__ import annotations

import os
import re
import typing as t

from ansible_collections.gpuops.clean_slate.plugins.module_utils import _cuda, _health, _reasons

#: Findings that are no reason (the others are the startability reasons of the same cause).
UVM_TOOLS_MISSING = "uvm_tools_missing"
CAPS_MISSING = "caps_missing"
DEVICE_COUNT = "device_count"
PERSISTENCE_OFF = "persistence_off"
CUDA_ENV = "cuda_env"
INFOROM_CORRUPT = "inforom_corrupt"

NOT_VISIBLE = (
    "a job's own environment (its systemd unit, its launcher script, the shell that started it) is not visible to the"
    " module: only its own, /etc/environment and PID 1's are read"
)
_NVML_ERROR_CORRUPTED_INFOROM = 14


def node(path: str) -> dict[str, t.Any]:
    """``{path, ok, why}`` of one device file: present, a character device (or, in a simulator, a file) and openable."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return {"path": path, "ok": False, "why": f"{path} is absent"}
    except OSError as exc:
        return {"path": path, "ok": False, "why": f"{path} cannot be looked at ({exc.strerror})"}
    if os.path.isdir(path):
        names = sorted(os.listdir(path))
        if not names:
            return {"path": path, "ok": False, "why": f"{path} is empty"}
        bad = [n for n in (node(os.path.join(path, name)) for name in names) if not n["ok"]]
        return {"path": path, "ok": not bad, "why": bad[0]["why"] if bad else None}
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as exc:
        # In a container the device cgroup refuses here (EPERM); a node of a driver not loaded says ENXIO/ENODEV.
        return {"path": path, "ok": False, "why": f"{path} is present but cannot be opened ({exc.strerror})", "mode": oct(st.st_mode)}
    os.close(fd)
    return {"path": path, "ok": True, "why": None}


def uvm_major() -> int | None:
    """nvidia-uvm's major number from /proc/devices (dynamic: 511, 508, 238 ... where 195 is the GPUs'), or None."""
    try:
        with open("/proc/devices", encoding="utf-8") as fh:
            for line in fh:
                parts = line.split()
                if len(parts) == 2 and parts[1] == "nvidia-uvm" and parts[0].isdigit():
                    return int(parts[0])
    except OSError:
        return None
    return None


def device_nodes(device_dir: str, gpus: t.Sequence[tuple[int, int | None, bool]], nvml_count: int) -> dict[str, t.Any]:
    """What the device files say: ``gpus`` (index -> node), ``ctl``, ``uvm``, ``uvm_tools``, ``caps`` (where a selected
    GPU has MIG on, else None), ``gpu_files`` (how many ``nvidia<N>`` files), ``nvml_count`` and ``uvm_major``.

    ``gpus`` is ``(index, minor, mig_on)`` of each selected GPU.
    """
    join = os.path.join
    try:
        files = sum(1 for name in os.listdir(device_dir) if re.match(r"^nvidia\d+$", name))
    except OSError:
        files = 0
    out: dict[str, t.Any] = {
        "dir": device_dir,
        "gpus": {
            index: node(join(device_dir, f"nvidia{minor}")) if minor is not None else {"path": None, "ok": True, "why": None} for index, minor, _mig in gpus
        },
        "ctl": node(join(device_dir, "nvidiactl")),
        "uvm": node(join(device_dir, "nvidia-uvm")),
        "uvm_tools": node(join(device_dir, "nvidia-uvm-tools")),
        "caps": node(join(device_dir, "nvidia-caps")) if any(mig for _i, _m, mig in gpus) else None,
        "gpu_files": files,
        "nvml_count": nvml_count,
        "uvm_major": uvm_major(),
    }
    return out


def _env_file(path: str, sep: bytes) -> dict[str, str] | None:
    try:
        with open(path, "rb") as fh:
            data = fh.read()
    except OSError:
        return None
    out = {}
    for raw in data.split(sep):
        line = raw.decode("utf-8", "replace").strip()
        if line.startswith("export "):
            line = line[len("export ") :]
        name, eq, value = line.partition("=")
        if eq and not name.startswith("#"):
            out[name.strip()] = value.strip().strip('"').strip("'")
    return out


def environment(module_env: t.Mapping[str, str] | None = None) -> dict[str, t.Any]:
    """DCGM's flagged variables where they can be seen: ``found`` (``name``, ``where``, ``value``), ``read``, ``unreadable``, ``not_visible``."""
    sources: list[tuple[str, t.Mapping[str, str] | None]] = [
        ("the module's environment", os.environ if module_env is None else module_env),
        ("/etc/environment", _env_file("/etc/environment", b"\n")),
        ("PID 1's environment", _env_file("/proc/1/environ", b"\0")),
    ]
    found = []
    for where, env in sources:
        for name in _cuda.BAD_ENV:
            if env is not None and name in env:
                found.append({"name": name, "where": where, "value": env[name]})
    return {
        "found": found,
        "read": [where for where, env in sources if env is not None],
        "unreadable": [where for where, env in sources if env is None],
        "not_visible": NOT_VISIBLE,
    }


def read_inforom(_session: t.Any, gpu: t.Any) -> bool | None:
    """True when the GPU's infoROM checks out, False when NVML says it is corrupted, None where it cannot say (NVML, in the prober's helper)."""
    import pynvml  # pylint: disable=import-outside-toplevel

    try:
        pynvml.nvmlDeviceValidateInforom(gpu.handle)
    except pynvml.NVMLError as exc:
        return False if getattr(exc, "value", None) == _NVML_ERROR_CORRUPTED_INFOROM else None
    return True


def findings(
    devices: dict[str, t.Any], env: dict[str, t.Any], persistence: t.Mapping[int, bool | None], inforom: t.Mapping[int, bool | None]
) -> list[dict[str, t.Any]]:
    """Every failed check as ``{name, verdict, gpu, text}`` (``gpu`` None for the host); warnings are ``ok``."""
    out: list[dict[str, t.Any]] = []

    def add(name: str, verdict: str, text: str, gpu: int | None = None) -> None:
        out.append({"name": name, "verdict": verdict, "gpu": gpu, "text": text})

    for index, n in sorted(devices["gpus"].items()):
        if not n["ok"]:
            add(_reasons.DEVICE_MISSING, _health.RESET_GPU, f"{n['why']}: CUDA cannot use GPU {index} here; pass its device file into the container", index)
    if not devices["ctl"]["ok"]:
        add(_reasons.DEVICE_MISSING, _health.RESET_GPU, f"{devices['ctl']['why']}: no CUDA program can start")
    if not devices["uvm"]["ok"]:
        major = f" (major {devices['uvm_major']} here: dynamic, not 195)" if devices.get("uvm_major") else ""
        add(
            _reasons.UVM_MISSING,
            _health.RESET_GPU,
            f"{devices['uvm']['why']}: NVML works without it but every CUDA start fails; load nvidia-uvm on the host (nvidia-modprobe -u -c=0)"
            f" and pass /dev/nvidia-uvm{major} into the container",
        )
    if not devices["uvm_tools"]["ok"]:
        add(UVM_TOOLS_MISSING, _health.OK, f"{devices['uvm_tools']['why']}: CUDA starts, but profilers and debuggers (CUPTI, Nsight, cuda-gdb) will not")
    if devices["caps"] is not None and not devices["caps"]["ok"]:
        add(
            CAPS_MISSING,
            _health.RESET_GPU,
            f"{devices['caps']['why']}: MIG is on and CUDA needs the MIG capability devices to use its instances; pass /dev/nvidia-caps through",
        )
    if devices["nvml_count"] and devices["gpu_files"] != devices["nvml_count"]:
        add(
            DEVICE_COUNT,
            _health.OK,
            f"NVML lists {devices['nvml_count']} GPU(s) and {devices['dir']} holds {devices['gpu_files']} GPU device file(s) (DCGM's device count check)",
        )
    for index, on in sorted(persistence.items()):
        if on is False:
            add(
                PERSISTENCE_OFF,
                _health.OK,
                f"GPU {index}: persistence mode is off: every start re-initialises the GPU (seconds); run nvidia-persistenced",
                index,
            )
    for var in env["found"]:
        add(
            CUDA_ENV,
            _health.RESTART_APP,
            f"{var['name']} is set in {var['where']} ({var['value']!r}): CUDA programs started with it load a profiler or debugger hook, or dump core"
            " and wait on an exception; remove it",
        )
    for index, valid in sorted(inforom.items()):
        if valid is False:
            add(
                INFOROM_CORRUPT,
                _health.DRAIN,
                f"GPU {index}: the infoROM is corrupted (nvmlDeviceValidateInforom): its ECC and retirement records cannot be trusted;"
                " have it reflashed (NVIDIA support)",
                index,
            )
    return out
