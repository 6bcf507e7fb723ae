"""The node description file (``$GPUSIM_STATE/node.conf``).

A flat ``key=value`` text file, easy to parse in C. gpusim writes it; the
simulated libnvidia-ml reads it on nvmlInit and re-reads it whenever it is
replaced (every write is a rename, so the library notices a new inode), and
the driver daemon reads it for capacity and release timing. Faults live in the
same file, so switching one on at runtime reaches every running NVML client.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field, fields
from pathlib import Path

#: PCI bus numbers of the 8 GPUs of an HGX H100/H200 baseboard.
HGX_BUSES = [0x18, 0x2A, 0x3A, 0x5D, 0x9A, 0xAB, 0xBA, 0xDB]
H200_PCI_DEVICE_ID = 0x233510DE  # device 0x2335, vendor 0x10DE
H200_PCI_SUBSYSTEM_ID = 0x18BE10DE

PROCESS_APIS = ("v1", "v2", "v3")
#: Device memory a live CUDA context costs beyond what NVML charges its process: a torch process
#: listed with 518 MiB used 527 MiB device-wide on an H200 (gpu-facts §4b).
CONTEXT_OVERHEAD_MIB = 9


@dataclass
class GpuSpec:
    """One GPU as the node describes it."""

    index: int
    name: str
    uuid: str
    pci_bus_id: str
    minor: int
    total_mib: int
    reserved_mib: int
    mig_mode: int = 0  #: 1: MIG on (processes carry GPU/compute instance ids, per-process memory N/A)
    pci_device_id: int = H200_PCI_DEVICE_ID
    pci_subsystem_id: int = H200_PCI_SUBSYSTEM_ID
    # Health (issue 12): what NVML reports besides memory. None for features: derived from the name.
    features: list[str] | None = None
    persistence: int = 1
    mig_pending: int | None = None  #: None: the same as mig_mode (no change pending)
    remap_correctable: int = 0
    remap_uncorrectable: int = 0
    remap_pending: int = 0
    remap_failure: int = 0
    retired_sbe: int = 0
    retired_dbe: int = 0
    retired_pending: int = 0
    ecc_volatile_uncorrected: int = 0
    fabric_state: int = 3  #: nvmlGpuFabricState_t: 0 not supported, 1 not started, 2 in progress, 3 completed
    fabric_status: int = 0  #: the nvmlReturn_t of the fabric setup
    #: An uncorrectable ECC error the GPU could not contain (Xid 95): until a reset every new context fails
    #: with CUDA_ERROR_ECC_UNCORRECTABLE (214), while NVML still lists the GPU.
    ecc_uncontained: int = 0
    inforom_corrupt: int = 0  #: nvmlDeviceValidateInforom answers NVML_ERROR_CORRUPTED_INFOROM
    # Links, clocks and temperature (issue 39). None: what the model has (model_links()).
    nvlinks: int | None = None  #: NVLink links (0: none, every NVLink call NOT_SUPPORTED)
    nvlink_version: int | None = None  #: nvmlNvlinkVersion_t (6: NVLink 4.0, Hopper; 7: 5.0, Blackwell)
    nvlink_remote: int = 2  #: nvmlIntNvLinkDeviceType_t of the links' far end: 2, the baseboard's NVSwitches
    nvlink_down: list[int] = field(default_factory=list)  #: inactive links
    #: NVLink error counters since the driver loaded: counter ("replay", "recovery", "crc_flit", "crc_data") -> {link: n}
    nvlink_errors: dict[str, dict[int, int]] = field(default_factory=dict)
    pcie_gen_gpu_max: int | None = None  #: what the GPU supports
    pcie_gen_max: int | None = None  #: what the GPU and its slot allow (None: the GPU's)
    pcie_gen: int | None = None  #: what the link trained at, read while the GPU is busy (None: the maximum)
    pcie_gen_idle: int | None = None  #: what an idle GPU lowers its link to (0: it does not; None: the model's habit)
    pcie_width_max: int = 16
    pcie_width: int | None = None  #: what the link trained at (None: the maximum)
    clocks_event_reasons: int = 0  #: nvmlClocksEventReason* bits besides GpuIdle (which the library adds while idle)
    temperature: int = 44  #: the die's, C (an idle H200: 44 C)
    temp_limit: int = 87  #: T.Limit, the maximum operating temperature (the H200's margin read 43 C at 44 C)

    def feature_list(self) -> list[str]:
        return list(self.features) if self.features is not None else model_features(self.name)

    def links(self) -> dict[str, int]:
        """The link fields with the model's defaults filled in."""
        model = model_links(self.name)
        gen_gpu = self.pcie_gen_gpu_max if self.pcie_gen_gpu_max is not None else model["pcie_gen"]
        gen_max = self.pcie_gen_max if self.pcie_gen_max is not None else gen_gpu
        return {
            "nvlinks": self.nvlinks if self.nvlinks is not None else model["nvlinks"],
            "nvlink_version": self.nvlink_version if self.nvlink_version is not None else model["nvlink_version"],
            "pcie_gen_gpu_max": gen_gpu,
            "pcie_gen_max": gen_max,
            "pcie_gen": self.pcie_gen if self.pcie_gen is not None else gen_max,
            "pcie_gen_idle": self.pcie_gen_idle if self.pcie_gen_idle is not None else model["pcie_gen_idle"],
            "pcie_width": self.pcie_width if self.pcie_width is not None else self.pcie_width_max,
        }


