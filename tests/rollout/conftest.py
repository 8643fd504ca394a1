"""Fixtures of the rollout tests; the helpers live in megatron_rl_testing/rollout_models.py, the fixtures shared
with the servers, weights and agent tests in megatron_rl_testing/rollout_fixtures.py."""

from __future__ import annotations

import pytest

from megatron_rl.rollout.hf_engine import HFEngine
from megatron_rl_testing.rollout_fixtures import sglang_stand_in, sglang_stand_in_module, single_thread
from megatron_rl_testing.rollout_models import make_engine

__all__ = ["sglang_stand_in", "sglang_stand_in_module", "single_thread"]  # fixtures for this folder's tests


@pytest.fixture
def engine() -> HFEngine:
    return make_engine()


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    """The demo's task, tokenizer and tiny model (megatron_rl.demo), for the trainer runs of a module."""
    from megatron_rl.demo import prepare_assets

    train, val, model = prepare_assets(tmp_path_factory.mktemp("assets"))
    return {"train": train, "val": val, "model": model}
