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


# ---------------------------------------------------------------------------- issue 32, item 6
def _no_gpu_cuda_torch(monkeypatch):
    """What a build node shows torch's extension builder: CUDA torch (nvcc found), no visible device."""
    import torch

    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST", raising=False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_arch_list", lambda: ["sm_90", "sm_100", "sm_120"])


def test_torchs_builder_fails_without_a_visible_gpu_and_the_arch_list_unset(monkeypatch):
    """The mechanism of the bug, against the torch in .venv: this is what `pip install` hit (IndexError)."""
    from torch.utils import cpp_extension

    _no_gpu_cuda_torch(monkeypatch)
    with pytest.raises(IndexError):
        cpp_extension._get_cuda_arch_flags()


def test_without_a_visible_gpu_the_build_takes_the_hopper_blackwell_list(monkeypatch):
    from torch.utils import cpp_extension

    _no_gpu_cuda_torch(monkeypatch)
    environ: dict[str, str] = {}
    message = setup_cuda.apply_cuda_arch_list(environ, visible_gpus=0, toolkit="13.0")
    assert environ == {"TORCH_CUDA_ARCH_LIST": "9.0;10.0+PTX"}
    assert "no GPU is visible" in message and "'9.0;10.0+PTX'" in message and "set TORCH_CUDA_ARCH_LIST" in message
    # torch's builder accepts the list and compiles for sm_90 and sm_100 (+ PTX of compute_100)
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", environ["TORCH_CUDA_ARCH_LIST"])
    flags = cpp_extension._get_cuda_arch_flags()
    assert "-gencode=arch=compute_90,code=sm_90" in flags and "-gencode=arch=compute_100,code=sm_100" in flags
    assert "-gencode=arch=compute_100,code=compute_100" in flags


def test_an_older_toolkit_gets_hopper_only_and_a_set_list_or_visible_gpus_are_left_to_torch(monkeypatch):
    from torch.utils import cpp_extension

    environ: dict[str, str] = {}
    setup_cuda.apply_cuda_arch_list(environ, visible_gpus=0, toolkit="12.4")  # nvcc < 12.8 has no sm_100
    assert environ == {"TORCH_CUDA_ARCH_LIST": "9.0+PTX"}
    _no_gpu_cuda_torch(monkeypatch)
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", environ["TORCH_CUDA_ARCH_LIST"])
    assert "-gencode=arch=compute_90,code=sm_90" in cpp_extension._get_cuda_arch_flags()

    environ = {"TORCH_CUDA_ARCH_LIST": "8.0"}
    assert "TORCH_CUDA_ARCH_LIST=8.0 (from the environment)" in setup_cuda.apply_cuda_arch_list(environ, 0, "13.0")
    assert environ == {"TORCH_CUDA_ARCH_LIST": "8.0"}
    environ = {}
    assert "of the 8 visible GPU(s)" in setup_cuda.apply_cuda_arch_list(environ, 8, "13.0")
    assert environ == {}