#: Health fields of GpuSpec that Node.set_health() changes, and their node.conf keys (the same names).
HEALTH_FIELDS = (
    "persistence",
    "mig_pending",
    "remap_correctable",
    "remap_uncorrectable",
    "remap_pending",
    "remap_failure",
    "retired_sbe",
    "retired_dbe",
    "retired_pending",
    "ecc_volatile_uncorrected",
    "fabric_state",
    "fabric_status",
    "ecc_uncontained",
    "inforom_corrupt",
)
FEATURES = ("ecc", "remap", "retired", "fabric", "mig")
#: Link fields of GpuSpec that Node.set_links() changes (node.conf keys of the same names).
LINK_FIELDS = (
    "nvlinks",
    "nvlink_version",
    "nvlink_remote",
    "nvlink_down",
    "nvlink_errors",
    "pcie_gen_gpu_max",
    "pcie_gen_max",
    "pcie_gen",
    "pcie_gen_idle",
    "pcie_width_max",
    "pcie_width",
    "clocks_event_reasons",
    "temperature",
    "temp_limit",
)
NVLINK_COUNTERS = ("replay", "recovery", "crc_flit", "crc_data")


def model_links(name: str) -> dict[str, int]:
    """What a GPU model's links are (NVIDIA's data sheets): the SXM modules of an HGX baseboard have 18 NVLink links
    to its NVSwitches (H100/H200: NVLink 4, 25 GB/s a link and direction; B200: NVLink 5, 50 GB/s), an A100 SXM 12
    (NVLink 3), a V100 SXM 6 (NVLink 2); PCIe cards (RTX, L40S, the PCIe H100 without its bridge) none. PCIe 5 from
    Hopper and Blackwell on, 4 for Ampere, 3 before. A data-centre module keeps its link's generation at idle (the
    H200 read Gen5 idle, docs/results/nvidia-smi-q-h200x1-2026-12-01.txt); a workstation or consumer card lowers it
    to Gen1 while idle."""
    if any(m in name for m in ("B200", "B100", "GB200", "B300")):
        return {"nvlinks": 18, "nvlink_version": 7, "pcie_gen": 5, "pcie_gen_idle": 0}
    if any(m in name for m in ("H100", "H200", "H800", "GH200")) and "PCIe" not in name and "NVL" not in name:
        return {"nvlinks": 18, "nvlink_version": 6, "pcie_gen": 5, "pcie_gen_idle": 0}
    if any(m in name for m in ("A100", "A800")) and "PCIe" not in name:
        return {"nvlinks": 12, "nvlink_version": 4, "pcie_gen": 4, "pcie_gen_idle": 0}
    if "V100" in name and "PCIe" not in name:
        return {"nvlinks": 6, "nvlink_version": 2, "pcie_gen": 3, "pcie_gen_idle": 0}
    gen = 5 if any(m in name for m in ("Blackwell", "H100", "H200", "L40", "RTX PRO", "5090", "Ada")) else 4
    return {"nvlinks": 0, "nvlink_version": 0, "pcie_gen": gen, "pcie_gen_idle": 1}


