"""gpusim: a simulated NVIDIA GPU node for testing gpuops.clean_slate.

The collection's real code (nvidia-ml-py through ctypes, psutil, /proc scans,
real signals) runs unchanged against it:

* a simulated ``libnvidia-ml.so.1`` (C, built from NVIDIA's nvml.h),
* device files that real processes open and map, with GPU memory owned by
  open file descriptions exactly like the driver's,
* a "kernel driver" daemon that notices when the last holder is gone and
  frees the memory after a realistic delay,
* fake CUDA jobs (``gpusim-worker``), an ``nvidia-smi``, PID-namespace
  sandboxes standing in for LXC containers, and switchable faults.

    from gpusim import Node
    with Node() as node:
        w = node.spawn_worker(gpus=[3], mib=20000)
        env = node.env()        # GPUSIM_STATE + LD_LIBRARY_PATH for NVML clients

See docs/simulator.md.
"""

from .description import CONTEXT_OVERHEAD_MIB, Description, Faults, GpuSpec
from .node import Node, Worker, WorkerError
from .paths import BIN_DIR, LIB_DIR
from .sandbox import Sandbox

__all__ = ["BIN_DIR", "CONTEXT_OVERHEAD_MIB", "LIB_DIR", "Description", "Faults", "GpuSpec", "Node", "Sandbox", "Worker", "WorkerError"]
