# Copyright (c) 2026, gpuops.clean_slate maintainers
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# Note: this module_util is PRIVATE to the collection; it may change without notice.

"""Every ``reason`` a module of this collection can fail with, in one place.

A failed module result always has the same shape (the user guide's "What a red
run means" lists every reason with what to do):

``reason``
    One of the constants below: machine-readable, stable, what the role, AWX
    workflows and alerts branch on.
``msg``
    A sentence saying what happened and what to do.
the details
    Keys that say more about this failure: ``option`` (the option a
    ``bad_arguments`` refusal is about, where one is), ``exception`` (the
    traceback of an ``internal_error`` or ``missing_library``, which Ansible
    returns when asked for error tracebacks, ``ANSIBLE_DISPLAY_TRACEBACK=error``), and each module's own result keys (``targets`` of
    ``gpu_procs_kill``, ``gpus`` of ``gpu_mem_verify``, ``cmd`` of ``pct_exec``...).

Nothing else in ``plugins/`` spells a reason out; a unit test
(tests/unit/plugins/module_utils/test__reasons.py) holds the code, the modules'
documentation and the user guide to that.
"""

from __future__ import annotations

# ---------------------------------------------------------------------- every module
#: Refused before anything was done: a bad option value (Ansible's own argument checks included).
BAD_ARGUMENTS = "bad_arguments"
#: A Python library the module needs is not installed for the target's interpreter.
MISSING_LIBRARY = "missing_library"
#: A bug: an unexpected exception, its traceback kept in ``exception``.
INTERNAL_ERROR = "internal_error"

#: The umbrella module (clean_slate_node) was asked to end processes on GPUs it did not read first.
GPUS_NOT_READ = "gpus_not_read"

# ---------------------------------------------------------------------- containers (pct, lxc-info)
#: The container exists but does not run (or its init cannot be seen from here).
NOT_RUNNING = "not_running"
#: No such container on this node (a container of another cluster node included).
NO_SUCH_CONTAINER = "no_such_container"
#: pct (or sudo in front of it) failed otherwise, or there is no pct on the node.
PCT_FAILED = "pct_failed"

# ---------------------------------------------------------------------- pct_exec
#: The command exited with a non-zero status.
COMMAND_FAILED = "command_failed"
#: The command ran past its time limit and was killed where it ran. Also NVML's answer when the driver times out.
TIMEOUT = "timeout"

# ---------------------------------------------------------------------- gpu_procs_kill
#: Neither NVML nor the device files can find GPU processes, and name-only matching was not allowed.
NO_DISCOVERY_SOURCE = "no_discovery_source"
#: A target survived SIGKILL (stuck in the kernel, usually in the driver).
UNKILLABLE = "unkillable"
#: Processes were still found when the kill's deadline had passed.
HOLDERS_REMAIN = "holders_remain"

# ---------------------------------------------------------------------- gpu_mem_verify
#: A selected GPU is not clean at the deadline (each GPU's ``diagnosis`` says why).
NOT_CLEAN = "not_clean"
#: Fewer healthy GPUs than ``expected_count``.
MISSING_GPUS = "missing_gpus"
#: The memory is clean, but the health verdict (``health.verdict``) is at or above ``fail_on``; ``health.evidence`` says why.
UNHEALTHY = "unhealthy"
#: Every GPU is clean and startable alone, but not together: a pair's peer copies broken or hanging, the peer check
#: unproven, or peer access unsupported where ``peers_required`` says the server needs it (``together.findings`` say which).
NOT_READY_TOGETHER = "not_ready_together"

# ---------------------------------------------------------------------- gpu_mode_restore
#: A declared value did not take (the compute mode reads otherwise, or the MPS daemon survived its deadline).
RESTORE_FAILED = "restore_failed"

# ---------------------------------------------------------------------- NVML: the GPUs cannot be read
LIBRARY_NOT_FOUND = "library_not_found"
DRIVER_NOT_LOADED = "driver_not_loaded"
DRIVER_LIBRARY_MISMATCH = "driver_library_mismatch"
NO_PERMISSION = "no_permission"
NOT_SUPPORTED = "not_supported"
GPU_LOST = "gpu_lost"
NEEDS_RESET = "needs_reset"
NVML_ERROR = "nvml_error"
#: An NVML call did not return within ``probe_timeout`` (the driver is hung): the helper process making it was
#: killed. For the driver as a whole (nvmlInit, a system call) a module failure; for one GPU its diagnosis.
DRIVER_HUNG = "driver_hung"

