"""Rank jobs of test_fp8_checkpoint.py (importable by spawned ranks): logits and exports of tiny DeepSeek-V3 models
built from an FP8 block-scaled checkpoint and from its dequantised twin, at several (TP, EP) layouts."""

from __future__ import annotations

from typing import Any

from megatron_rl_testing.tiny_models import padded_batch as batch


def fp8_checks(dirs: dict[str, str], layouts: list[tuple[int, int]]) -> dict[str, Any]:
    """For each (TP, EP) layout and each checkpoint: gathered logits and every exported tensor; at TP=2 also the
    export of the FP8 checkpoint built with bf16 parameters."""
    import torch

    from megatron_rl.distributed import init_model_parallel
    from megatron_rl.models import build_from_hf, compute_full_logits
    from megatron_rl.weights import export_hf_weights

    input_ids, attention_mask = batch()
    out: dict[str, Any] = {"logits": {}, "export": {}}
    for tp, ep in layouts:
        init_model_parallel(tp=tp, pp=1, ep=ep, etp=1 if tp > 1 and ep > 1 else None)
        for name, directory in dirs.items():
            chunks = build_from_hf(directory)
            out["logits"][name, tp, ep] = compute_full_logits(chunks, input_ids, attention_mask)
            out["export"][name, tp, ep] = [(n, t.clone()) for n, t in export_hf_weights(chunks)]
        if tp == 2:
            chunks = build_from_hf(dirs["fp8"], params_dtype=torch.bfloat16)
            out["export"]["fp8", "bf16"] = [(n, t.clone()) for n, t in export_hf_weights(chunks)]
    return out
