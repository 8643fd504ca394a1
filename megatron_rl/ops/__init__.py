"""Fused RL kernels: vocab-parallel log-prob/entropy, masked GAE and whitening, group normalisation.

Each op runs the compiled kernels of `megatron_rl._C` (C++ on CPU, CUDA on GPU) and falls back to the
plain-torch semantics in `megatron_rl.ops.reference` when they are not built (one warning).
"""

from megatron_rl.ops._extension import backend_summary, release_cpu_cache
from megatron_rl.ops.gae import masked_gae
from megatron_rl.ops.group_norm import group_normalize, masked_broadcast, row_sums
from megatron_rl.ops.log_probs import check_token_ids, log_probs_from_logits
from megatron_rl.ops.masked import masked_mean, masked_whiten

__all__ = [
    "backend_summary",
    "check_token_ids",
    "group_normalize",
    "log_probs_from_logits",
    "masked_broadcast",
    "masked_gae",
    "masked_mean",
    "masked_whiten",
    "release_cpu_cache",
    "row_sums",
]
