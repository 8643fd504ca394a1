"""The steps a training loop is made of, one function each, in the order of a sample's lifeline
(docs/architecture.md): rollout, score, dynamic sampling, log-probs, advantage, update, weight sync.

Each step takes what it works on and returns what it made: the batch goes in and comes out, metrics are added
to the step's dict, stage times to its timer; nothing is left on an object for the next step to find. Where the
loops differ they pass their own function: ``generate`` (where generation runs, and which weights its samples
must come from) and ``sync`` (how weights reach the engines). ``run`` (loop.Run) holds the parts every step
uses: the config, the worker groups, the reward function. The loops that put these steps in order are
rl_trainer.py (synchronous), off_policy.py (one step off policy) and fully_async.py (fully async).
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Callable, Iterator

import numpy as np
import torch

from megatron_rl.algos import (
    apply_kl_penalty,
    compute_advantage,
    filter_zero_variance_groups,
    get_estimator_traits,
    rewards_from_scores,
)
from megatron_rl.algos.rollout_corr import RolloutCorrection, apply_rollout_correction
from megatron_rl.algos.seq_balance import balance_permutation, row_seqlens, seqlen_imbalance_metrics
from megatron_rl.config.distillation_schema import served_teacher
from megatron_rl.config.schema import PPOTrainerConfig
from megatron_rl.protocol import DataProto, reduce_metrics
from megatron_rl.trainer.metrics import StageTimer, multi_turn_metrics, rollout_probs_diff

if TYPE_CHECKING:
    from megatron_rl.trainer.loop import Run

logger = logging.getLogger(__name__)

Generate = Callable[[DataProto], DataProto]  # prompts -> responses, on the weights the loop expects
Sync = Callable[[int], "dict[str, float]"]  # version -> the sync's metrics


def new_uids(step: int, count: int) -> np.ndarray:
    """Group ids for the prompts of a step; deterministic so a resumed run reproduces them."""
    return np.array([f"{step}-{i}" for i in range(count)], dtype=object)


def step_meta(cfg: PPOTrainerConfig, step: int) -> dict[str, Any]:
    """What every generation of a step carries; temperature travels with the batch because log-probs
    must be computed at the sampling temperature."""
    rollout = cfg.actor_rollout_ref.rollout
    return {"global_steps": step, "seed": rollout.seed + step, "temperature": rollout.temperature}


def pop_for_generation(cfg: PPOTrainerConfig, batch: DataProto) -> DataProto:
    """The prompt batch for the rollout; a multi-turn rollout also gets what picks and sets up each sample's
    environment (verl's agent_name, extra_info with tools_kwargs, the row's data_source and reward_model)."""
    gen = batch.pop_for_generation()
    if cfg.actor_rollout_ref.rollout.multi_turn.enable:
        for key in ("agent_name", "extra_info", "data_source", "reward_model"):
            if key in batch.non_tensor_batch:
                gen.non_tensor_batch[key] = batch.non_tensor_batch[key]
    return gen


# ---------------------------------------------------------------------- rollout and reward
def rollout(run: Run, batch: DataProto, step: int, generate: Generate, timer: StageTimer) -> DataProto:
    """n responses per prompt, joined to the prompts' rows (the async loops call this ahead of the step)."""
    batch.non_tensor_batch["uid"] = new_uids(step, len(batch))
    gen = pop_for_generation(run.cfg, batch)
    with timer("gen"):
        out = generate(gen.repeat(run.n, interleave=True))
    if get_estimator_traits(run.cfg.algorithm.adv_estimator).needs_greedy_baseline:
        with timer("gen_max"):
            batch.batch["reward_baselines"] = greedy_baseline(run, batch, gen, generate)
    return batch.repeat(run.n, interleave=True).union(out)  # response_mask comes with `out`


def greedy_baseline(run: Run, batch: DataProto, gen: DataProto, generate: Generate) -> torch.Tensor:
    """ReMax: the score of one greedy response per prompt is the baseline of that prompt's samples."""
    greedy = gen.select()
    greedy.meta_info["do_sample"] = False
    out = generate(greedy)
    prompt_fields = batch.select([], list(batch.non_tensor_batch), [])
    return run.reward_fn(prompt_fields.union(out)).batch["token_level_scores"].sum(-1)


def score(run: Run, batch: DataProto, metrics: dict[str, float], timer: StageTimer) -> DataProto:
    """token_level_scores (at the last valid token) and the scorer's per-sample extras."""
    with timer("reward"):
        scores = run.reward_fn(batch)
    metrics |= scores.meta_info.pop("reward_metrics", {})
    metrics |= multi_turn_metrics(batch)  # num_turns/*, tool_call_counts/* of multi-turn rollouts (verl's names)
    return batch.union(scores)


