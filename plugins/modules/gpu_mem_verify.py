#!/usr/bin/python
# Copyright (c) 2026, gpuops.clean_slate maintainers
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

from __future__ import annotations

DOCUMENTATION = r"""
module: gpu_mem_verify
short_description: Verify that NVIDIA GPUs are clean, waiting until they are or a deadline passes
version_added: 0.1.0
author:
  - gpuops.clean_slate maintainers (@gpuops)
description:
  - Polls NVML until every selected GPU is clean or O(timeout) seconds pass, and returns as soon as
    they are, so a clean node answers in milliseconds.
  - Every NVML call runs in a helper process under a deadline (O(probe_timeout)), so a hung driver cannot hang the
    task; the GPU whose call did not return is diagnosed V(driver_hung) and the others are still reported.
  - A GPU is clean when its used memory (NVML memory info v2, which excludes the memory the driver reserves) is at
    most O(max_used_mib), no process is listed on it (with O(require_no_processes)), and the driver asks for no
    recovery action.
  - Drivers without memory info v2 report v1 C(used), which includes reserved memory (about 615 MiB on an idle
    H200); the module then subtracts an estimate of the reserved memory and says so in RV(notes).
  - For every GPU that is not clean the module gives a diagnosis (RV(gpus[].diagnosis)) and the next step, naming
    the processes that hold it, found through NVML and through the holders of the GPU's device file.
  - With O(cuda_probe), every selected GPU that NVML reads clean is then proven startable by a CUDA start through
    C(libcuda.so.1) (C(cuInit), the primary context, an allocation of O(cuda_probe_memory_fraction) of its memory, a
    memset, synchronize, free and release), each GPU in a helper process of its own, all at once, each under
    O(cuda_probe_timeout); NVML is then read until the helpers and their memory are gone. A GPU whose start failed is not
    clean, diagnosed V(uvm_missing), V(device_missing), V(no_libcuda), V(cuda_busy), V(cuda_oom), V(ecc_uncorrectable),
    V(fabric_not_ready), V(cuda_hung), V(cuda_error) or V(cuda_residue), with the CUDA error code in RV(gpus[].startable).
  - With O(containers) (a container cleaned from its Proxmox VE node), the CUDA start and the device-file checks are made
    inside that container, where the next server starts, through C(pct exec) and the container's own C(python3), and
    NVML is read on the node before and after; a GPU whose start could not be made there is V(cuda_unproven).
  - Ready together (RV(together)) - with O(peers), the GPUs whose CUDA start is made are also proven to reach each other
    as a tensor-parallel server's do, in one more helper beside the starts, under the same deadline - for every pair, what
    the driver says of peer access, peer access enabled both ways, a known pattern copied both ways, read back and
    compared, and the copy's bandwidth against what the pair's link allows. With O(links), each GPU's NVLink links and
    error counters, PCIe link, clock event reasons and temperature are read from NVML (in the same bounded helper as
    every other reading); the room in C(/dev/shm) and vLLM's cached P2P answer are looked at. Each finding is named with
    its verdict and joins the health verdict; a broken or hanging pair (or peer access unsupported with
    O(peers_required)) fails the module with RV(reason=not_ready_together) although every GPU is clean.
  - Changes nothing on the target but, with O(peers_cache=remove), a vLLM cache file that says peer access works where it
    does not. The CUDA probe takes a context and memory on each GPU for well under a second and gives them back before
    the module returns.
  - The P(gpuops.clean_slate.clean_slate#role) role runs it after M(gpuops.clean_slate.gpu_procs_kill).
extends_documentation_fragment:
  - gpuops.clean_slate._attributes
  - gpuops.clean_slate._containers
attributes:
  check_mode:
    support: full
    details: >-
      The module only reads; check mode runs it normally but makes no CUDA start (RV(gpus[].startable) says so). With
      O(containers) it still looks at the container's device files there (a read-only program).
  diff_mode:
    support: none
  idempotent:
    support: full
options:
  gpus:
    description:
      - GPUs to verify, by index (V(0)), UUID (V(GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx)) or device file (V(/dev/nvidia0), by minor number).
      - Empty means every GPU.
    type: list
    elements: raw
    default: []
  expected_count:
    description:
      - Fail when fewer than this many healthy GPUs are visible (lost GPUs do not count).
      - The number an operator would count in C(nvidia-smi) output, for example V(8); from 0 to 1024.
    type: int
  max_used_mib:
    description:
      - Most memory, in MiB of v2 C(used), that a clean GPU may have in use, from 0 to 1048576.
      - One leftover CUDA context costs about 500 MiB, so the default catches any.
    type: int
    default: 64
  require_no_processes:
    description:
      - A GPU on which NVML lists any process is not clean, whatever its memory.
    type: bool
    default: true
  timeout:
    description:
      - Seconds to wait for the GPUs to become clean, from 0 to 86400 (one day). V(0) checks once.
    type: float
    default: 30
  progress_timeout:
    description:
      - Past O(timeout), a GPU whose used memory went down within the last O(progress_window) seconds is still in a
        teardown that makes progress (GB300 teardowns take more than 30 s) and is not judged yet - the polling goes on,
        while that holds, up to this many seconds from the start. V(0) (or anything up to O(timeout)) stops at
        O(timeout), as before.
    type: float
    default: 120
  progress_window:
    description: Seconds within which a GPU's used memory must have gone down for the polling to go on past O(timeout).
    type: float
    default: 10
  interval:
    description:
      - Seconds between two polls, from 0.001 to 60.
    type: float
    default: 0.1
  probe_timeout:
    description:
      - Seconds one NVML call may take, from 0.1 to 3600. Every NVML call runs in a helper process; a call that has
        not returned by then is abandoned (the helper is killed) and its GPU is diagnosed V(driver_hung), while the
        other GPUs are still read by a fresh helper. If NVML itself does not open in time the module fails with
        RV(reason=driver_hung).
      - NVML work ends half a second after the later of O(timeout) and O(probe_timeout), so the module returns within
        about that even when calls hang.
      - A healthy call takes well under a millisecond; raise it on nodes whose GPUs are slow to wake (without
        persistence mode the first call can take seconds).
    type: float
    default: 10
  fail_on_dirty:
    description:
      - Fail when a GPU is not clean at the deadline or fewer than O(expected_count) GPUs are visible.
      - V(false) only reports (RV(clean) tells), for a "before" picture.
    type: bool
    default: true
  device_dir:
    description:
      - Directory holding the C(nvidia*) device files, scanned to name the processes holding a GPU that is not clean.
      - It must exist; the module warns when it holds no GPU device file, since holders NVML does not list (forked
        children) can then not be named.
    type: path
    default: /dev
  health:
    description:
      - Judge each GPU's health besides its memory (RV(gpus[].health), RV(health)), from NVML (recovery action, row
        remaps, retired pages, volatile uncorrectable ECC errors, NVLink fabric state, compute, MIG and persistence
        modes), from Xid errors in the kernel log since O(since), and from the host (an MPS daemon left behind,
        C(nvidia-fabricmanager) not running where the fabric is not up).
      - It costs well under a millisecond per GPU plus one read of the kernel log; V(false) skips it.
    type: bool
    default: true
  fail_on:
    description:
      - The health verdict from which the module fails with RV(reason=unhealthy) (when the memory is clean). The
        verdicts, from best to worst, are V(ok), V(restart_app), V(fix_config), V(reset_gpu), V(reboot) and V(drain);
        V(never) only reports.
      - V(fix_config) is a configuration fault no reset or reboot fixes (a device file absent, another device's or refused,
        C(nvidia-uvm), C(libcuda.so.1), a variable DCGM flags, C(nvidia-fabricmanager)), fixed in the configuration.
      - A host fails when its verdict is a finding (anything but V(ok)) at or above O(fail_on). A healthy host never
        fails for its health, so V(ok) fails on any finding, as V(restart_app) does. V(reset_gpu) and above leave a
        configuration fault reported only (a GPU whose CUDA start it broke is not clean, whatever O(fail_on) says).
      - With O(fail_on_dirty=false) the module never fails for health either.
    type: str
    choices: [ok, restart_app, fix_config, reset_gpu, reboot, drain, never]
    default: fix_config
  since:
    description:
      - Xid errors logged before this time are ignored, as epoch seconds (V(1796112000)) or an ISO 8601 time
        (V(2026-12-01T08:00:00Z); without a zone, the target's local time). A number that is not finite (V(nan),
        V(inf)) is refused with RV(reason=bad_arguments).
      - Default, when the module starts. Give the time the job (or the clean-up run) started, so that the Xids of
        the job that just ended count, and none that a reset has since cleared.
    type: raw
  kernel_log:
    description:
      - The kernel log to read Xid errors from, in C(/dev/kmsg)'s record format. When it cannot be read (the kernel's
        C(dmesg_restrict) without become), the module asks C(journalctl -k); when neither works, the C(kernel_log) of RV(health)'s C(host)
        is V(unreadable) and a note says so.
      - A file is read from its end, its newest 16 MiB (whole records), so that the newest Xid errors are always read
        whatever its size; C(/dev/kmsg) is read to its end for at most 5 seconds. Memory stays bounded either way (only
        the Xid records are kept). C(kernel_log_read) of RV(health)'s C(host) and a note say when older records were not
        read (and whether Xid errors since O(since) may be among them) or when the log could not be read to its end.
    type: path
    default: /dev/kmsg
  cuda_probe:
    description:
      - Prove each selected GPU that NVML reads clean startable with a CUDA start a moment before the verdict (see the
        description), and take no context on a GPU in use, except a context alone on one in exclusive_process or
        prohibited mode, which tells V(cuda_busy) apart. A GPU with MIG on is not probed; nor is any GPU when an NVML
        call hung on one of them (V(driver_hung)), since a CUDA start can stick in a hung driver where no kill reaches it.
      - Measured on an H200 (persistence mode on) 0.34-0.60 s per GPU in a fresh helper, the GPUs in parallel.
    type: bool
    default: true
  cuda_probe_memory_fraction:
    description:
      - The share of each GPU's memory (as CUDA reports its total) the probe allocates, sets and frees, from 0 (a context
        only) to 0.99. The default is what servers ask for (vLLM's C(gpu_memory_utilization), SGLang's
        C(mem_fraction_static)); a GPU where it cannot be allocated is V(cuda_oom), whatever NVML reads free.
    type: float
    default: 0.9
  cuda_probe_timeout:
    description:
      - Seconds one GPU's CUDA start may take, from 0.1 to 3600; a start still running then has its helper killed and its
        GPU is V(cuda_hung), named by the call it was stuck in. The module returns within this plus about 2.5 s after the
        polling even when a start hangs.
      - Without persistence mode the first start on an idle GPU re-initialises it (seconds); raise it there.
    type: float
    default: 10
  peers:
    description:
      - Prove the GPUs whose CUDA start is made (those NVML reads clean, in the default compute mode; two or more) ready
        together - for each pair, C(cuDeviceCanAccessPeer) both ways, C(cuCtxEnablePeerAccess) both ways, O(peers_copy_mib)
        of a known pattern copied each way eight times back to back (C(cuMemcpyPeer), timed with events), read back and compared. One
        helper process holds a context on each of them (made in parallel threads) beside the starts' helpers, under
        O(cuda_probe_timeout); its copies wait until every start has passed its memset. A pair whose copy hangs is
        named by its two GPUs when the helper is killed at the deadline. Made only when every selected GPU reads
        clean (with one busy or hung the run is red already, and the check waits for the run after its fix).
      - Findings (RV(together)) - V(p2p_unsupported) (the driver offers no peer access; a warning unless
        O(peers_required)), V(p2p_broken) (a copy arrived changed, failed or hung, or enabling failed where the driver
        offers it; fails the module), V(p2p_slow) (below O(peers_min_bandwidth) of the pair's link), V(peers_unproven)
        (the check could not be made although every GPU started; fails the module).
      - Needs O(cuda_probe); never in check mode. The matrix of 28 pairs takes about 0.1 s (docs/benchmarks.md, "Ready
        together").
    type: bool
    default: true
  peers_required:
    description:
      - The next server needs peer access between every two of the GPUs (NCCL's P2P transport, vLLM's and SGLang's custom
        all-reduce), so V(p2p_unsupported) fails the module (RV(reason=not_ready_together)); without it unsupported peer
        access is reported as a warning (a server then falls back to copies through host memory).
    type: bool
    default: false
  peers_copy_mib:
    description:
      - MiB of the pattern one peer copy moves, from 1 to 1024. Each direction of each pair copies it eight times back to
        back between two events (the time is the link's, not the host's to issue the copies) and reads it back once to
        compare every byte; the check holds two buffers of it on each GPU.
      - What the host reads back and compares is what the matrix costs (the copies cost only the GPUs' copy engines) -
        2 MiB keeps 28 pairs near 0.1 s (docs/benchmarks.md, "Ready together"); a larger copy tests more bytes.
    type: int
    default: 2
  peers_min_bandwidth:
    description:
      - A pair is V(p2p_slow) when a copy between them moves less than this share of what their link allows in one
        direction, from 0 (never slow) to 1. The link is the one NVML reports for the pair - NVLink (the GPUs' links at 25
        GB/s each for NVLink 2 to 4, 50 for NVLink 5, through NVSwitches; one link for a direct bridge) or PCIe (the
        narrower GPU's maximum width at its maximum generation).
      - The default is below what healthy pairs reach (copies reach about 80 % of a link's rate) and above a copy staged
        through host memory; raise it once measured on your nodes.
    type: float
    default: 0.25
  links:
    description:
      - Read each GPU's links, clocks and temperature from NVML and judge them (RV(together)) - V(nvlink_inactive) (a link
        down while others of the GPU are up), V(nvlink_errors) (a link's replay, recovery or CRC counter above
        O(nvlink_error_threshold)), V(pcie_width_degraded) (the link trained narrower than GPU and slot allow),
        V(pcie_gen_degraded) (a lower generation than allowed while the GPU is busy - an idle GPU lowers its link's
        generation to save power, so the generation is read while this module's CUDA start keeps the GPU busy and is never
        judged idle), V(clocks_slowdown) (HW slowdown, HW thermal or power-brake slowdown, or SW thermal slowdown between
        jobs) and V(temperature_high) (within 5 C of the thermal limit; a warning).
      - A few dozen NVML calls per GPU, in the helper that bounds every NVML call.
    type: bool
    default: true
  nvlink_error_threshold:
    description:
      - The most errors of one kind (replay, recovery, CRC flit, CRC data) one NVLink link may have counted since the driver
        loaded or the GPU was reset before it is V(nvlink_errors), from 0 (any error; facebookresearch/gcm's default).
    type: int
    default: 0
  shm_min_mib:
    description:
      - The room in MiB the next start needs free in C(/dev/shm) (the container's own with O(containers)), else V(shm_low);
        V(0) does not look. NCCL's segments (about 9 MiB each) and the servers' queues go there, and a tmpfs without room
        fails them with C(No space left on device) or a bus error; a Docker or Kubernetes default of 64 MiB is too small.
    type: int
    default: 1024
  peers_cache:
    description:
      - What to do with vLLM's cached P2P answer (C(gpu_p2p_access_cache_for_<devices>.json) in O(peers_cache_dirs)) when it
        says peer access works between GPUs where the check found it does not - vLLM trusts the file instead of testing
        again. V(report) (V(p2p_cache_stale)), V(remove) (the file is removed, only when it is still the file read; not in
        check mode) or V(ignore) (not looked at).
    type: str
    choices: [report, remove, ignore]
    default: report
  peers_cache_dirs:
    description:
      - Where vLLM keeps its cache (its C(VLLM_CACHE_ROOT), by default C(~/.cache/vllm)), absolute, a component may be a
        glob; with O(containers), inside the container. A symbolic link on the way is not followed.
    type: list
    elements: str
    default: [/root/.cache/vllm, /home/*/.cache/vllm]
  containers:
    description:
      - On a Proxmox VE node, the LXC container (one vmid) whose GPUs are verified from the node, as the
        P(gpuops.clean_slate.clean_slate#role) role's hypervisor mode does - NVML is read on the node, and the CUDA start
        (O(cuda_probe)) and the device-file checks (O(health)) are made inside the container, where the next server starts.
        A container without C(/dev/nvidia-uvm), without a GPU's device file or whose device cgroup refuses one reads clean
        through NVML on the node while every CUDA start inside it fails; this finds it (V(uvm_missing), V(device_missing)).
      - The container is entered with C(pct exec <vmid> --keep-env 0), and the probe, a program of the standard library
        only, runs with the container's own C(python3) (3.6 or later; nothing is installed or copied). The whole run has
        O(cuda_probe_timeout) plus 15 s (pct's start, the container's Python); past that its process group is killed and
        the probe's helpers in the container end with it. Before the verdict the node verifies that nothing of the run is
        left (a process still carrying the run's random token on its command line is SIGKILLed through a pidfd).
      - When the start cannot be made in the container (no C(python3) there, pct fails or times out) every GPU that was to be
        probed is V(cuda_unproven), not clean, and its RV(gpus[].detail) says why and what to do; without O(cuda_probe) the
        device files that could not be checked are the V(devices_unchecked) finding of RV(software), which does not fail.
      - Give the container's GPUs in O(gpus); a GPU not passed into it is V(device_missing) there. More than one container
        is refused with RV(reason=bad_arguments).
    type: list
    elements: int
    default: []
requirements:
  - nvidia-ml-py (C(pynvml)) on the target
  - the NVIDIA driver (C(libnvidia-ml.so.1))
notes:
  - Inside an LXC container the driver lists only the container's own processes while memory counts everything;
    memory held from outside is diagnosed as V(held_outside_namespace).
  - A GPU held only by daemons that M(gpuops.clean_slate.gpu_procs_kill) protects (recognised by their executable, as
    that module does) is diagnosed as V(held_by_protected), since no kill will free it.
  - Numbers that are not finite (V(nan), V(inf)) or out of range and a O(device_dir) that does not exist are refused
    with RV(reason=bad_arguments), naming the option, before the GPUs are read.
seealso:
  - module: gpuops.clean_slate.gpu_procs_kill
"""

