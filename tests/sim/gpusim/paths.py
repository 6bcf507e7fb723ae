"""Where the simulator's pieces live, and building them on demand."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SIM_ROOT = Path(__file__).resolve().parent.parent  #: tests/sim
REPO_ROOT = SIM_ROOT.parent.parent
BUILD_DIR = SIM_ROOT / "build"
LIB_DIR = BUILD_DIR / "lib"  #: holds libnvidia-ml.so.1
BIN_DIR = BUILD_DIR / "bin"  #: holds nvidia-smi and gpusim-worker
GEN_DIR = BUILD_DIR / "gen"  #: generated sources and function lists
LIBRARY = LIB_DIR / "libnvidia-ml.so.1"
CUDA_DIR = BUILD_DIR / "cuda"  #: holds libcuda.so.1 (a directory of its own: a node can leave it off the path)
LIBCUDA = CUDA_DIR / "libcuda.so.1"
WORKER = BIN_DIR / "gpusim-worker"
NVIDIA_SMI = BIN_DIR / "nvidia-smi"


def _venv() -> Path:
    """The venv whose nvml.h the build uses: this interpreter's, else the repo's."""
    here = Path(sys.prefix)
    if list(here.glob("lib/python3*/site-packages/nvidia/cu*/include/nvml.h")):
        return here
    return REPO_ROOT / ".venv"


def ensure_built() -> None:
    """Run `make -C tests/sim` if a build product is missing (the top-level
    Makefile normally did it already; make is incremental, so this is cheap)."""
    if all(p.exists() for p in (LIBRARY, WORKER, NVIDIA_SMI, LIBCUDA)):
        return
    proc = subprocess.run(
        ["make", "-s", "-C", str(SIM_ROOT), f"VENV={_venv()}"],
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"building the GPU simulator failed:\n{proc.stdout}{proc.stderr}")
