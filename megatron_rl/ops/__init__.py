"""Fused RL kernels: vocab-parallel log-prob/entropy, masked GAE and whitening, group normalisation.

`megatron_rl.ops.reference` holds the plain-torch semantics every op here matches.
"""
from megatron_rl.ops.reference import (
    group_normalize,
    log_probs_from_logits,
    masked_gae,
    masked_mean,
    masked_whiten,
)

__all__ = ["group_normalize", "log_probs_from_logits", "masked_gae", "masked_mean", "masked_whiten"]
