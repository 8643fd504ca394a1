"""The synchronous loop. `RLTrainer.fit()` follows the lifeline of a sample in DESIGN.md step by step: every
step generates on the weights of the last sync, scores, learns, and syncs the new weights to the engines.

The steps are steps.py's, what happens around them loop.py's; the loop talks to worker groups through plain
method calls that take and return DataProto, so the same loop drives Ray worker groups (single controller)
and in-process workers under torchrun. The async loops are off_policy.py and fully_async.py.
"""
from __future__ import annotations

from typing import Any, Callable, Iterator

from megatron_rl.protocol import DataProto
from megatron_rl.trainer import loop, steps
from megatron_rl.trainer.metrics import StageTimer, compute_data_metrics


class RLTrainer:
    """``sync``: how the weights reach the engines (default ``actor_rollout.sync_weights``; a run with server
    restarts passes servers/restarts.py's); ``generate``: where the rollouts come from (default
    ``actor_rollout.generate_sequences``)."""

    def __init__(self, cfg, sizes, actor_rollout, critic, reward_fn, train_loader,
                 val_batches: Callable[[], Iterator[DataProto]] | None, tracking=None, stop=None, checkpointer=None,
                 *, sync: steps.Sync | None = None, generate: steps.Generate | None = None) -> None:
        self.run = loop.build_run(cfg, sizes, actor_rollout, critic, reward_fn, train_loader, val_batches, stop,
                                  checkpointer)
        self.tracking = tracking  # None on ranks that do not log
        self.sync = sync or actor_rollout.sync_weights
        self.generate_on_workers = generate or actor_rollout.generate_sequences
        self.stopped: str | None = None  # the signal that stopped the run early (resumable), else None
        self.last_batch: DataProto | None = None  # the last step's trained batch, for inspection

    @property
    def state(self) -> loop.TrainerState:
        return self.run.state

    def fit(self) -> dict[str, float]:
        """Train from the current state (call `resume()` first to continue a run) to the last step."""
        run, last = self.run, {}
        loop.start(run, self.tracking, self.generate)
        batches = loop.loader_batches(run)
        while run.state.global_steps < run.total_steps and (batch := next(batches, None)) is not None:
            step, timer = run.state.global_steps + 1, StageTimer()
            with timer("step"):
                self.last_batch, metrics = self.train_step(batch, step, timer, batches)
            last = loop.end_step(run, self.tracking, step, self.last_batch, metrics, timer, self.generate,
                                 self.save_checkpoint)
            if run.stop.heeded:
                break
        self.stopped = loop.finish(run)
        return last

    def train_step(self, batch: DataProto, step: int, timer: StageTimer,
                   more_batches: Iterator[DataProto]) -> tuple[DataProto, dict[str, float]]:
        """One step: the trained batch and its metrics. ``more_batches``: DAPO's refills."""
        run, metrics, meta = self.run, {}, steps.step_meta(self.run.cfg, step)
        batch.meta_info.update(meta)
        batch = steps.generate_and_score(run, batch, step, self.generate, metrics, timer)
        run.reward_failures.check(metrics, len(batch), step)
        if run.cfg.algorithm.filter_groups.enable:
            batch = steps.fill_with_informative_groups(run, batch, step, meta, more_batches, self.generate,
                                                       metrics, timer)
        batch = steps.log_probs(run, batch, metrics, timer)
        batch = steps.advantage(run, batch, metrics, timer)
        steps.update(run, batch, metrics, timer)
        steps.sync(self.sync, step, metrics, timer)
        return batch, metrics | compute_data_metrics(batch, run.use_critic)

    def generate(self, prompts: DataProto) -> DataProto:
        """Every generation (training, ReMax's greedy baseline, DAPO's refills, validation) must run on the
        weights of the last sync, which are the current step's: a sample from other weights is refused."""
        out = self.generate_on_workers(prompts)
        served = out.meta_info.get("weight_version")
        if served is not None and served != self.run.state.global_steps:
            raise RuntimeError(f"the rollout generated with weight version {served}, but the actor's weights are "
                               f"version {self.run.state.global_steps}: a weight sync did not reach the engines")
        return out

    def save_checkpoint(self) -> Any:
        return loop.save_checkpoint(self.run)

    def resume(self) -> int:
        """Restore the newest checkpoint per trainer.resume_mode; returns the step training continues from."""
        if loop.resume(self.run) is None:
            return 0
        self.sync(self.run.state.global_steps)  # the engines generate with the restored weights
        return self.run.state.global_steps
