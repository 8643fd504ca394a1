"""The demo's task, tokenizer and tiny model, made once for all end-to-end tests."""
from __future__ import annotations

from pathlib import Path

import pytest

from megatron_rl.demo import prepare_assets


@pytest.fixture(scope="session")
def tiny_assets(tmp_path_factory) -> dict[str, Path]:
    train, val, model = prepare_assets(tmp_path_factory.mktemp("assets"))
    return {"train": train, "val": val, "model": model}


@pytest.fixture(scope="session")
def moe_assets(tiny_assets, tmp_path_factory) -> dict:
    """The e2e task and tokenizer, with a random tiny Qwen3-MoE (4 experts, top-2) in place of the dense model."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3MoeConfig

    model_dir = tmp_path_factory.mktemp("qwen3_moe")
    tokenizer = AutoTokenizer.from_pretrained(tiny_assets["model"])
    tokenizer.save_pretrained(model_dir)
    config = Qwen3MoeConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_experts=4,
        num_experts_per_tok=2, norm_topk_prob=True, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=64, tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(model_dir)
    return {**tiny_assets, "model": model_dir}
