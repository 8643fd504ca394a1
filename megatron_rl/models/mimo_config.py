"""MiMo's config.json read by transformers without the checkpoint's own code (``configuration_mimo.py``, which a
run here never executes: model code from a checkpoint is refused). MiMo's main model is Qwen2's; its config adds
``num_nextn_predict_layers``, which a Qwen2 config keeps as an attribute. vLLM (MiMoForCausalLM, and its MTP
drafter ``MiMoMTPModel`` for speculative decoding) reads the config through transformers' AutoConfig, in the
driver and in its engine processes: ``register_mimo_config`` makes ``model_type: mimo`` known there."""

from __future__ import annotations

from transformers import AutoConfig, Qwen2Config


class MiMoConfig(Qwen2Config):
    model_type = "mimo"


def register_mimo_config() -> None:
    """Make transformers' AutoConfig read ``model_type: mimo`` (idempotent)."""
    AutoConfig.register("mimo", MiMoConfig, exist_ok=True)