def model_features(name: str) -> list[str]:
    """What NVML answers for a GPU model (the rest is NVML_ERROR_NOT_SUPPORTED, as on the real one).

    Hopper and later data-centre GPUs (H100, H200, GH200, B200): ECC, row remapping, the NVLink fabric
    state and MIG; A100/A30: the same without the fabric state (it came with Hopper); V100: ECC and
    dynamic page retirement (row remapping replaced it from Ampere on); a consumer GPU (GeForce, RTX):
    none of them."""
    if any(m in name for m in ("H100", "H200", "H800", "GH200", "B200", "B100", "GB200")):
        return ["ecc", "remap", "fabric", "mig"]
    if any(m in name for m in ("A100", "A30", "A800")):
        return ["ecc", "remap", "mig"]
    if any(m in name for m in ("V100", "P100", "T4")):
        return ["ecc", "retired"]
    return []


@dataclass
class Faults:
    """Every switchable misbehaviour of the node (see docs/simulator.md)."""

    library_absent: bool = False  #: node.env() leaves libnvidia-ml.so.1 off the library path
    init_error: str = ""  #: nvmlInit returns this NVML error (name or number)
    lost: list[int] = field(default_factory=list)  #: GPUs that fell off the bus (GPU_IS_LOST)
    timeout_functions: list[str] = field(default_factory=list)  #: these return NVML_ERROR_TIMEOUT
    timeout_gpus: list[int] = field(default_factory=list)  #: ... only for these GPUs (empty: all)
    timeout_delay_ms: int = 0  #: ... after hanging this long
    hang_functions: list[str] = field(default_factory=list)  #: these never return (a driver hang)
    hang_gpus: list[int] = field(default_factory=list)  #: ... only for these GPUs (empty: all)
    orphan: dict[int, int] = field(default_factory=dict)  #: GPU -> MiB held by no process at all
    recovery_action: dict[int, int] = field(default_factory=dict)  #: GPU -> nvmlDeviceGpuRecoveryAction_t
    legacy_pids: bool = False  #: driver < 535.113: host pids, not converted into the caller's namespace
    memory_v2_unsupported: bool = False  #: nvmlDeviceGetMemoryInfo_v2 -> FUNCTION_NOT_FOUND
    process_api: str = "v3"  #: newest process entry point that exists
    memory_na: bool = False  #: per-process usedGpuMemory = NVML_VALUE_NOT_AVAILABLE
    #: GPU -> pids the compute list reports that hold nothing (driver/binding skew, nvitop#181)
    phantom_pids: dict[int, list[int]] = field(default_factory=dict)
    cuda_absent: bool = False  #: node.env() leaves libcuda.so.1 off the library path (NVML still there)
    #: GPU -> MiB the driver cannot hand out although NVML does not count them as used: CUDA allocates
    #: (and cuMemGetInfo reports) that much less than NVML's free
    hidden: dict[int, int] = field(default_factory=dict)
    # Peers (issue 39): pairs (a, b) of GPU indexes, either order.
    p2p_unsupported: list[tuple[int, int]] = field(default_factory=list)  #: no peer access (CanAccessPeer 0, Enable 217)
    p2p_corrupt: list[tuple[int, int]] = field(default_factory=list)  #: a peer copy's bytes arrive changed
    p2p_hang: list[tuple[int, int]] = field(default_factory=list)  #: a peer copy never completes
    p2p_gbps: dict[tuple[int, int], float] = field(default_factory=dict)  #: what a copy between them moves per second

    def recovery(self, gpu: int) -> int:
        """Effective recovery action: explicit, else NONE (0).

        Real leaked memory usually carries no recovery action (the driver does not know it
        leaked), so an orphan alone leaves the flag at NONE; set ``recovery_action`` for the
        cases where the driver does ask for a reset."""
        return self.recovery_action.get(gpu, 0)


