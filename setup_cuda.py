"""Whether setup.py builds the CUDA kernels: torch's CUDA and the toolkit's nvcc must agree on the major.

Kept out of setup.py so tests can ask it (tests/unit/test_setup_cuda.py). An extension compiled by a
CUDA 12 nvcc against a CUDA 13 torch (or the reverse) fails deep in torch's headers or at load time;
here the mismatch is said in one sentence before anything compiles.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

CUDA_ENV = "MEGATRON_RL_BUILD_CUDA"


def nvcc_version(cuda_home: str | None) -> str | None:
    """``major.minor`` of ``<cuda_home>/bin/nvcc``, or None when there is none that answers."""
    if not cuda_home:
        return None
    nvcc = Path(cuda_home) / "bin" / "nvcc"
    try:
        out = subprocess.run([str(nvcc), "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    match = re.search(r"release (\d+)\.(\d+)", out)
    return f"{match.group(1)}.{match.group(2)}" if match else None


def cuda_build_decision(
    torch_cuda: str | None, toolkit: str | None, forced: str | None, cuda_home: str | None = None
) -> tuple[bool, str | None]:
    """(build the CUDA kernels, a warning to print or None).

    ``torch_cuda``: torch.version.cuda; ``toolkit``: nvcc's version; ``forced``: $MEGATRON_RL_BUILD_CUDA
    (None, "0" or "1"). "1" turns every reason not to build into an error; unset, a mismatch builds the
    CPU kernels only, with the warning.
    """
    if forced not in (None, "0", "1"):
        raise RuntimeError(f"{CUDA_ENV} must be 0 or 1, got {forced!r}")
    if forced == "0":
        return False, None
    if torch_cuda is None or toolkit is None:
        if forced == "1":
            raise RuntimeError(
                f"{CUDA_ENV}=1 but the CUDA kernels cannot be built: torch.version.cuda={torch_cuda}, "
                f"nvcc {'not found' if toolkit is None else toolkit} (CUDA_HOME={cuda_home})"
            )
        return False, None
    torch_major, toolkit_major = torch_cuda.split(".")[0], toolkit.split(".")[0]
    if torch_major != toolkit_major:
        message = (
            f"the CUDA toolkit at CUDA_HOME={cuda_home} is {toolkit}, but torch was built with CUDA {torch_cuda}: "
            f"an extension compiled with CUDA {toolkit_major} does not work with a CUDA {torch_major} torch. "
            f"Install CUDA {torch_major}.x and point CUDA_HOME at it (constraints/gpu.txt pins torch 2.14.1, "
            f"built with CUDA 13.0), or set {CUDA_ENV}=0 for a CPU-only build"
        )
        if forced == "1":
            raise RuntimeError(f"{CUDA_ENV}=1: {message}")
        return False, f"WARNING: building the CPU kernels only: {message}"
    return True, None
