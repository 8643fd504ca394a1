"""Shared fixtures of the kernel tests: they test the compiled kernels, so a missing build fails."""

import pytest
import torch

from megatron_rl import ops
from megatron_rl.ops import _extension


@pytest.fixture(autouse=True)
def compiled_kernels():
    """Every test here runs against megatron_rl._C; without it they would silently test the reference."""
    if _extension._load() is None:
        pytest.fail("megatron_rl._C is not built: run `pip install --no-build-isolation -e .`")
    assert ops.backend_summary().startswith("compiled")


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(1234)
