"""Rollout: generation only (docs/rollout.md). The engine interface (``base``), the HF engine (``hf_engine``),
SGLang's contract, adapter and transports (``sglang``; it never imports sglang itself until an engine is built),
sampling, batch I/O and the rollout mesh (which ranks form which engine). Weights reach engines through
``megatron_rl.weights``; the server fleet is ``megatron_rl.servers``; the multi-turn loop ``megatron_rl.agent``.
"""
from megatron_rl.rollout.base import RolloutEngine, WeightUpdateError
from megatron_rl.rollout.factory import build_rollout_engine
from megatron_rl.rollout.hf_engine import HFEngine

__all__ = ["HFEngine", "RolloutEngine", "WeightUpdateError", "build_rollout_engine"]
