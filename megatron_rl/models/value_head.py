"""Scalar value head (hidden -> 1) that stands in for GPTModel's vocabulary output layer.

The critic is the policy's GPT with this head: ``GPTModel.forward`` then returns values of shape
[batch, seq, 1] instead of logits. The layout matches transformers' ``*ForTokenClassification`` with
``num_labels=1`` (``score.weight`` [1, hidden], ``score.bias`` [1]), so an exported critic loads there.
A reward model (``*ForSequenceClassification``, one label) has the same ``score.weight`` and no bias.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.tensor_parallel import gather_from_sequence_parallel_region
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig


class ValueHead(MegatronModule):
    """Replicated on every TP rank (the same weight everywhere).

    Without sequence parallelism the hidden states entering it are identical across TP ranks, so every
    rank computes the same values and the same gradients without communication.

    Under sequence parallelism (as verl's ``LinearForLastLayer`` and slime do) each TP rank applies the
    head to its own slice of the sequence and the [s/TP, b, 1] values are gathered with
    ``tensor_parallel_output_grad=False``: every rank holds the full values and the full loss, so the
    backward of the gather only keeps this rank's slice of the (identical) value gradient. Gathering the
    hidden states with the default ``tensor_parallel_output_grad=True`` instead reduce-scatters that
    identical gradient, i.e. multiplies every trunk gradient by TP while the head's stays x1 (wrong grad
    norm and clipping). The head's weight and bias gradients are then partial sums over this rank's
    tokens, so they are marked ``sequence_parallel`` and Megatron's ``finalize_model_grads`` sums them
    over TP (``_allreduce_non_tensor_model_parallel_grads``), exactly like the norms' weights.
    """

    def __init__(self, config: TransformerConfig, init: str = "normal", bias: bool = True):
        super().__init__(config=config)
        if init not in ("normal", "zero"):
            raise ValueError(f"value head init must be 'normal' or 'zero', got {init!r}")
        device = torch.cuda.current_device() if torch.cuda.is_available() else torch.device("cpu")
        self.weight = torch.nn.Parameter(
            torch.empty(1, config.hidden_size, dtype=config.params_dtype, device=device)
        )
        self.bias = (
            torch.nn.Parameter(torch.zeros(1, dtype=config.params_dtype, device=device)) if bias else None
        )
        with torch.no_grad():
            if init == "zero":
                self.weight.zero_()
            else:
                self.weight.normal_(mean=0.0, std=config.init_method_std)
        for param in self.parameters():
            param.sequence_parallel = bool(config.sequence_parallel)

    def forward(
        self,
        hidden_states: torch.Tensor,
        weight: torch.Tensor | None = None,
        runtime_gather_output: bool | None = None,
    ) -> tuple[torch.Tensor, None]:
        """Same call signature as ColumnParallelLinear, which GPTModel._postprocess uses."""
        values = torch.nn.functional.linear(hidden_states, self.weight, self.bias)
        if self.config.sequence_parallel:
            values = gather_from_sequence_parallel_region(values, tensor_parallel_output_grad=False)
        return values, None


def attach_value_head(model: torch.nn.Module, init: str = "normal", bias: bool = True) -> None:
    """Replace a last-stage GPTModel's output layer with a ValueHead (in place); ``bias=False`` for a
    sequence-classification reward model."""
    if not getattr(model, "post_process", False):
        raise ValueError("only the last pipeline stage (post_process=True) has an output layer to replace")
    if model.share_embeddings_and_output_weights:
        raise ValueError("a value model must not tie embeddings to its output layer")
    head = ValueHead(model.config, init=init, bias=bias)
    # Every TP rank must start from the same head, whatever its RNG consumed before.
    tp_group = parallel_state.get_tensor_model_parallel_group()
    if dist.get_world_size(tp_group) > 1:
        dist.broadcast(
            head.weight.data, src=parallel_state.get_tensor_model_parallel_src_rank(), group=tp_group
        )
    model.output_layer = head
