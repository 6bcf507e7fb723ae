#!/usr/bin/python
# Copyright (c) 2026, gpuops.clean_slate maintainers
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

from __future__ import annotations

DOCUMENTATION = r"""
module: pct_exec
short_description: Run a command inside a Proxmox VE LXC container with pct exec
version_added: 0.1.0
author:
  - gpuops.clean_slate maintainers (@gpuops)
description:
  - Runs on a Proxmox VE node and executes a command inside one of that node's LXC containers through C(pct exec),
    without SSH access to the container.
  - The command line is built as a list and never parsed by a shell on the node; pct's own options come before C(--),
    the command after it, so arguments with spaces, quotes, command substitutions, leading dashes or any Unicode reach the container
    unchanged. O(command) is the one place a shell runs, C(/bin/sh -c) inside the container.
  - Nothing is expanded on the node either, unlike M(ansible.builtin.command). C($VAR), C(${VAR}) and C(~) in O(argv),
    O(command), O(env) values, O(chdir), O(creates) and O(removes) reach the container as written (where the shell of
    O(command) may expand them with the container's own environment), so the node's environment never leaks into the
    container. RV(cmd) is exactly the command line that ran.
  - Checks the container with C(pct status) first and reports pct's own failures with a RV(reason) (V(no_such_container),
    V(not_running), V(bad_arguments), V(pct_failed)) recognised from pct's messages, instead of guessing from exit code
    255, which pct and the command share. A command that fails gives V(command_failed); one that runs past O(timeout)
    gives V(timeout).
  - When the remote user is not root, pct runs through C(sudo -n), which fails instead of prompting.
extends_documentation_fragment:
  - gpuops.clean_slate._attributes
attributes:
  check_mode:
    support: partial
    details:
      - In check mode the module checks that the container exists and runs, evaluates O(creates) and O(removes),
        and reports what would run; it does not run the command.
  diff_mode:
    support: none
  idempotent:
    support: N/A
    details:
      - Whether the command is idempotent depends on the command; use O(creates) or O(removes) to skip it.
options:
  vmid:
    description:
      - ID of the container, 100 to 999999999.
      - Only containers whose configuration lives on the node the task runs on are visible to pct; run the task on the
        container's node (the inventory plugin P(gpuops.clean_slate.proxmox#inventory) sets C(proxmox_node_host) for this).
    type: int
    required: true
  argv:
    description:
      - The command and its arguments as a list, passed on unchanged.
      - Exactly one of O(argv) and O(command) is required.
    type: list
    elements: str
  command:
    description:
      - A command line for C(/bin/sh -c) inside the container, for pipes, redirections and variables.
      - Exactly one of O(argv) and O(command) is required.
    type: str
  chdir:
    description:
      - Directory inside the container to run the command in, as written (not expanded on the node).
    type: str
  env:
    description:
      - Environment variables to set for the command inside the container, through C(env(1)).
      - Names must be letters, digits and underscores.
    type: dict
    default: {}
  stdin:
    description:
      - Data sent to the command on its standard input.
    type: str
  stdin_add_newline:
    description:
      - Append a newline to O(stdin).
    type: bool
    default: true
  timeout:
    description:
      - Seconds the command may run. It is enforced inside the container with C(timeout), so the command is stopped
        where it runs; after O(kill_after) more seconds it is killed with SIGKILL.
      - Needs C(timeout) (coreutils or busybox) inside the container.
      - From 1 to 86400 (one day). Unset means no limit.
    type: int
  kill_after:
    description:
      - Seconds between the SIGTERM at O(timeout) and a SIGKILL if the command is still running, from 0 to 3600.
        V(0) never sends SIGKILL.
    type: int
    default: 5
  keep_env:
    description:
      - Pass the environment of the pct process into the container (C(--keep-env 1)).
      - By default the environment is cleared (C(--keep-env 0), like C(lxc-attach --clear-env)), so nothing from the
        node or the Ansible connection leaks into the container.
      - C(--keep-env) exists since Proxmox VE 8.2.
    type: bool
    default: false
  creates:
    description:
      - A path inside the container; when it exists, the command is not run.
    type: str
  removes:
    description:
      - A path inside the container; when it does not exist, the command is not run.
    type: str
  pct_path:
    description:
      - Path of the C(pct) binary. By default C(pct) is looked up in E(PATH) and C(/usr/sbin).
      - When set, it must name an executable file, or the module fails with RV(reason=bad_arguments) naming the path.
    type: path
  node:
    description:
      - Name of the Proxmox VE node the task runs on, as reported in RV(node) and in messages.
      - By default the node named by C(/etc/pve/local) (a link to C(nodes/<name>)), else the short host name; when pct
        names the node in an error message, that name is reported.
    type: str
requirements:
  - the C(pct) command of Proxmox VE on the target node (root, or passwordless C(sudo) for C(pct))
notes:
  - The container's standard output and error are returned separately (no pseudo terminal).
  - For QEMU virtual machines there is no pct; use the guest agent or SSH.
seealso:
  - plugin: gpuops.clean_slate.proxmox
    plugin_type: inventory
"""

