"""Rank job of test_moe_grouped_cuda.py (importable by spawned ranks): the same MoE model with SequentialMLP
and with TEGroupedMLP experts on one GPU, weights through models/moe_experts.py's mapping; logits, gradients,
export and the step time of each."""

from __future__ import annotations

from typing import Any

import torch

# The timed model: big enough that per-expert kernel launches show (16 experts, 4096 tokens, top-4)
TIMING_MODEL = dict(hidden_size=1024, num_heads=8, num_kv_heads=4, num_layers=2, intermediate_size=2048,
                    vocab_size=4096, num_experts=16, num_experts_per_tok=4, moe_intermediate_size=512)
TIMING_BATCH = (16, 256)  # rows, tokens per row (max_position_embeddings of the tiny configs)
WARMUP, STEPS = 3, 10


def _experts(model: torch.nn.Module) -> torch.nn.Module:
    return next(layer.mlp.experts for layer in model.decoder.layers if hasattr(layer.mlp, "experts"))


def _forward(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    from megatron_rl.models.api import position_ids_from_mask
    from megatron_rl.models.attention import causal_padding_mask

    return model(ids, position_ids_from_mask(mask), causal_padding_mask(mask), runtime_gather_output=True)


def _logits_and_grads(model: torch.nn.Module, ids, mask) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """fp32 logits of the real vocabulary and the gradients (by HF key) of a fixed weighting of them."""
    from megatron_rl.models.layout import chunk_mappings

    model.train()
    model.zero_grad(set_to_none=True)
    vocab = model.hf_config.vocab_size
    logits = _forward(model, ids, mask)[..., :vocab].float()
    weights = torch.randn(logits.shape, generator=torch.Generator().manual_seed(7)).to(logits.device)
    (logits * weights * mask[..., None]).sum().backward()
    grads = {m.group.key: m.param.grad.float().cpu()
             for m in chunk_mappings(model) if m.param.grad is not None}
    return logits.detach().cpu(), grads


def _step_ms(model: torch.nn.Module, ids, mask) -> float:
    """Median milliseconds of one forward + backward (no optimizer step: it is the same for both layouts)."""
    times = []
    for step in range(WARMUP + STEPS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        model.zero_grad(set_to_none=True)
        start.record()
        _forward(model, ids, mask).float().mean().backward()
        end.record()
        torch.cuda.synchronize()
        if step >= WARMUP:
            times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def grouped_cuda_job(model_dir: str) -> dict[str, Any]:
    from megatron_rl.distributed import destroy_model_parallel, init_model_parallel
    from megatron_rl.models import build_from_hf, build_gpt_model, parse_hf_config
    from megatron_rl.models.builder import te_available
    from megatron_rl.models.layout import chunk_mappings
    from megatron_rl.models.moe_experts import expert_state_key
    from megatron_rl.weights import export_hf_weights
    from megatron_rl_testing.tiny_models import padded_batch, tiny_hf_config

    init_model_parallel(tp=1)
    out: dict[str, Any] = {"te": te_available()}
    bf16 = torch.bfloat16
    models = {grouped: build_from_hf(model_dir, params_dtype=bf16, moe_grouped_gemm=grouped)[0]
              for grouped in (False, True)}
    out["layers"] = {grouped: type(_experts(m)).__name__ for grouped, m in models.items()}
    out["grouped_names"] = sorted(n for n, _ in models[True].named_parameters() if ".experts." in n)
    # export through the mapping: the same HF tensors from either layout
    exports = {g: [(n, t.cpu().clone()) for n, t in export_hf_weights([m])] for g, m in models.items()}
    out["export_names_equal"] = [n for n, _ in exports[False]] == [n for n, _ in exports[True]]
    pairs = zip(exports[False], exports[True], strict=True)
    out["export_differs"] = [n for (n, a), (_, b) in pairs if not torch.equal(a, b)]
    # a SequentialMLP state dict converted by expert_state_key loads into the grouped model (TE's _extra_state
    # entries are per module and differ between the layouts: not weights)
    state = {expert_state_key(k, grouped=True): v for k, v in models[False].state_dict().items()
             if not k.endswith("_extra_state")}
    third = build_from_hf(model_dir, params_dtype=bf16, moe_grouped_gemm=True)[0]
    with torch.no_grad():
        for m in chunk_mappings(third):
            m.param.zero_()
    result = third.load_state_dict(state, strict=False)
    out["state_missing"] = [k for k in result.missing_keys if not k.endswith("_extra_state")]
    out["state_unexpected"] = list(result.unexpected_keys)
    pairs = zip(chunk_mappings(third), chunk_mappings(models[True]), strict=True)
    out["state_equal"] = all(torch.equal(a.param, b.param) for a, b in pairs)
    del third

    ids, mask = (t.cuda() for t in padded_batch())
    for grouped, model in models.items():
        out["logits", grouped], out["grads", grouped] = _logits_and_grads(model, ids, mask)
    out["mask"] = mask.cpu()
    del models, exports
    torch.cuda.empty_cache()

    # the measure: step time of each layout on a model where the expert GEMMs matter
    hf = parse_hf_config(tiny_hf_config("qwen3_moe", **TIMING_MODEL).to_dict())
    sequential = build_gpt_model(hf, params_dtype=bf16, moe_grouped_gemm=False)[0]
    grouped = build_gpt_model(hf, params_dtype=bf16, init_weights=False, moe_grouped_gemm=True)[0]
    with torch.no_grad():  # the same weights, paired by HF key through the mapping
        for a, b in zip(chunk_mappings(sequential), chunk_mappings(grouped), strict=True):
            assert a.group.key == b.group.key
            b.param.copy_(a.param)
    rows, length = TIMING_BATCH
    ids = torch.randint(0, hf.vocab_size, (rows, length), generator=torch.Generator().manual_seed(3)).cuda()
    full = torch.ones_like(ids)
    with torch.no_grad():
        a, b = (_forward(m, ids, full).float() for m in (sequential, grouped))
        out["timing_logits_rel"] = float((a - b).norm() / a.norm())
    out["step_ms"] = {"SequentialMLP": _step_ms(sequential, ids, full),
                      "TEGroupedMLP": _step_ms(grouped, ids, full)}
    out["timing_tokens"] = rows * length
    destroy_model_parallel()
    return out
