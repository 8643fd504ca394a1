"""Fully asynchronous training with partial rollouts (``async_training.mode=fully_async``; verl's
recipe/fully_async_policy, AReaL's asynchronous RL).

A rollout thread (the *rollouter*, verl's name) keeps generating loader batches on the rollout servers into a
bounded buffer: at most ``async_training.buffer_batches`` batches are generated or generating and not yet
trained, and a batch starts as soon as that bound allows, while earlier ones still generate (streaming: each
server goes on with its part of the next batch once done with its part of the earlier ones, so none idles at
a batch boundary waiting for the slowest). The trainer takes the oldest batch each step, once generated. A
weight sync first pauses the servers (``/pause_generation``, mode ``abort``): the batches in flight come back
partial and their rows are sent again
(servers/client.py), so after the sync and ``/continue_generation`` their responses go on with the new
weights; every token keeps the version that sampled it (the prefix keeps the old version's log-probs).
``async_training.partial_rollout=false`` instead waits for the batches in flight to finish before the sync.

A batch is one loader batch with its n responses per prompt, generated as one request per server, so groups
always stay complete. Staleness of a sample = the policy version that trains it minus the version of its
oldest token. ``async_training.max_staleness`` bounds it, ``async_training.stale_samples`` says how:

- ``drop``: a batch holding a sample above the bound is not trained (its groups whole, its prompts not
  regenerated), counted in ``async/dropped_samples``;
- ``mask``: tokens sampled by weights above the bound leave ``response_mask`` (slime's
  mask-offpolicy-in-partial-rollout, with a bound); a batch with no token left is dropped.

Samples within the bound are reweighted by the off-policy correction (algorithm.rollout_correction, or
``actor.policy_loss=decoupled_ppo``): behaviour log-probs = the rollout's, proximal = the recomputed
``old_log_probs``. ``max_staleness=0`` is the on-policy limit: a batch is generated only when the trainer asks
for it, nothing overlaps an update, and the run equals the synchronous trainer's.

Checkpoints: a save waits for the batches in flight (no new one starts), then keeps the finished batches
(``rollout_buffer_<i>.pkl``) next to the loader position after them, so a resumed run trains every produced
batch once. Only batches dropped for staleness are never trained (counted in ``async/dropped_samples_total``).
"""
from __future__ import annotations

import json
import logging
import queue
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

from megatron_rl.protocol import DataProto
from megatron_rl.trainer.metrics import StageTimer
from megatron_rl.trainer.off_policy import staleness_metrics
from megatron_rl.trainer.rl_trainer import RLTrainer

logger = logging.getLogger(__name__)

BUFFER_FILE = "rollout_buffer_{}.pkl"
STATE_FILE = "rollout_buffer.json"