@dataclass
class Description:
    """Everything in node.conf."""

    gpus: list[GpuSpec]
    driver_version: str = "580.159.04"
    nvml_version: str = "13.580.159.04"
    cuda_driver_version: int = 13000
    # Measured on an H200 pair with torch workers (docs/validation.md): memory back ~185 ms
    # after the process exits, several contexts on one GPU freed ~60 ms apart.
    release_delay_ms: int = 185
    release_gap_ms: int = 60
    # Microseconds of teardown per GiB the context held, on top of release_delay_ms: 0 (one figure
    # for every size) by default; gpusim.servers sets the H200's 2026-12-02 figures (a SIGKILLed torch
    # worker's memory back after 0.12-0.15 s with 40 GiB, 0.22 s with 120 GiB: 85 ms + 1.1 ms/GiB).
    release_us_per_gib: int = 0
    # A CUDA context costs the device more than the process is charged for: 527 MiB device-wide for
    # a torch process NVML lists with 518 MiB (gpu-facts §4b, measured on an H200). This much of
    # every live context is "used" memory that no listed process explains.
    context_overhead_mib: int = CONTEXT_OVERHEAD_MIB
    # How long an exiting CUDA process stays in the driver (state D) after its memory is back:
    # 0 on the H200 (the process was gone when its memory was), more to model a task stuck there.
    teardown_hang_ms: int = 0
    # 1: a context's memory goes down step by step between its death and its release (a long teardown that makes
    # progress, as on GB300, where it takes more than 30 s: sglang PR #31281); 0: all of it at the release (the H200).
    release_gradual: int = 0
    # What a CUDA start costs on an H200 with persistence mode on (docs/results/cuda-facts-h200x1-2026-12-02.json):
    # cuInit 0.10-0.21 s, cuDevicePrimaryCtxRetain 0.10-0.16 s, cuDevicePrimaryCtxRelease 0.06-0.10 s.
    cuda_init_ms: int = 100
    cuda_ctx_ms: int = 120
    cuda_release_ms: int = 70
    # A start's memset and free (docs/results/startable-h200x1-2026-12-02.json): 128840 MiB set and synchronized in
    # 0.031 s (4.4 TB/s), freed in 0.05-0.08 s (about 600 us a GiB; 4 GiB in 0.003 s).
    cuda_memset_gbps: int = 4400
    cuda_free_us_per_gib: int = 600
    faults: Faults = field(default_factory=Faults)

    # ------------------------------------------------------------ building
    @classmethod
    def create(
        cls,
        gpus: int,
        name: str,
        total_mib: int,
        reserved_mib: int,
        seed: str = "gpusim",
        minors: list[int] | None = None,
        **kw: object,
    ) -> Description:
        """A node of `gpus` identical GPUs with deterministic UUIDs and bus ids.

        ``minors`` gives each GPU's device minor (``/dev/nvidia<minor>``) in index order; the
        default is minor == index. NVML orders GPUs by PCI bus id while the kernel driver numbers
        the device files in its own probe order, so the two can differ on a real node."""
        if minors is None:
            minors = list(range(gpus))
        if len(minors) != gpus or len(set(minors)) != gpus or min(minors) < 0 or max(minors) > 254:
            raise ValueError(f"minors must be {gpus} distinct numbers from 0 to 254 (255 is nvidiactl), got {minors}")
        specs = [
            GpuSpec(
                index=i,
                name=name,
                uuid=gpu_uuid(seed, i),
                pci_bus_id=f"00000000:{bus_number(i):02X}:00.0",
                minor=minors[i],
                total_mib=total_mib,
                reserved_mib=reserved_mib,
            )
            for i in range(gpus)
        ]
        return cls(gpus=specs, **kw)  # type: ignore[arg-type]

    # ------------------------------------------------------------ encoding
    def to_text(self) -> str:
        f = self.faults
        lines = [
            "# gpusim node description: written by gpusim, read by libnvidia-ml (sim) and the driver daemon",
            f"driver_version={self.driver_version}",
            f"nvml_version={self.nvml_version}",
            f"cuda_driver_version={self.cuda_driver_version}",
            f"release_delay_ms={self.release_delay_ms}",
            f"release_gap_ms={self.release_gap_ms}",
            f"release_us_per_gib={self.release_us_per_gib}",
            f"context_overhead_mib={self.context_overhead_mib}",
            f"teardown_hang_ms={self.teardown_hang_ms}",
            f"release_gradual={self.release_gradual}",
            f"cuda_init_ms={self.cuda_init_ms}",
            f"cuda_ctx_ms={self.cuda_ctx_ms}",
            f"cuda_release_ms={self.cuda_release_ms}",
            f"cuda_memset_gbps={self.cuda_memset_gbps}",
            f"cuda_free_us_per_gib={self.cuda_free_us_per_gib}",
            f"gpu_count={len(self.gpus)}",
        ]
        for g in self.gpus:
            p = f"gpu.{g.index}."
            lines += [
                f"{p}name={g.name}",
                f"{p}uuid={g.uuid}",
                f"{p}pci_bus_id={g.pci_bus_id}",
                f"{p}minor={g.minor}",
                f"{p}total_mib={g.total_mib}",
                f"{p}reserved_mib={g.reserved_mib}",
                f"{p}mig_mode={g.mig_mode}",
                f"{p}pci_device_id=0x{g.pci_device_id:08X}",
                f"{p}pci_subsystem_id=0x{g.pci_subsystem_id:08X}",
                f"{p}lost={int(g.index in f.lost)}",
                f"{p}orphan_mib={f.orphan.get(g.index, 0)}",
                f"{p}hidden_mib={f.hidden.get(g.index, 0)}",
                f"{p}recovery_action={f.recovery(g.index)}",
                f"{p}features={','.join(g.feature_list())}",
                *(f"{p}{k}={-1 if k == 'mig_pending' and getattr(g, k) is None else getattr(g, k)}" for k in HEALTH_FIELDS),
                *(f"{p}{k}={v}" for k, v in g.links().items()),
                f"{p}nvlink_remote={g.nvlink_remote}",
                f"{p}nvlink_down={','.join(str(i) for i in sorted(g.nvlink_down))}",
                *(f"{p}nvlink_{c}={','.join(f'{link}:{n}' for link, n in sorted(g.nvlink_errors.get(c, {}).items()))}" for c in NVLINK_COUNTERS),
                f"{p}pcie_width_max={g.pcie_width_max}",
                f"{p}clocks_event_reasons=0x{g.clocks_event_reasons:X}",
                f"{p}temperature={g.temperature}",
                f"{p}temp_limit={g.temp_limit}",
            ]
        lines += [
            f"fault.library_absent={int(f.library_absent)}",
            f"fault.init_error={f.init_error}",
            f"fault.legacy_pids={int(f.legacy_pids)}",
            f"fault.memory_v2_unsupported={int(f.memory_v2_unsupported)}",
            f"fault.process_api={f.process_api}",
            f"fault.memory_na={int(f.memory_na)}",
            f"fault.timeout_functions={','.join(f.timeout_functions)}",
            f"fault.timeout_gpus={','.join(str(i) for i in f.timeout_gpus)}",
            f"fault.timeout_delay_ms={f.timeout_delay_ms}",
            f"fault.hang_functions={','.join(f.hang_functions)}",
            f"fault.hang_gpus={','.join(str(i) for i in f.hang_gpus)}",
            f"fault.recovery_explicit={','.join(f'{k}:{v}' for k, v in sorted(f.recovery_action.items()))}",
            f"fault.phantom_pids={','.join(f'{g}:{p}' for g, pids in sorted(f.phantom_pids.items()) for p in pids)}",
            f"fault.cuda_absent={int(f.cuda_absent)}",
            f"p2p.unsupported={_pairs(f.p2p_unsupported)}",
            f"p2p.corrupt={_pairs(f.p2p_corrupt)}",
            f"p2p.hang={_pairs(f.p2p_hang)}",
            f"p2p.gbps={','.join(f'{a}-{b}:{g:g}' for (a, b), g in sorted(f.p2p_gbps.items()))}",
        ]
        return "\n".join(lines) + "\n"

    @classmethod
    def parse(cls, text: str) -> Description:
        kv: dict[str, str] = {}
        for line in text.splitlines():
            line = line.strip()
            if line and not line.startswith("#") and "=" in line:
                k, v = line.split("=", 1)
                kv[k.strip()] = v.strip()
        faults = Faults(
            library_absent=kv.get("fault.library_absent", "0") == "1",
            init_error=kv.get("fault.init_error", ""),
            legacy_pids=kv.get("fault.legacy_pids", "0") == "1",
            memory_v2_unsupported=kv.get("fault.memory_v2_unsupported", "0") == "1",
            process_api=kv.get("fault.process_api", "v3") or "v3",
            memory_na=kv.get("fault.memory_na", "0") == "1",
            timeout_functions=_split(kv.get("fault.timeout_functions", "")),
            timeout_gpus=[int(x) for x in _split(kv.get("fault.timeout_gpus", ""))],
            timeout_delay_ms=int(kv.get("fault.timeout_delay_ms", "0") or 0),
            hang_functions=_split(kv.get("fault.hang_functions", "")),
            hang_gpus=[int(x) for x in _split(kv.get("fault.hang_gpus", ""))],
            recovery_action={int(k): int(v) for k, v in (p.split(":") for p in _split(kv.get("fault.recovery_explicit", "")))},
            cuda_absent=kv.get("fault.cuda_absent", "0") == "1",
            p2p_unsupported=_parse_pairs(kv.get("p2p.unsupported", "")),
            p2p_corrupt=_parse_pairs(kv.get("p2p.corrupt", "")),
            p2p_hang=_parse_pairs(kv.get("p2p.hang", "")),
            p2p_gbps={pair: float(g) for pair, g in ((_parse_pairs(x.split(":")[0])[0], x.split(":")[1]) for x in _split(kv.get("p2p.gbps", "")))},
        )
        for pair in _split(kv.get("fault.phantom_pids", "")):
            g, p = pair.split(":")
            faults.phantom_pids.setdefault(int(g), []).append(int(p))
        gpus = []
        for i in range(int(kv.get("gpu_count", "0"))):
            p = f"gpu.{i}."
            gpus.append(
                GpuSpec(
                    index=i,
                    name=kv[p + "name"],
                    uuid=kv[p + "uuid"],
                    pci_bus_id=kv[p + "pci_bus_id"],
                    minor=int(kv[p + "minor"]),
                    total_mib=int(kv[p + "total_mib"]),
                    reserved_mib=int(kv[p + "reserved_mib"]),
                    mig_mode=int(kv.get(p + "mig_mode", "0")),
                    pci_device_id=int(kv.get(p + "pci_device_id", str(H200_PCI_DEVICE_ID)), 0),
                    pci_subsystem_id=int(kv.get(p + "pci_subsystem_id", str(H200_PCI_SUBSYSTEM_ID)), 0),
                    features=_split(kv[p + "features"]) if p + "features" in kv else None,
                    **{k: int(kv[p + k]) for k in HEALTH_FIELDS if p + k in kv},
                    **{k: int(kv[p + k], 0) for k in LINK_FIELDS if p + k in kv and k not in ("nvlink_down", "nvlink_errors")},
                    nvlink_down=[int(x) for x in _split(kv.get(p + "nvlink_down", ""))],
                    nvlink_errors={
                        c: {int(a): int(b) for a, b in (x.split(":") for x in _split(kv.get(f"{p}nvlink_{c}", "")))}
                        for c in NVLINK_COUNTERS
                        if kv.get(f"{p}nvlink_{c}")
                    },
                )
            )
            if gpus[-1].mig_pending == -1:
                gpus[-1].mig_pending = None
            if kv.get(p + "lost", "0") == "1":
                faults.lost.append(i)
            orphan = int(kv.get(p + "orphan_mib", "0"))
            if orphan:
                faults.orphan[i] = orphan
            hidden = int(kv.get(p + "hidden_mib", "0"))
            if hidden:
                faults.hidden[i] = hidden
        return cls(
            gpus=gpus,
            driver_version=kv.get("driver_version", "580.159.04"),
            nvml_version=kv.get("nvml_version", "13.580.159.04"),
            cuda_driver_version=int(kv.get("cuda_driver_version", "13000")),
            release_delay_ms=int(kv.get("release_delay_ms", "185")),
            release_gap_ms=int(kv.get("release_gap_ms", "60")),
            release_us_per_gib=int(kv.get("release_us_per_gib", "0")),
            context_overhead_mib=int(kv.get("context_overhead_mib", "0")),
            teardown_hang_ms=int(kv.get("teardown_hang_ms", "0")),
            release_gradual=int(kv.get("release_gradual", "0")),
            cuda_init_ms=int(kv.get("cuda_init_ms", "100")),
            cuda_ctx_ms=int(kv.get("cuda_ctx_ms", "120")),
            cuda_release_ms=int(kv.get("cuda_release_ms", "70")),
            cuda_memset_gbps=int(kv.get("cuda_memset_gbps", "4400")),
            cuda_free_us_per_gib=int(kv.get("cuda_free_us_per_gib", "600")),
            faults=faults,
        )

    # ------------------------------------------------------------ file I/O
    def write(self, state_dir: Path) -> None:
        """Replace node.conf atomically (readers never see a half-written file)."""
        path = Path(state_dir) / "node.conf"
        tmp = path.with_name(f".node.conf.{os.getpid()}.tmp")
        tmp.write_text(self.to_text())
        os.replace(tmp, path)

    @classmethod
    def read(cls, state_dir: Path) -> Description:
        return cls.parse((Path(state_dir) / "node.conf").read_text())


