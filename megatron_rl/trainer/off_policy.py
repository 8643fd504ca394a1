"""One-step off-policy training (``async_training.mode=one_step_off``, verl's recipe/one_step_off_policy):
the rollouts of step k+1 are generated on the rollout servers while the trainer ranks update step k.

Timeline (version v = the step whose update produced the weights; the servers start at v0):

    step 1:  generate batch 1 (v0) | start batch 2 on the servers (v0) | update -> v1 | wait batch 2, sync v1
    step 2:  take batch 2 (v0)     | start batch 3 (v1)                | update -> v2 | wait batch 3, sync v2
    step k:  take batch k (v[k-2]) | start batch k+1 (v[k-1])          | update -> vk | wait, sync vk

So every sample of step k >= 2 is exactly one version behind the policy it trains (staleness 1); its
behaviour log-probs (``rollout_log_probs``) enter the update through rollout correction, the recomputed
``old_log_probs`` being the current (proximal) policy's: decoupled PPO. A sync waits for the generation in
flight, so no sample mixes two versions. ``max_staleness=0`` is the on-policy limit: nothing is generated
ahead and the run equals the synchronous trainer's.

Every sample's version is checked against the version the servers were last synced to; the metrics give
``async/staleness_mean|max``. A checkpoint keeps the rollouts generated ahead (``rollout_ahead.pkl``): a
resumed run trains them, so it neither loses nor repeats a sample.
"""
from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

from megatron_rl.protocol import DataProto
from megatron_rl.trainer import loop, steps
from megatron_rl.trainer.metrics import StageTimer, compute_data_metrics

logger = logging.getLogger(__name__)

AHEAD_FILE = "rollout_ahead.pkl"


@dataclass
class Ahead:
    """The rollouts of ``step``, generated (or being generated) before that step began."""

    step: int
    batch: DataProto  # what the loop trains at the step (the prompt rows; the rollouts once restored)
    result: Future

    def wait(self) -> DataProto:
        return self.result.result()


def staleness_metrics(versions: np.ndarray, policy_version: int) -> dict[str, float]:
    """How many versions each sample lags the policy that trains on it."""
    lag = policy_version - versions.astype(np.int64)
    return {"async/staleness_mean": float(lag.mean()), "async/staleness_max": float(lag.max()),
            "async/weight_version_min": float(versions.min())}


