"""A real GPU workload for the hardware validation (torch, no network).

    python3 workload.py --gpu 0 --gib 20 [--title sglang::scheduler_TP0]
                        [--ignore-term] [--stop] [--fork-child] [--nvml-only]

Prints "ready <pid>" (and " child <pid>" with --fork-child) on stdout once the
memory is allocated and touched, then sleeps until it is killed.

--title rewrites the argv area and comm the way setproctitle does, so that
/proc/PID/cmdline reads exactly the title (SGLang: sglang::scheduler_TP0).
--fork-child allocates, forks a child that keeps the CUDA mappings and fds and
sleeps, and the parent exits: the child holds the memory while NVML lists the
dead parent. --nvml-only is a management client: it opens NVML and holds it.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import sys
import time


def set_title(title: str) -> None:
    """setproctitle without the package: overwrite the argv block and comm."""
    with open("/proc/self/stat", "rb") as fh:
        fields = fh.read().rsplit(b")", 1)[1].split()
    # Fields 48 and 49 of /proc/PID/stat (arg_start, arg_end), counted after the comm.
    arg_start, arg_end = int(fields[45]), int(fields[46])
    size = arg_end - arg_start
    data = title.encode()[: size - 1]
    buf = data + b"\0" * (size - len(data))
    ctypes.memmove(arg_start, buf, size)
    libc = ctypes.CDLL(None)
    libc.prctl(15, title.encode()[:15], 0, 0, 0)  # PR_SET_NAME


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--gpu", type=int, default=0)
    p.add_argument("--gib", type=float, default=1.0)
    p.add_argument("--title")
    p.add_argument("--ignore-term", action="store_true")
    p.add_argument("--stop", action="store_true")
    p.add_argument("--fork-child", action="store_true")
    p.add_argument("--nvml-only", action="store_true")
    a = p.parse_args()
    if a.ignore_term:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if a.nvml_only:
        import pynvml

        pynvml.nvmlInit()
        handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
        print(f"ready {os.getpid()} handles {len(handles)}", flush=True)
        while True:
            time.sleep(3600)
    import torch

    device = torch.device(f"cuda:{a.gpu}")
    keep = torch.empty(int(a.gib * (1 << 30)), dtype=torch.uint8, device=device)
    keep.fill_(1)
    torch.cuda.synchronize(device)
    if a.title:
        set_title(a.title)
    if a.fork_child:
        child = os.fork()
        if child == 0:
            # The child never touches CUDA; it only inherited the context's fds and maps.
            if a.title:
                set_title(a.title.replace("scheduler", "data_worker"))
            while True:
                time.sleep(3600)
        print(f"ready {os.getpid()} child {child}", flush=True)
        os._exit(0)
    print(f"ready {os.getpid()}", flush=True)
    if a.stop:
        os.kill(os.getpid(), signal.SIGSTOP)
    while True:
        time.sleep(3600)


if __name__ == "__main__":
    sys.exit(main())
