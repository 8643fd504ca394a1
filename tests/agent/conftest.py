"""Fixtures of the agent-loop tests (megatron_rl/agent), shared with the rollout tests; the helpers live in
megatron_rl_testing/agent_support.py."""

from __future__ import annotations

from megatron_rl_testing.rollout_fixtures import sglang_stand_in, single_thread

__all__ = ["sglang_stand_in", "single_thread"]  # fixtures for this folder's tests
