"""Fixtures of the weight-sync tests (megatron_rl/weights), shared with the rollout tests."""

from __future__ import annotations

from megatron_rl_testing.rollout_fixtures import sglang_stand_in, single_thread

__all__ = ["sglang_stand_in", "single_thread"]  # fixtures for this folder's tests
