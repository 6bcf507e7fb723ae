# Copyright (c) 2026, gpuops.clean_slate maintainers
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# Note: this module_util is PRIVATE to the collection; it may change without notice.

"""NVIDIA's Xid catalog as data: for each Xid the health verdict reads, its resolution bucket, what it means and
where the bucket comes from. Data only; :func:`._health.xid_bucket` reads it.

The catalog (:data:`CATALOG`) gives each Xid of Ampere and newer GPUs a "resolution bucket", its immediate action:
``IGNORE``, ``RESTART_APP``, ``RESET_GPU``, ``RESTART_BM`` (reboot the bare-metal node), ``CONTACT_SUPPORT`` and
``CHECK_MECHANICALS`` (service: drain), ``UPDATE_SWFW`` (the driver software: a configuration fault, fix_config),
``RESTART_VM``, or a workflow that decodes the event further (45, 48, 74, 144-150, 154, 159). Each entry here is the
catalog's immediate action; for a workflow, the bucket its text gives and the reason, in the entry's ``source``. The
Xids the catalog marks "Unused" on these GPUs are its ``CONTACT_SUPPORT`` (:data:`UNUSED`). Not listed, and so
``UNKNOWN`` (which the verdict counts as a reset, and says so): those the catalog gives no action yet (162-172) and any
newer one. An Xid this table does not know is never guessed harmless.

Held against NVIDIA's NVSentinel (:data:`NVSENTINEL`), which reads the same catalog edition and maps its buckets to
actions: it agrees on every Xid but where noted in the entries' sources (74, 144-150, 154's texts, 78, 159) and on the
unknown ones (its ``CONTACT_SUPPORT``, where this table says ``reset_gpu``: the catalog's word for an Xid it does not
list is none, and a reset is the smallest step that a workflow can try and the verification then judge again).
"""

from __future__ import annotations

import typing as t

#: The catalog read, named by what it holds (the page carries no version or date of its own).
CATALOG = (
    "NVIDIA's Xid catalog for Ampere and newer GPUs (docs.nvidia.com/deploy/xid-errors/analyzing-xid-catalog.html and its"
    " Xid-Catalog.xlsx, modified 2025-09-30), the edition that lists Xids 1 to 172 with driver linkage up to R575 / CUDA 12.9,"
    " read 2026-12-02 and 2026-12-05"
)
#: The mapping this table was held against (its syslog health monitor's MapActionStringToProto over the same catalog).
NVSENTINEL = "NVIDIA/NVSentinel main at 42672ae (2026-08-21; platform v1.8.0), pkg/common/common.go, read 2026-12-05"

IGNORE = "IGNORE"
RESTART_APP = "RESTART_APP"
RESET_GPU = "RESET_GPU"
RESTART_BM = "RESTART_BM"
CONTACT_SUPPORT = "CONTACT_SUPPORT"
CHECK_MECHANICALS = "CHECK_MECHANICALS"
DRAIN_P2P = "DRAIN_P2P"
UPDATE_SWFW = "UPDATE_SWFW"
RESTART_VM = "RESTART_VM"
UNKNOWN = "UNKNOWN"
#: Every bucket an event can carry.
BUCKETS = (IGNORE, RESTART_APP, RESET_GPU, RESTART_BM, RESTART_VM, UPDATE_SWFW, CONTACT_SUPPORT, CHECK_MECHANICALS, DRAIN_P2P, UNKNOWN)


class Xid(t.NamedTuple):
    """One Xid of the catalog: its bucket, what it means, and where the bucket comes from."""

    bucket: str
    meaning: str
    source: str


# Sources. "catalog" is the catalog's immediate action for the Xid, as printed; the others say where this table
# reads it otherwise, and why.
CAT = "catalog"
K8S = "catalog; NVIDIA's k8s-device-plugin ignores it too (internal/rm/health.go)"
K8S_109 = (
    "catalog (RESET_GPU, linked to driver R570); NVIDIA's k8s-device-plugin ignores it (internal/rm/health.go) as an"
    " application error: the catalog, the newer and more careful word, is followed"
)
XID_45 = (
    "catalog: WORKFLOW_XID_45 (with other Xids, follow them; alone, restart nvidia-fabricmanager, whose state the"
    " health verdict reads on its own); every SIGKILLed CUDA process logs it; k8s-device-plugin ignores it"
)
XID_48 = "catalog: WORKFLOW_XID_48 (a GPU reset or node reboot clears it; SRAM over threshold: RMA flow)"
XID_74 = 'catalog: WORKFLOW_NVLINK_ERR ("a GPU reset or node reboot is needed to clear this error")'
NVLINK5_MIXED = "catalog: WORKFLOW_NVLINK5_ERR, decoded by subcode (IGNORE to RESET_GPU): without the decode, its worst, RESET_GPU"
NVLINK5_IGNORE = "catalog: WORKFLOW_NVLINK5_ERR, every subcode of which is IGNORE"
UNUSED_SOURCE = "catalog: Unused on these GPUs, CONTACT_SUPPORT (NVSentinel: CONTACT_SUPPORT)"
XID_78 = (
    "catalog: UPDATE_SWFW (a guest driver incompatible with the host's, a vGPU type not supported: the software, not the GPU;"
    " NVSentinel: CONTACT_SUPPORT, a human decides)"
)
XID_159 = (
    'catalog: CHECK_UVM ("if UVM/vGPU is being utilized, RESET_GPU; otherwise IGNORE"): every CUDA context uses UVM, so RESET_GPU; NVSentinel: CONTACT_SUPPORT'
)
#: The Xids the catalog marks "Unused" on Ampere and newer GPUs: its immediate action is CONTACT_SUPPORT.
UNUSED = (
    *range(1, 8),
    9,
    10,
    12,
    *range(15, 25),
    *range(26, 31),
    *range(33, 37),
    42,
    47,
    *range(49, 54),
    *range(55, 60),
    61,
    65,
    73,
    81,
    87,
    90,
    91,
    *range(111, 119),
    *range(122, 126),
    138,
)

