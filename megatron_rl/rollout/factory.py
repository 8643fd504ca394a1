"""Build the configured rollout engine (``rollout.name``: hf | sglang)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from megatron_rl.rollout.base import RolloutEngine

__all__ = ["build_rollout_engine"]


def build_rollout_engine(
    config: Any,
    model_path: str | os.PathLike,
    *,
    response_length: int | None = None,
    eos_token_id: int | Sequence[int] | None = None,
    pad_token_id: int | None = None,
    **engine_kwargs: Any,
) -> RolloutEngine:
    """``config``: ``actor_rollout_ref.rollout``; ``model_path``: the actor's HF directory (config, and for
    SGLang the tokenizer); ``response_length``: data.max_response_length, used when
    ``rollout.response_length`` is unset. ``engine_kwargs`` go to the engine class (HFEngine:
    weights_path, device; SGLangEngine: weight_transport, master_address, base_gpu_id, ...)."""
    common = {"response_length": response_length, "eos_token_id": eos_token_id, "pad_token_id": pad_token_id}
    if config.name == "hf":
        from megatron_rl.rollout.hf_engine import HFEngine

        return HFEngine(config, model_path, **common, **engine_kwargs)
    if config.name == "sglang":
        from megatron_rl.rollout.sglang_engine import SGLangEngine

        return SGLangEngine(config, str(model_path), **common, **engine_kwargs)
    raise ValueError(f"rollout.name must be hf or sglang, got {config.name!r}")
