#!/usr/bin/python
# Copyright (c) 2026, gpuops.clean_slate maintainers
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# This module is implemented as an action plugin (plugins/action/clean_slate_host.py); this file holds its documentation.

from __future__ import annotations

DOCUMENTATION = r"""
module: clean_slate_host
short_description: The clean_slate role's work on one host, in two steps
version_added: 0.4.0
author:
  - gpuops.clean_slate maintainers (@gpuops)
description:
  - The steps the C(gpuops.clean_slate.clean_slate) role runs for each host. It reads the role's C(clean_slate_*)
    variables from the task's variables; outside that role, use M(gpuops.clean_slate.clean_slate_node) and the
    phases' own modules.
  - V(clean) refuses bad role variables (nothing runs on the host then), looks for the modules' virtual environment when
    C(clean_slate_install_dependencies) is true, and runs M(gpuops.clean_slate.clean_slate_node) once on the host the
    task runs on, for the phases that C(--tags) and C(--skip-tags) select. It returns that module's result, but does not
    fail the task when the module failed (RV(module_failed)); the role fails the host once, after the record.
  - V(record) turns what the run registered into the host's result (RV(clean_slate_result)), writes the node_exporter
    metrics on the GPU node (C(clean_slate_metrics_dir)) and the JSON report on the controller
    (C(clean_slate_report_dir)), and publishes the result with set_stats (C(clean_slate), aggregated per host).
  - Both were a dozen tasks of the role; each task costs Ansible a worker and a callback round, about 0.03 s on a GPU
    node even when skipped.
extends_documentation_fragment:
  - gpuops.clean_slate._attributes
attributes:
  check_mode:
    support: full
    details: V(clean) runs the module in check mode; V(record) writes the JSON report in check mode too (it is an output of the run).
  diff_mode:
    support: none
  idempotent:
    support: full
    details: As M(gpuops.clean_slate.clean_slate_node).
  action:
    support: full
    description: Indicates this has a corresponding action plugin so some parts of the options can be executed on the controller.
options:
  step:
    description:
      - V(clean) or V(record), as above.
    type: str
    required: true
    choices: [clean, record]
  python:
    description:
      - With V(clean), the Python that runs the module on the host (the role passes its virtual environment's after an
        installation). An extra variable C(ansible_python_interpreter) still wins.
    type: str
  run:
    description:
      - With V(record), the result the V(clean) step registered (or the one after an installation of the dependencies).
    type: dict
    default: {}
  deps:
    description:
      - With V(record), the results the role's dependency tasks registered, by step (C(deps), C(venv_pkg), C(venv),
        C(wheels), C(pip)).
    type: dict
    default: {}
seealso:
  - module: gpuops.clean_slate.clean_slate_node
notes:
  - Runs inside the C(gpuops.clean_slate.clean_slate) role; its role variables are documented there.
"""

EXAMPLES = r"""
# From the role's tasks/main.yml (the role's vars/main.yml defines _clean_slate_delegate):
- name: Clean the GPUs
  gpuops.clean_slate.clean_slate_host:
    step: clean
  delegate_to: "{{ _clean_slate_delegate }}"
  register: _clean_slate_r_host

- name: Record the result
  gpuops.clean_slate.clean_slate_host:
    step: record
    run: "{{ _clean_slate_r_host }}"
  delegate_to: "{{ _clean_slate_delegate }}"
"""

RETURN = r"""
clean_slate:
  description: With V(clean), what the step worked out (the targets, the lists as read, the virtual environment found).
  returned: with clean
  type: dict
module_failed:
  description: With V(clean), whether M(gpuops.clean_slate.clean_slate_node) failed.
  returned: with clean, when the module ran
  type: bool
deps_needed:
  description: With V(clean), whether the module's Python lacks its dependencies (the role then deals with them).
  returned: with clean
  type: bool
clean_slate_result:
  description: With V(record), the host's result, as the role documents C(clean_slate_result).
  returned: with record
  type: dict
"""
