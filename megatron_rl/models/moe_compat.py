"""Megatron-Core 0.16.1's MoE and MLA code: without Transformer Engine one name it leaves undefined and one flag it
sets wrongly; and one shape error of the expert bias's token count under a padding mask.

``moe_utils.RouterGatingLinearFunction`` (the router's matmul) tests ``te_general_gemm is not None``, but
``te_general_gemm`` is only bound when Transformer Engine imports; without TE the test raises NameError
(CPU runs, or GPUs without TE). Binding it to None selects the plain ``torch.mm`` path the function
already has. The fused permute/router kernels are turned off by the builder (moe_permute_fusion /
moe_router_fusion false), so no other TE name is reached.
"""

from __future__ import annotations


def bind_missing_te_names() -> None:
    """Idempotent; changes nothing when Transformer Engine is installed (the name is then bound)."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def disable_mla_te_check_without_te() -> None:
    """Megatron-Core 0.16.1's multi_latent_attention.py imports TELinear from extensions/transformer_engine.py,
    which without Transformer Engine defines its TE classes on a MagicMock: the import succeeds, the module sets
    ``HAVE_TE = True``, and ``MultiLatentAttention.__init__`` then calls ``isinstance(linear_proj, TELinear)``
    with a MagicMock instance, a TypeError. That flag only gates this FP8/FP4 TELinear test; it is set to what
    is true (TE absent). Idempotent; changes nothing when Transformer Engine is installed."""
    from megatron.core.extensions import transformer_engine
    from megatron.core.transformer import multi_latent_attention

    if not transformer_engine.HAVE_TE:
        multi_latent_attention.HAVE_TE = False


def accept_whole_mla_down_projections() -> None:
    """The local spec's MLA down projections are kept whole on every TP rank (models/mla_layers.py says why).
    MLASelfAttention accepts a whole projection only as the class its module calls ``Linear`` (modelopt's, imported
    beside TE's names: torch's init, a checkpoint entry that needs metadata this engine does not pass); that name
    is bound to ``DuplicatedLinear``. The TE spec uses TELinear and never reads it. Idempotent."""
    from megatron.core.transformer import multi_latent_attention

    from megatron_rl.models.mla_layers import DuplicatedLinear  # lazy: it imports Megatron, as this module does

    multi_latent_attention.Linear = DuplicatedLinear


def count_expert_bias_tokens_without_pads() -> None:
    """Megatron-Core 0.16.1's ``TopKRouter._apply_expert_bias`` (router.py) counts each expert's tokens for the
    expert-bias update as ``routing_map & ~padding_mask``: [tokens, experts] against the flattened [tokens] pad mask,
    a shape error whenever a router with an expert bias (DeepSeek-V3's) trains on a micro-batch with pads (the
    engine passes its pad mask: models/moe_training.py moe_padding). Rebound to the same count with the mask
    broadcast over the experts. Idempotent."""
    import torch
    from megatron.core.transformer.moe.router import TopKRouter

    if getattr(TopKRouter._apply_expert_bias, "counts_without_pads", False):
        return

    def _apply_expert_bias(self, routing_map: torch.Tensor, padding_mask: torch.Tensor | None = None) -> None:
        if self.enable_expert_bias and torch.is_grad_enabled():  # not in evaluation or recomputation (Megatron's)
            with torch.no_grad():
                if padding_mask is not None:
                    routing_map = routing_map & ~padding_mask.reshape(-1, 1)
                self.local_tokens_per_expert += routing_map.sum(dim=0)

    _apply_expert_bias.counts_without_pads = True
    TopKRouter._apply_expert_bias = _apply_expert_bias
