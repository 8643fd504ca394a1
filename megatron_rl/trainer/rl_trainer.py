"""The driver loop. `RLTrainer.fit()` follows the lifeline of a sample in DESIGN.md step by step.

The trainer talks to worker groups through plain method calls that take and return DataProto, so the
same loop drives Ray worker groups (single controller) and in-process workers under torchrun.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Protocol

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from megatron_rl.algos import (
    apply_kl_penalty,
    compute_advantage,
    filter_zero_variance_groups,
    get_estimator_traits,
    get_kl_controller,
    rewards_from_scores,
)
from megatron_rl.algos.rollout_corr import RolloutCorrection, apply_rollout_correction
from megatron_rl.plan.validate import DerivedSizes
from megatron_rl.protocol import DataProto, reduce_metrics
from megatron_rl.reward.overlap import OverlappedScoring
from megatron_rl.trainer.checkpointing import TrainerCheckpointer
from megatron_rl.trainer.metrics import (
    StageTimer,
    compute_data_metrics,
    compute_throughput_metrics,
    multi_turn_metrics,
    rollout_probs_diff,
)
from megatron_rl.trainer.signals import StopRequest
from megatron_rl.trainer.validation import validation_metrics

logger = logging.getLogger(__name__)



class ActorRolloutRef(Protocol):
    """What the trainer needs from the colocated actor + reference + rollout workers."""

    def generate_sequences(self, data: DataProto) -> DataProto: ...
    def compute_log_prob(self, data: DataProto) -> DataProto: ...
    def compute_ref_log_prob(self, data: DataProto) -> DataProto: ...
    def update_actor(self, data: DataProto) -> DataProto: ...
    def sync_weights(self, version: int) -> dict[str, float]: ...
    def save_checkpoint(self, path: str) -> None: ...
    def load_checkpoint(self, path: str) -> None: ...
    def save_hf(self, path: str) -> None: ...


class Critic(Protocol):
    def compute_values(self, data: DataProto) -> DataProto: ...
    def update_critic(self, data: DataProto) -> DataProto: ...
    def save_checkpoint(self, path: str) -> None: ...
    def load_checkpoint(self, path: str) -> None: ...


# Scores a batch: returns token_level_scores (+ per-sample extras such as `acc`), with the step's
# reward metrics in meta_info["reward_metrics"] (megatron_rl.reward.RewardManager).
RewardFn = Callable[[DataProto], DataProto]


@dataclass
class TrainerState:
    """Everything of the driver that a resumed run needs to continue as if never stopped."""

    global_steps: int = 0
    dataloader: dict[str, Any] = field(default_factory=dict)
    kl_ctrl: dict[str, Any] = field(default_factory=dict)


def new_uids(step: int, count: int) -> np.ndarray:
    """Group ids for the prompts of a step; deterministic so a resumed run reproduces them."""
    return np.array([f"{step}-{i}" for i in range(count)], dtype=object)


def planned_steps(cfg: DictConfig, batches_per_epoch: int) -> int:
    """The run's step count: ``trainer.total_training_steps``, else epochs x batches per epoch (verl's rule)."""
    if cfg.trainer.total_training_steps is not None:
        return int(cfg.trainer.total_training_steps)
    total = batches_per_epoch * cfg.trainer.total_epochs
    if total == 0:
        raise ValueError(f"the training data gives 0 steps: {batches_per_epoch} batches of "
                         f"data.train_batch_size={cfg.data.train_batch_size} prompts per epoch x "
                         f"trainer.total_epochs={cfg.trainer.total_epochs}; use more prompts or a "
                         f"smaller data.train_batch_size")
    return total


def fill_optimizer_steps(cfg: DictConfig, batches_per_epoch: int) -> None:
    """An optimizer's ``total_training_steps: -1`` becomes the run's step count (as verl fills it), before the
    workers are built: the cosine schedule decays over it."""
    total = planned_steps(cfg, batches_per_epoch)
    for role in ("actor_rollout_ref.actor", "critic"):
        optim = OmegaConf.select(cfg, f"{role}.optim")
        if optim is not None and optim.total_training_steps == -1:
            optim.total_training_steps = total


class RLTrainer:
    def __init__(self, cfg: DictConfig, sizes: DerivedSizes, actor_rollout: ActorRolloutRef,
                 critic: Critic | None, reward_fn: RewardFn, train_loader, val_batches: Callable[[], Iterator[DataProto]] | None,
                 tracking=None, stop: StopRequest | None = None, checkpointer: TrainerCheckpointer | None = None) -> None:
        self.cfg = cfg
        self.sizes = sizes
        self.actor_rollout = actor_rollout
        self.critic = critic
        self.reward_fn = reward_fn
        self.train_loader = train_loader
        self.val_batches = val_batches
        self.tracking = tracking  # None on ranks that do not log
        self.stop = stop or StopRequest()
        algo = cfg.algorithm
        self.n = cfg.actor_rollout_ref.rollout.n
        self.use_critic = sizes.uses_critic
        self.use_reference = algo.use_kl_in_reward or cfg.actor_rollout_ref.actor.use_kl_loss
        self.kl_ctrl = get_kl_controller(algo.kl_ctrl) if algo.use_kl_in_reward else None
        self.total_steps = self._total_steps()
        self.state = TrainerState()
        self.checkpointer = checkpointer or TrainerCheckpointer(Path(cfg.trainer.default_local_dir),
                                                                cfg.trainer.max_ckpt_to_keep)
        self.stopped: str | None = None  # the signal that stopped the run early (resumable), else None
        self._failed_reward_steps = 0  # consecutive steps in which every sample's reward errored
        overlap = OmegaConf.select(cfg, "reward.overlap")
        self.overlap = OverlappedScoring(reward_fn, overlap.num_chunks) if overlap and overlap.enable else None

    # ------------------------------------------------------------------ the loop
    def fit(self) -> dict[str, float]:
        """Train from the current state (call `resume()` first to continue a run) to the last step."""
        last: dict[str, float] = {}
        if self.state.global_steps >= self.total_steps > 0:
            logger.warning("the run in %s already finished its %d steps; nothing to train",
                           self.cfg.trainer.default_local_dir, self.total_steps)
        if self.cfg.trainer.val_before_train and self.val_batches is not None and self.state.global_steps == 0:
            self._log(self.validate(), step=0)
        for batch in self._train_batches():
            step = self.state.global_steps + 1
            timer = StageTimer()
            with timer("step"):
                metrics = self.train_step(batch, step, timer)
            self.state.global_steps = step
            metrics |= timer.metrics()
            metrics |= compute_throughput_metrics(self._last_batch, timer.seconds["step"], self.sizes.world_size)
            if self._due(self.cfg.trainer.test_freq, step) and self.val_batches is not None:
                metrics |= self.validate()
            # The last step is saved too (when saving at all): a failed final export then costs no training.
            final = step >= self.total_steps and self.cfg.trainer.save_freq > 0
            if self._due(self.cfg.trainer.save_freq, step) or final or self.stop.requested:
                self.save_checkpoint()
            self._log(metrics, step)
            last = metrics
            if self.stop.requested:
                self.stopped = self.stop.reason
                logger.warning("stopping after step %d on %s; checkpoint saved, the run is resumable",
                               step, self.stop.reason)
                break
        if self.stop.requested:
            self.stopped = self.stop.reason
        elif self.state.global_steps < self.total_steps:
            epochs = self.cfg.trainer.total_epochs
            if self.state.global_steps == 0:
                raise RuntimeError(f"the training data gave no batch: trainer.total_training_steps="
                                   f"{self.total_steps} but {len(self.train_loader)} batches per epoch x "
                                   f"trainer.total_epochs={epochs}; nothing was trained")
            logger.warning("the data ran out after %d of trainer.total_training_steps=%d steps "
                           "(%d batches per epoch x trainer.total_epochs=%d); raise total_epochs to train them all",
                           self.state.global_steps, self.total_steps, len(self.train_loader), epochs)
        if not self.stop.requested and self.cfg.trainer.save_hf_at_end:
            self.export_hf()
        return last

    def export_hf(self) -> Path:
        """The final HF checkpoint, written to `hf_final.tmp` and renamed: `hf_final` is never half-written."""
        with self.checkpointer.publishing(self.hf_output_dir) as tmp:
            self.actor_rollout.save_hf(str(tmp))
        return self.hf_output_dir

    def train_step(self, batch: DataProto, step: int, timer: StageTimer) -> dict[str, float]:
        metrics: dict[str, float] = {}
        self._step_meta = self.step_meta(step)
        batch.meta_info.update(self._step_meta)

        batch = self.generate_and_score(batch, step, metrics, timer)
        self._check_reward_failures(metrics, len(batch), step)
        if self.cfg.algorithm.filter_groups.enable:
            batch = self.fill_with_informative_groups(batch, step, metrics, timer)

        correction = RolloutCorrection.from_config(self.cfg.algorithm.get("rollout_correction"))
        if correction.bypass_mode:  # verl's bypass mode: the rollout's log-probs are the old policy's
            batch.require("rollout_log_probs", where="algorithm.rollout_correction.bypass_mode")
            batch.batch["old_log_probs"] = batch.batch["rollout_log_probs"]
        else:
            with timer("old_log_prob"):
                batch = batch.union(self.actor_rollout.compute_log_prob(batch))
            metrics |= rollout_probs_diff(batch)  # trainer vs engine on the trained tokens (verl's training/*)
        metrics |= apply_rollout_correction(batch, correction)  # IS weights, rejected tokens
        if self.use_reference:
            with timer("ref"):
                batch = batch.union(self.actor_rollout.compute_ref_log_prob(batch))
        if self.use_critic:
            with timer("values"):
                batch = batch.union(self.critic.compute_values(batch))

        with timer("adv"):
            if self.kl_ctrl is not None:
                batch, kl_metrics = apply_kl_penalty(batch, self.kl_ctrl, self.cfg.algorithm.kl_penalty)
                metrics |= kl_metrics
            else:
                batch = rewards_from_scores(batch)
            batch = compute_advantage(batch, self.cfg.algorithm.adv_estimator, gamma=self.cfg.algorithm.gamma,
                                      lam=self.cfg.algorithm.lam, num_repeat=self.n,
                                      norm_adv_by_std_in_grpo=self.cfg.algorithm.norm_adv_by_std_in_grpo)

        if self.use_critic:
            with timer("update_critic"):
                metrics |= reduce_metrics(self.critic.update_critic(batch).meta_info["metrics"])
        with timer("update_actor"):
            metrics |= reduce_metrics(self.actor_rollout.update_actor(batch).meta_info["metrics"])
        with timer("sync_weights"):
            metrics |= self.actor_rollout.sync_weights(step)

        metrics |= compute_data_metrics(batch, self.use_critic)
        self._last_batch = batch
        return metrics

    def generate(self, prompts: DataProto) -> DataProto:
        """Every generation (training, ReMax's greedy baseline, DAPO's refills, validation) must run on the
        weights of the last sync, which are the current step's: a sample from other weights is refused."""
        out = self.actor_rollout.generate_sequences(prompts)
        served = out.meta_info.get("weight_version")
        if served is not None and served != self.state.global_steps:
            raise RuntimeError(f"the rollout generated with weight version {served}, but the actor's weights are "
                               f"version {self.state.global_steps}: a weight sync did not reach the engines")
        return out

    def step_meta(self, step: int) -> dict[str, Any]:
        """What every generation of a step carries; temperature travels with the batch because log-probs
        must be computed at the sampling temperature."""
        rollout = self.cfg.actor_rollout_ref.rollout
        return {"global_steps": step, "seed": rollout.seed + step, "temperature": rollout.temperature}

    def generate_and_score(self, batch: DataProto, step: int, metrics: dict[str, float],
                           timer: StageTimer) -> DataProto:
        """Rollout n responses per prompt and score them: the first half of the lifeline."""
        if self.overlap is not None:
            return self.overlapped_generate_and_score(batch, step, metrics, timer)
        return self.score(self.rollout(batch, step, timer), metrics, timer)

    def overlapped_generate_and_score(self, batch: DataProto, step: int, metrics: dict[str, float],
                                      timer: StageTimer) -> DataProto:
        """reward.overlap: generated in chunks, each scored while the next generates (reward/overlap.py).
        timing_s/reward is the scoring time, timing_s/reward_exposed the part of it the step waited for."""
        batch.non_tensor_batch["uid"] = new_uids(step, len(batch))
        gen = self._pop_for_generation(batch)
        if get_estimator_traits(self.cfg.algorithm.adv_estimator).needs_greedy_baseline:
            with timer("gen_max"):  # first: its scoring must not run beside the chunks' in the scoring thread
                batch.batch["reward_baselines"] = self._greedy_baseline(batch, gen)
        with timer("gen"):
            pending = self.overlap.start(batch.repeat(self.n, interleave=True), gen.repeat(self.n, interleave=True),
                                         self.generate, group_size=self.n)
        with timer("reward_exposed"):
            batch = pending.wait()
        timer.seconds["reward"] += pending.scoring_s
        metrics |= pending.metrics
        metrics |= multi_turn_metrics(batch)
        return batch

    def rollout(self, batch: DataProto, step: int, timer: StageTimer) -> DataProto:
        """n responses per prompt, joined to the prompts' rows (a trainer.async_mode loop calls this ahead)."""
        batch.non_tensor_batch["uid"] = new_uids(step, len(batch))
        gen = self._pop_for_generation(batch)
        with timer("gen"):
            out = self.generate(gen.repeat(self.n, interleave=True))
        if get_estimator_traits(self.cfg.algorithm.adv_estimator).needs_greedy_baseline:
            with timer("gen_max"):
                batch.batch["reward_baselines"] = self._greedy_baseline(batch, gen)
        return batch.repeat(self.n, interleave=True).union(out)  # response_mask comes with `out`

    def score(self, batch: DataProto, metrics: dict[str, float], timer: StageTimer) -> DataProto:
        with timer("reward"):
            scores = self.reward_fn(batch)
        metrics |= scores.meta_info.pop("reward_metrics", {})
        metrics |= multi_turn_metrics(batch)  # num_turns/*, tool_call_counts/* of multi-turn rollouts (verl's names)
        return batch.union(scores)

    def _pop_for_generation(self, batch: DataProto) -> DataProto:
        """The prompt batch for the rollout; a multi-turn rollout also gets what picks and sets up each sample's
        environment (verl's agent_name, extra_info with tools_kwargs, the row's data_source and reward_model)."""
        gen = batch.pop_for_generation()
        if OmegaConf.select(self.cfg, "actor_rollout_ref.rollout.multi_turn.enable", default=False):
            for key in ("agent_name", "extra_info", "data_source", "reward_model"):
                if key in batch.non_tensor_batch:
                    gen.non_tensor_batch[key] = batch.non_tensor_batch[key]
        return gen

    def _check_reward_failures(self, reward_metrics: dict[str, float], samples: int, step: int) -> None:
        """A reward that fails for every sample trains on zeros: warn each such step, stop after
        reward.max_failed_steps in a row (0: never stop)."""
        if samples == 0 or reward_metrics.get("reward/errors", 0.0) < samples:
            self._failed_reward_steps = 0
            return
        self._failed_reward_steps += 1
        limit = self.cfg.reward.get("max_failed_steps", 0)
        logger.warning("step %d: the reward of every one of the %d samples errored or timed out "
                       "(%d step(s) in a row)", step, samples, self._failed_reward_steps)
        if limit and self._failed_reward_steps >= limit:
            raise RuntimeError(
                f"the reward of every sample errored or timed out for {self._failed_reward_steps} steps in a row "
                f"(last at step {step}): training on all-zero scores is pointless. Fix the scorer (its errors are "
                f"logged above) or raise reward.max_failed_steps (0 disables this check)")
  # token_level_scores at the last valid token

    def fill_with_informative_groups(self, batch: DataProto, step: int, metrics: dict[str, float],
                                     timer: StageTimer) -> DataProto:
        """DAPO dynamic sampling: drop groups whose responses all scored the same (no gradient signal)
        and generate more prompts until a full batch of informative groups is collected."""
        wanted = self.cfg.data.train_batch_size * self.n
        kept, dropped = filter_zero_variance_groups(batch, metric=self.cfg.algorithm.filter_groups.metric)
        total_dropped, generations = dropped, 1
        while len(kept) < wanted and generations < self.cfg.algorithm.filter_groups.max_num_gen_batches:
            more = next(self._batch_iter, None)
            if more is None:
                break
            more.meta_info.update(self._step_meta)  # the step's settings, not the first rollout's outputs
            more = self.generate_and_score(more, step * 1000 + generations, metrics, timer)
            more_kept, more_dropped = filter_zero_variance_groups(more, metric=self.cfg.algorithm.filter_groups.metric)
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

    def _greedy_baseline(self, batch: DataProto, gen: DataProto) -> torch.Tensor:
        """ReMax: the score of one greedy response per prompt is the baseline of that prompt's samples."""
        greedy = gen.select()
        greedy.meta_info["do_sample"] = False
        out = self.generate(greedy)
        prompt_fields = batch.select([], list(batch.non_tensor_batch), [])
        return self.reward_fn(prompt_fields.union(out)).batch["token_level_scores"].sum(-1)

    # ------------------------------------------------------------------ validation
    def validate(self) -> dict[str, float]:
        vk = self.cfg.actor_rollout_ref.rollout.val_kwargs
        scored = []
        for batch in self.val_batches():
            batch.meta_info.update(validate=True, do_sample=vk.do_sample, temperature=vk.temperature,
                                   top_p=vk.top_p, top_k=vk.top_k, seed=self.cfg.actor_rollout_ref.rollout.seed)
            gen = self._pop_for_generation(batch)
            out = self.generate(gen.repeat(vk.n, interleave=True))
            full = batch.repeat(vk.n, interleave=True).union(out)
            scores = self.reward_fn(full)
            scores.meta_info.pop("reward_metrics", None)
            scored.append(full.union(scores))
        return validation_metrics(DataProto.concat(scored), n=vk.n)

    # ------------------------------------------------------------------ checkpoints
    @property
    def hf_output_dir(self) -> Path:
        return Path(self.cfg.trainer.default_local_dir) / "hf_final"

    def save_checkpoint(self) -> Path:
        self.state.dataloader = self.train_loader.state_dict()
        self.state.kl_ctrl = self.kl_ctrl.state_dict() if self.kl_ctrl is not None else {}
        with self.checkpointer.saving(self.state.global_steps) as tmp_dir:
            try:
                self.actor_rollout.save_checkpoint(str(tmp_dir / "actor"))
                if self.critic is not None:
                    self.critic.save_checkpoint(str(tmp_dir / "critic"))
                self.checkpointer.write_trainer_state(tmp_dir, self.state.__dict__)
                self.save_driver_extras(tmp_dir)
            except OSError:
                raise  # the checkpointer names the directory
            except Exception as err:  # a remote worker's error (Ray wraps the OSError)
                raise RuntimeError(f"saving the step-{self.state.global_steps} checkpoint into {tmp_dir} "
                                   f"failed: {err}") from err
        return self.checkpointer.step_dir(self.state.global_steps)

    def resume(self) -> int:
        """Restore the newest checkpoint per trainer.resume_mode; returns the step training continues from."""
        self.checkpointer.clean_leftovers()
        path = self.checkpointer.resume_path(self.cfg.trainer.resume_mode, self.cfg.trainer.resume_from_path)
        if path is None:
            return 0
        logger.info("resuming from %s", path)
        state = self.checkpointer.read_trainer_state(path)
        self.actor_rollout.load_checkpoint(str(path / "actor"))
        if self.critic is not None:
            self.critic.load_checkpoint(str(path / "critic"))
        self.state = TrainerState(**state)
        self.train_loader.load_state_dict(self.state.dataloader)
        if self.kl_ctrl is not None and self.state.kl_ctrl:
            self.kl_ctrl.load_state_dict(self.state.kl_ctrl)
        self.load_driver_extras(path)
        # The rollout engine must generate with the restored weights, not the initial ones.
        self.actor_rollout.sync_weights(self.state.global_steps)
        return self.state.global_steps

    def save_driver_extras(self, directory: Path) -> None:
        """Driver state beyond TrainerState (an async loop's rollouts generated ahead); nothing here."""

    def load_driver_extras(self, directory: Path) -> None:
        """Counterpart of save_driver_extras."""

    # ------------------------------------------------------------------ helpers
    def _train_batches(self) -> Iterator[DataProto]:
        self._batch_iter = self._endless_batches()
        while self.state.global_steps < self.total_steps:
            batch = next(self._batch_iter, None)
            if batch is None:
                return
            yield batch

    def _endless_batches(self) -> Iterator[DataProto]:
        """Batches across epochs; the loader's own state says which epoch and position come next."""
        while self.train_loader.epoch < self.cfg.trainer.total_epochs:
            yield from self.train_loader

    def _total_steps(self) -> int:
        total = planned_steps(self.cfg, len(self.train_loader))
        for role in ("actor_rollout_ref.actor", "critic"):
            warmup = OmegaConf.select(self.cfg, f"{role}.optim.lr_warmup_steps", default=0) or 0
            if warmup > total and (role != "critic" or self.use_critic):
                raise ValueError(f"{role}.optim.lr_warmup_steps={warmup} is longer than the {total} training steps")
        return total

    @staticmethod
    def _due(freq: int, step: int) -> bool:
        return freq > 0 and step % freq == 0

    def _log(self, metrics: dict[str, float], step: int) -> None:
        if self.tracking is not None:
            self.tracking.log(metrics, step)

    def config_dict(self) -> dict[str, Any]:
        return OmegaConf.to_container(self.cfg, resolve=True, enum_to_str=True)  # type: ignore[return-value]
