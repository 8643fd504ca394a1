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
            f"Install CUDA {torch_major}.x and point CUDA_HOME at it (constraints/gpu-sglang.txt and gpu-vllm.txt pin "
            f"torch 2.14.1 and 2.13.0, both built with CUDA 13.0), or set {CUDA_ENV}=0 for a CPU-only build"
        )
        if forced == "1":
            raise RuntimeError(f"{CUDA_ENV}=1: {message}")
        return False, f"WARNING: building the CPU kernels only: {message}"
    return True, None


ARCH_ENV = "TORCH_CUDA_ARCH_LIST"
# Hopper (H100/H200, what every GPU preset targets) and Blackwell (B200/GB200), with PTX of the newest so a
# later GPU can JIT it. Names as torch's cpp_extension accepts them ("9.0", "10.0+PTX").
DEFAULT_ARCH_LIST = "9.0;10.0+PTX"
HOPPER_ONLY_ARCH_LIST = "9.0+PTX"  # a toolkit older than 12.8 cannot compile sm_100


def cuda_arch_list(env_value: str | None, visible_gpus: int, toolkit: str | None) -> tuple[str | None, str]:
    """(the TORCH_CUDA_ARCH_LIST to set, or None to leave torch's choice; why, to print at build time).

    torch's extension builder (``cpp_extension._get_cuda_arch_flags``) takes the list from
    $TORCH_CUDA_ARCH_LIST, else from the GPUs it sees; with none visible (a login or build node, a container
    without ``--gpus``) it fails with an IndexError on the empty list. Then the presets' architectures are
    set here instead.
    """
    if env_value:
        return None, f"CUDA architectures: {ARCH_ENV}={env_value} (from the environment)"
    if visible_gpus > 0:
        return None, (f"CUDA architectures: those of the {visible_gpus} visible GPU(s) ({ARCH_ENV} is unset; "
                      "set it to build for other GPUs)")
    arch = DEFAULT_ARCH_LIST
    if toolkit is not None and tuple(int(x) for x in toolkit.split(".")[:2]) < (12, 8):
        arch = HOPPER_ONLY_ARCH_LIST
    return arch, (f"CUDA architectures: {ARCH_ENV} is unset and no GPU is visible, so building for "
                  f"{ARCH_ENV}={arch!r} (Hopper{'' if arch == HOPPER_ONLY_ARCH_LIST else ' and Blackwell'}; "
                  f"CUDA {toolkit}); set {ARCH_ENV} to choose others")


def apply_cuda_arch_list(environ: dict, visible_gpus: int, toolkit: str | None) -> str:
    """Set ``environ[TORCH_CUDA_ARCH_LIST]`` when :func:`cuda_arch_list` says so; returns the message."""
    arch, message = cuda_arch_list(environ.get(ARCH_ENV), visible_gpus, toolkit)
    if arch is not None:
        environ[ARCH_ENV] = arch
    return message
