"""setup.py's CUDA decision (setup_cuda.py): a toolkit whose CUDA major differs from torch's is a clear
error when the CUDA kernels are required and a CPU-only build with a warning otherwise (issue 14)."""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("setup_cuda", ROOT / "setup_cuda.py")
setup_cuda = importlib.util.module_from_spec(spec)
spec.loader.exec_module(setup_cuda)


def test_matching_majors_build_the_cuda_kernels():
    assert setup_cuda.cuda_build_decision("13.0", "13.1", None) == (True, None)
    assert setup_cuda.cuda_build_decision("13.0", "13.0", "1") == (True, None)
    assert setup_cuda.cuda_build_decision("13.0", "13.0", "0") == (False, None)


def test_a_major_mismatch_is_a_clear_error_or_a_cpu_only_build_with_a_warning():
    build, warning = setup_cuda.cuda_build_decision("13.0", "12.4", None, cuda_home="/usr/local/cuda-12.4")
    assert build is False
    assert "CUDA_HOME=/usr/local/cuda-12.4 is 12.4, but torch was built with CUDA 13.0" in warning
    assert "Install CUDA 13.x" in warning and "MEGATRON_RL_BUILD_CUDA=0" in warning
    with pytest.raises(RuntimeError, match="MEGATRON_RL_BUILD_CUDA=1: the CUDA toolkit .* is 12.4, but torch was "
                                           "built with CUDA 13.0"):
        setup_cuda.cuda_build_decision("13.0", "12.4", "1", cuda_home="/usr/local/cuda-12.4")


def test_no_cuda_torch_or_no_nvcc():
    assert setup_cuda.cuda_build_decision(None, "13.0", None) == (False, None)  # CPU torch (this machine)
    with pytest.raises(RuntimeError, match="torch.version.cuda=None"):
        setup_cuda.cuda_build_decision(None, "13.0", "1")
    with pytest.raises(RuntimeError, match="nvcc not found"):
        setup_cuda.cuda_build_decision("13.0", None, "1")
    with pytest.raises(RuntimeError, match="must be 0 or 1"):
        setup_cuda.cuda_build_decision("13.0", "13.0", "yes")


def test_nvcc_version_is_read_from_the_toolkit(tmp_path):
    nvcc = tmp_path / "bin" / "nvcc"
    nvcc.parent.mkdir()
    nvcc.write_text("#!/bin/sh\necho 'Cuda compilation tools, release 12.4, V12.4.131'\n")
    os.chmod(nvcc, 0o755)
    assert setup_cuda.nvcc_version(str(tmp_path)) == "12.4"
    assert setup_cuda.nvcc_version(str(tmp_path / "missing")) is None
    assert setup_cuda.nvcc_version(None) is None
