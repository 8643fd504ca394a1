"""Tiny random models, prompt batches and a trainer-side log-prob function for the rollout tests
(no downloads, CPU, fp32)."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, Qwen2Config

from megatron_rl.config.schema import RolloutConfig
from megatron_rl.ops import log_probs_from_logits
from megatron_rl.protocol import DataProto
from megatron_rl.rollout.hf_engine import HFEngine

VOCAB = 96
EOS = 2
PAD = 0


def tiny_qwen2_config(**overrides) -> Qwen2Config:
    kwargs = {
        "vocab_size": VOCAB,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 128,
        "eos_token_id": EOS,
        "pad_token_id": PAD,
        "tie_word_embeddings": False,
    }
    kwargs.update(overrides)
    return Qwen2Config(**kwargs)


def source_model(seed: int, config: Qwen2Config | None = None) -> torch.nn.Module:
    """A randomly initialised HF model standing in for the trainer's weights."""
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config or tiny_qwen2_config()).eval()


def make_engine(
    response_length: int = 8, config: Qwen2Config | None = None, weights_seed: int | None = 100, **rollout
) -> HFEngine:
    """An HF engine serving ``source_model(weights_seed)`` as weight version 0 (None: never synced)."""
    engine = HFEngine(
        RolloutConfig(response_length=response_length, **rollout), config or tiny_qwen2_config()
    )
    if weights_seed is not None:
        engine.update_weights(source_model(weights_seed, config).state_dict().items(), version=0)
    return engine


def prompt_batch(lengths: list[int], width: int | None = None, prompt_seed: int = 0, **meta) -> DataProto:
    """Left-padded random prompts of the given lengths with verl's position_ids (0 on padding);
    keyword arguments become meta_info."""
    width = width or max(lengths)
    gen = torch.Generator().manual_seed(prompt_seed)
    ids = torch.full((len(lengths), width), PAD, dtype=torch.long)
    mask = torch.zeros((len(lengths), width), dtype=torch.long)
    for row, n in enumerate(lengths):
        ids[row, width - n :] = torch.randint(3, VOCAB, (n,), generator=gen)
        mask[row, width - n :] = 1
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    return DataProto.from_dict(
        {"input_ids": ids, "attention_mask": mask, "position_ids": pos}, meta_info=meta
    )


def trainer_log_probs(model):
    """What the trainer's compute_log_prob returns for a generated batch: [B, R], 0 at padding."""

    @torch.no_grad()
    def fn(batch):
        width = batch.batch["responses"].shape[-1]
        logits = model(
            input_ids=batch.batch["input_ids"],
            attention_mask=batch.batch["attention_mask"],
            position_ids=batch.batch["position_ids"],
        ).logits[:, -width - 1 : -1]
        temperature = batch.meta_info.get("temperature", 1.0)
        return (
            log_probs_from_logits(logits, batch.batch["responses"], temperature=temperature)
            * batch.batch["response_mask"]
        )

    return fn
