"""What the vLLM tests share: a tiny checkpoint vLLM's CPU attention runs, buckets of HF-named tensors, and the
parameters vLLM must hold after loading them (its fused and padded layout)."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
import torch

from megatron_rl.bucket import WeightBucket
from megatron_rl.protocol import DataProto
from megatron_rl.rollout.vllm.contract import vllm_missing
from megatron_rl_testing.tiny_models import make_tiny_hf_checkpoint

VOCAB, MAX_LEN, EOS, PAD = 96, 256, 95, 0
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def skip_without_vllm() -> None:
    """Skip the calling module where vLLM is absent, except in CI (make test installs it: there it fails)."""
    if vllm_missing() and not os.environ.get("CI"):
        pytest.skip(f"vLLM is not installed here ({vllm_missing()}); `make install-vllm` installs it",
                    allow_module_level=True)


def tiny_model(path, seed: int, num_kv_heads: int = 1, family: str = "qwen2"):
    """Head size 32 (vLLM's CPU attention refuses the usual tiny 16), non-trivial norms and biases; an MoE
    ``family`` with experts of width 32 (vLLM's fused-MoE CPU kernel takes it)."""
    moe = {"moe_intermediate_size": 32} if family in ("qwen3_moe", "qwen2_moe") else {}
    return make_tiny_hf_checkpoint(path, family, seed=seed, vocab_size=VOCAB, hidden_size=64, num_heads=2,
                                   num_kv_heads=num_kv_heads, intermediate_size=128, max_position_embeddings=MAX_LEN,
                                   with_tokenizer=False, eos_token_id=EOS, pad_token_id=PAD, bos_token_id=1, **moe)


# A checkpoint's own sampling defaults, as Qwen2.5-Instruct ships repetition_penalty 1.05 in generation_config.json:
# vLLM applies such defaults to every request that leaves the field unset unless started with generation_config=vllm
# (vllm/config/model.py get_diff_sampling_param). Every value here would change the sampled distribution.
CHECKPOINT_SAMPLING = {"repetition_penalty": 1.3, "min_p": 0.2, "temperature": 0.3, "top_p": 0.5, "top_k": 5,
                       "max_new_tokens": 3, "do_sample": True}


def with_checkpoint_sampling_defaults(path) -> Path:
    """``path``'s generation_config.json with CHECKPOINT_SAMPLING added (as a checkpoint, not a model config)."""
    file = Path(path) / "generation_config.json"
    config = json.loads(file.read_text()) if file.exists() else {}
    file.write_text(json.dumps({**config, **CHECKPOINT_SAMPLING, "_from_model_config": False}, indent=2))
    return Path(path)


def as_bucket(named: list[tuple[str, torch.Tensor]]) -> WeightBucket:
    bucket = WeightBucket(WeightBucket.capacity_for([(tuple(t.shape), t.dtype) for _, t in named]), "cpu")
    for name, tensor in named:
        bucket.add(name, tensor, tensor.dtype)
    return bucket


# An MoE layer's experts in HF's checkpoint names (gate, up, down) -> vLLM's fused-MoE parameters: per layer one
# w13 [experts, 2 x ffn, hidden] (gate then up) and one w2 [experts, hidden, ffn]
EXPERT = re.compile(r"(?P<block>.*\.(?:mlp|block_sparse_moe)\.experts)\.(?P<e>\d+)\.(?P<leaf>\w+)\.weight$")
EXPERT_ROLES = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down", "w1": "gate", "w3": "up", "w2": "down"}


def _fused_experts(sent: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    parts: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    for name, tensor in sent.items():
        match = EXPERT.match(name)
        if match:
            role = EXPERT_ROLES[match["leaf"]]
            parts.setdefault(match["block"], {}).setdefault(int(match["e"]), {})[role] = tensor
    out = {}
    for block, experts in parts.items():
        order = sorted(experts)
        out[f"{block}.routed_experts.w13_weight"] = torch.stack(
            [torch.cat([experts[e]["gate"], experts[e]["up"]]) for e in order])
        out[f"{block}.routed_experts.w2_weight"] = torch.stack([experts[e]["down"] for e in order])
    return out


def vllm_layout(sent: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF-named tensors as vLLM's TP-1 model holds them: q/k/v and gate/up concatenated, experts fused."""
    out = _fused_experts(sent)
    for name, tensor in sent.items():
        if EXPERT.match(name):
            continue
        module, _, kind = name.rpartition(".")
        prefix, _, leaf = module.rpartition(".")
        fused = next((f for f, parts in FUSED.items() if leaf in parts), None)
        if fused is None:
            out[name] = tensor
        elif leaf == FUSED[fused][0]:
            out[f"{prefix}.{fused}.{kind}"] = torch.cat([sent[f"{prefix}.{p}.{kind}"] for p in FUSED[fused]])
    return out


def assert_served_equal(served: dict[str, torch.Tensor], sent: dict[str, torch.Tensor]) -> None:
    expected = vllm_layout(sent)
    assert set(expected) == set(served), set(expected) ^ set(served)
    for name, tensor in expected.items():
        got = served[name][: tensor.shape[0]]  # vLLM pads vocabulary rows to a multiple of 64
        assert torch.equal(got, tensor), f"{name}: max diff {(got - tensor).abs().max()}"


def prompts(rows: list[list[int]], **meta) -> DataProto:
    """Left-padded prompt rows (PAD) with their mask and positions, as the trainer hands them to an engine."""
    width = max(len(r) for r in rows)
    ids = torch.tensor([[PAD] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    return DataProto.from_dict({"input_ids": ids, "attention_mask": mask,
                                "position_ids": (mask.cumsum(-1) - 1).clamp(min=0)}, meta_info=meta)
