#!/usr/bin/python
# Copyright (c) 2026, gpuops.clean_slate maintainers
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

from __future__ import annotations

DOCUMENTATION = r"""
module: clean_slate_node
short_description: Every phase of a GPU node's clean slate in one module run
version_added: 0.3.0
author:
  - gpuops.clean_slate maintainers (@gpuops)
description:
  - Runs the phases of a clean slate on one host, in one remote execution, each through its own module's code, so
    that each phase's result is exactly what that module returns alone. V(preflight) reads the GPUs
    (M(gpuops.clean_slate.gpu_mem_verify) with the O(verify) options, C(timeout=0), C(fail_on_dirty=false)); V(kill)
    ends the GPU processes (M(gpuops.clean_slate.gpu_procs_kill) with the O(kill) options), after the O(pre_stop)
    commands when there is something to end; V(residue) removes what dead jobs left
    (M(gpuops.clean_slate.gpu_job_residue) with the O(residue) options); V(restore) puts back the modes the last job
    changed (M(gpuops.clean_slate.gpu_mode_restore) with the O(restore) options); V(verify) waits until every GPU is
    clean and judges its health (M(gpuops.clean_slate.gpu_mem_verify) with the O(verify) options).
  - This is what the C(gpuops.clean_slate.clean_slate) role runs. Ansible pays for every module it runs (a worker on
    the controller, the transfer, an interpreter start on the host); one run instead of four keeps the whole playbook
    within a breath of the modules' own time.
  - Every option of every selected phase is checked before the first phase runs, so bad input is refused
    (RV(reason=bad_arguments)) before anything is read, signalled or removed.
  - A kill never runs on GPUs that were not read (RV(reason=gpus_not_read)), unless C(allow_name_only) in O(kill); that
    option also lets a driver that cannot be read go on to a name-only kill.
  - The run stops at the first phase that fails; the module then fails with that phase's RV(reason) and RV(msg), names
    the phase in RV(phase) and keeps every phase's result.
  - Its action plugin chooses the phases from the run's tags when O(phases) is not given (see O(phases)).
extends_documentation_fragment:
  - gpuops.clean_slate._attributes
  - gpuops.clean_slate._containers
attributes:
  check_mode:
    support: full
    details:
      - Each phase runs in check mode (the kill reports what it would end, the residue what it would remove).
      - The pre-stop commands on the host do not run; those in a container are reported as they would run.
  diff_mode:
    support: full
    details: The diffs of the kill and residue phases, as a list.
  idempotent:
    support: full
    details: A second run on a clean node finds nothing to end or remove and reports no change.
options:
  phases:
    description:
      - The phases this task may run, always in the order V(preflight), V(kill), V(residue), V(restore), V(verify).
        Default all.
      - The action plugin runs those of them that the run's tags select, each phase judged as Ansible judges a task
        that carries the phase's tags (V(preflight) C(clean_slate), C(clean_slate_preflight), C(clean_slate_kill);
        V(kill) C(clean_slate), C(clean_slate_kill); V(residue) C(clean_slate), C(clean_slate_residue); V(restore)
        C(clean_slate), C(clean_slate_restore); V(verify) C(clean_slate), C(clean_slate_verify)) plus the tags the
        task inherits (an including task's C(apply), a block, a role's tags), against C(--tags) and C(--skip-tags).
        With no phase selected, nothing runs on the host and the task is skipped.
    type: list
    elements: str
    choices: [preflight, kill, residue, restore, verify]
  verify:
    description:
      - The options of M(gpuops.clean_slate.gpu_mem_verify), for the V(verify) phase; the V(preflight) phase uses them
        too, with C(timeout=0), C(fail_on_dirty=false), no O(gpuops.clean_slate.gpu_mem_verify#module:expected_count), no health
        verdict and no CUDA probe (the start is proven after the kill and the residue, never before).
    type: dict
    default: {}
  kill:
    description:
      - The options of M(gpuops.clean_slate.gpu_procs_kill) but O(containers) and O(pct_path), which are this module's.
      - The plan taken before the O(pre_stop) commands is that module in check mode with the same options.
    type: dict
    default: {}
  residue:
    description:
      - The options of M(gpuops.clean_slate.gpu_job_residue) but O(containers) and O(pct_path), which are this module's.
      - With the V(kill) phase in the same run, who holds each candidate is read right before the kill, and a file whose
        holders that kill ended is orphaned at once, whatever its age (in check mode, whose holders it would end).
    type: dict
    default: {}
  profiles:
    description:
      - What server profiles add to the O(kill) and O(residue) options, each list after the one given (or, when the
        option is not given, after its module's default), without repeats - the C(gpuops.clean_slate.server_profiles)
        filter's result, as the C(gpuops.clean_slate.clean_slate) role passes it. Keys - C(patterns) (to both),
        C(servers) (O(gpuops.clean_slate.gpu_procs_kill#module:servers)), C(shm), C(sockets), C(locks), C(dirs),
        C(files), C(caches), C(dirs_holding), C(keep_while) (the residue options of those names) and C(ports)
        (O(gpuops.clean_slate.gpu_job_residue#module:server_ports)). An unknown key is refused.
    type: dict
    default: {}
  restore:
    description:
      - The options of M(gpuops.clean_slate.gpu_mode_restore), for the V(restore) phase (after the residue, before the
        verification). In check mode a GPU still in use does not stop the run there.
      - The V(restore) phase runs only when this declares something; V({}) leaves it out.
    type: dict
    default: {}
  pre_stop:
    description:
      - Commands run before the kill, only when the kill has something to end, for example a graceful
        C(systemctl stop sglang). Each is split like the C(cmd) of M(ansible.builtin.command) (no shell).
      - With O(containers) they run inside the (first) container, through C(pct exec), as
        M(gpuops.clean_slate.pct_exec) runs them; else on the host. The first that fails stops the run before anything
        is signalled.
    type: list
    elements: str
    default: []
  pre_stop_timeout:
    description: Seconds each O(pre_stop) command may take (more than 0).
    type: float
    default: 60
  metrics:
    description:
      - Write the host's outcome as node_exporter textfile metrics (C(clean_slate_<host>.prom) in O(metrics.dir)) at
        the end of the run, whatever the outcome; the outcome is computed as the C(gpuops.clean_slate.clean_slate_result)
        filter computes it. Written whole (a temporary file renamed over it), not in check mode.
      - O(metrics.dir) is checked before any phase runs (an absolute path to a writable directory), so that a mistyped
        directory refuses the run (V(bad_arguments)) before anything is ended.
    type: dict
    suboptions:
      dir:
        description: node_exporter's textfile directory (its C(--collector.textfile.directory)) on this host.
        type: path
        required: true
      host:
        description: The C(host) label of the series (the inventory name).
        type: str
        required: true
  stop:
    description:
      - Run no phase; fail with this phase, reason and message (after writing O(metrics)). The
        C(gpuops.clean_slate.clean_slate) role passes it for a host it refused before the clean (a bad variable,
        dependencies it could not install), so that the host's metrics say so like any other failure.
    type: dict
    suboptions:
      phase:
        description: Where the host stopped.
        type: str
        required: true
        choices: [arguments, dependencies]
      reason:
        description: Why.
        type: str
        required: true
        choices: [bad_variable, missing_dependencies, dependency_install_failed]
      msg:
        description: What to do.
        type: str
        required: true
  python:
    description:
      - The interpreter to run this module with on the host (the role's virtual environment), unless an extra variable
        sets C(ansible_python_interpreter). Read by the action plugin; empty means the host's own.
    type: str
  record:
    description:
      - Read by the action plugin. After the run, build the host's result with the code of the
        P(gpuops.clean_slate.clean_slate_result#filter) filter, from the run and this context (the filter's C(context) argument),
        and set it as the host's variable C(clean_slate_result), as M(ansible.builtin.set_fact) would; the run then
        returns RV(recorded=true). The C(gpuops.clean_slate.clean_slate) role passes it, so that its record needs no
        task of its own on each host.
      - The context's C(host), C(delegate) (where the module ran), C(mode) (V(hypervisor) with O(containers)), C(label),
        C(check_mode) and C(role_path) default to the run's own; this option adds the rest (C(fail_on_dirty),
        C(health_fail_on)) and wins.
      - An action can set a variable this way from ansible-core 2.21 on; before, the run returns RV(recorded=false) and
        the role builds the result with the filter. Ansible sets it only when the task neither fails nor is skipped
        (the role registers the run with C(failed_when) false); a run that selects no phase is skipped and returns
        RV(recorded=false).
    type: dict
  containers:
    description:
      - On a Proxmox VE hypervisor, the LXC containers (by vmid) whose processes the kill may end and whose residue is
        looked at; see the same option of M(gpuops.clean_slate.gpu_procs_kill) and M(gpuops.clean_slate.gpu_job_residue).
      - The verify phase makes its CUDA start and its device-file checks inside the container (the same option of
        M(gpuops.clean_slate.gpu_mem_verify)), so with O(verify) selected it takes one container; more are refused with
        RV(reason=bad_arguments) before anything runs.
    type: list
    elements: int
    default: []
seealso:
  - module: gpuops.clean_slate.gpu_mem_verify
  - module: gpuops.clean_slate.gpu_procs_kill
  - module: gpuops.clean_slate.gpu_job_residue
  - module: gpuops.clean_slate.gpu_mode_restore
"""