XIDS: dict[int, Xid] = {
    # The application's fault: the GPU is fine once the application is gone.
    8: Xid(RESTART_APP, "GPU stopped processing (channel idle timeout)", CAT),
    11: Xid(RESTART_APP, "invalid or corrupted push buffer stream", CAT),
    13: Xid(RESTART_APP, "graphics engine exception (an out-of-bounds access or illegal instruction in a kernel)", K8S),
    25: Xid(RESTART_APP, "invalid or illegal push buffer stream", CAT),
    31: Xid(RESTART_APP, "GPU memory page fault (an illegal address)", K8S),
    32: Xid(RESTART_APP, "invalid or corrupted push buffer stream (DMA controller fault)", CAT),
    39: Xid(RESTART_APP, "copy engine exception (CE0)", CAT),
    40: Xid(RESTART_APP, "copy engine exception (CE1)", CAT),
    41: Xid(RESTART_APP, "copy engine exception (CE2)", CAT),
    60: Xid(RESTART_APP, "video processor exception (SEC2)", CAT),
    68: Xid(RESTART_APP, "NVDEC0 exception", K8S),
    69: Xid(RESTART_APP, "graphics engine class error", CAT),
    70: Xid(RESTART_APP, "copy engine error (CE3)", CAT),
    71: Xid(RESTART_APP, "copy engine error (CE4)", CAT),
    72: Xid(RESTART_APP, "copy engine error (CE5)", CAT),
    75: Xid(RESTART_APP, "copy engine error (CE6)", CAT),
    76: Xid(RESTART_APP, "copy engine error (CE7)", CAT),
    77: Xid(RESTART_APP, "copy engine error (CE8)", CAT),
    80: Xid(RESTART_APP, "corrupted data sent to the GPU (push buffer CRC mismatch)", CAT),
    82: Xid(RESTART_APP, "NVJPG0 error", CAT),
    83: Xid(RESTART_APP, "NVDEC1 error", CAT),
    84: Xid(RESTART_APP, "NVDEC2 error", CAT),
    85: Xid(RESTART_APP, "copy engine error (CE9)", CAT),
    86: Xid(RESTART_APP, "OFA exception", CAT),
    88: Xid(RESTART_APP, "NVDEC3 error", CAT),
    89: Xid(RESTART_APP, "NVDEC4 error", CAT),
    94: Xid(RESTART_APP, "contained memory error: only the application that touched the memory was ended", CAT),
    **{x: Xid(RESTART_APP, f"NVDEC{x - 91} error", CAT) for x in (96, 97, 98)},
    **{x: Xid(RESTART_APP, f"NVJPG{x - 98} error", CAT) for x in range(99, 106)},
    **{x: Xid(RESTART_APP, f"copy engine error (CE{x - 116})", CAT) for x in range(126, 136)},
    139: Xid(RESTART_APP, "OFA1 error", CAT),
    # Informational: nothing to do now.
    14: Xid(IGNORE, "fake or injected error from userspace", CAT),
    37: Xid(IGNORE, "driver firmware error (unimplemented firmware method)", CAT),
    38: Xid(IGNORE, "driver firmware error (watchdog timeout)", CAT),
    43: Xid(IGNORE, "GPU stopped processing: an application hit a software-induced fault and had to end; the GPU stays healthy", K8S),
    44: Xid(IGNORE, "graphics engine fault during context switch", CAT),
    45: Xid(IGNORE, "preemptive cleanup: the driver tore down the channels of an application that was aborted (Ctrl-C, SIGKILL, a reset)", XID_45),
    63: Xid(IGNORE, "GPU memory remapping event (a row was remapped; a pending remap is read from NVML and counts as reset_gpu)", CAT),
    66: Xid(IGNORE, "illegal access by the driver (register access violation)", CAT),
    67: Xid(IGNORE, "illegal access by the driver (verification violation)", CAT),
    92: Xid(IGNORE, "high single-bit ECC error rate (corrected)", CAT),
    93: Xid(IGNORE, "InfoROM wear limit reached (non-fatal)", CAT),
    106: Xid(IGNORE, "SMBPBI test message", CAT),
    107: Xid(IGNORE, "SMBPBI test message (silent)", CAT),
    108: Xid(IGNORE, "NVLink remote translation error (unused)", CAT),
    121: Xid(IGNORE, "C2C link corrected errors (Grace-Hopper/Blackwell): no operational impact", CAT),
    137: Xid(IGNORE, "NVLink privilege error (an illegal peer-to-peer access, usually the application's)", CAT),
    141: Xid(IGNORE, "CUDA fast path error", CAT),
    147: Xid(IGNORE, "NVLink TREX error", NVLINK5_IGNORE),
    148: Xid(IGNORE, "NVLink NVLPW_CTRL error", NVLINK5_IGNORE),
    157: Xid(IGNORE, "resource retirement failure (no repair possible; workloads may run)", CAT),
    160: Xid(IGNORE, "channel retirement event", CAT),
    161: Xid(IGNORE, "channel retirement failure", CAT),
    # The GPU needs a reset.
    46: Xid(RESET_GPU, "GPU stopped processing (GPU timeout)", CAT),
    48: Xid(RESET_GPU, "double-bit ECC error", XID_48),
    62: Xid(RESET_GPU, "internal micro-controller halt", CAT),
    64: Xid(RESET_GPU, "GPU memory remapping failure (the catalog's investigatory action: contact support)", CAT),
    74: Xid(RESET_GPU, "NVLink error", XID_74),
    95: Xid(RESET_GPU, "uncontained memory error: every application on the GPU is affected", CAT),
    109: Xid(RESET_GPU, "context switch timeout", K8S_109),
    110: Xid(RESET_GPU, "security fault", CAT),
    119: Xid(RESET_GPU, "GSP RPC timeout", CAT),
    120: Xid(RESET_GPU, "GSP error", CAT),
    136: Xid(RESET_GPU, "NVLink link training failed", CAT),
    140: Xid(RESET_GPU, "unrecovered ECC error", CAT),
    143: Xid(RESET_GPU, "GPU initialisation error", CAT),
    144: Xid(RESET_GPU, "NVLink SAW error", NVLINK5_MIXED),
    145: Xid(RESET_GPU, "NVLink RLW error", NVLINK5_MIXED),
    146: Xid(RESET_GPU, "NVLink TLW error", NVLINK5_MIXED),
    149: Xid(RESET_GPU, "NVLink NETIR error (link fatal)", NVLINK5_MIXED),
    150: Xid(RESET_GPU, "NVLink MSE error", NVLINK5_MIXED),
    155: Xid(RESET_GPU, "NVLink software-defined error (a link taken down on purpose)", CAT),
    156: Xid(RESET_GPU, "resource retirement event", CAT),
    158: Xid(RESET_GPU, "GPU fatal timeout", CAT),
    # The node must be rebooted.
    79: Xid(RESTART_BM, "GPU has fallen off the bus", CAT),
    159: Xid(RESET_GPU, "UVM or vGPU error", XID_159),
    # The software, not the GPU: a configuration fault.
    78: Xid(UPDATE_SWFW, "vGPU start error (a guest driver the host's does not support)", XID_78),
    # A virtual machine's restart (confidential computing's key rotation): a reboot where the GPU is a VM's.
    151: Xid(RESTART_VM, "key rotation error (confidential computing)", CAT),
    **{x: Xid(IGNORE, "applies to no data-center GPU", CAT) for x in (152, 153)},
    # Service: keep the node out until someone has looked.
    54: Xid(CHECK_MECHANICALS, "auxiliary power is not connected to the GPU board", CAT),
    142: Xid(CONTACT_SUPPORT, "NVENC3 error", CAT),
    **{x: Xid(CONTACT_SUPPORT, "an Xid the catalog marks unused on Ampere and newer GPUs: something no one expects", UNUSED_SOURCE) for x in UNUSED},
}

#: Xid 154 ("GPU recovery action changed from 0x0 (None) to 0x1 (GPU Reset Required)") carries the new recovery
#: action in its text (catalog: XID_154): the bucket of each action NVML names (``_nvml.RECOVERY_ACTIONS``); any
#: other reads RESET_GPU.
XID154_BUCKETS = {"none": IGNORE, "gpu_reset": RESET_GPU, "node_reboot": RESTART_BM, "drain_p2p": DRAIN_P2P, "drain_and_reset": DRAIN_P2P}

#: The Xids NVIDIA's k8s-device-plugin treats as the application's (it never marks a GPU unhealthy for them),
#: as its internal/rm/health.go lists them (commit 02597b9). Kept to hold the table to it: each is IGNORE or
#: RESTART_APP here, but 109, where the catalog says RESET_GPU.
K8S_DEVICE_PLUGIN_IGNORED = (13, 31, 43, 45, 68, 109)
