"""The two log-prob forward+backward steps the CPU and GPU kernel benchmarks compare."""
from __future__ import annotations

import torch

from megatron_rl import ops


def fused_step(x, labels, with_entropy):
    x.grad = None
    if with_entropy:
        lp, h = ops.log_probs_from_logits(x, labels, with_entropy=True)
        (lp.sum() + h.sum()).backward()
    else:
        ops.log_probs_from_logits(x, labels).sum().backward()


def torch_step(x, labels, with_entropy):
    """log_softmax + gather, and verl's entropy_from_logits (softmax, logsumexp - sum p*x)."""
    x.grad = None
    logits = x.float()
    loss = torch.log_softmax(logits, dim=-1).gather(-1, labels.unsqueeze(-1)).sum()
    if with_entropy:
        p = torch.softmax(logits, dim=-1)
        loss = loss + (torch.logsumexp(logits, dim=-1) - (p * logits).sum(-1)).sum()
    loss.backward()
