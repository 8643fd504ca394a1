"""Fixtures of the rollout-server tests (megatron_rl/servers); the helpers live in
megatron_rl_testing/rollout_models.py."""

from __future__ import annotations

import pytest

from megatron_rl_testing.rollout_fixtures import single_thread
from megatron_rl_testing.rollout_models import tiny_qwen2_config

__all__ = ["single_thread"]  # fixtures for this folder's tests


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    """A tiny Qwen2 checkpoint directory (config only: servers start unsynced) for a module's servers."""
    path = tmp_path_factory.mktemp("tiny_qwen2_model")
    tiny_qwen2_config().save_pretrained(path)
    return str(path)