# ---------------------------------------------------------------------- gpu_job_residue
PORT_IN_USE = "port_in_use"
PORT_CONNECTED = "port_connected"
PORT_TIME_WAIT = "port_time_wait"
REMOVE_FAILED = "remove_failed"
SCAN_INCOMPLETE = "scan_incomplete"

# ---------------------------------------------------------------------- the role (gpuops.clean_slate.clean_slate)
# A host's result (``clean_slate_result.reason``) is a module's reason, a GPU's diagnosis, or one of these.
#: A role variable was refused (the argument spec, an unknown clean_slate_* name, a value the modules refuse).
BAD_VARIABLE = "bad_variable"
#: The modules' Python lacks nvidia-ml-py, psutil or jmespath, and the role was not asked to install them.
MISSING_DEPENDENCIES = "missing_dependencies"
#: clean_slate_install_dependencies could not make the virtual environment or install into it.
DEPENDENCY_INSTALL_FAILED = "dependency_install_failed"
#: One of the user's clean_slate_before_kill_tasks failed (the GPUs were read; nothing was ended).
BEFORE_KILL_FAILED = "before_kill_failed"
#: The preflight could not read the GPUs (Ansible failed the module run: no Python there, a module failure).
GPUS_UNREADABLE = "gpus_unreadable"
#: The kill's plan, taken before the pre-stop commands, failed.
PRE_STOP_FAILED = "pre_stop_failed"
#: A phase failed without a reason of its own (a task Ansible failed).
KILL_FAILED = "kill_failed"
RESIDUE_FAILED = "residue_failed"
#: The node_exporter textfile could not be written on the node.
METRICS_NOT_WRITTEN = "metrics_not_written"
#: The JSON report could not be written on the controller.
REPORT_NOT_WRITTEN = "report_not_written"
#: The host (or the hypervisor of a container cleaned through it) did not answer.
UNREACHABLE = "unreachable"
#: Processes were ended, or nothing was read, but no verification ran (--tags/--skip-tags left it out).
NOT_VERIFIED = "not_verified"
#: Every read GPU is clean but fewer are visible than clean_slate_expected_gpus.
TOO_FEW_GPUS = "too_few_gpus"

# ---------------------------------------------------------------------- per-GPU diagnoses
# gpu_mem_verify's gpus[].diagnosis; the role reports the first dirty GPU's as its verify reason.
CLEAN = "clean"
BUSY = "busy"
HELD_BY_PROTECTED = "held_by_protected"
HELD_OUTSIDE_NAMESPACE = "held_outside_namespace"
ORPHANED_CONTEXT = "orphaned_context"
UNSUPPORTED = "unsupported"
UNRESPONSIVE = "unresponsive"

# ---------------------------------------------------------------------- startability (gpu_mem_verify's cuda_probe)
# A GPU NVML reads clean on which a CUDA start failed a moment before the verdict: its diagnosis, with the CUDA
# error code and what to do in its detail (gpus[].startable has the whole answer).
#: /dev/nvidia-uvm is absent or cannot be opened: NVML works, every CUDA start fails (cuInit: CUDA_ERROR_UNKNOWN).
UVM_MISSING = "uvm_missing"
#: The GPU's device file (or nvidiactl) is absent, another device's or refused here. Also gpu_mem_verify's failure when
#: NVML cannot open because nvidiactl is (a configuration fault, never a driver to reload).
DEVICE_MISSING = "device_missing"
#: libcuda.so.1 cannot be loaded: NVML works, no CUDA program can start.
NO_LIBCUDA = "no_libcuda"
#: CUDA_ERROR_DEVICE_UNAVAILABLE: exclusive_process mode with a context held elsewhere, or prohibited mode.
CUDA_BUSY = "cuda_busy"
#: CUDA_ERROR_OUT_OF_MEMORY: less memory can be allocated than a server asks for, whatever NVML reads free.
CUDA_OOM = "cuda_oom"
#: CUDA_ERROR_ECC_UNCORRECTABLE: an uncorrectable ECC error the GPU has not been reset from.
ECC_UNCORRECTABLE = "ecc_uncorrectable"
#: CUDA_ERROR_SYSTEM_NOT_READY: the NVLink fabric is not up (Fabric Manager has not completed).
FABRIC_NOT_READY = "fabric_not_ready"
#: The start did not finish within cuda_probe_timeout (a GPU wedged in the driver); its helper was killed.
CUDA_HUNG = "cuda_hung"
#: Any other CUDA error; the detail names the code and the call.
CUDA_ERROR = "cuda_error"
#: The probe's own context was still on the GPU after its helper ended.
CUDA_RESIDUE = "cuda_residue"
#: Container scope: the start could not be made inside the container (no python3 there, pct failed or timed out), so
#: nothing proves that a server can start there; the detail says why.
CUDA_UNPROVEN = "cuda_unproven"

