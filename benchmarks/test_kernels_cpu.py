"""Fused kernels on CPU against their plain references, timed in the same run (issue 3 targets).

    pytest benchmarks/test_kernels_cpu.py -s --benchmark-columns=min,mean,rounds     # ~2-3 min

Each test times ours with pytest-benchmark and the references with the same best-of-N clock, checks
that the results agree, and stores seconds, the speed-up and peak extra memory in extra_info (printed
with -s). Targets on CPU: log-prob fwd+bwd >= 2.5x log_softmax+gather with extra memory < 10 % of the
logits; masked GAE + whiten >= 50x the per-timestep loop; group_normalize >= 20x the per-group loop.
Log-prob "ours" is the steady state (the gradient lands in the block the previous one freed, see
docs/kernels.md); "ours_fresh_grad" and the memory figures start cold (no gradient held, no kept block).
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
    ours = benchmark.stats.stats.min  # steady state: each gradient lands in the block the last one freed

    def cold() -> tuple:
        # no gradient held and no kept block: the step's gradient is fresh memory, as in a first step
        x.grad = None
        ops.release_cpu_cache()
        return ()

    ours_fresh = measure.best_seconds(lambda: fused_step(x, labels, with_entropy), rounds=2, setup=cold)
    plain = measure.best_seconds(lambda: torch_step(x, labels, with_entropy), rounds=2, setup=cold)

    def extra_pct(step, setup=cold) -> float:
        # beyond the logits and their gradient (an output of any fwd+bwd), in % of the logits, from cold
        extra = measure.peak_extra_bytes(step, setup=setup)
        return float("nan") if extra is None else 100.0 * (extra - logits_bytes) / logits_bytes

    fields = {
        "ours_s": ours,
        "ours_fresh_grad_s": ours_fresh,
        "torch_s": plain,
        "speedup_vs_torch": plain / ours,
        "speedup_fresh_grad": plain / ours_fresh,
        "ours_extra_mem_pct": extra_pct(lambda: fused_step(x, labels, with_entropy)),
        "torch_extra_mem_pct": extra_pct(lambda: torch_step(x, labels, with_entropy)),
    }
    cold()
    if not with_entropy:  # Megatron's cross-entropy computes no entropy

        def fresh():
            cold()
            return (logits.clone().requires_grad_(),)

        megatron = measure.best_seconds(lambda t: megatron_step(t, labels), rounds=2, setup=fresh)
        fields.update(
            megatron_s=megatron,
            speedup_vs_megatron=megatron / ours,
            megatron_extra_mem_pct=extra_pct(lambda t: megatron_step(t, labels), setup=fresh),
        )
    report(benchmark, f"log-prob fwd+bwd {dtype} entropy={with_entropy}", **fields)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_log_prob_breakdown(benchmark, measure, dtype):
    """Where the fwd+bwd time goes (docs/kernels.md, "CPU performance"): the forward op, the backward op
    into a kept block and into fresh memory, and a fresh gradient-sized buffer filled once."""
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(ROWS, VOCAB, generator=gen) * 2).to(dtype)
    labels = torch.randint(0, VOCAB, (ROWS,), generator=gen)
    assert ops.backend_summary().startswith("compiled")  # also loads the ops
    mrl, shard = torch.ops.megatron_rl, (0, VOCAB, 1.0, -100)

    def forward():
        return mrl.log_prob_stats(logits, labels, *shard)

    _, entropy, row_max, log_sum = mrl.log_prob_merge(forward()[None], labels, -100)

    def backward():
        upstream = torch.ones(ROWS)
        return mrl.log_prob_backward(logits, labels, row_max, log_sum, entropy, upstream, None, *shard)

    def no_kept_block() -> tuple:
        ops.release_cpu_cache()
        return ()

    benchmark.pedantic(forward, rounds=ROUNDS, iterations=1, warmup_rounds=1)
    report(
        benchmark,
        f"log-prob breakdown {dtype}",
        forward_s=benchmark.stats.stats.min,
        backward_kept_s=measure.best_seconds(backward, rounds=ROUNDS),
        backward_fresh_s=measure.best_seconds(backward, rounds=ROUNDS, setup=no_kept_block),
        fresh_buffer_fill_s=measure.best_seconds(lambda: torch.empty_like(logits).fill_(1), rounds=ROUNDS),
    )


def test_copy_bandwidth(benchmark):
    """The floor under the kernels (docs/kernels.md, "CPU performance"): dst.copy_(src) of the fp32 logits."""
    src = torch.ones(ROWS, VOCAB)
    dst = torch.zeros_like(src)
    benchmark.pedantic(dst.copy_, args=(src,), rounds=5, iterations=1, warmup_rounds=1)
    seconds = benchmark.stats.stats.min
    moved = 2 * src.numel() * src.element_size()  # read + write
    report(benchmark, "copy 512 MiB fp32", seconds=seconds, read_write_gb_s=moved / seconds / 1e9)


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
