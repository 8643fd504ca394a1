"""Fused kernels on CPU against their plain references, timed in the same run (issue 3 targets).

    pytest benchmarks/test_kernels_cpu.py -s --benchmark-columns=min,mean,rounds     # ~2-3 min

Each test times ours with pytest-benchmark and the references with the same best-of-N clock, checks
that the results agree, and stores seconds, the speed-up and peak extra memory in extra_info (printed
with -s). Targets on CPU: log-prob fwd+bwd >= 2x log_softmax+gather with extra memory < 10 % of the
logits; masked GAE + whiten >= 50x the per-timestep loop; group_normalize >= 20x the per-group loop.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from logprob_steps import fused_step, torch_step
from megatron_rl import ops
from megatron_rl.distributed.spawn import free_port
from megatron_rl.ops import reference

ROWS, VOCAB = 4096, 32768
ROUNDS = 3


def report(benchmark, name: str, **fields) -> None:
    benchmark.extra_info.update(fields)
    print(
        f"\n[{name}] "
        + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in fields.items())
    )


# ---- log-prob fwd+bwd ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def megatron_tp1():
    """Megatron's parallel state on a 1-rank gloo group, for vocab_parallel_cross_entropy at TP=1."""
    from megatron.core import parallel_state

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    yield
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def megatron_step(x, labels):
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    x.grad = None
    (-vocab_parallel_cross_entropy(x, labels)).sum().backward()  # overwrites x (fp32) in place


@pytest.mark.parametrize("with_entropy", [False, True], ids=["logprob", "logprob+entropy"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_log_prob_fwd_bwd(benchmark, measure, megatron_tp1, dtype, with_entropy):
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(ROWS, VOCAB, generator=gen) * 2).to(dtype)
    labels = torch.randint(0, VOCAB, (ROWS,), generator=gen)
    x = logits.clone().requires_grad_()
    logits_bytes = logits.numel() * logits.element_size()

    fused_step(x, labels, with_entropy)
    fused_grad = x.grad.float()
    torch_step(x, labels, with_entropy)
    torch.testing.assert_close(fused_grad, x.grad.float(), rtol=1e-2, atol=1e-4)

    benchmark.pedantic(
        fused_step, args=(x, labels, with_entropy), rounds=ROUNDS, iterations=1, warmup_rounds=1
    )
    ours = benchmark.stats.stats.min
    plain = measure.best_seconds(lambda: torch_step(x, labels, with_entropy), rounds=2)
    x.grad = None

    def extra_pct(step, setup=None) -> float:
        # beyond the logits and their gradient (an output of any fwd+bwd), in % of the logits
        extra = measure.peak_extra_bytes(step, setup=setup)
        return float("nan") if extra is None else 100.0 * (extra - logits_bytes) / logits_bytes

    fields = {
        "ours_s": ours,
        "torch_s": plain,
        "speedup_vs_torch": plain / ours,
        "ours_extra_mem_pct": extra_pct(lambda: fused_step(x, labels, with_entropy)),
        "torch_extra_mem_pct": extra_pct(lambda: torch_step(x, labels, with_entropy)),
    }
    x.grad = None
    if not with_entropy:  # Megatron's cross-entropy computes no entropy

        def fresh():
            return (logits.clone().requires_grad_(),)

        megatron = measure.best_seconds(lambda t: megatron_step(t, labels), rounds=2, setup=fresh)
        fields.update(
            megatron_s=megatron,
            speedup_vs_megatron=megatron / ours,
            megatron_extra_mem_pct=extra_pct(lambda t: megatron_step(t, labels), setup=fresh),
        )
    report(benchmark, f"log-prob fwd+bwd {dtype} entropy={with_entropy}", **fields)


# ---- advantages -----------------------------------------------------------------------------------


def test_gae_and_whiten(benchmark, measure):
    batch, steps = 256, 2048
    gen = torch.Generator().manual_seed(1)
    rewards = torch.randn(batch, steps, generator=gen)
    values = torch.randn(batch, steps, generator=gen)
    lengths = torch.randint(1, steps + 1, (batch,), generator=gen)
    mask = (torch.arange(steps) < lengths.unsqueeze(1)).float()

    def fused():
        adv, ret = ops.masked_gae(rewards, values, mask, 0.99, 0.95)
        return ops.masked_whiten(adv, mask), ret

    def loop():  # verl's per-timestep loop, then its whitening
        adv, ret = reference.masked_gae(rewards, values, mask, 0.99, 0.95)
        return reference.masked_whiten(adv, mask), ret

    for a, b in zip(fused(), loop()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    benchmark.pedantic(fused, rounds=10, iterations=1, warmup_rounds=1)
    ours = benchmark.stats.stats.min
    plain = measure.best_seconds(loop, rounds=2)
    report(benchmark, "masked_gae+whiten 256x2048", ours_s=ours, loop_s=plain, speedup_vs_loop=plain / ours)


@pytest.mark.parametrize("groups, group_size", [(1024, 8), (256, 64)], ids=["8192_in_8", "16384_in_64"])
def test_group_normalize(benchmark, measure, groups, group_size):
    gen = torch.Generator().manual_seed(2)
    scores = (torch.rand(groups * group_size, generator=gen) > 0.5).float()
    group_index = torch.randperm(groups * group_size, generator=gen) % groups  # shuffled, not sorted

    def fused():
        return ops.group_normalize(scores, group_index, mode="grpo")

    def loop():
        return reference.group_normalize(scores, group_index, mode="grpo")

    torch.testing.assert_close(fused(), loop(), rtol=1e-5, atol=1e-5)
    benchmark.pedantic(fused, rounds=20, iterations=1, warmup_rounds=1)
    ours = benchmark.stats.stats.min
    plain = measure.best_seconds(loop, rounds=2)
    report(
        benchmark,
        f"group_normalize {groups}x{group_size}",
        ours_s=ours,
        loop_s=plain,
        speedup_vs_loop=plain / ours,
    )
