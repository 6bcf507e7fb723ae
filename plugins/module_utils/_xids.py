# Copyright (c) 2026, gpuops.clean_slate maintainers
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# Note: this module_util is PRIVATE to the collection; it may change without notice.

"""NVIDIA's Xid catalog as data: for each Xid the health verdict reads, its resolution bucket, what it means and
where the bucket comes from. Data only; :func:`._health.xid_bucket` reads it.

NVIDIA's Xid catalog gives each Xid a "resolution bucket", the immediate action
(https://docs.nvidia.com/deploy/xid-errors/analyzing-xid-catalog.html): ``RESTART_APP``, ``RESET_GPU``,
``RESTART_BM`` (reboot the bare-metal node), ``CONTACT_SUPPORT`` / ``CHECK_MECHANICALS`` (service: drain) and
``IGNORE``. An Xid the table does not list is not guessed harmless: it is ``UNKNOWN``, which the verdict counts as
a reset, and says so.
"""

from __future__ import annotations

import typing as t

#: Where the catalog lives.
CATALOG_URL = "https://docs.nvidia.com/deploy/xid-errors/analyzing-xid-catalog.html"

IGNORE = "IGNORE"
RESTART_APP = "RESTART_APP"
RESET_GPU = "RESET_GPU"
RESTART_BM = "RESTART_BM"
CONTACT_SUPPORT = "CONTACT_SUPPORT"
DRAIN_P2P = "DRAIN_P2P"
UNKNOWN = "UNKNOWN"
#: Every bucket an event can carry.
BUCKETS = (IGNORE, RESTART_APP, RESET_GPU, RESTART_BM, CONTACT_SUPPORT, DRAIN_P2P, UNKNOWN)


class Xid(t.NamedTuple):
    """One Xid of the catalog: its bucket, what it means, and the source of the bucket."""

    bucket: str
    meaning: str
    source: str


_CATALOG = "NVIDIA Xid catalog"
_K8S = "NVIDIA Xid catalog; k8s-device-plugin (NVIDIA/k8s-device-plugin#1340: application-level)"
_NEXT = "NVIDIA Xid catalog; next-start-facts §4"
_GPUD = "NVIDIA Xid catalog; leptonai/gpud PR#80"

XIDS: dict[int, Xid] = {
    # Application errors: the GPU is fine once the application is gone.
    8: Xid(RESTART_APP, "GPU stopped processing (channel timeout)", _CATALOG),
    13: Xid(RESTART_APP, "graphics engine exception (an illegal access in a kernel)", _K8S),
    31: Xid(RESTART_APP, "GPU memory page fault", _K8S),
    32: Xid(RESTART_APP, "invalid or corrupted push buffer stream", _CATALOG),
    43: Xid(RESTART_APP, "GPU stopped processing (the channel was reset)", _K8S),
    45: Xid(RESTART_APP, "preemptive cleanup: the driver ended the channels of a process that ended", _K8S),
    68: Xid(RESTART_APP, "NVDEC0 exception", _K8S),
    69: Xid(RESTART_APP, "graphics engine class error", _CATALOG),
    94: Xid(RESTART_APP, "contained ECC error: only the application that touched the memory was ended", _CATALOG),
    109: Xid(RESTART_APP, "context switch timeout", _K8S),
    # Informational: corrected errors.
    92: Xid(IGNORE, "high single-bit ECC error rate (corrected)", _CATALOG),
    # The GPU needs a reset.
    38: Xid(RESET_GPU, "driver firmware error", _CATALOG),
    44: Xid(RESET_GPU, "graphics engine fault during context switch", _CATALOG),
    48: Xid(RESET_GPU, "double-bit ECC error", _NEXT),
    57: Xid(RESET_GPU, "error programming video memory interface", _CATALOG),
    61: Xid(RESET_GPU, "internal micro-controller breakpoint/warning", _CATALOG),
    62: Xid(RESET_GPU, "internal micro-controller halt", _CATALOG),
    63: Xid(RESET_GPU, "row remapping pending: takes effect at the next GPU reset", _GPUD),
    74: Xid(RESET_GPU, "NVLink error", _CATALOG),
    95: Xid(RESET_GPU, "uncontained ECC error", _CATALOG),
    119: Xid(RESET_GPU, "GSP RPC timeout", _CATALOG),
    120: Xid(RESET_GPU, "GSP error", _CATALOG),
    121: Xid(RESET_GPU, "C2C link corrected error", _CATALOG),
    140: Xid(RESET_GPU, "unrecovered ECC error", _CATALOG),
    143: Xid(RESET_GPU, "GPU initialisation failure", _CATALOG),
    144: Xid(RESET_GPU, "NVLink SAW error", _CATALOG),
    145: Xid(RESET_GPU, "NVLink RLW error", _CATALOG),
    146: Xid(RESET_GPU, "NVLink TLW error", _CATALOG),
    147: Xid(RESET_GPU, "NVLink TREX error", _CATALOG),
    148: Xid(RESET_GPU, "NVLink NVLPW_CTRL error", _CATALOG),
    149: Xid(RESET_GPU, "NVLink NETIR error", _CATALOG),
    150: Xid(RESET_GPU, "NVLink MSE error", _CATALOG),
    # The node must be rebooted.
    79: Xid(RESTART_BM, "GPU has fallen off the bus", _CATALOG),
    # Service: field diagnosis, likely an RMA.
    64: Xid(CONTACT_SUPPORT, "row remapping failure", _GPUD),
}

#: Xid 154 ("GPU recovery action changed from 0x0 (None) to 0x1 (GPU Reset Required)") carries the new recovery
#: action in its text: the bucket of each action NVML names (``_nvml.RECOVERY_ACTIONS``); any other reads RESET_GPU.
XID154_BUCKETS = {"none": IGNORE, "gpu_reset": RESET_GPU, "node_reboot": RESTART_BM, "drain_p2p": DRAIN_P2P, "drain_and_reset": DRAIN_P2P}
