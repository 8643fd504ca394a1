"""Vocab-parallel log_probs_from_logits: TP=2 over gloo equals TP=1 (values and gradients)."""

import pytest
import torch
import torch.distributed as dist

from megatron_rl import ops
from megatron_rl.distributed.spawn import run_multiprocess
from megatron_rl.ops import reference

TP = 2
ROWS, VOCAB = 24, 96  # two shards of 48 columns
CASES = [  # (vocab_size, temperature): no padding; last shard partly padding; last shard all padding
    (None, 1.0),
    (80, 0.7),
    (40, 1.3),
]
COLLECTIVES = ("all_gather_into_tensor", "all_gather", "all_reduce", "broadcast", "reduce_scatter_tensor")


def full_problem(vocab_size):
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(ROWS, VOCAB, generator=gen) * 3
    labels = torch.randint(0, vocab_size or VOCAB, (ROWS,), generator=gen)
    labels[[2, 11]] = -100
    upstream = (torch.randn(ROWS, generator=gen), torch.randn(ROWS, generator=gen))
    return logits, labels, upstream


def forward_backward(fn, logits, labels, upstream, **kw):
    x = logits.clone().requires_grad_()
    lp, h = fn(x, labels, with_entropy=True, **kw)
    ((lp * upstream[0]).sum() + (h * upstream[1]).sum()).backward()
    return lp.detach(), h.detach(), x.grad


class CollectiveCounter:
    """Counts torch.distributed collectives called while active."""

    def __init__(self):
        self.calls = []

    def __enter__(self):
        self.saved = {name: getattr(dist, name) for name in COLLECTIVES}
        for name, original in self.saved.items():
            setattr(dist, name, self._counting(name, original))
        return self

    def _counting(self, name, original):
        def wrapper(*args, **kwargs):
            self.calls.append(name)
            return original(*args, **kwargs)

        return wrapper

    def __exit__(self, *exc):
        for name, original in self.saved.items():
            setattr(dist, name, original)


def shard_results():
    """Runs on each rank: fused and reference results for this rank's vocabulary shard."""
    rank, width = dist.get_rank(), VOCAB // TP
    out = []
    for vocab_size, temperature in CASES:
        logits, labels, upstream = full_problem(vocab_size)
        shard = logits[:, rank * width : (rank + 1) * width]
        kw = {"tp_group": dist.group.WORLD, "vocab_size": vocab_size, "temperature": temperature}
        with CollectiveCounter() as counter:
            fused = forward_backward(ops.log_probs_from_logits, shard, labels, upstream, **kw)
        ref = forward_backward(reference.log_probs_from_logits, shard, labels, upstream, **kw)
        out.append((fused, ref, counter.calls))
    logits, labels, upstream = nan_problem()
    shard = logits[:, rank * width : (rank + 1) * width]
    out.append(forward_backward(ops.log_probs_from_logits, shard, labels, upstream, tp_group=dist.group.WORLD))
    return out


def nan_problem():
    """NaN / +inf logits on ONE shard: the merge must carry them to every rank (a max must not drop them)."""
    logits, labels, upstream = full_problem(None)
    width = VOCAB // TP
    labels[:4] = torch.tensor([width + 3, 5, width + 6, 9])  # rows 0, 2 labelled on shard 1; rows 1, 3 on 0
    logits[0, 1] = float("nan")  # on shard 0, label on shard 1
    logits[1, width + 2] = float("nan")  # on shard 1, label on shard 0
    logits[2, width + 6] = float("nan")  # the target itself
    logits[3, width + 1] = float("inf")
    return logits, labels, upstream


@pytest.mark.distributed
def test_tp2_propagates_nan_from_any_shard():
    per_rank = run_multiprocess(shard_results, TP, timeout_s=120)
    logits, labels, upstream = nan_problem()
    lp, h, grad = forward_backward(reference.log_probs_from_logits, logits, labels, upstream)
    assert lp[:4].isnan().all() and torch.isfinite(lp[4:][labels[4:] != -100]).all()
    for rank, results in enumerate(per_rank):
        tp_lp, tp_h, tp_grad = results[-1]
        torch.testing.assert_close(tp_lp, lp, rtol=1e-5, atol=1e-5, equal_nan=True, msg=f"rank {rank} log-probs")
        torch.testing.assert_close(tp_h, h, rtol=1e-5, atol=1e-5, equal_nan=True, msg=f"rank {rank} entropy")
        columns = slice(rank * VOCAB // TP, (rank + 1) * VOCAB // TP)
        assert tp_grad[:4].isnan().all(), f"rank {rank}: every gradient of a NaN row is NaN"
        torch.testing.assert_close(tp_grad, grad[:, columns], rtol=1e-5, atol=1e-6, equal_nan=True)


@pytest.mark.distributed
def test_tp2_equals_tp1():
    per_rank = run_multiprocess(shard_results, TP, timeout_s=120)
    for case, (vocab_size, temperature) in enumerate(CASES):
        logits, labels, upstream = full_problem(vocab_size)
        kw = {"vocab_size": vocab_size, "temperature": temperature}
        lp, h, grad = forward_backward(ops.log_probs_from_logits, logits, labels, upstream, **kw)
        lp_ref, h_ref, grad_ref = forward_backward(
            reference.log_probs_from_logits, logits, labels, upstream, **kw
        )
        torch.testing.assert_close(lp, lp_ref, rtol=1e-5, atol=1e-5)
        for rank, results in enumerate(per_rank):
            (tp_lp, tp_h, tp_grad), (r_lp, r_h, r_grad), calls = results[case]
            assert calls == ["all_gather_into_tensor"], f"rank {rank}: expected one collective, saw {calls}"
            torch.testing.assert_close(tp_lp, lp, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(tp_h, h, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(r_lp, lp_ref, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(r_h, h_ref, rtol=1e-5, atol=1e-5)
            columns = slice(rank * VOCAB // TP, (rank + 1) * VOCAB // TP)
            torch.testing.assert_close(tp_grad, grad[:, columns], rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(r_grad, grad_ref[:, columns], rtol=1e-5, atol=1e-6)
