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
  - Finds every process holding the selected GPUs from the processes NVML lists (compute, graphics, MPS), the holders
    of the GPUs' device files C(/dev/nvidia<minor>) (through C(/proc/*/fd) and C(/proc/*/maps), which finds forked
    children NVML never lists), and processes whose command line, name or executable match O(patterns) (which finds
    renamed workers such as C(sglang::scheduler_TP0) or C(VLLM::Worker_TP1)).
  - An NVML entry must be corroborated before it is trusted. It is dropped, and listed in RV(ignored) with the reason,
    when its pid does not exist in this PID namespace (a dead parent whose forked child holds the memory, which the
    device files find, or a process of another namespace), is a zombie, exits while being inspected, or, with the
    V(device_files) source on and the process's file descriptors readable, does not hold that GPU's device file (a
    stale entry, or a pid from another namespace that names an innocent process here). With V(device_files) off or
    unavailable (no GPU device file in O(device_dir)), or for a process whose file descriptors cannot be read (without
    C(become)), NVML's word alone is trusted.
  - Never signals PID 1 of any namespace, kernel threads, this module, its ancestors and the processes it started,
    any Ansible process on the host (the controller and its workers, C(ansible-connection), async wrappers, other
    modules, also under C(async)), processes outside the O(containers) scope, or protected daemons
    (C(nvidia-persistenced), C(nv-hostengine), C(dcgm-exporter), C(nvidia-fabricmanager), C(nvidia-imex), display
    servers, core system services), whatever the patterns say. A daemon is recognised by its executable
    (C(/proc/<pid>/exe)), not by the name it gives itself. Processes that hold device files without mapping them
    (management clients) are reported, not ended, unless O(kill_management_clients).
  - A protected process that holds GPU memory is listed in RV(protected) with the GPUs and memory it holds, and the
    module warns, since that GPU cannot come clean while it runs.
  - With O(trees) (the default) it ends whole server trees in one run, adding the members of each target's session when a
    target leads that session (SGLang starts each scheduler in a session of its own), and of its process group when a
    target leads the group or its leader has exited (a launcher that died leaves its workers there, reparented to
    PID 1 or a subreaper). A session or group led by a live process that is no target (a login shell, a supervisor, a
    container's init) is never entered, nor one that holds this module, an Ansible process or an init; with O(gpus),
    a member holding another GPU is left out (RV(ignored)). Protection applies to the members as to any target.
  - Sends O(signal) (SIGTERM) to each target, SIGCONT to stopped ones, waits up to O(grace_period), sends SIGKILL to
    survivors and waits up to O(kill_timeout). It returns as soon as the last target has exited.
  - With O(servers) it stops each server in its own order. A live target whose command line matches a server's
    O(servers[].roots) (SGLang's launcher, vLLM's API server) gets O(signal) first, alone, and up to that server's
    O(servers[].grace) to tear its tree down itself (SGLang's launcher asks its schedulers to release their resources,
    then kills the rest of its tree; its schedulers have no SIGTERM handler, so a TERM sent to them directly is a raw
    crash that leaves their files). What is left of the tree then is ended as above, a root still there with SIGKILL.
    Without a live root (a crash - the root is dead, its workers reparented) the rest is ended at once.
  - With O(spare_trackers) (the default) a multiprocessing resource tracker (C(-c from multiprocessing.resource_tracker
    import main;main(N)), and loky's) is ended last - spared while any process still holds its pipe (its clients),
    given O(tracker_timeout) after the last one is gone to unlink the shared memory and semaphores they registered and
    exit on its own, and ended only if it is still there then. One whose client is a process this run does not end is
    left alone (RV(targets[].outcome=spared)), since it is still needed.
  - A target that is already exiting (its teardown in the GPU driver under way, dying or a zombie whose last
    thread is still tearing down) is never signalled (again), since SIGKILL cannot shorten a teardown. It is waited for,
    until O(deadline), and reported with RV(targets[].teardown_s); past the deadline, while its teardown makes progress
    (the memory of the selected GPUs going down, its state, wait channel or CPU time changing; GB300 teardowns take more
    than 30 s), up to O(teardown_timeout) after the first signal. One still there then, one that made no progress for
    O(teardown_stall) seconds past the deadline, or one that has not even begun to exit O(kill_timeout) after SIGKILL,
    fails the module with RV(reason=unkillable) and RV(verdict=reboot), and the module returns then.
  - Then it looks again, and ends in a new round whatever appeared meanwhile (workers a launcher forked during the
    grace period, a service restarted under it), until a discovery finds nothing or O(deadline) passes. Processes
    still found then make the module fail with RV(reason=holders_remain).
  - A process is identified by pid and start time and signalled through a pidfd, so a pid reused between discovery
    and signal is never hit.
  - The module warns when a discovery source it was asked to use is unavailable (NVML cannot be read, the device files
    are absent or cannot be read). With neither NVML nor device files, only O(patterns) could find processes, and a
    match by name alone cannot tell a GPU job from anything else of that name; the module then refuses
    (RV(reason=no_discovery_source)) unless O(allow_name_only=true).
  - It does not wait for GPU memory to be released; use M(gpuops.clean_slate.gpu_mem_verify) after it, as the
    P(gpuops.clean_slate.clean_slate#role) role does.
extends_documentation_fragment:
  - gpuops.clean_slate._attributes
  - gpuops.clean_slate._containers
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
      - An empty list with no O(patterns) is refused (nothing could be found); an empty list with O(patterns) is
        matching by name only, which needs O(allow_name_only=true).
    type: list
    elements: str
    choices: [nvml, device_files]
    default: [nvml, device_files]
  allow_name_only:
    description:
      - Allow the kill when no GPU discovery source is available (NVML cannot be read and there are no readable
        device files, or O(discovery) is empty), so that only O(patterns) find processes.
      - Without it the module refuses such a run with RV(reason=no_discovery_source), because a name alone cannot
        tell a GPU job from any other process of that name. With it the module warns and ends what the patterns match.
      - The role variable C(clean_slate_allow_name_only) feeds it.
    type: bool
    default: false
  patterns:
    description:
      - Regular expressions (Python C(re.search)) matched against each process's command line, name (comm) and
        executable path. Matching processes become targets.
      - An empty pattern is refused, since it would match every process; write V(.*) if that is really meant.
    type: list
    elements: str
    default: []
  users:
    description:
      - Only end processes owned by these users (names or uids). Empty means any user.
      - A user name or uid that does not exist on the host is refused (a uid exists when the host's passwd or
        C(/etc/subuid) has it, or a process runs as it).
      - With O(containers), names are looked up in each container's C(/etc/passwd) and uids are the container's,
        mapped to the host's through the container's user namespace (an unprivileged container's V(root) is the
        host's uid 100000); one the container does not know is refused.
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
      - Also end the other members of each target's process group, whoever leads it, unless the group contains this
        module or one of its ancestors. O(trees) enters a group only when a target leads it or its leader has exited.
    type: bool
    default: false
  trees:
    description:
      - End whole server trees, found through their sessions and process groups (see the description), that is the
        members of a session a target leads, and of a process group a target leads or whose leader has exited.
    type: bool
    default: true
  protect:
    description:
      - More programs never to signal, as shell-style globs matched against the basename of the process's executable
        (C(/proc/<pid>/exe)) and, for a program run by an interpreter (C(python3 /opt/exporter.py)), the script's
        basename. They extend the default list.
      - The name a process gives itself (comm, argv[0], a C(setproctitle) title) does not count, so no process can
        borrow a protected name; it counts only when the executable cannot be read (then the process is protected
        by name, on the safe side). Proxmox VE's Perl daemons (C(pvedaemon), C(pveproxy), ...) are protected as perl
        running under their names.
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
      - Seconds to wait after the first signal before sending SIGKILL, from 0 to 86400 (one day).
    type: float
    default: 10
  kill_timeout:
    description:
      - Seconds to wait after SIGKILL for a process to begin to exit, from 0 to 86400 (one day); one that has not is
        reported as unkillable. One that is exiting (its GPU teardown under way) is waited for until O(deadline).
    type: float
    default: 10
  deadline:
    description:
      - Seconds from the first signal within which the module may start new rounds, for processes that appeared
        during the kill, from 0 to 86400 (one day). A later round gets what is left of it as its grace period; SIGKILL
        always gets O(kill_timeout). Processes still found when it has passed make the module fail; a process still
        in its teardown then is unkillable. The module returns by this deadline, or by O(grace_period) plus
        O(kill_timeout) after the first signal if that is later.
      - Unset means twice the sum of O(grace_period) and O(kill_timeout), plus the longest O(servers[].grace), at most
        86400.
    type: float
  servers:
    description:
      - Servers to stop in their own order, each by the command lines of its roots (the process its own stop starts
        from). The role's server profiles give SGLang's launcher and vLLM's API server, with the grace their teardown
        needs.
      - A root pattern that does not compile, and a grace outside 0-86400 seconds, are refused before anything is
        signalled.
    type: list
    elements: dict
    default: []
    suboptions:
      name:
        description: The server's name, for the records.
        type: str
        required: true
      roots:
        description: Regular expressions searched in the command line; a target matching one is that server's root.
        type: list
        elements: str
        required: true
      grace:
        description: Seconds the root is given to tear its tree down before the rest is ended; unset means O(grace_period).
        type: float
  spare_trackers:
    description:
      - End a multiprocessing (or loky) resource tracker only once its clients are gone, after O(tracker_timeout) to unlink
        what they registered; V(false) ends it with the rest, as any target.
    type: bool
    default: true
  tracker_timeout:
    description: Seconds a spared resource tracker is given to unlink and exit on its own after its last client is gone.
    type: float
    default: 2
  teardown_timeout:
    description:
      - Seconds from the first signal up to which a target whose teardown still makes progress is waited for, past
        O(deadline).
    type: float
    default: 120
  teardown_stall:
    description:
      - Seconds without progress after which a target still in its teardown past O(deadline) is unkillable.
    type: float
    default: 10
  device_dir:
    description:
      - Directory holding the C(nvidia*) device files. It must exist.
    type: path
    default: /dev
  probe_timeout:
    description:
      - Seconds one NVML call may take, from 0.1 to 3600. Every NVML call runs in a helper process; a call that has
        not returned by then is abandoned (the helper is killed), the module warns that the driver is hung on that GPU
        and finds that GPU's processes through the device files only. Each hung GPU costs this once.
    type: float
    default: 10
requirements:
  - psutil on the target
  - nvidia-ml-py (C(pynvml)) on the target for the V(nvml) source and for selecting GPUs
  - jmespath on the target when O(where) is used
notes:
  - The module fails, with the process state and kernel wait channel, when a target survives SIGKILL (a task stuck in
    the driver, state D); only a reboot or GPU reset frees such a process.
  - Numbers that are not finite (V(nan), V(inf)) or out of range, a O(device_dir) that does not exist and a O(pct_path)
    that names no executable are refused with RV(reason=bad_arguments), naming the option, before anything is signalled.
  - Every failure carries RV(reason). A failure after signals were sent still lists, in RV(targets), every signal sent.
  - Safe under C(async); the guide's section on running it safely explains how Ansible's processes are recognised.
seealso:
  - module: gpuops.clean_slate.gpu_mem_verify
"""

EXAMPLES = r"""
---
- name: End everything holding any GPU (SIGTERM, 10 s grace, then SIGKILL)
  gpuops.clean_slate.gpu_procs_kill:

- name: End SGLang and vLLM workers, renamed ones (VLLM::Worker_TP1) included, and their children
  gpuops.clean_slate.gpu_procs_kill:
    # Patterns are case-sensitive regular expressions: (?i) makes them match VLLM:: too.
    patterns:
      - '(?i)sglang'
      - '(?i)vllm'
      - 'torchrun'
    include_children: true
    grace_period: 5
    kill_timeout: 5

- name: Stop SGLang in its own order (its launcher first, alone, 25 s for its own teardown), then the rest
  gpuops.clean_slate.gpu_procs_kill:
    patterns: ['^sglang::', 'sglang\.launch_server']
    servers:
      - name: sglang
        roots: ['-m sglang\.launch_server( |$)', '(^|/)sglang serve( |$)']
        grace: 25
    # A GB300's teardown takes more than 30 s: wait for one that makes progress up to 3 minutes.
    teardown_timeout: 180

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

- name: On a host whose driver cannot be read, end the SGLang workers by name only
  gpuops.clean_slate.gpu_procs_kill:
    patterns: ['^sglang::']
    allow_name_only: true

- name: Give a launcher's late workers up to a minute in all
  gpuops.clean_slate.gpu_procs_kill:
    patterns: ['torchrun']
    include_children: true
    deadline: 60

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
      description: Process name (comm); a byte that is not UTF-8 appears as C(\xNN).
      type: str
      sample: sglang::schedul
    cmdline:
      description: Command line, its words joined by spaces; a byte that is not UTF-8 appears as C(\xNN).
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
    step:
      description: Its step in its round's stop - V(root) (a server's root, signalled first and alone), V(tree) (the
        rest, ended after the roots had their grace) or V(tracker) (a resource tracker, ended last, once its clients were
        gone).
      type: str
      sample: root
    server:
      description: A root's server (O(servers[].name)), with its RV(targets[].grace).
      type: str
      sample: sglang
    grace:
      description: The seconds a root was given to tear its tree down.
      type: float
      sample: 25.0
    ended_by:
      description: How it ended - V(own_stop) (a root that exited within its grace after its first signal, its own
        teardown run), V(server_stop) (its server's stop ended it, no signal from this module), V(own_exit) (a resource
        tracker that exited on its own once its clients were gone), the first signal's name (V(TERM), it exited on it),
        V(KILL), V(waited) (it was already exiting), V(gone) (it had exited before its signal); null when it did not
        end or in check mode.
      type: str
      sample: own_stop
    why:
      description: For a spared resource tracker, who still needs it.
      type: str
      sample: "a resource tracker whose client PID 812 (python3) lives and is not ended by this run: spared, ..."
    round:
      description: The round that found it; V(1) for what the first discovery found, more for a process that appeared
        during the kill (a worker a launcher forked in the grace period). Null in check mode.
      type: int
      sample: 1
    outcome:
      description: V(terminated) (after the first signal), V(killed) (after SIGKILL), V(exited) (it was already exiting
        and got no signal; it was waited for), V(stopped) (ended by its server's own stop, or a resource tracker on its
        own once its clients were gone; RV(targets[].ended_by) says which), V(spared) (a resource tracker a process this
        run does not end still needs, left alone), V(vanished) (gone before it was signalled), V(unkillable) (still there
        at the deadline, or not exiting after SIGKILL), or null in check mode.
      type: str
      sample: terminated
    seconds:
      description: Seconds from the first signal (or, for V(exited), from the start of the kill) until it was gone.
      type: float
      sample: 0.004
    teardown_s:
      description: Seconds the kill waited for its teardown in the driver, from when it was found exiting (when its
        grace period or O(kill_timeout) ran out, or already at the start) until it was gone or the deadline passed.
        Absent when it was gone within its grace period.
      type: float
      sample: 31.2
    state:
      description: Process state of an unkillable process (for example V(D)).
      type: str
      sample: D
    wchan:
      description: Kernel function an unkillable process waits in.
      type: str
      sample: __refrigerator
    exiting:
      description: For an unkillable process, whether it had begun to exit (stuck in its teardown) or not (SIGKILL not
        even acted on).
      type: bool
      sample: true
protected:
  description:
    - Processes found but never signalled, with why.
    - One that holds GPU memory also has C(gpus), C(used_mib) and C(holds_gpu_memory=true); its GPUs cannot come clean
      while it runs.
  returned: always
  type: list
  elements: dict
  sample: [{"pid": 812, "name": "nvidia-persiste", "cmdline": "nvidia-persistenced", "why": "protected daemon (nvidia-persistenced)", "container": null}]
remaining:
  description: Processes still found when O(deadline) had passed (something keeps starting them), as target records.
  returned: when the module fails with RV(reason=holders_remain)
  type: list
  elements: dict
  sample: [{"pid": 5120, "name": "sglang::schedul", "reasons": ["holds nvidia0 (fd+mmap)"]}]
msg:
  description: What was ended, in one sentence; on failure, what went wrong and what to do.
  returned: always
  type: str
  sample: ended 9 process(es); 1 protected
reason:
  description:
    - Why the module failed. V(bad_arguments) (refused before anything was signalled), V(no_discovery_source) (no
      GPU discovery source and no O(allow_name_only)), V(unkillable) (a target survived SIGKILL), V(holders_remain)
      (processes still found after O(deadline)), V(not_running), V(no_such_container) or V(pct_failed) (resolving
      O(containers)), V(missing_library), V(internal_error) (a bug; RV(targets) still lists every signal sent), or,
      when selecting GPUs needs the driver, V(library_not_found), V(driver_not_loaded), V(driver_library_mismatch),
      V(no_permission), V(not_supported), V(timeout), V(gpu_lost), V(needs_reset), V(nvml_error) (NVML failed; the
      message says why and what to do) or V(driver_hung) (NVML did not open within O(probe_timeout)).
    - The failure shape all the collection's modules share (RV(reason), RV(msg), details); the user guide lists every reason.
  returned: failure
  type: str
  sample: holders_remain
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
  description:
    - Counts of outcomes and of the signals sent, the number of rounds, and how many targets appeared during the kill
      (found after the first round).
    - V(vanished) counts targets that had exited before their first signal, V(exited) those already exiting (waited
      for, not signalled); neither is counted as ended. V(stopped) counts those their server's own stop ended (and
      resource trackers that exited on their own), V(spared) the resource trackers left alone; both only when there are any.
    - V(teardown) counts the targets whose teardown the kill waited for (RV(targets[].teardown_s)), V(teardown_s) is the
      longest such wait.
  returned: always
  type: dict
  sample: {"terminated": 7, "killed": 2, "exited": 0, "vanished": 0, "unkillable": 0, "stopped": 3, "teardown": 1,
    "teardown_s": 1.8, "signals": {"TERM": 9, "KILL": 2}, "rounds": 1, "respawned": 0}
verdict:
  description: V(reboot) when the module fails with RV(reason=unkillable), since a process the kernel cannot end keeps
    its GPU until the node reboots (the health verdict's scale, C(ok) < C(restart_app) < C(fix_config) < C(reset_gpu) <
    C(reboot) < C(drain)).
  returned: when the module fails with RV(reason=unkillable)
  type: str
  sample: reboot
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

from ansible_collections.gpuops.clean_slate.plugins.module_utils import _kill, _module, _pct, _signals


def main() -> None:
    module = _module.Module(
        argument_spec={**_kill.argument_spec(), **_pct.SCOPE_OPTIONS},
        supports_check_mode=True,
    ).ready()
    run = _kill.ModuleRun(_pct.scopes_of(module))
    psutil = _module.Library("psutil", _signals.HAS_PSUTIL)
    # Every failure lists every signal sent before it (run.details), whatever failed.
    _module.finish(module, run, "gpu_procs_kill", libraries=[psutil], details=run.details)


if __name__ == "__main__":
    main()