class Rollouter:
    """The thread that generates batches ahead. ``claim()``: the next batch to generate (its index set), or None
    when the data ran out; ``roll(claimed)``: its rollouts. ``capacity`` batches may be generating or waiting
    untrained (0: one only when ``request()`` asks).

    Streaming: a batch starts as soon as a permit frees, even while earlier ones still generate (each server
    takes its part of it once done with its part of the earlier ones: servers/client.py), so no server
    idles at a batch boundary waiting for the slowest. Batches are claimed in loader order and handed over in
    that order."""

    def __init__(self, claim: Callable[[], Any], roll: Callable[[Any], DataProto], capacity: int,
                 ready: list[DataProto]) -> None:
        self._claim, self._roll, self.capacity = claim, roll, capacity
        self.ready: queue.Queue = queue.Queue()  # Futures in claim order; None after the last
        for batch in ready:
            self.ready.put(_done(batch))
        self._permits = threading.Semaphore(max(capacity - len(ready), 0))
        self._state = threading.Condition()
        self._holding = self._stopping = False
        self._generating = 0
        self.error: BaseException | None = None
        self._pool = ThreadPoolExecutor(max_workers=max(capacity, 1), thread_name_prefix="rollouter-batch")
        self._thread = threading.Thread(target=self._run, name="rollouter", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        try:
            while True:
                self._permits.acquire()
                with self._state:
                    self._state.wait_for(lambda: not self._holding or self._stopping)
                    if self._stopping:
                        return
                    claimed = self._claim()
                    if claimed is None:
                        self.ready.put(None)
                        return
                    self._generating += 1
                    self.ready.put(self._pool.submit(self._roll_one, claimed))
        except BaseException as exc:  # noqa: BLE001 - handed to the trainer, which raises it
            self.error = exc
            self.ready.put(None)

    def _roll_one(self, claimed: Any) -> DataProto:
        try:
            return self._roll(claimed)
        finally:
            with self._state:
                self._generating -= 1
                self._state.notify_all()

    def request(self) -> None:
        """The on-policy limit (capacity 0): generate one batch now."""
        self._permits.release()

    def take(self) -> DataProto | None:
        """The oldest batch, once generated; None when the data ran out. A generation error is raised here."""
        pending = self.ready.get()
        if pending is None:
            if self.error is not None:
                raise RuntimeError(f"the rollout thread failed: {self.error}") from self.error
            return None
        try:
            rolled = pending.result()
        except BaseException as exc:
            raise RuntimeError(f"the rollout thread failed: {exc}") from exc
        if self.capacity > 0:
            self._permits.release()
        return rolled

    def hold(self) -> None:
        """Wait for the batches generating; none starts until ``release()``."""
        with self._state:
            self._holding = True
            self._state.wait_for(lambda: self._generating == 0)

    def release(self) -> None:
        with self._state:
            self._holding = False
            self._state.notify_all()

    def generated(self) -> int:
        """Batches generated and waiting for the trainer."""
        return sum(pending is not None and pending.done() for pending in list(self.ready.queue))

    def generating(self) -> int:
        with self._state:
            return self._generating

    def buffered(self) -> list[DataProto]:
        """The generated, untrained batches (call while held: every one has finished)."""
        return [pending.result() for pending in list(self.ready.queue) if pending is not None]

    def stop(self) -> None:
        """No batch starts any more; the ones generating finish (their rollouts are not trained)."""
        with self._state:
            self._stopping = True
            self._state.notify_all()
        self._permits.release()
        if self._thread.is_alive():
            self._thread.join()
        self._pool.shutdown(wait=True)


def _done(batch: DataProto) -> Future:
    future: Future = Future()
    future.set_result(batch)
    return future


class _PausedSync:
    """The actor/rollout workers, whose weight sync pauses the servers around it (partial rollouts) or waits
    for the batch in flight (``partial_rollout=false``)."""

    def __init__(self, workers: Any, trainer: "FullyAsyncTrainer") -> None:
        self._workers, self._trainer = workers, trainer

    def sync_weights(self, version: int) -> dict[str, float]:
        trainer, client = self._trainer, self._trainer.rollout_client
        rollouter = trainer.rollouter
        started = time.perf_counter()
        if trainer.partial_rollout:
            client.pause_generation()
        elif rollouter is not None:
            rollouter.hold()
        try:
            # paused servers hold every /generate until they continue, the verification probe's too
            metrics = self._workers.sync_weights(version, trainer.partial_rollout)
            trainer.served_version = version
        finally:
            if trainer.partial_rollout:
                client.continue_generation()
            elif rollouter is not None:
                rollouter.release()
        paused_s = time.perf_counter() - started
        if trainer.partial_rollout:
            metrics = {**metrics, **self._workers.verify_weights()}
        return {**metrics, "async/sync_pause_s": paused_s}

    def __getattr__(self, name: str) -> Any:
        return getattr(self._workers, name)


class FullyAsyncTrainer(RLTrainer):
    """``rollout_client``: generates on the rollout servers from the driver and pauses/continues them
    (servers/client.py); every sample carries ``non_tensor_batch["weight_version"]`` (its oldest token's)
    and ``["token_weight_versions"]``."""

    def __init__(self, *args: Any, rollout_client: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        run = self.cfg.async_training
        self.max_staleness = int(run.max_staleness)
        self.stale_samples = str(run.stale_samples)
        self.partial_rollout = bool(run.partial_rollout)
        self.capacity = int(run.buffer_batches) if self.max_staleness > 0 else 0
        self.rollout_client = rollout_client
        self.actor_rollout = _PausedSync(self.actor_rollout, self)
        self.served_version = 0
        self.rollouter: Rollouter | None = None
        self.produced = 0  # batches the rollouter started: their index names their uids and seeds
        self.dropped_total = 0
        self._restored: list[DataProto] = []
        self._dropped_now = 0
        self._wait_s = 0.0

    # ------------------------------------------------------------------ generation (rollouter thread)
    def generate(self, prompts: DataProto) -> DataProto:
        out = self.rollout_client.generate_sequences(prompts)
        newest = max(int(v.max()) for v in out.non_tensor_batch["token_weight_versions"])
        if newest > self.served_version:
            raise RuntimeError(f"a token was sampled with weight version {newest}, but the servers were synced to "
                               f"version {self.served_version}: a server was updated behind the trainer's back")
        return out

    def _claim(self) -> tuple[DataProto, int] | None:
        """The next loader batch and its index (the rollouter's lock keeps them in order)."""
        batch = next(self._batch_iter, None)
        if batch is None:
            return None
        self.produced += 1
        batch.meta_info.update(self.step_meta(self.produced))
        return batch, self.produced

    def _roll(self, claimed: tuple[DataProto, int]) -> DataProto:
        batch, index = claimed
        return self.rollout(batch, index, StageTimer())

    # ------------------------------------------------------------------ the trainer's side
    def _train_batches(self) -> Iterator[DataProto]:
        self._batch_iter = self._endless_batches()
        self.rollouter = Rollouter(self._claim, self._roll, self.capacity, self._restored)
        self._restored = []
        self.rollouter.start()
        while self.state.global_steps < self.total_steps:
            rolled = self._take()
            if rolled is None:
                return
            yield rolled

    def _take(self) -> DataProto | None:
        """The next batch within the staleness bound; the ones above it (drop) are counted and skipped."""
        started, self._dropped_now = time.perf_counter(), 0
        while True:
            if self.capacity == 0 and self.rollouter.ready.empty():
                self.rollouter.request()
            rolled = self.rollouter.take()
            if rolled is None or self._trainable(rolled):
                self._wait_s = time.perf_counter() - started
                return rolled
            self._dropped_now += len(rolled)
            self.dropped_total += len(rolled)
            logger.warning("dropped a batch of %d samples above async_training.max_staleness=%d",
                           len(rolled), self.max_staleness)

    def _lag(self, versions: np.ndarray) -> np.ndarray:
        return self.state.global_steps - versions.astype(np.int64)

    def _trainable(self, rolled: DataProto) -> bool:
        if self.stale_samples == "drop":
            return bool((self._lag(rolled.non_tensor_batch["weight_version"]) <= self.max_staleness).all())
        newest = np.asarray([v.max() for v in rolled.non_tensor_batch["token_weight_versions"]])
        return bool((self._lag(newest) <= self.max_staleness).any())

    def generate_and_score(self, batch: DataProto, step: int, metrics: dict[str, float],
                           timer: StageTimer) -> DataProto:
        """``batch``: rollouts the rollouter made; only the wait for them is this step's ``gen`` time."""
        timer.seconds["gen"] += self._wait_s
        metrics["async/gen_wait_s"] = self._wait_s
        metrics |= staleness_metrics(batch.non_tensor_batch["weight_version"], policy_version=self.state.global_steps)
        token_versions = batch.non_tensor_batch["token_weight_versions"]
        metrics["async/partial_samples"] = float(sum(len(set(v.tolist())) > 1 for v in token_versions))
        metrics["async/dropped_samples"] = float(self._dropped_now)
        metrics["async/dropped_samples_total"] = float(self.dropped_total)
        metrics["async/buffer_batches"] = float(self.rollouter.generated())
        metrics["async/generating_batches"] = float(self.rollouter.generating())
        if self.stale_samples == "mask":
            metrics["async/masked_tokens"] = self._mask_stale_tokens(batch, token_versions)
        elif metrics["async/staleness_max"] > self.max_staleness:
            raise RuntimeError(f"step {step} got samples {metrics['async/staleness_max']:.0f} versions old past the "
                               f"drop check (async_training.max_staleness={self.max_staleness})")
        return self.score(batch, metrics, timer)

    def _mask_stale_tokens(self, batch: DataProto, token_versions: np.ndarray) -> float:
        mask = batch.batch["response_mask"]
        masked = 0
        for row, versions in enumerate(token_versions):
            stale = np.flatnonzero(self._lag(versions) > self.max_staleness)
            if stale.size:
                mask[row, stale] = 0
                masked += stale.size
        return float(masked)

    def fit(self) -> dict[str, float]:
        try:
            return super().fit()
        finally:
            if self.rollouter is not None:
                self.rollouter.stop()  # the batch in flight finishes; what is left in the buffer is not trained
            close = getattr(self.rollout_client, "close", None)
            if close is not None:
                close()

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self) -> Path:
        """With the rollouter held: the loader's position is then right after the last batch it produced."""
        if self.rollouter is None:
            return super().save_checkpoint()
        self.rollouter.hold()
        try:
            return super().save_checkpoint()
        finally:
            if not self.stop.requested:  # a stopping run starts no batch its checkpoint would not hold
                self.rollouter.release()

    def save_driver_extras(self, directory: Path) -> None:
        buffered = self.rollouter.buffered() if self.rollouter is not None else self._restored
        for i, rolled in enumerate(buffered):
            rolled.save_to_disk(directory / BUFFER_FILE.format(i))
        (directory / STATE_FILE).write_text(json.dumps({"produced": self.produced, "buffered": len(buffered),
                                                        "dropped_total": self.dropped_total}))

    def load_driver_extras(self, directory: Path) -> None:
        path = directory / STATE_FILE
        if not path.is_file():
            raise FileNotFoundError(f"{path} is missing: {directory} was not saved by async_training.mode=fully_async")
        state = json.loads(path.read_text())
        self.produced, self.dropped_total = int(state["produced"]), int(state["dropped_total"])
        self._restored = [DataProto.load_from_disk(directory / BUFFER_FILE.format(i)) for i in range(state["buffered"])]
        logger.info("resumed with %d rollout batches generated before the checkpoint", len(self._restored))
