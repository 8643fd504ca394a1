"""Rank jobs of test_glm4_moe.py (importable by spawned ranks): logits and export of tiny GLM-4.5 models at several
(TP, PP, EP) layouts."""

from __future__ import annotations

from typing import Any

from megatron_rl_testing.tiny_models import padded_batch as batch

# layer_grads: the gradient comparison across layouts is DeepSeek-V3's (the same MoE block, GQA attention for MLA)
from deepseek_v3_jobs import GRAD_LAYER, _packed_logits, gradient_loss, layer_grads  # noqa: F401


def glm4_moe_checks(dirs: dict[str, str], layouts: list[tuple[int, int, int, int | None]]) -> dict[str, Any]:
    """For each (TP, PP, EP, ETP) layout (ETP None = TP) and each checkpoint whose layer count PP divides: gathered
    logits (last stage), every exported tensor; at TP=2 the logits under sequence parallelism; at the first layout the
    THD-packed logits and how many dims each head's RoPE rotates (Megatron's frequency table, doubled)."""
    from megatron_rl.distributed import init_model_parallel
    from megatron_rl.models import build_from_hf, compute_full_logits
    from megatron_rl.models.hf_config import load_hf_config
    from megatron_rl.weights import export_hf_weights

    input_ids, attention_mask = batch()
    out: dict[str, Any] = {"logits": {}, "export": {}, "rotary_dims": {}, "packed": {}}
    for tp, pp, ep, etp in layouts:
        init_model_parallel(tp=tp, pp=pp, ep=ep, etp=etp)
        for name, directory in dirs.items():
            if load_hf_config(directory).num_layers % pp:
                continue
            chunks = build_from_hf(directory)
            logits = compute_full_logits(chunks, input_ids, attention_mask)
            if logits is not None:  # the last pipeline stage
                out["logits"][name, tp, pp, ep] = logits
            out["export"][name, tp, pp, ep] = [(n, t.clone()) for n, t in export_hf_weights(chunks)]
            if tp > 1 and pp == 1 and ep == 1:
                sp_chunks = build_from_hf(directory, sequence_parallel=True)
                out["logits"][name, tp, pp, ep, "sp"] = compute_full_logits(sp_chunks, input_ids, attention_mask)
            if (tp, pp, ep, etp) == layouts[0]:
                out["rotary_dims"][name] = 2 * chunks[0].rotary_pos_emb.inv_freq.numel()
                out["packed"][name] = _packed_logits(chunks[0], input_ids, attention_mask)
    return out