class OneStepOffPolicyTrainer:
    """``rollout_client``: generates on the rollout servers from the driver (servers/client.py); every sample
    carries ``non_tensor_batch["weight_version"]``. ``sync``: the workers' weight sync (default
    ``actor_rollout.sync_weights``; a run with server restarts passes servers/restarts.py's)."""

    def __init__(self, cfg, sizes, actor_rollout, critic, reward_fn, train_loader,
                 val_batches: Callable[[], Iterator[DataProto]] | None, tracking=None, stop=None, checkpointer=None,
                 *, rollout_client: Any, sync: steps.Sync | None = None) -> None:
        self.run = loop.build_run(cfg, sizes, actor_rollout, critic, reward_fn, train_loader, val_batches, stop,
                                  checkpointer)
        self.tracking = tracking
        self.rollout_client = rollout_client
        self.sync_workers = sync or actor_rollout.sync_weights
        self.max_staleness = int(cfg.async_training.max_staleness)
        self.served_version = 0  # the weights on the servers: the last sync's version
        self.resumed: Ahead | None = None  # the rollouts a restored checkpoint had generated ahead
        self.stopped: str | None = None
        self.last_batch: DataProto | None = None

    @property
    def state(self) -> loop.TrainerState:
        return self.run.state

    def fit(self) -> dict[str, float]:
        run, last = self.run, {}
        threads = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollout-ahead")
        try:
            loop.start(run, self.tracking, self.generate)
            batches, ahead, self.resumed = loop.loader_batches(run), self.resumed, None
            while run.state.global_steps < run.total_steps:
                # a step whose rollouts were started ahead trains those
                if (batch := ahead.batch if ahead is not None else next(batches, None)) is None:
                    break
                step, timer = run.state.global_steps + 1, StageTimer()
                with timer("step"):
                    self.last_batch, metrics, ahead = self.train_step(batch, ahead, step, timer, batches, threads)
                last = loop.end_step(run, self.tracking, step, self.last_batch, metrics, timer, self.generate,
                                     partial(self.save_checkpoint, ahead))
                if run.stop.heeded:
                    break
            self.stopped = loop.finish(run)
            return last
        finally:
            threads.shutdown(wait=True)  # a generation in flight at an error finishes; its result is dropped
            close = getattr(self.rollout_client, "close", None)
            if close is not None:
                close()

    def train_step(self, batch: DataProto, ahead: Ahead | None, step: int, timer: StageTimer,
                   batches: Iterator[DataProto], threads: ThreadPoolExecutor
                   ) -> tuple[DataProto, dict[str, float], Ahead | None]:
        """Step ``step`` on its rollouts generated ahead (the first step's: now), the next step's generating
        meanwhile: the trained batch, its metrics and the next step's rollouts."""
        run, metrics = self.run, {}
        batch.meta_info.update(steps.step_meta(run.cfg, step))
        started = time.perf_counter()
        with timer("gen"):  # only the wait: the generation itself overlapped the previous update
            if ahead is not None:
                rolled = self.wait(ahead, step)
            else:
                rolled = steps.rollout(run, batch, step, self.generate, StageTimer())
        metrics["async/gen_wait_s"] = time.perf_counter() - started
        ahead = self.start_ahead(step + 1, batches, threads)
        metrics |= self.staleness(rolled, step)
        batch = steps.score(run, rolled, metrics, timer)
        run.reward_failures.check(metrics, len(batch), step)
        batch = steps.log_probs(run, batch, metrics, timer)
        batch = steps.advantage(run, batch, metrics, timer)
        steps.update(run, batch, metrics, timer)
        steps.sync(partial(self.sync_after_rollout, ahead), step, metrics, timer)
        return batch, metrics | compute_data_metrics(batch, run.use_critic), ahead

    # ------------------------------------------------------------------ the overlap
    def generate(self, prompts: DataProto) -> DataProto:
        """On the servers; every sample must come from the weights of the last sync."""
        out = self.rollout_client.generate_sequences(prompts)
        versions = out.non_tensor_batch["weight_version"]
        wrong = np.flatnonzero(versions != self.served_version)
        if wrong.size:
            raise RuntimeError(f"sample {int(wrong[0])} was generated with weight version {int(versions[wrong[0]])}, "
                               f"but the servers were synced to version {self.served_version}: a server missed a sync")
        return out

    def start_ahead(self, step: int, batches: Iterator[DataProto], threads: ThreadPoolExecutor) -> Ahead | None:
        """Generate step ``step``'s rollouts now, on the weights the servers hold (max_staleness 0: never)."""
        if self.max_staleness == 0 or step > self.run.total_steps:
            return None
        batch = next(batches, None)
        if batch is None:
            return None
        batch.meta_info.update(steps.step_meta(self.run.cfg, step))
        return Ahead(step, batch, threads.submit(steps.rollout, self.run, batch, step, self.generate, StageTimer()))

    @staticmethod
    def wait(ahead: Ahead, step: int) -> DataProto:
        if ahead.step != step:
            raise RuntimeError(f"the rollouts generated ahead are for step {ahead.step}, not step {step}")
        return ahead.wait()

    def staleness(self, rolled: DataProto, step: int) -> dict[str, float]:
        metrics = staleness_metrics(rolled.non_tensor_batch["weight_version"],
                                    policy_version=self.run.state.global_steps)
        if metrics["async/staleness_max"] > self.max_staleness:
            raise RuntimeError(f"step {step} would train on samples {metrics['async/staleness_max']:.0f} versions old, "
                               f"above async_training.max_staleness={self.max_staleness}")
        return metrics

    def sync_after_rollout(self, ahead: Ahead | None, version: int) -> dict[str, float]:
        """The weight sync, once the generation in flight is done: the servers never swap weights under it."""
        if ahead is not None:
            ahead.wait()  # raises the generation's error here, before weights move
        metrics = self.sync_workers(version)
        self.served_version = version
        return metrics

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, ahead: Ahead | None) -> Path:
        return loop.save_checkpoint(self.run, partial(save_ahead, ahead) if ahead is not None else None)

    def resume(self) -> int:
        """Restore the newest checkpoint (with the rollouts it generated ahead); the step training continues from."""
        path = loop.resume(self.run)
        if path is None:
            return 0
        self.resumed = load_ahead(path)
        self.sync_after_rollout(self.resumed, self.run.state.global_steps)
        return self.run.state.global_steps


def save_ahead(ahead: Ahead, directory: Path) -> None:
    """The rollouts generated ahead (done: the sync before a save waited for them) and their step; the data
    loader's position is already past their prompts."""
    rolled = ahead.wait()
    rolled.meta_info["ahead_step"] = ahead.step
    rolled.save_to_disk(directory / AHEAD_FILE)


def load_ahead(directory: Path) -> Ahead | None:
    path = directory / AHEAD_FILE
    if not path.is_file():
        return None
    rolled = DataProto.load_from_disk(path)
    done: Future = Future()
    done.set_result(rolled)
    step = int(rolled.meta_info.pop("ahead_step"))
    logger.info("resumed with the %d rollouts of step %d generated before the checkpoint", len(rolled), step)
    return Ahead(step, rolled, done)
