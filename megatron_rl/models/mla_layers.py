"""The down projections of multi-latent attention on the local (no Transformer Engine) layer spec.

Megatron-Core 0.16.1's local MLA spec splits ``linear_q_down_proj`` / ``linear_kv_down_proj`` over TP
(ColumnParallelLinear) and, in ``MLASelfAttention.get_query_key_value_tensors``, all-gathers kv_down's output and cuts
the shared RoPE key from it. That gather's backward only splits, while each TP rank uses the key for its own heads:
at TP > 1 every rank kept only its heads' share of the key's gradient (kv_a's RoPE rows and everything below them
off by ~1e-2: tests/models/test_deepseek_v3_grads.py). TE's spec keeps both projections whole on every rank
(TELinear, ``duplicated``), which takes MLA's other branch: the key is gathered along the sequence, whose backward
sums over TP. ``DuplicatedLinear`` is that whole projection without TE.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F
from megatron.core.transformer.transformer_config import TransformerConfig


class DuplicatedLinear(torch.nn.Module):
    """``y = x W^T`` with W whole on every TP rank. Under sequence parallelism each rank applies it to its slice of
    the sequence, so its weight's gradient is summed over TP by Megatron's ``finalize_model_grads`` (the
    ``sequence_parallel`` mark, as the norms have). Without sequence parallelism at TP > 1 the forward is exact
    (log-probs, the reference) but the key's gradient would be partial again; Megatron's MoE layers, which every
    MLA family here has, refuse to train at TP > 1 without sequence parallelism."""

    def __init__(self, input_size: int, output_size: int, *, config: TransformerConfig,
                 init_method: Callable[[torch.Tensor], Any], bias: bool = False, **_unused: Any) -> None:
        super().__init__()
        if bias:
            raise ValueError("DuplicatedLinear: MLA's down projections have no bias")
        self.weight = torch.nn.Parameter(torch.empty(output_size, input_size, dtype=config.params_dtype))
        if config.perform_initialization:
            init_method(self.weight)
        self.weight.sequence_parallel = bool(config.sequence_parallel)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        return F.linear(x, self.weight), None  # (output, bias) as Megatron's linears return

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        """Replicated over TP in Megatron's distributed checkpoint."""
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        return make_sharded_tensors_for_checkpoint(self.state_dict(prefix="", keep_vars=True), prefix, {},
                                                   sharded_offsets)
