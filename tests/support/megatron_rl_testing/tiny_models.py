"""Tiny random HF checkpoints (and a byte-level tokenizer) for tests — no downloads.

    path = make_tiny_hf_checkpoint(tmp_path / "qwen2", "qwen2")
    # -> config.json, model.safetensors (or shards + index), tokenizer files

Weights are random but not degenerate: norms are 1 + noise and biases non-zero, so a layout bug in
any tensor changes the logits.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "qwen3_moe", "mixtral", "qwen2_moe", "deepseek_v3", "glm4_moe")
# DeepSeek-V3 at toy size: multi-latent attention with q compression (q_lora_rank=None: Moonlight's variant) and
# YaRN, a dense first layer, 8 sigmoid-routed experts in 2 groups (top-1 group), one shared expert.
TINY_DEEPSEEK_V3 = dict(
    hidden_size=64, num_hidden_layers=3, num_key_value_heads=4, intermediate_size=96, head_dim=8,
    first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
    n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1, moe_intermediate_size=32,
    routed_scaling_factor=2.5, norm_topk_prob=True,
    rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 32,
                  "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0, "rope_theta": 10000.0},
)
# GLM-4.5 at toy size: GQA with q/k/v bias and q/k norms, RoPE on the first half of each head (partial_rotary_factor),
# a dense first layer, DeepSeek-V3's routing (8 sigmoid-routed experts in 2 groups, top-1 group, a correction bias
# set by perturb_norms_and_biases), one shared expert.
TINY_GLM4_MOE = dict(
    hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    intermediate_size=96, partial_rotary_factor=0.5, attention_bias=True, use_qk_norm=True, first_k_dense_replace=1,
    n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1, moe_intermediate_size=32,
    routed_scaling_factor=2.5, norm_topk_prob=True,
)
# Hy3: Qwen3's attention (q/k norms) and DeepSeek-V3's sigmoid routing without groups; the first layer dense
TINY_HY_V3 = dict(
    hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    intermediate_size=96, num_experts=8, num_experts_per_tok=2, num_shared_experts=1, moe_intermediate_size=32,
    router_scaling_factor=2.5, mlp_layer_types=["dense", "sparse", "sparse"],
)
# Expert counts etc. of the MoE families at toy size (any of them may be overridden).
TINY_MOE = {
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, norm_topk_prob=True),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    # a gated shared expert, and a dense layer first (decoder_sparse_step=2: layer 1 is the MoE one)
    "qwen2_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, norm_topk_prob=False,
                      shared_expert_intermediate_size=24, decoder_sparse_step=2, mlp_only_layers=[]),
    "deepseek_v3": TINY_DEEPSEEK_V3,
    "glm4_moe": TINY_GLM4_MOE,
    "hy_v3": TINY_HY_V3,
}

CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
SPECIAL_TOKENS = ("<|pad|>", "<|bos|>", "<|eos|>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>")


def make_tiny_tokenizer(path: str | Path) -> Path:
    """Byte-level BPE without merges: 256 byte tokens + a few special tokens (ids 256..262).

    Any text round-trips. Saved with a minimal chat template, so ``apply_chat_template`` works.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_vocab = pre_tokenizers.ByteLevel.alphabet()
    vocab = {token: i for i, token in enumerate(sorted(byte_vocab))}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens(list(SPECIAL_TOKENS))  # ids 256.. in this order: pad, bos, eos, ...
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token="<|pad|>",
        bos_token="<|bos|>",
        eos_token="<|eos|>",
        additional_special_tokens=list(SPECIAL_TOKENS[3:]),
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(str(path))
    return Path(path)


def tiny_hf_config(
    family: str,
    vocab_size: int = 300,
    hidden_size: int = 32,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 64,
    head_dim: int | None = None,
    tie_word_embeddings: bool = False,
    **overrides: Any,
):
    """A transformers config of ``family`` (one of FAMILIES) at toy size."""
    from transformers import (DeepseekV3Config, Glm4MoeConfig, HYV3Config, LlamaConfig, MistralConfig, MixtralConfig,
                              Qwen2Config, Qwen2MoeConfig, Qwen3Config, Qwen3MoeConfig)

    classes = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config, "mistral": MistralConfig,
               "qwen3_moe": Qwen3MoeConfig, "mixtral": MixtralConfig, "qwen2_moe": Qwen2MoeConfig,
               "deepseek_v3": DeepseekV3Config, "glm4_moe": Glm4MoeConfig, "hy_v3": HYV3Config}
    if family not in classes:
        raise ValueError(f"unknown family {family!r}; choose one of {', '.join(FAMILIES)}")
    kwargs: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        intermediate_size=intermediate_size,
        head_dim=head_dim or hidden_size // num_heads,
        tie_word_embeddings=tie_word_embeddings,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        initializer_range=0.1,
        bos_token_id=257,
        eos_token_id=258,
        pad_token_id=256,
    )
    kwargs.update(TINY_MOE.get(family, {}))
    kwargs.update(overrides)
    config = classes[family](**kwargs)
    config.architectures = [config.__class__.__name__.replace("Config", "ForCausalLM")]
    return config


def padded_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask) of three rows padded on the left, the right and both sides, like RL prompts +
    responses (token ids < 300, so any tiny model's vocabulary holds them)."""
    gen = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, 300, (3, 12), generator=gen)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[0, :3] = 0
    attention_mask[1, 9:] = 0
    attention_mask[2, :2] = 0
    attention_mask[2, 10:] = 0
    return input_ids, attention_mask


def perturb_norms_and_biases(model: torch.nn.Module) -> None:
    """Norm weights 1 + noise, biases noise (in place): a layout bug in any of them changes the outputs.
    DeepSeek-V3's and GLM-4.5's router bias (e_score_correction_bias, a buffer, zero at init) too, so that it moves the
    expert choice."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
            elif name.endswith("bias"):
                param.copy_(0.1 * torch.randn_like(param))
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(0.1 * torch.randn_like(buffer))


def make_tiny_hf_checkpoint(
    path: str | Path,
    family: str = "qwen2",
    *,
    seed: int = 0,
    max_shard_size: str | None = None,
    with_tokenizer: bool = True,
    dtype: torch.dtype = torch.float32,
    **config_kwargs: Any,
) -> Path:
    """Write a random ``family`` causal LM to ``path`` as an HF directory and return the path.

    ``config_kwargs`` go to ``tiny_hf_config`` (vocab_size, hidden_size, num_layers, num_heads,
    num_kv_heads, intermediate_size, head_dim, tie_word_embeddings, or any HF config field).
    ``max_shard_size`` (e.g. "20KB") forces several safetensors shards plus an index.
    """
    from transformers import AutoModelForCausalLM

    config = tiny_hf_config(family, **config_kwargs)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    perturb_norms_and_biases(model)
    model = model.to(dtype)
    save_kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(str(path), **save_kwargs)
    if with_tokenizer:
        make_tiny_tokenizer(path)
    return Path(path)


def make_tiny_critic_checkpoint(lm_dir: Path, out_dir: Path) -> Path:
    """The LM's backbone with a random scalar head, saved as HF's Qwen2ForTokenClassification."""
    from transformers import AutoModelForTokenClassification

    torch.manual_seed(2)
    critic = AutoModelForTokenClassification.from_pretrained(str(lm_dir), num_labels=1)
    with torch.no_grad():
        critic.score.bias.fill_(0.3)
    critic.save_pretrained(str(out_dir))
    return out_dir