EXAMPLES = r"""
---
- name: Check that all eight GPUs are clean, waiting up to 30 s
  gpuops.clean_slate.gpu_mem_verify:
    expected_count: 8

- name: Verify two GPUs by index and UUID, with a tighter threshold
  gpuops.clean_slate.gpu_mem_verify:
    gpus:
      - 0
      - GPU-5f2d3b0e-8c1a-4d6e-9b7f-2a4c6e8d0f13
    max_used_mib: 16
    timeout: 10
    interval: 0.05

- name: Take a before picture without failing
  gpuops.clean_slate.gpu_mem_verify:
    fail_on_dirty: false
    timeout: 0
  register: before

- name: Tolerate processes that use no memory (MPS control daemons)
  gpuops.clean_slate.gpu_mem_verify:
    require_no_processes: false

- name: Fail only for a GPU that needs a reboot or must be drained, counting Xids since the job started
  gpuops.clean_slate.gpu_mem_verify:
    fail_on: reboot
    since: "{{ job_started_epoch }}"

- name: Prove the GPUs startable for a server that asks for 95 % of the memory, allowing a cold start 30 s
  gpuops.clean_slate.gpu_mem_verify:
    cuda_probe_memory_fraction: 0.95
    cuda_probe_timeout: 30

- name: On the Proxmox VE node, verify container 129's GPUs, with the CUDA start made inside the container
  gpuops.clean_slate.gpu_mem_verify:
    containers: [129]
    gpus: [0, 1, 2, 3, 4, 5, 6, 7]

- name: Look for holders of a non-standard device directory
  gpuops.clean_slate.gpu_mem_verify:
    device_dir: /run/nvidia/driver/dev
"""