# ---------------------------------------------------------------------- groups
#: What NVML's failures become (_nvml.NvmlError); the GPUs cannot be read, or one GPU cannot.
NVML = (
    LIBRARY_NOT_FOUND,
    DRIVER_NOT_LOADED,
    DRIVER_LIBRARY_MISMATCH,
    NO_PERMISSION,
    NOT_SUPPORTED,
    TIMEOUT,
    GPU_LOST,
    NEEDS_RESET,
    NVML_ERROR,
    DRIVER_HUNG,
)
#: Looking up a container's init (O(containers), pct_exec's container check).
CONTAINERS = (NOT_RUNNING, NO_SUCH_CONTAINER, PCT_FAILED)
#: What a failed CUDA start on a GPU is diagnosed as.
STARTABILITY = (
    UVM_MISSING,
    DEVICE_MISSING,
    NO_LIBCUDA,
    CUDA_BUSY,
    CUDA_OOM,
    ECC_UNCORRECTABLE,
    FABRIC_NOT_READY,
    CUDA_HUNG,
    CUDA_ERROR,
    CUDA_RESIDUE,
    CUDA_UNPROVEN,
)
#: gpu_mem_verify's per-GPU diagnoses, ``clean`` included.
DIAGNOSES = (
    CLEAN,
    BUSY,
    HELD_BY_PROTECTED,
    HELD_OUTSIDE_NAMESPACE,
    ORPHANED_CONTEXT,
    GPU_LOST,
    NEEDS_RESET,
    UNSUPPORTED,
    UNRESPONSIVE,
    DRIVER_HUNG,
    *STARTABILITY,
)

#: The role's own reasons (the others of a host's result are its modules' reasons and the GPUs' diagnoses).
ROLE = (
    BAD_VARIABLE,
    MISSING_DEPENDENCIES,
    DEPENDENCY_INSTALL_FAILED,
    BEFORE_KILL_FAILED,
    GPUS_UNREADABLE,
    PRE_STOP_FAILED,
    KILL_FAILED,
    RESIDUE_FAILED,
    METRICS_NOT_WRITTEN,
    REPORT_NOT_WRITTEN,
    UNREACHABLE,
    NOT_VERIFIED,
    TOO_FEW_GPUS,
)

#: The reasons each module can fail with; each module's RETURN documentation lists exactly these.
MODULES: dict[str, tuple[str, ...]] = {
    "gpu_procs_kill": (BAD_ARGUMENTS, MISSING_LIBRARY, INTERNAL_ERROR, *CONTAINERS, NO_DISCOVERY_SOURCE, UNKILLABLE, HOLDERS_REMAIN, *NVML),
    "gpu_mem_verify": (BAD_ARGUMENTS, MISSING_LIBRARY, INTERNAL_ERROR, NOT_CLEAN, MISSING_GPUS, UNHEALTHY, NOT_READY_TOGETHER, *NVML, DEVICE_MISSING),
    "gpu_job_residue": (BAD_ARGUMENTS, INTERNAL_ERROR, *CONTAINERS, PORT_IN_USE, PORT_CONNECTED, PORT_TIME_WAIT, REMOVE_FAILED, SCAN_INCOMPLETE),
    "clean_slate_node": (
        BAD_ARGUMENTS,
        MISSING_LIBRARY,
        INTERNAL_ERROR,
        GPUS_NOT_READ,
        *CONTAINERS,
        COMMAND_FAILED,
        NO_DISCOVERY_SOURCE,
        UNKILLABLE,
        HOLDERS_REMAIN,
        NOT_CLEAN,
        MISSING_GPUS,
        UNHEALTHY,
        NOT_READY_TOGETHER,
        *NVML,
        DEVICE_MISSING,
        PORT_IN_USE,
        PORT_CONNECTED,
        PORT_TIME_WAIT,
        REMOVE_FAILED,
        SCAN_INCOMPLETE,
        BUSY,
        RESTORE_FAILED,
        # A run that records why the role stopped the host before any phase (its ``stop`` option), and its metrics.
        BAD_VARIABLE,
        MISSING_DEPENDENCIES,
        DEPENDENCY_INSTALL_FAILED,
        METRICS_NOT_WRITTEN,
    ),
    "pct_exec": (BAD_ARGUMENTS, INTERNAL_ERROR, *CONTAINERS, COMMAND_FAILED, TIMEOUT),
    "gpu_mode_restore": (BAD_ARGUMENTS, MISSING_LIBRARY, INTERNAL_ERROR, BUSY, RESTORE_FAILED, *NVML),
}