def generate_and_score(run: Run, batch: DataProto, step: int, generate: Generate, metrics: dict[str, float],
                       timer: StageTimer) -> DataProto:
    """Rollout n responses per prompt and score them: the first half of the lifeline."""
    if run.overlap is not None:
        return overlapped_generate_and_score(run, batch, step, generate, metrics, timer)
    return score(run, rollout(run, batch, step, generate, timer), metrics, timer)


def overlapped_generate_and_score(run: Run, batch: DataProto, step: int, generate: Generate,
                                  metrics: dict[str, float], timer: StageTimer) -> DataProto:
    """reward.overlap: generated in chunks, each scored while the next generates (reward/overlap.py).
    timing_s/reward is the scoring time, timing_s/reward_exposed the part of it the step waited for."""
    batch.non_tensor_batch["uid"] = new_uids(step, len(batch))
    gen = pop_for_generation(run.cfg, batch)
    if get_estimator_traits(run.cfg.algorithm.adv_estimator).needs_greedy_baseline:
        with timer("gen_max"):  # first: its scoring must not run beside the chunks' in the scoring thread
            batch.batch["reward_baselines"] = greedy_baseline(run, batch, gen, generate)
    with timer("gen"):
        pending = run.overlap.start(batch.repeat(run.n, interleave=True), gen.repeat(run.n, interleave=True),
                                    generate, group_size=run.n)
    with timer("reward_exposed"):
        batch = pending.wait()
    timer.seconds["reward"] += pending.scoring_s
    metrics |= pending.metrics
    metrics |= multi_turn_metrics(batch)
    return batch


class RewardFailures:
    """A reward that fails for every sample trains on zeros: ``check`` warns each such step and stops the run
    after ``limit`` in a row (reward.max_failed_steps; 0: never stop)."""

    def __init__(self, limit: int) -> None:
        self.limit, self.in_a_row = limit, 0

    def check(self, reward_metrics: dict[str, float], samples: int, step: int) -> None:
        if samples == 0 or reward_metrics.get("reward/errors", 0.0) < samples:
            self.in_a_row = 0
            return
        self.in_a_row += 1
        logger.warning("step %d: the reward of every one of the %d samples errored or timed out "
                       "(%d step(s) in a row)", step, samples, self.in_a_row)
        if self.limit and self.in_a_row >= self.limit:
            raise RuntimeError(
                f"the reward of every sample errored or timed out for {self.in_a_row} steps in a row "
                f"(last at step {step}): training on all-zero scores is pointless. Fix the scorer (its errors are "
                f"logged above) or raise reward.max_failed_steps (0 disables this check)")


def fill_with_informative_groups(run: Run, batch: DataProto, step: int, meta: dict[str, Any],
                                 more_batches: Iterator[DataProto], generate: Generate, metrics: dict[str, float],
                                 timer: StageTimer) -> DataProto:
    """DAPO dynamic sampling: drop groups whose responses all scored the same (no gradient signal) and generate
    more prompts (from ``more_batches``, with the step's ``meta``) until a full batch of informative groups."""
    filter_groups = run.cfg.algorithm.filter_groups
    wanted = run.cfg.data.train_batch_size * run.n
    kept, dropped = filter_zero_variance_groups(batch, metric=filter_groups.metric)
    total_dropped, generations = dropped, 1
    while len(kept) < wanted and generations < filter_groups.max_num_gen_batches:
        more = next(more_batches, None)
        if more is None:
            break
        more.meta_info.update(meta)  # the step's settings, not the first rollout's outputs
        more = generate_and_score(run, more, step * 1000 + generations, generate, metrics, timer)
        more_kept, more_dropped = filter_zero_variance_groups(more, metric=filter_groups.metric)
        kept = DataProto.concat([kept, more_kept]) if len(kept) else more_kept
        total_dropped += more_dropped
        generations += 1
    metrics["dynamic_sampling/num_dropped_groups"] = float(total_dropped)
    metrics["dynamic_sampling/num_gen_batches"] = float(generations)
    if len(kept) < wanted:
        # Too few informative groups even after max_num_gen_batches: train on the unfiltered batch
        # (its zero-variance groups get zero advantage) rather than stop the run.
        logger.warning("dynamic sampling: only %d of %d responses informative after %d generations; "
                       "using the unfiltered batch", len(kept), wanted, generations)
        return batch
    return kept[:wanted]  # wanted is a multiple of n, so whole groups are kept