EXAMPLES = r"""
---
- name: List the GPUs a container sees
  gpuops.clean_slate.pct_exec:
    vmid: 129
    argv: [nvidia-smi, "--query-gpu=index,memory.used", "--format=csv,noheader"]
  delegate_to: "{{ proxmox_node_host }}"

- name: Run a pipeline through the container's shell, with a time limit
  gpuops.clean_slate.pct_exec:
    vmid: "{{ proxmox_vmid }}"
    command: ps -eo pid,comm | grep -c python
    timeout: 30
  delegate_to: "{{ proxmox_node_host }}"
  register: pythons
  failed_when: pythons.rc not in [0, 1]

- name: Run a script in a directory with extra environment and input
  gpuops.clean_slate.pct_exec:
    vmid: 129
    argv: [python3, cleanup.py, --dry-run]
    chdir: /opt/jobs
    env:
      CUDA_VISIBLE_DEVICES: "0,1"
    stdin: "yes"

- name: Create a marker only once
  gpuops.clean_slate.pct_exec:
    vmid: 129
    argv: [touch, /var/lib/clean-slate.done]
    creates: /var/lib/clean-slate.done

- name: Keep the node's environment and use a non-standard pct
  gpuops.clean_slate.pct_exec:
    vmid: 129
    argv: [env]
    keep_env: true
    pct_path: /usr/local/sbin/pct
"""

RETURN = r"""
rc:
  description: Exit status of the command inside the container.
  returned: when the command ran
  type: int
  sample: 0
stdout:
  description: Standard output of the command (as C(stderr) and the lines of both, UTF-8 text; a byte that is not
    UTF-8 appears as C(\xNN)).
  returned: when the command ran
  type: str
  sample: "0, 0 MiB\n"
stderr:
  description: Standard error of the command.
  returned: when the command ran
  type: str
  sample: ""
stdout_lines:
  description: RV(stdout) split into lines.
  returned: when the command ran
  type: list
  elements: str
  sample: ["0, 0 MiB"]
stderr_lines:
  description: RV(stderr) split into lines.
  returned: when the command ran
  type: list
  elements: str
  sample: []
vmid:
  description: The container's ID.
  returned: always
  type: int
  sample: 129
node:
  description: The Proxmox VE node the command ran on.
  returned: always
  type: str
  sample: pve1
elapsed_s:
  description: Seconds the command took, pct included.
  returned: when the command ran
  type: float
  sample: 0.41
cmd:
  description: The command line run on the node, as a list, exactly as it ran (nothing in it was expanded).
  returned: always
  type: list
  elements: str
  sample: [/usr/sbin/pct, exec, "129", --keep-env, "0", --, nvidia-smi, -L]
reason:
  description:
    - Why the module failed.
    - V(no_such_container) (not on this node, including a container of another cluster node), V(not_running),
      V(bad_arguments) (rejected before running, including a O(pct_path) that names no executable, or by pct),
      V(timeout), V(command_failed) (non-zero exit status), V(pct_failed) (pct or sudo failed otherwise, or there is
      no pct on the node), V(internal_error) (a bug).
    - The failure shape all the collection's modules share (RV(reason), RV(msg), details); the user guide lists every reason.
  returned: failure
  type: str
  sample: not_running
msg:
  description: What happened, in words.
  returned: always
  type: str
  sample: the command exited with rc 1 in container 129
"""

from ansible_collections.gpuops.clean_slate.plugins.module_utils import _module, _pct


def main() -> None:
    module = _module.Module(
        argument_spec={
            "vmid": {"type": "int", "required": True},
            "argv": {"type": "list", "elements": "str"},
            "command": {"type": "str"},
            "chdir": {"type": "str"},
            "env": {"type": "dict", "default": {}},
            "stdin": {"type": "str"},
            "stdin_add_newline": {"type": "bool", "default": True},
            "timeout": {"type": "int"},
            "kill_after": {"type": "int", "default": 5},
            "keep_env": {"type": "bool", "default": False},
            "creates": {"type": "str"},
            "removes": {"type": "str"},
            "pct_path": {"type": "path"},
            "node": {"type": "str"},
        },
        mutually_exclusive=[("argv", "command")],
        required_one_of=[("argv", "command")],
        supports_check_mode=True,
    ).ready()
    # Every failure names the container it was about.
    _module.finish(module, _pct.execute, "pct_exec", details=lambda reason: {"vmid": module.params["vmid"]})


if __name__ == "__main__":
    main()
