#!/usr/bin/python
# Copyright (c) 2026, gpuops.clean_slate maintainers
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

from __future__ import annotations

DOCUMENTATION = r"""
module: gpu_mode_restore
short_description: Put back the GPU compute mode and stop an MPS daemon the last job left behind
version_added: 0.3.0
author:
  - gpuops.clean_slate maintainers (@gpuops)
description:
  - A job that left its GPUs in C(EXCLUSIVE_PROCESS) compute mode, or an MPS control daemon running, makes the next job
    fail with "CUDA-capable device(s) is/are busy or unavailable" although the memory is free. This module puts back the
    values the user declares, and nothing else.
  - Opt-in and guarded. Only O(compute_mode) and O(mps) are restored, each only when given. Everything is read and judged
    before anything changes; a GPU whose compute mode must change while NVML lists a process on it (other than the MPS
    daemon's own server, which goes with the daemon) is refused with RV(reason=busy) and nothing is changed.
  - Never resets a GPU and never changes clocks, power limits, ECC, MIG or persistence mode.
  - The MPS control daemon and its servers (C(nvidia-cuda-mps-control), C(nvidia-cuda-mps-server), recognised by their
    executable's name) are pinned with a pidfd and sent SIGTERM; the module waits O(mps_timeout) seconds for them to exit.
    PID 1 and the module's own ancestors are never signalled.
  - Setting the compute mode needs root (NVML answers C(NVML_ERROR_NO_PERMISSION) otherwise). Like C(nvidia-smi -c), it
    lasts until the driver is unloaded (with persistence mode off, until the last client closes the GPU).
extends_documentation_fragment:
  - gpuops.clean_slate._attributes
attributes:
  check_mode:
    support: full
    details: Reports what would be restored (RV(gpus[].compute_mode_after) is the declared mode) and changes nothing.
  diff_mode:
    support: full
    details: The diff shows each GPU's compute mode and the MPS daemons' PIDs before and after.
  idempotent:
    support: full
    details: Once the declared values hold, a second run changes nothing.
options:
  gpus:
    description:
      - GPUs whose compute mode to restore, by index, UUID or device file (V(/dev/nvidia0)); empty means every GPU.
    type: list
    elements: raw
    default: []
  compute_mode:
    description:
      - The compute mode the GPUs must have. Unset leaves it alone.
    type: str
    choices: [default, exclusive_process, prohibited]
  mps:
    description:
      - V(stopped) stops an MPS control daemon (and its servers) left running. Unset leaves MPS alone.
    type: str
    choices: [stopped]
  mps_timeout:
    description:
      - Seconds to wait for the MPS processes to exit after SIGTERM, from 0 to 86400.
    type: float
    default: 10
  probe_timeout:
    description:
      - Seconds one NVML call may take, from 0.1 to 3600. Every NVML call runs in a helper process under this deadline,
        as in M(gpuops.clean_slate.gpu_mem_verify); a call that does not return fails the module with RV(reason=driver_hung)
        and nothing after it is done.
    type: float
    default: 10
requirements:
  - nvidia-ml-py (C(pynvml)) on the target
  - the NVIDIA driver (C(libnvidia-ml.so.1))
seealso:
  - module: gpuops.clean_slate.gpu_mem_verify
"""

EXAMPLES = r"""
---
- name: Put every GPU back in the default compute mode and stop MPS
  gpuops.clean_slate.gpu_mode_restore:
    compute_mode: default
    mps: stopped
  become: true

- name: See what would change
  gpuops.clean_slate.gpu_mode_restore:
    compute_mode: default
  check_mode: true
  diff: true
"""

RETURN = r"""
msg:
  description: What was restored (or would be, in check mode), or why not.
  returned: always
  type: str
  sample: restored compute mode default on GPU 0, 1
reason:
  description:
    - Why the module failed, on every failure. V(bad_arguments), V(missing_library), V(internal_error), V(busy) (a GPU whose
      compute mode must change is still in use; nothing was changed), V(restore_failed) (a mode did not take, or the MPS
      daemon survived; the message says which), or, when the GPUs cannot be read, V(library_not_found),
      V(driver_not_loaded), V(driver_library_mismatch), V(no_permission), V(not_supported), V(timeout), V(gpu_lost),
      V(needs_reset), V(driver_hung) (an NVML call did not return within O(probe_timeout)) or V(nvml_error).
  returned: failure
  type: str
  sample: busy
gpus:
  description: One entry per selected GPU.
  returned: success
  type: list
  elements: dict
  contains:
    index:
      description: NVML index.
      type: int
    uuid:
      description: GPU UUID.
      type: str
    compute_mode_before:
      description: The compute mode found (V(default), V(exclusive_process), V(prohibited)).
      type: str
    compute_mode_after:
      description: The compute mode afterwards (in check mode, what it would be).
      type: str
    changed:
      description: Whether its compute mode was (or would be) changed.
      type: bool
mps:
  description: PIDs of the MPS processes found (C(before)), still running (C(after)) and ended (C(ended)); empty without O(mps).
  returned: success
  type: dict
  sample: {"before": [4242], "after": [], "ended": [4242]}
"""

from ansible_collections.gpuops.clean_slate.plugins.module_utils import _module, _nvml, _restore


def main() -> None:
    module = _module.Module(
        argument_spec=_restore.argument_spec(),
        supports_check_mode=True,
    ).ready()
    nvml = _module.Library("nvidia-ml-py", _nvml.HAS_PYNVML, _nvml.PYNVML_IMPORT_ERROR)
    _module.finish(module, _restore.run, "gpu_mode_restore", libraries=[nvml])


if __name__ == "__main__":
    main()
