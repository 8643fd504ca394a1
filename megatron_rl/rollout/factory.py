"""Build the configured rollout engine (``rollout.name``: hf | sglang | vllm)."""

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
    override_config: Any = None,
    **engine_kwargs: Any,
) -> RolloutEngine:
    """``config``: ``actor_rollout_ref.rollout``; ``model_path``: the actor's HF directory (config, and for
    SGLang the tokenizer); ``response_length``: data.max_response_length, used when
    ``rollout.response_length`` is unset. ``engine_kwargs`` go to the engine class (HFEngine:
    weights_path, device; SGLang: replica_index, base_gpu_id; vLLM: max_model_len, device).
    ``override_config``: actor_rollout_ref.model.override_config, applied to the HF engine's config as
    the Megatron builder applies it (models.load_pretrained_config), and to a colocated SGLang engine's
    (its json_model_override_args); servers started elsewhere must be started with it."""
    common = {"response_length": response_length, "eos_token_id": eos_token_id, "pad_token_id": pad_token_id}
    if config.name == "hf" and config.mode == "server":
        # HF-engine servers (servers/hf_server.py) speak SGLang's routes and weight protocol: same client.
        from megatron_rl.rollout.sglang import build_sglang_engine

        if override_config:
            raise ValueError("actor_rollout_ref.model.override_config cannot reach rollout servers started from "
                             "model.path; bake the fields into config.json or use rollout.mode=colocated")
        return build_sglang_engine(config, str(model_path), **common, compute_device="cpu")
    if config.name == "hf":
        from megatron_rl.rollout.hf_engine import HFEngine

        from megatron_rl.models.hf_config import load_pretrained_config

        model_config = load_pretrained_config(model_path, override_config) if override_config else model_path
        return HFEngine(config, model_config, **common, **engine_kwargs)
    if config.name == "sglang":
        from megatron_rl.models.hf_config import plain_overrides
        from megatron_rl.rollout.sglang import build_sglang_engine

        overrides = plain_overrides(override_config)
        if overrides and config.mode == "server":
            raise ValueError(
                f"actor_rollout_ref.model.override_config={overrides} cannot reach SGLang servers started "
                "elsewhere: start them with --json-model-override-args, bake the fields into config.json, "
                "or use rollout.mode=colocated"
            )
        extra = {"model_override": overrides} if overrides else {}
        return build_sglang_engine(config, str(model_path), **common, **extra, **engine_kwargs)
    if config.name == "vllm":
        from megatron_rl.models.hf_config import plain_overrides
        from megatron_rl.rollout.vllm import VLLMEngine

        if config.mode == "server":
            from megatron_rl.rollout.vllm.server import build_vllm_server_engine

            if override_config:
                raise ValueError("actor_rollout_ref.model.override_config cannot reach vLLM servers: bake the fields "
                                 "into config.json or use rollout.mode=colocated")

            return build_vllm_server_engine(config, str(model_path), **common)
        return VLLMEngine(config, model_path, **common, model_override=plain_overrides(override_config) or None,
                          **engine_kwargs)
    raise ValueError(f"rollout.name must be hf, sglang or vllm, got {config.name!r}")
