#!/usr/bin/python
# Copyright (c) 2026, gpuops.clean_slate maintainers
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

from __future__ import annotations

DOCUMENTATION = r"""
module: gpu_procs_kill
short_description: End the processes holding NVIDIA GPUs, safely, with escalation
version_added: 0.1.0
author:
  - gpuops.clean_slate maintainers (@gpuops)
description:
  - Finds every process holding the selected GPUs, as the union of the processes NVML lists (compute, graphics, MPS),
    the holders of the GPUs' device files C(/dev/nvidia<minor>) (through C(/proc/*/fd) and C(/proc/*/maps), which
    finds forked children NVML never lists), and processes whose command line, name or executable match O(patterns)
    (which finds renamed workers such as C(sglang::scheduler_TP0) or C(VLLM::Worker_TP1)).
  - Never signals PID 1 of any namespace, kernel threads, this module and its ancestors (its interpreter, Ansible, sshd,
    sudo), processes outside the O(containers) scope, or protected daemons (C(nvidia-persistenced), C(nv-hostengine),
    C(dcgm-exporter), C(nvidia-fabricmanager), C(nvidia-imex), display servers, core system services), whatever the
    patterns say. Processes that hold device files without mapping them (management clients) are reported, not ended,
    unless O(kill_management_clients).
  - Sends O(signal) (SIGTERM) to each target, SIGCONT to stopped ones, waits up to O(grace_period), sends SIGKILL to
    survivors and waits up to O(kill_timeout). It returns as soon as the last target has exited.
  - A process is identified by pid and start time and signalled through a pidfd, so a pid reused between discovery
    and signal is never hit.
  - It does not wait for GPU memory to be released; use M(gpuops.clean_slate.gpu_mem_verify) after it, as the
    P(gpuops.clean_slate.clean_slate#role) role does.
extends_documentation_fragment:
  - gpuops.clean_slate._attributes
attributes:
  check_mode:
    support: full
    details: Reports the processes it would end, with the reasons, and signals nothing.
  diff_mode:
    support: full
    details: The diff shows the target processes before and the survivors after.
  idempotent:
    support: full
    details: A second run on a clean node finds nothing to end and reports no change.
options:
  gpus:
    description:
      - GPUs to clean, by index (V(0)), UUID or device file (V(/dev/nvidia0), by minor number). Empty means every GPU.
      - With a subset, only processes tied to those GPUs (by NVML or by their device file) are ended; processes found
        only by name, or holding only C(nvidiactl)/C(nvidia-uvm), count only when every GPU is selected.
    type: list
    elements: raw
    default: []
  discovery:
    description:
      - Sources used to find GPU processes besides O(patterns).
      - V(nvml) asks the driver; V(device_files) scans C(/proc) for holders of the device files.
    type: list
    elements: str
    choices: [nvml, device_files]
    default: [nvml, device_files]
  patterns:
    description:
      - Regular expressions (Python C(re.search)) matched against each process's command line, name (comm) and
        executable path. Matching processes become targets.
    type: list
    elements: str
    default: []
  users:
    description:
      - Only end processes owned by these users (names or uids). Empty means any user.
    type: list
    elements: str
    default: []
  include_children:
    description:
      - Also end every descendant of a target.
    type: bool
    default: false
  process_group:
    description:
      - Also end the other members of each target's process group, unless the group contains this module or one of
        its ancestors.
    type: bool
    default: false
  protect:
    description:
      - More process names (shell-style globs matched against comm, executable name and argv[0]) never to signal.
        They extend the default list.
    type: list
    elements: str
    default: []
  unprotect:
    description:
      - Names to remove from the default protect list, for example V(Xorg) on a workstation whose display server must
        go. PID 1, kernel threads, this module and its ancestors stay protected whatever is given.
    type: list
    elements: str
    default: []
  kill_management_clients:
    description:
      - Also end processes that hold GPU device files without mapping them (NVML monitoring clients).
    type: bool
    default: false
  containers:
    description:
      - On a Proxmox VE hypervisor, end only processes of these LXC containers (by vmid), identified by the PID
        namespace of the container's init (from C(pct status <vmid> --verbose)) or the cgroup path C(/lxc/<vmid>/).
      - Every target reports its container id when it has one.
    type: list
    elements: int
    default: []
  pct_path:
    description:
      - Path of the C(pct) command used to resolve O(containers). Found on E(PATH) and in C(/usr/sbin) by default;
        C(lxc-info) is used when there is no C(pct).
    type: path
  where:
    description:
      - A JMESPath expression applied to the list of candidate records (C(pid), C(name), C(cmdline), C(user), C(gpus),
        C(used_mib), C(container), C(reasons)); only the records it returns are ended.
      - For example V([?used_mib > `1024`]).
    type: str
  signal:
    description:
      - The first signal to send. V(KILL) skips the grace period.
    type: str
    choices: [TERM, INT, HUP, QUIT, USR1, USR2, KILL]
    default: TERM
  grace_period:
    description:
      - Seconds to wait after the first signal before sending SIGKILL.
    type: float
    default: 10
  kill_timeout:
    description:
      - Seconds to wait after SIGKILL before reporting a process as unkillable.
    type: float
    default: 10
  device_dir:
    description:
      - Directory holding the C(nvidia*) device files.
    type: path
    default: /dev
requirements:
  - psutil on the target
  - nvidia-ml-py (C(pynvml)) on the target for the V(nvml) source and for selecting GPUs
  - jmespath on the target when O(where) is used
notes:
  - The module fails, with the process state and kernel wait channel, when a target survives SIGKILL (a task stuck in
    the driver, state D); only a reboot or GPU reset frees such a process.
seealso:
  - module: gpuops.clean_slate.gpu_mem_verify
"""

