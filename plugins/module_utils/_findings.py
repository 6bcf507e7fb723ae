# Copyright (c) 2026, gpuops.clean_slate maintainers
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# Note: this module_util is PRIVATE to the collection; it may change without notice.

"""Every finding the modules can report, and what fixes it: one table, data only (beside the Xid catalog, :mod:`._xids`;
the names that are also failure reasons or diagnoses are :mod:`._reasons`' constants).

A finding is named (``name``, stable, machine-readable), put on the health verdict's scale (``verdict``) and given the
fix an on-call engineer applies (``fix``, one sentence), and where that fix is made (``where``). The verdict is what a
workflow branches on; ``where`` keeps apart what NVIDIA's tools keep apart (DCGM's CONFIG severity is not its RESET,
NVSentinel attaches an action to each Xid): a container's missing device file is fixed in its configuration, never by
a GPU reset.

The scale, best first: ``ok`` (a warning, the verdict unchanged), ``restart_app`` (the GPU works; an application or a
setting it left must be dealt with), ``fix_config`` (the node's or container's configuration or driver services: no
reset or reboot fixes it, and none is needed), ``reset_gpu``, ``reboot``, ``drain`` (keep the node out of service).
``verdict`` is ``READING`` where the reading itself carries it (an Xid's bucket in the catalog, the driver's recovery
action), and ``NONE`` for a memory diagnosis, which makes its GPU not clean without being a health finding.

``guide_clean_slate.rst`` ("What fixes each finding") shows this table; a unit test holds the two, and every finding
the code names, to one another.
"""

from __future__ import annotations

import typing as t

from ansible_collections.gpuops.clean_slate.plugins.module_utils import _reasons

# The verdicts (the scale is :data:`._health.VERDICTS`; a unit test holds these names to it).
OK = "ok"
RESTART_APP = "restart_app"
FIX_CONFIG = "fix_config"
RESET_GPU = "reset_gpu"
REBOOT = "reboot"
DRAIN = "drain"
#: The verdict comes with the reading (an Xid's catalog bucket, the driver's recovery action).
READING = "reading"
#: A memory diagnosis: the GPU is not clean; not a health finding.
NONE = ""

# Where the fix is made.
PROCESS = "process"  # a process or service on the node or in the container
APP = "application"  # the next start, or the settings the last job left
CONFIG = "configuration"  # the node's or container's configuration, packages or driver services
GPU = "gpu"  # the GPU itself: a reset
NODE = "node"  # the node: a reboot
SERVICE = "service"  # hardware service: field diagnosis, RMA, mechanics
NOTHING = "nothing"  # a warning, or what cannot be judged


class Finding(t.NamedTuple):
    """One finding: its verdict, where it is fixed, and the fix in one sentence."""

    verdict: str
    where: str
    fix: str


