# Copyright (c) 2026, gpuops.clean_slate maintainers
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

# Note: this module_util is PRIVATE to the collection; it may change without notice.

"""What a dead GPU job leaves behind besides GPU memory, and removing it safely (the gpu_job_residue module).

Four kinds of residue, each found by absolute path globs:

* ``shm``: shared memory segments and POSIX semaphores in ``/dev/shm``
  (NCCL ``nccl-XXXXXX``, vLLM ``vllm*``, torch ``torch_<pid>_<n>``, Python
  ``psm_*`` and ``sem.mp-*``); regular files only.
* ``sockets``: ZMQ ``ipc://`` and other unix socket files; socket files only.
* ``locks``: lock files of JIT compile caches (flashinfer, torch extensions,
  triton, vLLM, inductor); regular files only. Reported, removed on request.
* ``dirs``: per-run directories (torchelastic's ``/tmp/torchelastic_*``),
  removed as a whole, on request.

An item goes only when it is provably orphaned: no live process has it (or,
for a directory, anything in it) open, mapped, locked, bound, or as its
working directory (:mod:`.._holders`).

The parts, one concern each, imported by their full path
(``ansible_collections.gpuops.clean_slate.plugins.module_utils._residue.<part>``); this file imports nothing:

* :mod:`.walk`: the default globs, the scopes' roots, the walker that never
  follows a symlink, the candidates (:class:`.walk.Item`).
* :mod:`.owners`: who holds what (the judgement over one pass of /proc, bound
  sockets, holder descriptions), zombies and port owners.
* :mod:`.remove`: the deleting part, alone: a last check that each item is
  still the file that was judged, then the unlink.
* :mod:`.report`: the result, its message, the failures, the diff.
* :mod:`.module`: the request, the argument spec, one whole run and the
  module's logic (:class:`.module.ModuleRun`).
"""