RETURN = r"""
clean:
  description: Whether every selected GPU is clean (and enough GPUs are visible), and the health verdict is below O(fail_on).
  returned: always
  type: bool
  sample: true
gpu_count:
  description: Number of GPUs the driver reports, lost ones included.
  returned: always
  type: int
  sample: 8
clean_count:
  description: Number of selected GPUs that are clean.
  returned: always
  type: int
  sample: 8
start:
  description: When the verification started, as C(ansible.builtin.command) reports it (local time, microseconds).
  returned: always
  type: str
  sample: "2026-11-30 02:40:01.523456"
end:
  description: When the verification ended.
  returned: always
  type: str
  sample: "2026-11-30 02:40:01.526789"
elapsed_s:
  description:
    - Seconds the verification took, everything its verdict waited for - the polling, the scan of C(/proc) that names the
      holders of a GPU that is not clean, the CUDA start and its settling, the health readings.
  returned: always
  type: float
  sample: 0.65
poll_s:
  description: Seconds of it spent reading the GPUs until they were clean (or the timeout passed), the naming of holders included.
  returned: always
  type: float
  sample: 0.003
cuda_s:
  description: Seconds of it spent on the CUDA start (C(elapsed_s) of RV(cuda_probe)); null with O(cuda_probe=false).
  returned: always
  type: float
  sample: 0.61
timings:
  description:
    - Where RV(elapsed_s) went, step by step - C(nvml_start) (the NVML helper's start and the GPUs' identities), C(poll),
      C(cuda) (the device files and the CUDA start with its settling), C(software), C(nvml_end), C(health) (the kernel
      log and the verdict), C(reset_plan). For a profile of a run; nothing depends on it.
  returned: always
  type: dict
time_to_clean_s:
  description: Seconds until every selected GPU was clean; null when they never were.
  returned: always
  type: float
  sample: 0.112
polls:
  description: Number of NVML polls made.
  returned: always
  type: int
  sample: 2
driver_version:
  description: The NVIDIA driver version.
  returned: when the driver answers
  type: str
  sample: 580.159.04
diagnosis:
  description:
    - Deprecated alias of RV(reason), with the same value on every failure; it will be removed in release 1.0.0. Read
      RV(reason) instead.
    - Each GPU's own verdict is RV(gpus[].diagnosis), which stays.
  returned: failure
  type: str
  sample: driver_not_loaded
msg:
  description:
    - How many GPUs are clean and how long it took; otherwise every GPU that is not clean, why, and what to do, each
      distinct finding once with the GPUs it applies to and its fix once, then the health verdict's findings and the reset
      plan. RV(lines) holds the same, a line each.
  returned: always
  type: str
  sample: 8/8 GPUs clean in 0.65 s
lines:
  description:
    - RV(msg) in its few lines, whatever the number of GPUs - the memory verdict (or the GPUs not clean, a line per distinct
      diagnosis and sentence, each diagnosis's fix on its first line), C(Health - <verdict>) and a line per distinct health
      finding, the verdict's advice, the reset plan.
  returned: always
  type: list
  elements: str
  sample: ["8 of 8 GPU(s) not clean after 1.9 s.", "GPUs 0-7 - uvm_missing - CUDA error 999 ... Fix - ..."]
reset_plan:
  description:
    - Advisory, when the fix of a GPU is a reset and nothing worse (a reboot, a drain) is due - nothing is ever reset.
      C(gpus) (C(index), C(uuid), C(pci_bus_id) and C(why), the findings that ask for it), C(together) (why more GPUs go with
      them - on an NVSwitch system every GPU of the same NVLink fabric), C(where) (this host; for a container cleaned from its
      node, the node by its own bus IDs; from inside a container, the host that runs it), C(daemons) (the management
      daemons running, C(name), C(service), C(pids)), C(holders) (other processes holding the GPUs' device files, C(pid),
      C(name), C(minors)) and C(commands) (in order - stop the daemons, end the holders, check, reset, start the daemons,
      read the GPUs).
    - Null when no reset is due, and in check mode.
  returned: always
  type: dict
  sample:
    advisory: true
    gpus: [{"index": 4, "uuid": "GPU-...", "pci_bus_id": "00000000:9A:00.0", "why": ["row_remap_pending"]}]
    where: this host
    commands: ["systemctl stop nvidia-dcgm nvidia-persistenced", "nvidia-smi -r -i 00000000:9A:00.0", "systemctl start nvidia-persistenced nvidia-dcgm"]
reason:
  description:
    - Why the module failed, on every failure. V(not_clean) (a selected GPU is not clean at the deadline; each GPU's
      RV(gpus[].diagnosis) says why), V(missing_gpus) (fewer healthy GPUs than O(expected_count)), V(bad_arguments),
      V(unhealthy) (the memory is clean but the health verdict is at or above O(fail_on); RV(health) says why),
      V(not_ready_together) (every GPU is clean, but a pair's peer copies are broken or hang, the peer check could not be
      made, or peer access is unsupported with O(peers_required); RV(together) says which),
      V(missing_library), V(internal_error), or, when the GPUs cannot be read, V(library_not_found),
      V(driver_not_loaded), V(driver_library_mismatch), V(no_permission), V(not_supported), V(timeout), V(gpu_lost),
      V(needs_reset), V(nvml_error) (NVML failed; the message says why and what to do) or V(driver_hung) (NVML did not
      even open within O(probe_timeout), so the driver is hung; reboot the node); V(device_missing) when NVML cannot open
      because C(nvidiactl) is absent, another device's or refused here (a configuration fault; C(nvml_reason) keeps
      NVML's own).
    - The failure shape all the collection's modules share (RV(reason), RV(msg), details); the user guide lists every reason.
  returned: failure
  type: str
  sample: not_clean
python:
  description: The target's Python and which of the collection's Python dependencies it lacks (by package name).
  returned: always
  type: dict
  sample: {"executable": "/usr/bin/python3", "version": "3.11.2", "missing": []}
notes:
  description: Caveats about the readings, such as the v1 memory estimate.
  returned: always
  type: list
  elements: str
  sample: []
gpus:
  description: One entry per selected GPU.
  returned: always
  type: list
  elements: dict
  contains:
    index:
      description: NVML index.
      type: int
      sample: 0
    uuid:
      description: GPU UUID.
      type: str
      sample: GPU-5f2d3b0e-8c1a-4d6e-9b7f-2a4c6e8d0f13
    name:
      description: Product name.
      type: str
      sample: NVIDIA H200
    pci_bus_id:
      description: PCI bus id.
      type: str
      sample: "00000000:18:00.0"
    minor:
      description: Minor number of the GPU's device file C(/dev/nvidia<minor>).
      type: int
      sample: 0
    total_mib:
      description: Total memory.
      type: int
      sample: 143771
    used_mib:
      description: Memory in use, excluding reserved memory.
      type: int
      sample: 0
    reserved_mib:
      description: Memory the driver and firmware reserve (estimated when RV(gpus[].memory_api=v1)).
      type: int
      sample: 615
    memory_api:
      description: V(v2), or V(v1) when the driver lacks memory info v2.
      type: str
      sample: v2
    processes:
      description: Processes NVML lists on the GPU (C(pid), C(name), C(used_mib), C(visible) in this PID namespace, C(types)).
      type: list
      elements: dict
      sample: [{"pid": 4242, "name": "sglang::schedul", "used_mib": 20000, "visible": true, "types": ["compute"]}]
    recovery_action:
      description: The driver's recovery action (V(none), V(gpu_reset), V(node_reboot), ...), null where unsupported.
      type: str
      sample: none
    clean:
      description: Whether this GPU is clean.
      type: bool
      sample: true
    diagnosis:
      description:
        - V(clean), V(busy) (processes hold it), V(held_by_protected) (only daemons gpu_procs_kill protects hold it),
          V(held_outside_namespace), V(orphaned_context) (memory held by no process), V(gpu_lost), V(needs_reset),
          V(unsupported), V(unresponsive) or V(driver_hung) (an NVML call on it did not return within
          O(probe_timeout); RV(gpus[].detail) names the call; reboot the node or follow its documented recovery).
        - With O(cuda_probe), a GPU NVML read clean whose CUDA start failed is V(uvm_missing), V(device_missing), V(no_libcuda),
          V(cuda_busy), V(cuda_oom), V(ecc_uncorrectable), V(fabric_not_ready), V(cuda_hung), V(cuda_error) or V(cuda_residue)
          (RV(gpus[].startable) has the code; the user guide says what to do about each); with O(containers), V(cuda_unproven)
          when the start could not be made in the container.
      type: str
      sample: clean
    detail:
      description: A sentence saying what holds the GPU and what to do next.
      type: str
      sample: clean
    startable:
      description:
        - The GPU's CUDA start (O(cuda_probe)) - C(ok) (null when it was not probed, with C(skipped) saying why), C(reason)
          (its diagnosis when it failed), C(code) and C(error) (the CUDA error), C(step) (the call), C(detail) (what to do),
          C(context_only), C(elapsed_s), C(steps) (seconds per call), C(cuda_total_mib), C(cuda_free_mib), C(allocated_mib),
          C(pid) (its helper) and C(gone_after_s) (when NVML read the helper and its memory gone).
      returned: when O(cuda_probe) is true
      type: dict
      sample: {"ok": true, "reason": null, "code": null, "step": null, "allocated_mib": 128840, "elapsed_s": 0.41}
    health:
      description:
        - The GPU's health verdict (V(ok), V(restart_app), V(fix_config), V(reset_gpu), V(reboot), V(drain)), the evidence
          (one sentence per finding, starting with the verdict it gives), C(findings) (each C(name), C(verdict), C(text); the
          user guide's table says what fixes each name) and the readings it was judged from.
        - C(readings) holds C(recovery_action), C(xid) (the Xid events of this GPU since O(since), each with C(xid), C(time),
          the catalog's C(bucket) and the C(line)), C(remapped_rows), C(retired_pages), C(ecc_volatile_uncorrected),
          C(fabric) (C(state), C(status), C(cluster_uuid), C(clique_id)), C(compute_mode), C(mig_mode) (C(current), C(pending)) and C(persistence_mode);
          each null where the GPU or the driver does not report it (never guessed).
        - A GPU diagnosed V(gpu_lost) (or whose driver call hung) is V(reboot).
        - An Xid's C(bucket) is the immediate action of NVIDIA's Xid catalog, the edition that lists Xids 1 to 172
          (driver linkage up to R575, CUDA 12.9; read 2026-12-02), V(UNKNOWN) for one it does not give one; the
          verdict of each bucket is V(IGNORE) V(ok), V(RESTART_APP) V(restart_app), V(RESET_GPU) and V(UNKNOWN)
          V(reset_gpu), V(RESTART_BM) V(reboot), V(CONTACT_SUPPORT), V(CHECK_MECHANICALS) and V(DRAIN_P2P) V(drain).
      returned: when O(health) is true
      type: dict
      sample:
        verdict: reset_gpu
        evidence: ["reset_gpu: a row remapping is pending: it takes effect at the next GPU reset."]
        readings: {"recovery_action": "none", "xid": [], "remapped_rows": {"correctable": 0, "uncorrectable": 1, "pending": true,
                   "failure": false}, "retired_pages": null, "ecc_volatile_uncorrected": 0, "fabric": {"state": "completed", "status": 0},
                   "compute_mode": "default", "mig_mode": {"current": false, "pending": false}, "persistence_mode": true}
cuda_probe:
  description:
    - What the CUDA probe did (null with O(cuda_probe=false)) - C(probed) (GPUs started on), C(started) (those that worked),
      C(memory_fraction), C(elapsed_s) (all of it), C(probes_s) (the starts, in parallel), C(gone_after_s) (how long NVML took
      to read the last helper gone) and C(left_behind) (helpers that did not die of SIGKILL, stuck in the driver).
    - With O(containers), C(container) - C(vmid), C(ok) (whether the program answered from the container), C(python) (the
      container's), C(elapsed_s) (the whole C(pct exec)), C(rc), C(ended) (host pids of the run - the program, its helpers,
      pct - still there after C(pct exec) returned, SIGKILLed before the verdict; normally empty), C(left) (those that did not
      die, stuck in the driver) and, when it did not answer, C(why).
  returned: always
  type: dict
  sample: {"probed": 8, "started": 8, "memory_fraction": 0.9, "elapsed_s": 0.61, "probes_s": 0.58, "gone_after_s": 0.003, "left_behind": []}
software:
  description:
    - DCGM level 1's software checks (null with O(health=false)) - C(devices) (each selected GPU's device file, C(ctl), C(uvm),
      C(uvm_tools), C(caps) where MIG is on, each with C(path), C(ok), C(why) and C(fault) - V(absent), V(wrong) (another
      device's numbers, or a regular file, against what C(/proc/devices) gives the driver), V(refused) (the device cgroup or
      the file's mode) or V(unopenable); C(gpu_files) against C(nvml_count); C(uvm_major); C(numbers_checked) (whether
      C(/proc/devices) lists the driver, so that each node's numbers were held to it); C(uvm_loaded);
      with O(containers) the container's, with C(container), and C(unchecked) when they could not be looked at),
      C(environment) (C(found) variables DCGM flags with C(name), C(where), C(value); C(read), C(unreadable) and C(not_visible), what
      the module cannot see), C(inforom) (C(index), C(valid)) and C(findings) (C(name), C(verdict), C(gpu), C(text)), which the
      host's health verdict counts.
  returned: always
  type: dict
  sample: {"findings": [], "inforom": [{"index": 0, "valid": true}]}
together:
  description:
    - Ready together (null with both O(cuda_probe) and O(health) false) - C(ready) (False when a finding fails the module,
      RV(reason=not_ready_together)), C(links) (per GPU C(index), C(nvlink) with C(links), C(active), C(inactive), C(version),
      C(remote) and the non-zero C(errors) by link; C(pcie) with C(gen), C(gen_max), C(gen_gpu_max), C(width), C(width_max),
      C(gen_under_load), C(gen_judged); C(clocks) with C(mask) and C(reasons); C(temperature) with C(gpu_c), C(margin_c),
      C(slowdown_c); C(p2p), NVML's word on each pair; null for what the GPU does not report), C(peers) (C(checked),
      C(skipped) saying why not, C(gpus), C(copy_mib), C(reps), C(min_bandwidth), C(setup_s), C(matrix_s), C(release_s),
      C(elapsed_s), C(pid) and C(pairs), each with C(gpus), C(link), C(link_gbps), C(can_access), C(enabled), C(copies)
      (C(from), C(to), C(gbps), C(match), C(error)), C(status) - V(ok), V(p2p_unsupported), V(p2p_broken), V(p2p_slow) or V(unchecked) -
      and C(detail)), C(shm) (C(path), C(size_mib), C(free_mib)), C(p2p_caches) (each vLLM cache with C(path), C(devices),
      C(entries), C(stale) pairs and C(removed)), C(findings) (C(name), C(verdict), C(gpu), C(gpus) for a pair, C(text)),
      which the host's health verdict counts, and C(elapsed_s).
  returned: always
  type: dict
  sample:
    ready: true
    findings: []
    peers: {"checked": true, "gpus": [0, 1], "copy_mib": 8, "reps": 2, "matrix_s": 0.012,
            "pairs": [{"gpus": [0, 1], "link": "nvlink", "link_gbps": 450.0, "status": "ok", "can_access": [true, true]}]}
    shm: {"path": "/dev/shm", "size_mib": 515072, "free_mib": 515060}
    p2p_caches: []
health:
  description:
    - The host's health verdict, the worst of its GPUs' and of its own findings, with O(fail_on), the evidence (GPU by GPU),
      C(since) (epoch seconds) and C(elapsed_s) (what judging it cost).
    - C(findings) says each distinct finding once, worst first - C(name), C(verdict), C(gpus) (the GPUs it applies to, [] for
      the host's own), C(text), C(where) (where the fix is made - V(configuration), V(gpu), V(node), V(service),
      V(application), V(process), V(nothing)) and C(fix) (the user guide's table, "What fixes each finding").
    - C(host) holds C(mps_daemon) (PIDs of MPS control daemons and servers left running), C(fabricmanager) (V(running),
      V(not_running), or V(not_needed) where no GPU has an NVLink fabric), C(kernel_log) (V(kmsg), V(journalctl) or V(unreadable))
      and C(kernel_log_read) (C(complete), whether the log was read to its end; C(skipped_bytes), the older records
      not read; C(read_from), the time of the oldest record read when some were skipped, else null).
    - Null with O(health=false).
  returned: always
  type: dict
  sample:
    verdict: ok
    fail_on: fix_config
    evidence: []
    findings: []
    host:
      mps_daemon: []
      fabricmanager: not_needed
      kernel_log: kmsg
      kernel_log_read: {"complete": true, "skipped_bytes": 0, "read_from": null}
    since: 1796112001.52
    elapsed_s: 0.0012
"""

from ansible_collections.gpuops.clean_slate.plugins.module_utils import _inside, _module, _nvml, _pct, _verify


def main() -> None:
    module = _module.Module(
        argument_spec={**_verify.argument_spec(), **_pct.SCOPE_OPTIONS},
        supports_check_mode=True,
    ).ready()
    nvml = _module.Library("nvidia-ml-py", _nvml.HAS_PYNVML, _nvml.PYNVML_IMPORT_ERROR)
    _module.finish(module, lambda m: _verify.run(m, _inside.runner(m)), "gpu_mem_verify", libraries=[nvml], details=_verify.failure_details)


if __name__ == "__main__":
    main()