EXAMPLES = r"""
---
- name: End everything holding any GPU (SIGTERM, 10 s grace, then SIGKILL)
  gpuops.clean_slate.gpu_procs_kill:

- name: End SGLang and vLLM workers, renamed ones included, and their children
  gpuops.clean_slate.gpu_procs_kill:
    patterns:
      - 'sglang'
      - 'vllm'
      - 'torchrun'
    include_children: true
    grace_period: 5
    kill_timeout: 5

- name: Clean only GPUs 2 and 3, with SIGINT first, then verify them
  block:
    - name: End the processes on GPUs 2 and 3
      gpuops.clean_slate.gpu_procs_kill:
        gpus: [2, 3]
        signal: INT
    - name: Wait for their memory to come back
      gpuops.clean_slate.gpu_mem_verify:
        gpus: [2, 3]

- name: Only big holders owned by the inference user
  gpuops.clean_slate.gpu_procs_kill:
    users: [inference]
    where: "[?used_mib > `1024`]"

- name: From a Proxmox hypervisor, clean LXC container 129 only
  gpuops.clean_slate.gpu_procs_kill:
    containers: [129]
    patterns: ['python3']

- name: Protect an extra exporter, and allow ending a stuck Xorg
  gpuops.clean_slate.gpu_procs_kill:
    protect: [my-gpu-exporter]
    unprotect: [Xorg]
    kill_management_clients: false

- name: Show what would be ended, without ending it
  gpuops.clean_slate.gpu_procs_kill:
    patterns: ['sglang::']
    discovery: [nvml]
    process_group: true
  check_mode: true
  diff: true
  register: plan

- name: Use a device directory other than /dev
  gpuops.clean_slate.gpu_procs_kill:
    device_dir: /run/nvidia/driver/dev
    pct_path: /usr/sbin/pct
"""