EXAMPLES = r"""
---
- name: Give the node's GPUs a clean slate in one module run
  gpuops.clean_slate.clean_slate_node:
    kill:
      patterns: ['^sglang::', '^VLLM::']
      include_children: true
      grace_period: 5
    residue:
      ports: [30000]
    verify:
      expected_count: 8
    pre_stop:
      - systemctl stop sglang
  register: slate

- name: Only read the GPUs
  gpuops.clean_slate.clean_slate_node:
    phases: [preflight]
"""

RETURN = r"""
recorded:
  description: Whether the action plugin set the host's C(clean_slate_result) (O(record)).
  returned: when O(record) is given
  type: bool
  sample: true
phases:
  description: The phases this run was asked for, in the order they run.
  returned: always
  type: list
  elements: str
  sample: [preflight, kill, residue, verify]
phase:
  description: The phase that failed, V(done) when none did.
  returned: always
  type: str
  sample: done
before:
  description:
    - What M(gpuops.clean_slate.gpu_mem_verify) returned for the before picture (its failure shape with C(failed) when it
      failed; C(failed) false when C(allow_name_only) in O(kill) lets an unreadable driver go on).
  returned: when the preflight phase ran
  type: dict
guard:
  description: Why the kill was refused (C(reason=gpus_not_read)).
  returned: when the kill was refused
  type: dict
plan:
  description: What M(gpuops.clean_slate.gpu_procs_kill) returned in check mode before the pre-stop commands.
  returned: when there are pre-stop commands and the kill phase ran
  type: dict
pre_stop:
  description: One result per pre-stop command that ran (C(item) the command, C(rc), C(stdout), C(stderr), C(failed)).
  returned: when the pre-stop commands ran
  type: list
  elements: dict
kill:
  description: What M(gpuops.clean_slate.gpu_procs_kill) returned.
  returned: when the kill phase ran
  type: dict
residue:
  description: What M(gpuops.clean_slate.gpu_job_residue) returned.
  returned: when the residue phase ran
  type: dict
restore:
  description: What M(gpuops.clean_slate.gpu_mode_restore) returned.
  returned: when the restore phase ran
  type: dict
verify:
  description: What M(gpuops.clean_slate.gpu_mem_verify) returned.
  returned: when the verify phase ran
  type: dict
msg:
  description: Each phase's message, or the failed phase's.
  returned: always
  type: str
reason:
  description:
    - Why the module failed, the failed phase's reason - V(gpus_not_read), V(command_failed) (a pre-stop command),
      those of M(gpuops.clean_slate.gpu_mem_verify) (V(not_clean), V(missing_gpus), V(unhealthy), V(not_ready_together), V(library_not_found),
      V(driver_not_loaded), V(driver_library_mismatch), V(no_permission), V(not_supported), V(timeout), V(gpu_lost),
      V(needs_reset), V(nvml_error), V(driver_hung), V(device_missing)), of M(gpuops.clean_slate.gpu_procs_kill) (V(no_discovery_source), V(unkillable),
      V(holders_remain)), of M(gpuops.clean_slate.gpu_job_residue) (V(port_in_use), V(port_connected),
      V(port_time_wait), V(remove_failed), V(scan_incomplete)), of M(gpuops.clean_slate.gpu_mode_restore) (V(busy),
      V(restore_failed)), V(not_running), V(no_such_container) or V(pct_failed)
      (the containers), V(bad_arguments), V(missing_library) or V(internal_error); the O(stop) given
      (V(bad_variable), V(missing_dependencies), V(dependency_install_failed)); V(metrics_not_written) when
      O(metrics) could not be written.
    - The failure shape all the collection's modules share (RV(reason), RV(msg), details); the user guide lists every reason.
  returned: failure
  type: str
  sample: not_clean
python:
  description: The interpreter that ran the module and which of the collection's Python dependencies it lacks.
  returned: always
  type: dict
  sample: {"executable": /usr/bin/python3, "version": 3.11.2, "missing": []}
metrics:
  description: The metrics file written (C(path)), or why not (C(failed), C(msg)).
  returned: when O(metrics) was given and not in check mode
  type: dict
elapsed_s:
  description: Seconds the module took, every phase included.
  returned: always
  type: float
  sample: 1.24
timings:
  description:
    - Where the seconds went - C(before_run) (from the process's start to the module's own code - the interpreter's
      start and the payload's import, to the kernel's clock tick), then each phase that ran (C(preflight), C(plan),
      C(pre_stop), C(kill), C(residue), C(restore), C(verify)) and C(metrics). For a profile of a run
      (tools/bench/cost.py); nothing depends on it.
  returned: always
  type: dict
  sample: {"before_run": 0.21, "preflight": 0.09, "kill": 0.05, "residue": 0.12, "verify": 0.72}
"""

# First: in the payload on the target, the collection's files below are then loaded from a bytecode cache instead of
# compiled again at every run (module_utils/_pyc.py says how, and what it trusts).
from ansible_collections.gpuops.clean_slate.plugins.module_utils import _pyc

_pyc.install()

from ansible_collections.gpuops.clean_slate.plugins.module_utils import _module, _node


def main() -> None:
    module = _module.Module(argument_spec=_node.argument_spec(), supports_check_mode=True).ready()
    _module.finish(module, _node.run, "clean_slate_node", details=_node.failure_details)


if __name__ == "__main__":
    main()
