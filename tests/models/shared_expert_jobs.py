"""Tiny Qwen2-MoE / dense-first Qwen3-MoE checkpoints and the rank job of test_moe_shared_experts.py.

The models mix dense and MoE layers: Qwen2-MoE with a gated shared expert, decoder_sparse_step=2 and an
mlp_only layer (layers 1, 5 MoE; 0, 2, 4 dense by the step, 3 by mlp_only_layers), Qwen3-MoE with
mlp_only_layers=[0] (layer 0 dense).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from megatron_rl_testing.tiny_models import padded_batch as batch
from megatron_rl_testing.tiny_models import perturb_norms_and_biases

# (TP, PP, EP, ETP); ETP None = TP. Two ranks: TP2 x EP2 runs with ETP=1 (experts laid out ETP x EP per stage);
# PP=2 cuts Qwen2-MoE's dense/MoE pattern at layer 3 (each stage builds its own layers' kinds).
LAYOUTS = [(1, 1, 1, None), (2, 1, 2, 1), (1, 2, 1, None)]

QWEN2_MOE = dict(
    num_hidden_layers=6, decoder_sparse_step=2, mlp_only_layers=[3], num_experts=4, num_experts_per_tok=2,
    moe_intermediate_size=16, shared_expert_intermediate_size=48, norm_topk_prob=False,
)
QWEN3_MOE = dict(
    num_hidden_layers=2, mlp_only_layers=[0], num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
    norm_topk_prob=True,
)
MODELS = {"qwen2_moe": QWEN2_MOE, "qwen3_moe": QWEN3_MOE}


def tiny_config(family: str, **overrides: Any):
    """A transformers config of ``family`` (qwen2_moe or qwen3_moe) at toy size with dense layers."""
    from transformers import Qwen2MoeConfig, Qwen3MoeConfig

    cls = {"qwen2_moe": Qwen2MoeConfig, "qwen3_moe": Qwen3MoeConfig}[family]
    kwargs: dict[str, Any] = dict(
        vocab_size=300, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        intermediate_size=64, max_position_embeddings=256, rms_norm_eps=1e-5, initializer_range=0.1,
        tie_word_embeddings=False, bos_token_id=257, eos_token_id=258, pad_token_id=256,
    )
    kwargs.update(MODELS[family])
    kwargs.update(overrides)
    config = cls(**kwargs)
    config.architectures = [cls.__name__.replace("Config", "ForCausalLM")]
    return config


def make_checkpoint(path: str | Path, family: str, *, seed: int = 0, **overrides: Any) -> Path:
    """A random HF directory of ``tiny_config(family)`` (fp32, norms and biases perturbed) with a tokenizer."""
    from transformers import AutoModelForCausalLM

    from megatron_rl_testing.tiny_models import make_tiny_tokenizer

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(family, **overrides), dtype=torch.float32)
    perturb_norms_and_biases(model)
    with torch.no_grad():  # transformers starts the shared-expert gate and routers at zero in places: make them bite
        for name, param in model.named_parameters():
            if name.endswith("shared_expert_gate.weight") or name.endswith("mlp.gate.weight"):
                param.copy_(torch.randn_like(param))
    model.save_pretrained(str(path))
    make_tiny_tokenizer(path)
    return Path(path)


def checks(dirs: dict[str, str], layouts: list[tuple[int, int, int, int | None]]) -> dict[str, Any]:
    """Per layout and model: logits on the last stage, and the full export (every rank)."""
    import torch.distributed as dist

    from megatron_rl.distributed import init_model_parallel
    from megatron_rl.models import build_from_hf, compute_full_logits
    from megatron_rl.weights import export_hf_weights

    input_ids, attention_mask = batch()
    out: dict[str, Any] = {"logits": {}, "export": {}}
    for tp, pp, ep, etp in layouts:
        init_model_parallel(tp=tp, pp=pp, ep=ep, etp=etp)
        for name, directory in dirs.items():
            chunks = build_from_hf(directory)
            logits = compute_full_logits(chunks, input_ids, attention_mask)
            if logits is not None:
                out["logits"][name, (tp, pp, ep, etp)] = logits
            out["export"][name, (tp, pp, ep, etp)] = [
                (n, t.clone()) for n, t in export_hf_weights(chunks, bucket_bytes=20_000)
            ]
    out["rank"] = dist.get_rank()
    return out
