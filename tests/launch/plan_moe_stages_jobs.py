"""Rank job of test_plan_moe_stages.py (importable by spawned ranks): the weight matrices of the model chunks
Megatron builds on this rank, counted as the planner counts them (norms and biases left out)."""

from __future__ import annotations

from typing import Any


def planner_counted(name: str) -> bool:
    """The planner's memory rows count weight matrices: not the norms, not the q/k/v biases (small_params)."""
    return not (name.endswith(".bias") or "layernorm" in name or name.endswith("layer_norm_weight")
                or "final_norm" in name)


def built_counts_job(model_dirs: dict[str, str], layouts: list[tuple[int, int | None, int]]) -> dict[Any, Any]:
    """(model, (pp, vpp, ep)) -> (this rank's counted parameters, its global layer indices, the names of
    parameters of unknown kind) for every model and layout, built with Megatron's builder."""
    import torch.distributed as dist
    from megatron_rl.distributed import init_model_parallel
    from megatron_rl.models.builder import build_gpt_model
    from megatron_rl.models.hf_config import load_hf_config

    out: dict[Any, Any] = {"rank": dist.get_rank()}
    for pp, vpp, ep in layouts:
        init_model_parallel(tp=1, pp=pp, vpp=vpp, ep=ep)
        for name, directory in model_dirs.items():
            hf = load_hf_config(directory)
            if hf.num_layers % (pp * (vpp or 1)):
                continue
            chunks = build_gpt_model(hf)
            count = sum(p.numel() for chunk in chunks for n, p in chunk.named_parameters() if planner_counted(n))
            layers = sorted(layer.layer_number - 1 for chunk in chunks for layer in chunk.decoder.layers)
            out[name, (pp, vpp, ep)] = (count, layers)
    return out