FINDINGS: dict[str, Finding] = {
    # ------------------------------------------------------------------ memory diagnoses (gpus[].diagnosis)
    _reasons.BUSY: Finding(
        NONE, PROCESS, "End the processes that hold it (the kill phase, gpuops.clean_slate.gpu_procs_kill) or stop the service that owns them."
    ),
    _reasons.HELD_BY_PROTECTED: Finding(
        NONE,
        PROCESS,
        "Stop the protected daemon through its service (systemctl stop nvidia-dcgm, ...), or take it off the protect list"
        " (clean_slate_unprotect) if it must go with the job.",
    ),
    _reasons.HELD_OUTSIDE_NAMESPACE: Finding(
        NONE, PROCESS, "Clean where the holders live: on the Proxmox host, with containers: [<vmid>], or inside the container that owns them."
    ),
    _reasons.ORPHANED_CONTEXT: Finding(
        RESET_GPU, GPU, "No process holds the memory: reset the GPU (nvidia-smi -r, as the reset plan says), or reboot the node."
    ),
    _reasons.NEEDS_RESET: Finding(
        RESET_GPU,
        GPU,
        "The driver asks for recovery before the GPU is used again: reset the GPU (nvidia-smi -r, as the reset plan says), or reboot if it asks for a reboot.",
    ),
    _reasons.UNSUPPORTED: Finding(
        NONE, NOTHING, "This GPU does not report its memory use (unified-memory platforms such as GB10): it cannot be verified by memory."
    ),
    _reasons.UNRESPONSIVE: Finding(RESET_GPU, GPU, "The driver timed out answering: check dmesg for Xid errors; reset the GPU or reboot the node."),
    _reasons.GPU_LOST: Finding(REBOOT, NODE, "The GPU fell off the bus (Xid 79): drain the node and reboot or power-cycle it."),
    _reasons.DRIVER_HUNG: Finding(REBOOT, NODE, "An NVML call never returned (the driver is hung): drain the node and reboot it."),
    # ------------------------------------------------------------------ the kill
    _reasons.UNKILLABLE: Finding(
        REBOOT, NODE, "A process is stuck in the kernel (usually the driver) and SIGKILL cannot end it: drain the node and reboot it."
    ),
    "gpus_not_listed": Finding(
        NONE,
        CONFIG,
        "Give the host every GPU it is expected to have: a GPU NVML does not list with its device file in place has fallen off the bus or was"
        " not passed through (check dmesg for Xid 79, lspci, and the container's configuration).",
    ),
    _reasons.HOLDERS_REMAIN: Finding(
        NONE, PROCESS, "Something keeps starting GPU processes: stop its service first (clean_slate_pre_stop_commands), then run again."
    ),
    # ------------------------------------------------------------------ health readings (gpu_mem_verify's health)
    "xid": Finding(
        READING, READING, "What NVIDIA's Xid catalog gives the Xid (its resolution bucket): restart the application, reset the GPU, reboot, or service."
    ),
    "recovery_action": Finding(READING, READING, "What the driver's recovery action asks for: a GPU reset, a reboot, or draining peer-to-peer traffic."),
    "row_remap_failure": Finding(
        DRAIN, SERVICE, "A row remapping failed: the memory cannot be repaired in the field; drain the node for NVIDIA's field diagnosis (RMA)."
    ),
    "row_remap_pending": Finding(RESET_GPU, GPU, "A row remapping is pending: it takes effect at the next GPU reset; reset the GPU."),
    "page_retirement_pending": Finding(RESET_GPU, GPU, "A page retirement is pending: it takes effect at the next GPU reset; reset the GPU."),
    "ecc_volatile": Finding(
        RESTART_APP, APP, "Uncorrectable ECC errors since the driver loaded: the application that met them must restart (the next start is that restart)."
    ),
    "fabric_incomplete": Finding(
        FIX_CONFIG, CONFIG, "The NVLink fabric is not up: start nvidia-fabricmanager (systemctl start nvidia-fabricmanager) and wait until it completes."
    ),
    "fabric_error": Finding(
        RESET_GPU, GPU, "The NVLink fabric setup completed with an error: reset the GPUs of the fabric together (see the reset plan), or reboot."
    ),
    "fabricmanager_not_running": Finding(
        FIX_CONFIG, CONFIG, "Start nvidia-fabricmanager and enable it at boot: the GPUs have an NVLink fabric that only it brings up."
    ),
    "compute_mode": Finding(RESTART_APP, APP, "Put the compute mode back to default (clean_slate_restore: {compute_mode: default})."),
    "mps_daemon": Finding(RESTART_APP, APP, "Stop the MPS daemon left behind (clean_slate_restore: {mps: stopped})."),
    "mig_pending": Finding(RESET_GPU, GPU, "A MIG mode change is pending: it takes effect at the next GPU reset; reset the GPU."),
    # ------------------------------------------------------------------ the CUDA start (gpus[].startable.reason)
    _reasons.UVM_MISSING: Finding(
        FIX_CONFIG,
        CONFIG,
        "Make /dev/nvidia-uvm the nvidia-uvm device where the start runs: load the module on the node (nvidia-modprobe -u -c=0); in an LXC"
        " container pass /dev/nvidia-uvm and /dev/nvidia-uvm-tools through with the major /proc/devices gives nvidia-uvm (it is dynamic),"
        " then restart the container.",
    ),
    _reasons.DEVICE_MISSING: Finding(
        FIX_CONFIG,
        CONFIG,
        "Give the start the GPU's own device file: pass /dev/nvidia<minor> and /dev/nvidiactl into the container (the node's major and minor,"
        " allowed by its device rules), or load the driver on the node.",
    ),
    _reasons.NO_LIBCUDA: Finding(
        FIX_CONFIG,
        CONFIG,
        "Make libcuda.so.1 the driver's, of the loaded kernel module's version, where the start runs: in a container install the node's driver"
        " version; on a node whose driver was upgraded, load the new kernel module (with nothing using the GPUs).",
    ),
    _reasons.CUDA_BUSY: Finding(
        RESTART_APP,
        APP,
        "End the process that holds a context where it runs (the node, or the container that owns it), or put the compute mode back to default.",
    ),
    _reasons.CUDA_OOM: Finding(
        RESET_GPU, GPU, "Memory no process explains cannot be allocated: reset the GPU (nvidia-smi -r, as the reset plan says) or reboot."
    ),
    _reasons.ECC_UNCORRECTABLE: Finding(
        RESET_GPU, GPU, "An uncorrectable ECC error the GPU has not been reset from: reset it; if it recurs, drain the node for field diagnosis."
    ),
    _reasons.FABRIC_NOT_READY: Finding(
        FIX_CONFIG,
        CONFIG,
        "The NVLink fabric is not up: start nvidia-fabricmanager (systemctl start nvidia-fabricmanager), wait for it to complete, run again.",
    ),
    _reasons.CUDA_HUNG: Finding(REBOOT, NODE, "A CUDA start hangs in the driver (often in UVM): check dmesg for Xid errors, drain the node and reboot it."),
    _reasons.CUDA_ERROR: Finding(RESET_GPU, GPU, "Check dmesg for Xid errors; reset the GPU (nvidia-smi -r, as the reset plan says) or reboot the node."),
    _reasons.CUDA_RESIDUE: Finding(RESET_GPU, GPU, "The probe's own context stayed on the GPU after its helper ended: check dmesg; reset the GPU or reboot."),
    _reasons.CUDA_UNPROVEN: Finding(
        FIX_CONFIG,
        CONFIG,
        "Let the start run inside the container: install python3 there and check pct; or clean it from inside (its own SSH), or set"
        " clean_slate_cuda_probe: false to accept NVML's word.",
    ),
    # ------------------------------------------------------------------ the software checks (DCGM level 1)
    "uvm_tools_missing": Finding(
        OK, NOTHING, "CUDA starts; pass /dev/nvidia-uvm-tools through only if profilers and debuggers (CUPTI, Nsight, cuda-gdb) must run."
    ),
    "caps_missing": Finding(FIX_CONFIG, CONFIG, "MIG is on and CUDA needs the MIG capability devices: pass /dev/nvidia-caps through."),
    "device_count": Finding(OK, NOTHING, "Check that every GPU the next server uses has its device file here (DCGM's device count check)."),
    "persistence_off": Finding(OK, NOTHING, "Run nvidia-persistenced, so that a start does not re-initialise the GPU (seconds)."),
    "cuda_env": Finding(
        FIX_CONFIG, CONFIG, "Remove the variable where it is set: CUDA programs started with it load a profiler or debugger hook, or dump core and wait."
    ),
    "inforom_corrupt": Finding(
        DRAIN, SERVICE, "The infoROM is corrupted: its ECC and retirement records cannot be trusted; drain the node and have it reflashed (NVIDIA support)."
    ),
    "devices_unchecked": Finding(
        OK, NOTHING, "The container's device files were not checked: let the check run inside it (python3 there), or check them by hand."
    ),
    # ------------------------------------------------------------------ ready together (issue 39: together.findings)
    # Peer access the driver does not offer is the host's topology or configuration (GPUs behind different root ports or
    # sockets, ACS redirecting peer traffic, a VM's passthrough, an IOMMU setting): no reset changes it. Reported as a
    # warning (ok) unless peers_required says the server needs it, then this verdict and red (not_ready_together).
    "p2p_unsupported": Finding(
        FIX_CONFIG,
        CONFIG,
        "Give the server GPUs that reach each other (nvidia-smi topo -p2p r), or allow peer access between them (ACS off on the PCIe"
        " switches, iommu=pt, the VM's or container's passthrough); until then start it with NCCL_P2P_DISABLE=1.",
    ),
    # Peer access offered and then broken (copies changed or hanging): the documented causes on PCIe are the host's (ACS
    # redirecting peer traffic to the root complex, the IOMMU, a VM's passthrough of the BARs), which a GPU reset does not
    # change; a broken NVLink shows in the GPUs' own nvlink findings (reset_gpu). Red whatever fail_on (not_ready_together).
    "p2p_broken": Finding(
        FIX_CONFIG,
        CONFIG,
        "Fix the peer path (ACS off on the PCIe switches, iommu=pt or off, the VM's passthrough; over NVLink, the GPUs' own NVLink findings"
        " say what), and until then start the server with NCCL_P2P_DISABLE=1 (vLLM: --disable-custom-all-reduce).",
    ),
    # Slower than the pair's link allows, with no link finding of its own: the route (through the CPUs' root complex or
    # their interconnect, ACS redirection) is configuration; a degraded link says so in its own finding with its verdict.
    "p2p_slow": Finding(
        FIX_CONFIG,
        CONFIG,
        "See the two GPUs' link findings (a degraded PCIe link or an NVLink down); without one, check the route between them (nvidia-smi topo -m:"
        " through the CPUs, ACS redirection) and put the server on GPUs that share a PCIe switch or NVLink.",
    ),
    # The check could not be made (its helper died or hung outside a pair) while every GPU started alone: not proven, so
    # not green; what hangs a process holding several GPUs is the driver's, which a reset (or a reboot) clears.
    "peers_unproven": Finding(RESET_GPU, GPU, "Check dmesg for Xid errors; reset the GPUs of the check (see the reset plan) or reboot, then run again."),
    "nvlink_inactive": Finding(
        RESET_GPU,
        GPU,
        "Reset the GPUs of the NVLink fabric together (see the reset plan) to retrain the links; a link that stays down needs field service (drain).",
    ),
    # The counters count since the driver loaded or the GPU was reset, and a reset clears them: over the threshold, reset;
    # counting up again after it, the link itself is bad (field service).
    "nvlink_errors": Finding(
        RESET_GPU, GPU, "Reset the GPUs (the counters start again from 0, the links retrain); if they count up again, drain the node for NVLink service."
    ),
    # A narrower link than the GPU and its slot allow is physical (the card's seating, a riser or cable, the slot): service.
    "pcie_width_degraded": Finding(
        DRAIN, SERVICE, "Drain the node and reseat the GPU (check its riser or cable and slot); a link that trains narrow again needs service."
    ),
    # A lower generation under load: a reboot retrains the link (and a BIOS may cap it); one that trains low again is physical.
    "pcie_gen_degraded": Finding(
        REBOOT, NODE, "Reboot to retrain the link and check the slot's generation in the BIOS; if it trains low again, reseat the GPU (service)."
    ),
    "clocks_slowdown": Finding(
        DRAIN,
        SERVICE,
        "Check the GPU's cooling (fans, airflow, inlet temperature) and power (the power brake comes from the power supply); drain until it clears.",
    ),
    "temperature_high": Finding(OK, NOTHING, "Check the cooling before the next job: the GPU is near its thermal limit already and will slow down under load."),
    "shm_low": Finding(
        FIX_CONFIG,
        CONFIG,
        "Give /dev/shm room (a larger tmpfs; for a container its shm size) or remove what fills it (the residue phase), then start the server.",
    ),
    "p2p_cache_stale": Finding(
        RESTART_APP,
        APP,
        "Remove the file (the role does with residue removal on: peers_cache: remove): vLLM tests again and stops trusting a broken peer path.",
    ),
}

#: The Xid catalog's buckets (:data:`._xids.BUCKETS`) on the scale, for ``xid`` findings.
XID_BUCKETS = {
    "IGNORE": OK,
    "RESTART_APP": RESTART_APP,
    "UPDATE_SWFW": FIX_CONFIG,
    "RESET_GPU": RESET_GPU,
    "RESTART_BM": REBOOT,
    "RESTART_VM": REBOOT,
    "CONTACT_SUPPORT": DRAIN,
    "CHECK_MECHANICALS": DRAIN,
    "DRAIN_P2P": DRAIN,
    "UNKNOWN": RESET_GPU,
}
