"""Fixtures of the rollout tests; the helpers live in rollout_models.py."""

from __future__ import annotations

import pytest
import torch
from rollout_models import make_engine

from megatron_rl.rollout.hf_engine import HFEngine


@pytest.fixture
def engine() -> HFEngine:
    return make_engine()


@pytest.fixture(autouse=True)
def single_thread():
    """The models here are tiny: intra-op threads only fight the other test processes for the cores."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