def fault_names() -> list[str]:
    """The names accepted by Node.set_fault()."""
    names = [f.name for f in fields(Faults) if not f.name.startswith(("timeout_", "hang_"))]
    return sorted([*names, "timeout", "hang"])


def gpu_uuid(seed: str, index: int) -> str:
    """Deterministic "GPU-8-4-4-4-12" UUID for GPU `index` of the node `seed`."""
    h = hashlib.sha256(f"{seed}/{index}".encode()).hexdigest()
    return f"GPU-{h[0:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


def bus_number(index: int) -> int:
    """PCI bus of GPU `index`: the HGX layout for the first 8, then free numbers."""
    if index < len(HGX_BUSES):
        return HGX_BUSES[index]
    spare = [b for b in range(0x01, 0x100) if b not in HGX_BUSES]
    return spare[(index - len(HGX_BUSES)) % len(spare)]


def _split(s: str) -> list[str]:
    return [x.strip() for x in s.split(",") if x.strip()]


def _pairs(pairs: list[tuple[int, int]]) -> str:
    return ",".join(f"{a}-{b}" for a, b in sorted(pairs))


def _parse_pairs(s: str) -> list[tuple[int, int]]:
    out = []
    for x in _split(s):
        a, b = x.split("-")
        out.append((int(a), int(b)))
    return out