RETURN = r"""
targets:
  description: The processes selected for ending (would be ended, in check mode).
  returned: always
  type: list
  elements: dict
  contains:
    pid:
      description: Process id in the module's PID namespace.
      type: int
      sample: 4242
    name:
      description: Process name (comm).
      type: str
      sample: sglang::schedul
    cmdline:
      description: Command line.
      type: str
      sample: sglang::scheduler_TP0
    user:
      description: Owner.
      type: str
      sample: inference
    gpus:
      description: Indices of the GPUs it holds.
      type: list
      elements: int
      sample: [0]
    used_mib:
      description: GPU memory NVML attributes to it on the selected GPUs, null when unknown.
      type: int
      sample: 20000
    container:
      description: LXC/Proxmox container id, from its cgroup, or null.
      type: int
      sample: 129
    reasons:
      description: Why it was selected.
      type: list
      elements: str
      sample: ["listed by NVML on GPU 0 (20000 MiB)", "holds nvidia0 (fd+mmap)", "matches pattern 'sglang'"]
    signals_sent:
      description: Signals sent, in order.
      type: list
      elements: str
      sample: [TERM, KILL]
    outcome:
      description: V(terminated) (after the first signal), V(killed) (after SIGKILL), V(vanished) (gone before it was
        signalled), V(unkillable) (alive after SIGKILL), or null in check mode.
      type: str
      sample: terminated
    seconds:
      description: Seconds from the first signal until it was gone.
      type: float
      sample: 0.004
    state:
      description: Process state of an unkillable process (for example V(D)).
      type: str
      sample: D
    wchan:
      description: Kernel function an unkillable process waits in.
      type: str
      sample: __refrigerator
protected:
  description: Processes found but never signalled, with why.
  returned: always
  type: list
  elements: dict
  sample: [{"pid": 812, "name": "nvidia-persiste", "cmdline": "nvidia-persistenced", "why": "protected daemon (nvidia-persistenced)", "container": null}]
ignored:
  description: Processes or NVML entries left alone for another reason (stale NVML pid, other user, filtered by O(where)).
  returned: always
  type: list
  elements: dict
  sample:
    - pid: 842
      gpu: 0
      why: listed by NVML but does not exist here (a dead parent whose forked child holds the memory, or a process in another PID namespace)
summary:
  description: Counts of outcomes and of the signals sent.
  returned: always
  type: dict
  sample: {"terminated": 7, "killed": 2, "vanished": 0, "unkillable": 0, "signals": {"TERM": 9, "KILL": 2}}
notes:
  description: Caveats (processes that could not be inspected, NVML unavailable, ...).
  returned: always
  type: list
  elements: str
  sample: []
start:
  description: When the module started, as C(ansible.builtin.command) reports it (local time, microseconds).
  returned: always
  type: str
  sample: "2026-11-30 02:40:01.123456"
end:
  description: When the module ended.
  returned: always
  type: str
  sample: "2026-11-30 02:40:01.334567"
elapsed_s:
  description: Seconds the module took, discovery included.
  returned: always
  type: float
  sample: 0.21
"""

import datetime
import time
import traceback

from ansible.module_utils.basic import AnsibleModule, missing_required_lib

from ansible_collections.gpuops.clean_slate.plugins.module_utils import _nvml, _procs, _scope, _signals
from ansible_collections.gpuops.clean_slate.plugins.module_utils._errors import CleanSlateError


def build_request(module: AnsibleModule, notes: list) -> _procs.Request:
    """Validate every option and gather NVML facts; raises before anything is signalled."""
    p = module.params
    for name in ("grace_period", "kill_timeout"):
        if p[name] < 0:
            raise CleanSlateError(f"{name} must be >= 0 seconds, got {p[name]}.", reason="bad_arguments")
    for vmid in p["containers"]:
        if not 100 <= vmid <= 999999999:
            raise CleanSlateError(f"containers: {vmid} is not a valid Proxmox vmid (100-999999999).", reason="bad_arguments")
    selectors = _nvml.parse_gpu_selectors(p["gpus"])
    patterns = _procs.compile_patterns(p["patterns"])
    users = _procs.resolve_users(p["users"])
    protect = _procs.protect_list(p["protect"], p["unprotect"])
    where = None
    if p["where"]:
        # Imported only when needed: every module run pays for its imports.
        try:
            import jmespath
        except ImportError:
            module.fail_json(msg=missing_required_lib("jmespath"), exception=traceback.format_exc())
        try:
            where = jmespath.compile(p["where"])
        except jmespath.exceptions.JMESPathError as exc:
            raise CleanSlateError(f"where: {p['where']!r} is not a valid JMESPath expression: {exc}", reason="bad_arguments") from None

    every, gpus, processes = _nvml.gpus_and_processes(selectors, "nvml" in p["discovery"], p["device_dir"], notes)
    scopes = []
    if p["containers"]:
        pct = p["pct_path"] or module.get_bin_path("pct", opt_dirs=["/usr/sbin"])
        lxc_info = None if pct else module.get_bin_path("lxc-info", opt_dirs=["/usr/bin", "/usr/sbin"])
        scopes = _scope.resolve(p["containers"], lambda argv, data, binary: module.run_command(argv, data=data, binary_data=binary), pct, lxc_info)
    return _procs.Request(
        gpus=gpus,
        all_gpus=not selectors,
        nvml_processes=processes,
        every_gpu=every,
        use_nvml="nvml" in p["discovery"],
        use_device_files="device_files" in p["discovery"],
        patterns=patterns,
        users=users,
        include_children=p["include_children"],
        process_group=p["process_group"],
        scopes=scopes,
        device_dir=p["device_dir"],
        protect=protect,
        kill_management_clients=p["kill_management_clients"],
        where=where,
    )


