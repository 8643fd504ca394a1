"""Tiny random sequence-classification reward models for tests (no downloads)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from megatron_rl_testing.tiny_models import make_tiny_tokenizer, perturb_norms_and_biases, tiny_hf_config


def make_tiny_reward_model(
    path: str | Path, family: str = "qwen2", *, seed: int = 0, with_tokenizer: bool = True, **config_kwargs: Any
) -> Path:
    """Write a random ``<Family>ForSequenceClassification`` (one label) with the tiny tokenizer to ``path``.

    Norms are 1 + noise, biases and the score head non-trivial, so a layout bug changes the score."""
    from transformers import AutoModelForSequenceClassification

    config = tiny_hf_config(family, **{"num_labels": 1, **config_kwargs})
    config.architectures = [config.architectures[0].replace("ForCausalLM", "ForSequenceClassification")]
    torch.manual_seed(seed)
    model = AutoModelForSequenceClassification.from_config(config, dtype=torch.float32)
    perturb_norms_and_biases(model)
    with torch.no_grad():
        model.score.weight.normal_()  # scores of order 1, not ~0.1
    model.save_pretrained(str(path))
    if with_tokenizer:
        make_tiny_tokenizer(path)
    return Path(path)
