"""End-to-end advantage estimation on a production-sized batch, against plain torch in the same run.

8192 responses x 1024 tokens (512 prompts x 16 samples, uids as strings), timed from the trainer's
inputs (reward/value tensors, the numpy uid array) to the advantages, including the uid -> group
mapping. The plain versions are what one writes first: a Python loop over groups (GRPO) and over
timesteps (GAE), each timed once. Each test checks both agree, then records the speed-up (ours =
best of 3 rounds) in extra_info["speedup"] and prints it:

    MEGATRON_RL_VERL_PATH=.cache/verl-oracle \
        pytest benchmarks/test_algos_advantage.py -s --benchmark-columns=min,mean,rounds

GRPO is also timed against verl 0.9.1's own vectorised ``compute_grpo_vectorized_outcome_advantage`` on the
same inputs (``make verl-oracle`` installs it into .cache/verl-oracle; the test skips without it).
"""

from __future__ import annotations

import time
from collections import defaultdict

import numpy as np
import pytest
import torch

from megatron_rl import algos
from megatron_rl_testing.verl_oracle import verl_module

PROMPTS, SAMPLES, LENGTH = 512, 16, 1024
BATCH = PROMPTS * SAMPLES
ROUNDS = 3


@pytest.fixture(scope="module")
def rollout():
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, LENGTH + 1, (BATCH,), generator=gen)
    mask = (torch.arange(LENGTH) < lengths.unsqueeze(1)).float()
    rewards = torch.zeros(BATCH, LENGTH)
    rewards[torch.arange(BATCH), lengths - 1] = torch.randint(0, 2, (BATCH,), generator=gen).float()
    values = torch.randn(BATCH, LENGTH, generator=gen) * mask
    uids = np.array([f"{p:08x}-uid" for p in range(PROMPTS) for _ in range(SAMPLES)], dtype=object)
    return rewards, values, mask, uids


def plain_grpo(
    rewards: torch.Tensor, mask: torch.Tensor, uids: np.ndarray, eps: float = 1e-6
) -> torch.Tensor:
    scores = rewards.sum(dim=-1)
    rows_of = defaultdict(list)
    for row, uid in enumerate(uids):
        rows_of[uid].append(row)
    out = torch.empty_like(scores)
    for rows in rows_of.values():
        idx = torch.tensor(rows)
        group = scores[idx]
        if len(rows) == 1:
            out[idx] = group / (1 + eps)
        else:
            out[idx] = (group - group.mean()) / (group.std() + eps)
    return out.unsqueeze(-1) * mask


def plain_gae(rewards, values, mask, gamma, lam) -> tuple[torch.Tensor, torch.Tensor]:
    next_value = torch.zeros(rewards.shape[0])
    last = torch.zeros(rewards.shape[0])
    columns = []
    for t in reversed(range(rewards.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        next_value = values[:, t] * mask[:, t] + (1 - mask[:, t]) * next_value
        last = (delta + gamma * lam * last) * mask[:, t] + (1 - mask[:, t]) * last
        columns.append(last)
    advantages = torch.stack(columns[::-1], dim=1)
    returns = advantages + values
    mean = (advantages * mask).sum() / mask.sum()
    var = ((advantages - mean) ** 2 * mask).sum() / mask.sum() * (mask.sum() / (mask.sum() - 1))
    return (advantages - mean) * torch.rsqrt(var + 1e-8), returns


def timed(fn):
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def record(benchmark, plain_s: float, reference: str = "plain torch") -> None:
    """The speed-up against the reference, kept in the saved JSON and printed (run with -s)."""
    ours_s = benchmark.stats.stats.min
    key = reference.replace(" ", "_")
    benchmark.extra_info.update({f"{key}_s": round(plain_s, 4), "speedup": round(plain_s / ours_s, 2)})
    print(
        f"\n{benchmark.name}: megatron_rl {ours_s * 1e3:.1f} ms, {reference} {plain_s * 1e3:.1f} ms, "
        f"speed-up {plain_s / ours_s:.1f}x"
    )


@pytest.mark.benchmark(group="algos-advantage")
def test_grpo_end_to_end(benchmark, rollout):
    rewards, _, mask, uids = rollout
    ours, _ = benchmark.pedantic(
        algos.compute_grpo_outcome_advantage, args=(rewards, mask, uids), rounds=ROUNDS, warmup_rounds=1
    )
    expected, plain_s = timed(lambda: plain_grpo(rewards, mask, uids))
    torch.testing.assert_close(ours, expected, atol=1e-5, rtol=1e-5)
    record(benchmark, plain_s)


@pytest.mark.benchmark(group="algos-advantage")
def test_grpo_against_verl_vectorized(benchmark, rollout):
    """Ours against verl's vectorised GRPO, best of ROUNDS each, from the same inputs to the same advantages.

    Our ``compute_grpo_vectorized_outcome_advantage`` (verl's name) is ``compute_grpo_outcome_advantage``.
    """
    core_algos = verl_module("verl.trainer.ppo.core_algos")  # skips: "verl oracle unavailable (...)"
    rewards, _, mask, uids = rollout

    def verl_grpo():
        return core_algos.compute_grpo_vectorized_outcome_advantage(rewards, mask, uids)[0]

    ours, _ = benchmark.pedantic(
        algos.compute_grpo_outcome_advantage, args=(rewards, mask, uids), rounds=ROUNDS, warmup_rounds=1
    )
    theirs, verl_s = timed(verl_grpo)
    verl_s = min([verl_s] + [timed(verl_grpo)[1] for _ in range(ROUNDS - 1)])
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
    twin, _ = algos.compute_grpo_vectorized_outcome_advantage(rewards, mask, uids)
    torch.testing.assert_close(twin, theirs, atol=1e-5, rtol=1e-5)
    record(benchmark, verl_s, "verl vectorized")


@pytest.mark.benchmark(group="algos-advantage")
def test_gae_end_to_end(benchmark, rollout):
    rewards, values, mask, _ = rollout
    ours = benchmark.pedantic(
        algos.compute_gae_advantage_return,
        args=(rewards, values, mask, 0.99, 0.95),
        rounds=ROUNDS,
        warmup_rounds=1,
    )
    expected, plain_s = timed(lambda: plain_gae(rewards, values, mask, 0.99, 0.95))
    for a, b in zip(ours, expected):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    record(benchmark, plain_s)