def run(module: AnsibleModule) -> dict:
    start = time.monotonic()
    started = datetime.datetime.now()
    p = module.params
    notes: list = []
    request = build_request(module, notes)
    plan = _procs.discover(request)
    notes.extend(plan.notes)
    victims = {c.pid: _signals.Victim(pid=c.pid, identity=c.identity) for c in plan.targets}
    before = [f"{c.pid} {c.facts.comm}" for c in plan.targets]
    if plan.targets and not module.check_mode:
        victims = {c.pid: _signals.pin(c.pid, c.identity) for c in plan.targets}
        _signals.escalate(list(victims.values()), first=p["signal"], grace_period=p["grace_period"], kill_timeout=p["kill_timeout"])
    targets = []
    for c in plan.targets:
        v = victims[c.pid]
        rec = c.record()
        rec.update(signals_sent=v.signals_sent, outcome=v.outcome, seconds=v.seconds)
        if v.outcome == "unkillable":
            rec.update(state=v.state, wchan=v.wchan)
        targets.append(rec)
    counts: dict = {k: sum(1 for x in targets if x["outcome"] == k) for k in ("terminated", "killed", "vanished", "unkillable")}
    signals: dict = {}
    for x in targets:
        for s in x["signals_sent"]:
            signals[s] = signals.get(s, 0) + 1
    counts["signals"] = signals
    changed = bool(signals) if not module.check_mode else bool(plan.targets)
    result = {
        "changed": changed,
        "targets": targets,
        "protected": plan.protected,
        "ignored": plan.ignored,
        "summary": counts,
        "notes": notes,
        "elapsed_s": round(time.monotonic() - start, 4),
        "start": str(started),
        "end": str(datetime.datetime.now()),
    }
    if module._diff:  # pylint: disable=protected-access
        survivors = [f"{x['pid']} {x['name']}" for x in targets if x["outcome"] == "unkillable"]
        result["diff"] = {"before": "\n".join(before) + ("\n" if before else ""), "after": "\n".join(survivors) + ("\n" if survivors else "")}
    verb = "would end" if module.check_mode else "ended"
    result["msg"] = f"{verb} {len(targets)} process(es); {len(plan.protected)} protected"
    stuck = [x for x in targets if x["outcome"] == "unkillable"]
    if stuck:
        detail = "; ".join(f"PID {x['pid']} ({x['name']}) in state {x.get('state')} waiting in {x.get('wchan') or '?'}" for x in stuck)
        result["msg"] = (
            f"{len(stuck)} process(es) survived SIGKILL after {p['kill_timeout']} s: {detail}. They are stuck in the kernel"
            " (often the NVIDIA driver); only a GPU reset or a reboot frees them."
        )
        module.fail_json(**result)
    return result


def main() -> None:
    module = AnsibleModule(
        argument_spec={
            "gpus": {"type": "list", "elements": "raw", "default": []},
            "discovery": {"type": "list", "elements": "str", "choices": ["nvml", "device_files"], "default": ["nvml", "device_files"]},
            "patterns": {"type": "list", "elements": "str", "default": []},
            "users": {"type": "list", "elements": "str", "default": []},
            "include_children": {"type": "bool", "default": False},
            "process_group": {"type": "bool", "default": False},
            "protect": {"type": "list", "elements": "str", "default": []},
            "unprotect": {"type": "list", "elements": "str", "default": []},
            "kill_management_clients": {"type": "bool", "default": False},
            "containers": {"type": "list", "elements": "int", "default": []},
            "pct_path": {"type": "path"},
            "where": {"type": "str"},
            "signal": {"type": "str", "choices": ["TERM", "INT", "HUP", "QUIT", "USR1", "USR2", "KILL"], "default": "TERM"},
            "grace_period": {"type": "float", "default": 10},
            "kill_timeout": {"type": "float", "default": 10},
            "device_dir": {"type": "path", "default": "/dev"},
        },
        supports_check_mode=True,
    )
    if not _signals.HAS_PSUTIL:
        module.fail_json(msg=missing_required_lib("psutil"))
    try:
        module.exit_json(**run(module))
    except CleanSlateError as exc:
        module.fail_json(targets=[], protected=[], **exc.result())
    except Exception as exc:  # pylint: disable=broad-exception-caught
        module.fail_json(msg=f"gpu_procs_kill failed unexpectedly: {exc}", exception=traceback.format_exc(), reason="internal_error", targets=[])


if __name__ == "__main__":
    main()
