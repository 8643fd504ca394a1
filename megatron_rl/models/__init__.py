"""Megatron-Core GPT models from HF checkpoints (Llama, Qwen2, Qwen3, Mistral), value head, loading.

Public API (docs/models.md has the details):
    load_hf_config(dir) -> HFModelConfig
    build_gpt_model(hf_config, *, value_head=False, ...) -> list of model chunks (one per VPP stage)
    load_hf_weights(chunks, dir)
    build_from_hf(dir, **build_kwargs) -> chunks (build + load)
    causal_padding_mask(attention_mask [B, T]) -> [B, 1, T, T] bool mask for GPTModel.forward
    compute_full_logits(chunks, input_ids, attention_mask) -> [B, T, vocab] on the last stage

The export back to HF names lives in ``megatron_rl.weights``. Names are resolved lazily so that the light
modules (hf_config, sizes) load without importing Megatron-Core (which takes seconds).
"""

from importlib import import_module
from typing import Any

_EXPORTS = {
    "build_from_hf": "api",
    "compute_full_logits": "api",
    "position_ids_from_mask": "api",
    "SDPAttention": "attention",
    "causal_padding_mask": "attention",
    "build_gpt_model": "builder",
    "make_transformer_config": "builder",
    "CheckpointMismatchError": "hf_checkpoint",
    "HFCheckpointReader": "hf_checkpoint",
    "SUPPORTED_ARCHITECTURES": "hf_config",
    "HFModelConfig": "hf_config",
    "UnsupportedModelError": "hf_config",
    "load_hf_config": "hf_config",
    "load_pretrained_config": "hf_config",
    "parse_hf_config": "hf_config",
    "load_hf_weights": "loading",
    "check_parallel_fit": "sizes",
    "padded_vocab_size": "sizes",
    "ValueHead": "value_head",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'megatron_rl.models' has no attribute {name!r}")
    return getattr(import_module(f"megatron_rl.models.{_EXPORTS[name]}"), name)
