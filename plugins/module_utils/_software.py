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
import typing as t

from ansible_collections.gpuops.clean_slate.plugins.module_utils import _cuda, _cuda_program, _findings, _reasons

#: Findings that are no reason (the others are the startability reasons of the same cause).
UVM_TOOLS_MISSING = "uvm_tools_missing"
CAPS_MISSING = "caps_missing"
DEVICE_COUNT = "device_count"
PERSISTENCE_OFF = "persistence_off"
CUDA_ENV = "cuda_env"
INFOROM_CORRUPT = "inforom_corrupt"
#: Container scope: the container's device files could not be looked at (the program that does it could not run there).
DEVICES_UNCHECKED = "devices_unchecked"
OK_NODE: dict[str, t.Any] = {"ok": True, "why": None}

NOT_VISIBLE = (
    "a job's own environment (its systemd unit, its launcher script, the shell that started it) is not visible to the"
    " module: only its own, /etc/environment and PID 1's are read"
)
_NVML_ERROR_CORRUPTED_INFOROM = 14


#: The device files, looked at where the next start runs (:mod:`._cuda_program`, whose text also runs in a container).
node = _cuda_program.node
uvm_major = _cuda_program.uvm_major
device_nodes = _cuda_program.device_nodes


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
    """Every failed check as ``{name, verdict, gpu, text}`` (``gpu`` None for the host); warnings are ``ok``. The verdict of
    each is its row of ``_findings.FINDINGS`` (a device file absent, another device's or refused is ``fix_config``)."""
    out: list[dict[str, t.Any]] = []

    def add(name: str, text: str, gpu: int | None = None) -> None:
        out.append({"name": name, "verdict": _findings.FINDINGS[name].verdict, "gpu": gpu, "text": text})

    if devices.get("unchecked"):
        # Container scope, and the program that looks at the container's files could not run there.
        add(DEVICES_UNCHECKED, f"the device files were not checked: {devices['unchecked']}")
        devices = {**devices, "ctl": OK_NODE, "uvm": OK_NODE, "uvm_tools": OK_NODE, "caps": None, "gpu_files": 0, "nvml_count": 0}
    for index, n in sorted(devices["gpus"].items()):
        if not n["ok"]:
            add(_reasons.DEVICE_MISSING, f"{n['why']}: CUDA cannot use GPU {index} here", index)
    if not devices["ctl"]["ok"]:
        add(_reasons.DEVICE_MISSING, f"{devices['ctl']['why']}: no CUDA program can start")
    if not devices["uvm"]["ok"]:
        major = f" (nvidia-uvm's major is {devices['uvm_major']} here: dynamic, not 195)" if devices.get("uvm_major") else ""
        add(_reasons.UVM_MISSING, f"{devices['uvm']['why']}{major}: NVML works without it but every CUDA start fails")
    elif devices.get("uvm_loaded") is False:
        add(_reasons.UVM_MISSING, "the nvidia-uvm module is not loaded on this kernel (/proc/devices lists no nvidia-uvm): every CUDA start fails")
    if not devices["uvm_tools"]["ok"]:
        add(UVM_TOOLS_MISSING, f"{devices['uvm_tools']['why']}: CUDA starts, but profilers and debuggers (CUPTI, Nsight, cuda-gdb) will not")
    if devices["caps"] is not None and not devices["caps"]["ok"]:
        add(CAPS_MISSING, f"{devices['caps']['why']}: MIG is on and CUDA needs the MIG capability devices to use its instances")
    if devices["nvml_count"] and devices["gpu_files"] != devices["nvml_count"]:
        count = devices["nvml_count"]
        listed = f"{count} GPU(s) are selected for container {devices['container']}" if devices.get("container") else f"NVML lists {count} GPU(s)"
        add(DEVICE_COUNT, f"{listed} and {devices['dir']} holds {devices['gpu_files']} GPU device file(s) (DCGM's device count check)")
    for index, on in sorted(persistence.items()):
        if on is False:
            add(PERSISTENCE_OFF, f"GPU {index}: persistence mode is off: every start re-initialises the GPU (seconds)", index)
    for var in env["found"]:
        add(
            CUDA_ENV,
            f"{var['name']} is set in {var['where']} ({var['value']!r}): CUDA programs started with it load a profiler or debugger hook, or dump core"
            " and wait on an exception",
        )
    for index, valid in sorted(inforom.items()):
        if valid is False:
            add(INFOROM_CORRUPT, f"GPU {index}: the infoROM is corrupted (nvmlDeviceValidateInforom): its ECC and retirement records cannot be trusted", index)
    return out