# ---------------------------------------------------------------------- learning
def release_rollout(run: Run) -> None:
    """Colocated engines give their memory back before any training-phase compute, whichever role computes first:
    in bypass mode without a reference the critic's values come before any actor call (which also releases).
    Servers keep theirs (their devices are not the trainer's); a worker group without the call (a test's fake)
    has no engine to release."""
    release = getattr(run.actor_rollout, "release_rollout", None)
    if release is not None and run.cfg.actor_rollout_ref.rollout.mode == "colocated":
        release()


def balance_batch(batch: DataProto, dp_size: int, metrics: dict[str, float]) -> DataProto:
    """trainer.balance_batch (verl's ``_balance_batch``): the rows permuted in place so that the data-parallel
    dispatch's contiguous chunks carry nearly equal token sums (algos/seq_balance.py); verl's global_seqlen/*
    metrics say the imbalance before and after. Rows keep all their fields, so uid-grouped advantages are
    unchanged; which rows share a mini-batch changes, as in verl."""
    seqlens = row_seqlens(batch.batch["attention_mask"])
    order, groups = balance_permutation(seqlens, dp_size)
    batch.reorder(order)
    metrics |= seqlen_imbalance_metrics(seqlens, groups)
    return batch


def log_probs(run: Run, batch: DataProto, metrics: dict[str, float], timer: StageTimer) -> DataProto:
    """The forward passes before the advantage: old log-probs (or the rollout's, in bypass mode) with the
    rollout correction's weights, the reference's log-probs when KL is used, the teacher's scores with
    distillation, the critic's values. First, with
    trainer.balance_batch, the batch is reordered for the actor's DP ranks (where verl does it: after the
    rollout, before the first pass dispatched to the DP ranks)."""
    release_rollout(run)
    if run.cfg.trainer.balance_batch:
        batch = balance_batch(batch, run.sizes.actor.data_parallel_size, metrics)
    correction = RolloutCorrection.from_config(run.cfg.algorithm.rollout_correction)
    if correction.bypass_mode:  # verl's bypass mode: the rollout's log-probs are the old policy's
        batch.require("rollout_log_probs", where="algorithm.rollout_correction.bypass_mode")
        batch.batch["old_log_probs"] = batch.batch["rollout_log_probs"]
    else:
        with timer("old_log_prob"):
            batch = batch.union(run.actor_rollout.compute_log_prob(batch))
        metrics |= rollout_probs_diff(batch)  # trainer vs engine on the trained tokens (verl's training/*)
    metrics |= apply_rollout_correction(batch, correction)  # IS weights, rejected tokens
    if run.use_reference:
        with timer("ref"):
            batch = batch.union(run.actor_rollout.compute_ref_log_prob(batch))
    if run.cfg.distillation.enabled:  # on-policy distillation: the teacher scores the student's tokens
        workers = run.actor_rollout
        score = (workers.compute_teacher_log_prob if served_teacher(run.cfg.distillation) is None
                 else workers.compute_teacher_log_prob_on_engine)  # an HF engine on the rollout leaders
        with timer("teacher"):
            batch = batch.union(score(batch))
    if run.use_critic:
        with timer("values"):
            batch = batch.union(run.critic.compute_values(batch))
    return batch


def advantage(run: Run, batch: DataProto, metrics: dict[str, float], timer: StageTimer) -> DataProto:
    """Rewards (scores, less the KL penalty when in the reward), then the estimator's advantages and returns."""
    algo = run.cfg.algorithm
    with timer("adv"):
        if run.kl_ctrl is not None:
            batch, kl_metrics = apply_kl_penalty(batch, run.kl_ctrl, algo.kl_penalty)
            metrics |= kl_metrics
        else:
            batch = rewards_from_scores(batch)
        return compute_advantage(batch, algo.adv_estimator, gamma=algo.gamma, lam=algo.lam, num_repeat=run.n,
                                 norm_adv_by_std_in_grpo=algo.norm_adv_by_std_in_grpo)


def update(run: Run, batch: DataProto, metrics: dict[str, float], timer: StageTimer) -> None:
    """The critic's update (when used), then the actor's."""
    if run.use_critic:
        with timer("update_critic"):
            metrics |= reduce_metrics(run.critic.update_critic(batch).meta_info["metrics"])
    with timer("update_actor"):
        metrics |= reduce_metrics(run.actor_rollout.update_actor(batch).meta_info["metrics"])


def sync(sync_weights: Sync, version: int, metrics: dict[str, float], timer: StageTimer) -> None:
    """The updated weights to the rollout engines, as the loop's ``sync_weights`` does it."""
    with timer("sync_weights"):
        metrics |= sync_weights(version)
