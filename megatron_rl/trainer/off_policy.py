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
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from megatron_rl.protocol import DataProto
from megatron_rl.trainer.metrics import StageTimer
from megatron_rl.trainer.rl_trainer import RLTrainer

logger = logging.getLogger(__name__)

AHEAD_FILE = "rollout_ahead.pkl"


@dataclass
class _Ahead:
    """The rollouts of ``step``, generated (or being generated) before that step began."""

    step: int
    batch: DataProto  # what the loop yields for the step (the prompt rows; the rollouts once restored)
    result: Future

    def wait(self) -> DataProto:
        return self.result.result()


class _SyncAfterRollout:
    """The actor/rollout workers, whose weight sync first waits for the generation in flight: the servers
    never swap weights under a running generation."""

    def __init__(self, workers: Any, trainer: "OneStepOffPolicyTrainer") -> None:
        self._workers, self._trainer = workers, trainer

    def sync_weights(self, version: int) -> dict[str, float]:
        ahead = self._trainer.ahead
        if ahead is not None:
            ahead.wait()  # raises the generation's error here, before weights move
        metrics = self._workers.sync_weights(version)
        self._trainer.served_version = version
        return metrics

    def __getattr__(self, name: str) -> Any:
        return getattr(self._workers, name)


def staleness_metrics(versions: np.ndarray, policy_version: int) -> dict[str, float]:
    """How many versions each sample lags the policy that trains on it."""
    lag = policy_version - versions.astype(np.int64)
    return {"async/staleness_mean": float(lag.mean()), "async/staleness_max": float(lag.max()),
            "async/weight_version_min": float(versions.min())}


class OneStepOffPolicyTrainer(RLTrainer):
    """``rollout_client``: generates on the rollout servers from the driver (servers/client.py);
    every sample carries ``non_tensor_batch["weight_version"]``."""

    def __init__(self, *args: Any, rollout_client: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.max_staleness = int(self.cfg.async_training.max_staleness)
        self.rollout_client = rollout_client
        self.actor_rollout = _SyncAfterRollout(self.actor_rollout, self)
        self.served_version = 0  # the weights on the servers: the last sync's version
        self.ahead: _Ahead | None = None
        self._threads = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollout-ahead")

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

    def generate_and_score(self, batch: DataProto, step: int, metrics: dict[str, float],
                           timer: StageTimer) -> DataProto:
        ahead, self.ahead = self.ahead, None
        started = time.perf_counter()
        with timer("gen"):  # only the wait: the generation itself overlapped the previous update
            if ahead is not None:
                if ahead.step != step:
                    raise RuntimeError(f"the rollouts generated ahead are for step {ahead.step}, not step {step}")
                rolled = ahead.wait()
            else:
                rolled = self.rollout(batch, step, StageTimer())
        metrics["async/gen_wait_s"] = time.perf_counter() - started
        self._start_ahead(step + 1)
        versions = rolled.non_tensor_batch["weight_version"]
        metrics |= staleness_metrics(versions, policy_version=self.state.global_steps)
        if metrics["async/staleness_max"] > self.max_staleness:
            raise RuntimeError(f"step {step} would train on samples {metrics['async/staleness_max']:.0f} versions old, "
                               f"above async_training.max_staleness={self.max_staleness}")
        return self.score(rolled, metrics, timer)

    def _start_ahead(self, step: int) -> None:
        """Generate the next step's rollouts now, on the weights the servers hold (max_staleness 0: never)."""
        if self.max_staleness == 0 or step > self.total_steps:
            return
        batch = next(self._batch_iter, None)
        if batch is None:
            return
        batch.meta_info.update(self.step_meta(step))
        self.ahead = _Ahead(step, batch, self._threads.submit(self.rollout, batch, step, StageTimer()))

    def _train_batches(self) -> Iterator[DataProto]:
        """The loader's batches, except that a step whose rollouts were started ahead trains those."""
        self._batch_iter = self._endless_batches()
        while self.state.global_steps < self.total_steps:
            batch = self.ahead.batch if self.ahead is not None else next(self._batch_iter, None)
            if batch is None:
                return
            yield batch

    def fit(self) -> dict[str, float]:
        try:
            return super().fit()
        finally:
            self._threads.shutdown(wait=True)  # a generation in flight at an error finishes; its result is dropped
            close = getattr(self.rollout_client, "close", None)
            if close is not None:
                close()

    # ------------------------------------------------------------------ checkpoints
    def save_driver_extras(self, directory: Path) -> None:
        """The rollouts generated ahead (done: the sync before a save waited for them) and their step;
        the data loader's position is already past their prompts."""
        if self.ahead is None:
            return
        rolled = self.ahead.wait()
        rolled.meta_info["ahead_step"] = self.ahead.step
        rolled.save_to_disk(directory / AHEAD_FILE)

    def load_driver_extras(self, directory: Path) -> None:
        path = directory / AHEAD_FILE
        if not path.is_file():
            return
        rolled = DataProto.load_from_disk(path)
        done: Future = Future()
        done.set_result(rolled)
        step = int(rolled.meta_info.pop("ahead_step"))
        self.ahead = _Ahead(step, rolled, done)
        logger.info("resumed with the %d rollouts of step %d generated before the checkpoint", len(rolled), step)
