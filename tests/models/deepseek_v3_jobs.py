"""Rank jobs of test_deepseek_v3.py (importable by spawned ranks): logits, export and the router bias of tiny
DeepSeek-V3 models at several (TP, EP) layouts."""

from __future__ import annotations

from typing import Any

import torch

from megatron_rl_testing.tiny_models import padded_batch as batch


def _packed_logits(model, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Logits of the rows' real tokens laid end to end in one THD pack ([T, vocab], the rows in order)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    lengths = attention_mask.sum(-1)
    cu_seqlens = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)]).int()
    tokens = input_ids[attention_mask.bool()][None, :]
    positions = torch.cat([torch.arange(int(n)) for n in lengths])[None, :]
    longest = int(lengths.max())
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
                             max_seqlen_q=longest, max_seqlen_kv=longest)
    model.eval()
    with torch.no_grad():
        return model(tokens, positions, None, packed_seq_params=params)[0, :, : model.hf_config.vocab_size]


def deepseek_checks(
    dirs: dict[str, str], layouts: list[tuple[int, int, int, int | None]], with_mtp: str
) -> dict[str, Any]:
    """For each (TP, PP, EP, ETP) layout (ETP None = TP) and each checkpoint whose layer count PP divides:
    gathered logits (last stage), every exported tensor; at TP=2 the logits under sequence parallelism; at the
    first layout the THD-packed logits, how the router bias is held (requires_grad, gradient after a training
    backward), the shared-prompt RoPE refusal, and the logits of ``with_mtp`` (the q_lora checkpoint plus
    stored multi-token-prediction tensors)."""
    from megatron_rl.distributed import init_model_parallel
    from megatron_rl.models import build_from_hf, causal_padding_mask, compute_full_logits, position_ids_from_mask
    from megatron_rl.models.hf_config import load_hf_config
    from megatron_rl.models.rope_positions import check_rope_positions
    from megatron_rl.weights import export_hf_weights

    input_ids, attention_mask = batch()
    out: dict[str, Any] = {"logits": {}, "export": {}, "router_bias": {}, "rope_positions": {}, "packed": {}}
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
            if tp > 1 and pp == 1 and ep == 1:  # sequence parallel: MLA gathers / scatters its latents itself
                sp_chunks = build_from_hf(directory, sequence_parallel=True)
                out["logits"][name, tp, pp, ep, "sp"] = compute_full_logits(sp_chunks, input_ids, attention_mask)
            if (tp, pp, ep, etp) == layouts[0]:
                if name == "q_lora":  # the same checkpoint with a multi-token-prediction layer stored
                    mtp_chunks = build_from_hf(with_mtp)
                    out["logits"]["q_lora_mtp"] = compute_full_logits(mtp_chunks, input_ids, attention_mask)
                model = chunks[0]
                out["packed"][name] = _packed_logits(model, input_ids, attention_mask)
                model.train()
                logits = model(input_ids, position_ids_from_mask(attention_mask), causal_padding_mask(attention_mask))
                (logits * attention_mask[..., None]).sum().backward()
                try:  # shared prompts (RoPE at given positions) are refused by name
                    check_rope_positions(model)
                except ValueError as err:
                    out["rope_positions"][name] = str(err)
                router = model.decoder.layers[1].mlp.router
                out["router_bias"][name] = dict(
                    is_parameter=any(p is router.expert_bias for p in model.parameters()),
                    requires_grad=router.expert_bias.requires_grad,
                    grad=router.expert_bias.grad,
                    router_weight_grad_nonzero=bool(router.weight.grad.abs().sum() > 0),
                )
    return out
