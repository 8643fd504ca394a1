"""Rank jobs of test_moe_grouped_experts.py (importable by spawned ranks), and the plain-torch twin of
Transformer Engine's grouped experts that lets a CPU run hold an MoE model in the grouped layout.

``GroupedExpertsTwin`` has TEGroupedMLP's interface and parameter names (``linear_fc1.weight<i>``,
``linear_fc2.weight<i>``, one per local expert) and its computation: the dispatcher hands it the local tokens
sorted by expert with the count per expert, and it runs one matmul per expert on the stacked [E, out, in]
weights (TE's grouped GEMM), SwiGLU, the routing probability, then fc2 the same way.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

EXPERT_LAYOUTS = (1, 2)  # EP sizes on 2 ranks (TP = PP = 1)


class GroupedExpertsTwin(torch.nn.Module):
    """TEGroupedMLP in plain torch (SwiGLU experts without bias)."""

    def __init__(self, num_local_experts: int, hidden: int, ffn: int) -> None:
        super().__init__()
        self.num_local_experts = num_local_experts
        self.linear_fc1, self.linear_fc2 = torch.nn.Module(), torch.nn.Module()
        for i in range(num_local_experts):
            self.linear_fc1.register_parameter(f"weight{i}", torch.nn.Parameter(torch.zeros(2 * ffn, hidden)))
            self.linear_fc2.register_parameter(f"weight{i}", torch.nn.Parameter(torch.zeros(hidden, ffn)))

    def _stacked(self, linear: torch.nn.Module) -> torch.Tensor:
        return torch.stack([getattr(linear, f"weight{i}") for i in range(self.num_local_experts)])

    def forward(
        self, tokens: torch.Tensor, tokens_per_expert: torch.Tensor, probs: torch.Tensor
    ) -> tuple[torch.Tensor, None]:
        counts = [int(n) for n in tokens_per_expert.tolist()]
        fc1, fc2 = self._stacked(self.linear_fc1), self._stacked(self.linear_fc2)
        out = []
        for e, (x, p) in enumerate(zip(tokens.split(counts), probs.split(counts), strict=True)):
            gate, up = (x @ fc1[e].t()).chunk(2, dim=-1)
            out.append(((F.silu(gate) * up) * p.unsqueeze(-1)).to(x.dtype) @ fc2[e].t())
        return torch.cat(out), None


def use_grouped_twins(model: torch.nn.Module) -> int:
    """Replace every MoE layer's SequentialMLP by an (all-zero) GroupedExpertsTwin; the number replaced."""
    from megatron.core.transformer.moe.experts import SequentialMLP

    replaced = 0
    for layer in model.decoder.layers:
        experts = getattr(layer.mlp, "experts", None)
        if isinstance(experts, SequentialMLP):
            fc1 = experts.local_experts[0].linear_fc1.weight
            layer.mlp.experts = GroupedExpertsTwin(experts.num_local_experts, fc1.shape[1], fc1.shape[0] // 2)
            replaced += 1
    return replaced


def grouped_state(state: dict[str, Any]) -> dict[str, Any]:
    """A SequentialMLP model's state dict in the grouped layout (models/moe_experts.py: expert_state_key); each
    expert linear's ``_extra_state`` (None: the local linears keep no FP8 metadata) has no grouped counterpart."""
    from megatron_rl.models.moe_experts import expert_state_key

    return {expert_state_key(key, grouped=True): value for key, value in state.items()
            if not (".local_experts." in key and key.endswith("._extra_state"))}


def _layer_check(sequential: torch.nn.Module, grouped: torch.nn.Module) -> dict[str, Any]:
    """One MoE layer of each model on the same random hidden states: outputs, input gradients and
    expert-weight gradients (in the HF key of each weight)."""
    from megatron_rl.models.layout import chunk_mappings

    layers = sequential.decoder.layers
    layer_number = next(i for i, layer in enumerate(layers) if hasattr(layer.mlp, "experts"))
    hidden_size = sequential.config.hidden_size
    torch.manual_seed(11)
    hidden = torch.randn(6, 2, hidden_size)
    weights = torch.randn(6, 2, hidden_size)
    out: dict[str, Any] = {}
    for name, model in (("sequential", sequential), ("grouped", grouped)):
        model.zero_grad(set_to_none=True)
        x = hidden.clone().requires_grad_(True)
        y, _ = model.decoder.layers[layer_number].mlp(x)
        (y * weights).sum().backward()
        grads = {m.group.key: m.param.grad.clone() for m in chunk_mappings(model)
                 if m.group.expert is not None and m.param.grad is not None}
        out[name] = {"output": y.detach(), "input_grad": x.grad, "expert_grads": grads}
    return out


def grouped_layout_job(model_dirs: dict[str, str]) -> dict[str, Any]:
    """Per model and EP size: the export (and logits, gradients) of the SequentialMLP model and of its grouped
    twin holding the converted state; a grouped twin filled from the HF files; one MoE layer of each."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from moe_jobs import _grads_by_hf_key

    from megatron_rl.distributed import init_model_parallel
    from megatron_rl.models import build_from_hf, compute_full_logits, load_hf_weights
    from megatron_rl.models.layout import chunk_mappings
    from megatron_rl.models.moe import local_experts
    from megatron_rl.models.moe_experts import is_grouped
    from megatron_rl.weights import export_hf_weights
    from megatron_rl_testing.tiny_models import padded_batch

    input_ids, attention_mask = padded_batch()
    out: dict[str, Any] = {"rank": dist.get_rank()}
    for ep in EXPERT_LAYOUTS:
        init_model_parallel(tp=1, pp=1, ep=ep)
        for name, directory in model_dirs.items():
            key = (name, ep)
            ep_rank = parallel_state.get_expert_model_parallel_rank()
            sequential = build_from_hf(directory)[0]
            grouped = build_from_hf(directory)[0]
            replaced = use_grouped_twins(grouped)
            grouped.load_state_dict(grouped_state(sequential.state_dict()), strict=True)
            from_hf = build_from_hf(directory)[0]
            use_grouped_twins(from_hf)  # zeros, then the HF files through the mapping
            load_hf_weights([from_hf], directory)
            from_hf_params = {m.group.key: m.param.detach().clone() for m in chunk_mappings(from_hf)}
            out[key] = {
                "replaced": replaced,
                "grouped_layout": all(is_grouped(layer.mlp.experts) for layer in grouped.decoder.layers
                                      if hasattr(layer.mlp, "experts")),
                "owned": list(local_experts(sequential.hf_config.moe, ep, ep_rank)),
                "sequential_params": {m.group.key: m.param.detach().clone()
                                      for m in chunk_mappings(sequential)},
                "from_hf_params": from_hf_params,
                "export": {},
                "logits": {},
                "grads": {},
                "layer": _layer_check(sequential, grouped),
            }
            for layout, model in (("sequential", sequential), ("grouped", grouped)):
                exported = export_hf_weights([model], bucket_bytes=20_000)  # several buckets per layer
                out[key]["export"][layout] = [(n, t.clone()) for n, t in exported]
                out[key]["logits"][layout] = compute_full_logits([model], input_ids, attention_mask)
                model.zero_grad(set_to_none=True)  # _layer_check's backward
                out[key]["grads"][layout] = _grads_by_hf_key([model])
    return out
