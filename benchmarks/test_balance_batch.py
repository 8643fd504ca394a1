"""trainer.balance_batch: the actor's step (old log-probs + one PPO update) at DP=2 on two gloo ranks (CPU), on
a skewed-length batch, with the rows in their incoming order and reordered by balance_batch. Each rank takes
its contiguous half, as the DP dispatch gives it; the step ends when the slower rank ends (the gradient
all-reduce makes the faster one wait), so the table reports the slower rank's time, best of 3. Run:

    pytest benchmarks/test_balance_batch.py -s
"""

from __future__ import annotations

import pytest
import torch

from megatron_rl.distributed.spawn import run_multiprocess
from megatron_rl_testing.rl_batches import grouped_rl_batch
from megatron_rl_testing.timing import best_seconds

PROMPTS, N, PROMPT_LEN, RESPONSE_LEN, DP = 16, 4, 16, 192, 2


def skewed_batch():
    """16 prompts x n=4, interleaved as the rollout returns them; the first half of the prompts' responses run
    long (150-192 tokens), the rest short (8-24): contiguous halves are as unbalanced as a batch gets."""
    gen = torch.Generator().manual_seed(0)
    rows = PROMPTS * N
    long_rows = rows // 2
    response_lens = torch.cat([torch.randint(150, RESPONSE_LEN + 1, (long_rows,), generator=gen),
                               torch.randint(8, 25, (rows - long_rows,), generator=gen)])
    return grouped_rl_batch(PROMPTS, N, PROMPT_LEN, response_lens, RESPONSE_LEN, gen)


def balance_bench_job(model_dir: str, balanced: bool, packed: bool) -> dict[str, float]:
    import torch.distributed as dist

    from megatron_rl.config.schema import ActorConfig, MegatronParallelConfig, OptimConfig
    from megatron_rl.distributed import destroy_model_parallel, init_model_parallel
    from megatron_rl.trainer.steps import balance_batch
    from megatron_rl.workers import ActorRole, MegatronEngine

    torch.set_num_threads(1)
    init_model_parallel()
    batch, metrics = skewed_batch(), {}
    if balanced:
        balance_batch(batch, DP, metrics)
    rank = dist.get_rank()
    shard = batch.chunk(DP)[rank]  # what the DP dispatch hands this rank
    megatron = MegatronParallelConfig(packed_sequences=packed)
    rows = len(shard)
    config = ActorConfig(ppo_mini_batch_size=PROMPTS, ppo_micro_batch_size_per_gpu=8,
                         optim=OptimConfig(lr=1e-4, weight_decay=0.0), megatron=megatron)
    actor = ActorRole(MegatronEngine(model_dir, megatron, config.optim), config, rollout_n=N)

    def step():
        shard.batch["old_log_probs"] = actor.compute_log_prob(shard).batch["old_log_probs"]
        actor.update_actor(shard)

    def timed():
        dist.barrier()
        seconds = best_seconds(1, step)
        times = [None] * DP
        dist.all_gather_object(times, seconds)
        return max(times)  # the step ends with the slower rank

    timed()  # warm-up
    slowest = min(timed() for _ in range(3))
    destroy_model_parallel()
    return {"step_s": slowest, "tokens": int(shard.batch["attention_mask"].sum()), "rows": rows, **metrics}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from megatron_rl_testing.tiny_models import make_tiny_hf_checkpoint

    return str(make_tiny_hf_checkpoint(
        tmp_path_factory.mktemp("balance_bench") / "m", "qwen2", with_tokenizer=False, vocab_size=512,
        hidden_size=256, intermediate_size=1024, num_layers=4, num_heads=4, num_kv_heads=2))


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "padded"])
def test_balance_batch_step_time_on_a_skewed_batch(model_dir, packed):
    plain = run_multiprocess(balance_bench_job, DP, model_dir, False, packed, timeout_s=900)
    balanced = run_multiprocess(balance_bench_job, DP, model_dir, True, packed, timeout_s=900)
    plain_tokens = [r["tokens"] for r in plain]
    balanced_tokens = [r["tokens"] for r in balanced]
    m = balanced[0]
    print(f"\n{'packed (THD)' if packed else 'padded micro-batches'}: tokens per rank {plain_tokens} -> "
          f"{balanced_tokens} (global_seqlen/minmax_diff {m['global_seqlen/minmax_diff']:.0f}, balanced "
          f"{m['global_seqlen/balanced_max'] - m['global_seqlen/balanced_min']:.0f})")
    print(f"| layout | step, incoming order (s) | step, balance_batch (s) | speed-up |\n|---|---|---|---|\n"
          f"| {'packed' if packed else 'padded'} | {plain[0]['step_s']:.2f} | {balanced[0]['step_s']:.2f} | "
          f"{plain[0]['step_s'] / balanced[0]['step_s']:.2f}x |")
    assert max(balanced_tokens) - min(balanced_tokens) < max(plain_tokens) - min(plain_tokens)
