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
from functools import partial
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

from megatron_rl.protocol import DataProto
from megatron_rl.trainer import loop, steps
from megatron_rl.trainer.metrics import StageTimer, compute_data_metrics
from megatron_rl.trainer.off_policy import staleness_metrics

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


class FullyAsyncTrainer:
    """``rollout_client``: generates on the rollout servers from the driver and pauses/continues them
    (servers/client.py); every sample carries ``non_tensor_batch["weight_version"]`` (its oldest token's)
    and ``["token_weight_versions"]``. ``sync``: the workers' weight sync (default
    ``actor_rollout.sync_weights``; a run with server restarts passes servers/restarts.py's)."""

    def __init__(self, cfg, sizes, actor_rollout, critic, reward_fn, train_loader,
                 val_batches: Callable[[], Iterator[DataProto]] | None, tracking=None, stop=None, checkpointer=None,
                 *, rollout_client: Any, sync: Callable[..., dict[str, float]] | None = None) -> None:
        self.run = loop.build_run(cfg, sizes, actor_rollout, critic, reward_fn, train_loader, val_batches, stop,
                                  checkpointer)
        self.tracking = tracking
        self.rollout_client = rollout_client
        self.sync_workers = sync or actor_rollout.sync_weights
        run = cfg.async_training
        self.max_staleness = int(run.max_staleness)
        self.stale_samples = str(run.stale_samples)
        self.partial_rollout = bool(run.partial_rollout)
        self.capacity = int(run.buffer_batches) if self.max_staleness > 0 else 0
        self.served_version = 0  # the weights on the servers: the last sync's version
        self.produced = 0  # batches the rollouter started: their index names their uids and seeds
        self.dropped_total = 0
        self.resumed: list[DataProto] = []  # the generated batches a restored checkpoint held
        self.stopped: str | None = None
        self.last_batch: DataProto | None = None

    @property
    def state(self) -> loop.TrainerState:
        return self.run.state

    def fit(self) -> dict[str, float]:
        run, last, rollouter = self.run, {}, None
        try:
            loop.start(run, self.tracking, self.generate)
            batches = loop.loader_batches(run)
            rollouter = Rollouter(partial(self.claim, batches), self.roll, self.capacity, self.resumed)
            self.resumed = []
            rollouter.start()
            while run.state.global_steps < run.total_steps:
                rolled, wait_s, dropped = self.take(rollouter)  # the wait is the step's gen time, below
                if rolled is None:
                    break
                step, timer = run.state.global_steps + 1, StageTimer()
                with timer("step"):
                    self.last_batch, metrics = self.train_step(rolled, step, timer, rollouter, wait_s, dropped)
                last = loop.end_step(run, self.tracking, step, self.last_batch, metrics, timer, self.generate,
                                     partial(self.save_checkpoint, rollouter))
                if run.stop.heeded:
                    break
            self.stopped = loop.finish(run)
            return last
        finally:
            if rollouter is not None:
                rollouter.stop()  # the batch in flight finishes; what is left in the buffer is not trained
            close = getattr(self.rollout_client, "close", None)
            if close is not None:
                close()

    def train_step(self, batch: DataProto, step: int, timer: StageTimer, rollouter: Rollouter, wait_s: float,
                   dropped: int) -> tuple[DataProto, dict[str, float]]:
        """Step ``step`` on ``batch``, rollouts the rollouter made (``wait_s``: the wait for them; ``dropped``:
        samples of stale batches skipped before it): the trained batch and its metrics."""
        run, metrics = self.run, {}
        batch.meta_info.update(steps.step_meta(run.cfg, step))
        timer.seconds["gen"] += wait_s
        metrics |= self.buffer_metrics(batch, step, rollouter, wait_s, dropped)  # mask: stale tokens leave
        batch = steps.score(run, batch, metrics, timer)
        run.reward_failures.check(metrics, len(batch), step)
        batch = steps.log_probs(run, batch, metrics, timer)
        batch = steps.advantage(run, batch, metrics, timer)
        steps.update(run, batch, metrics, timer)
        steps.sync(partial(self.paused_sync, rollouter), step, metrics, timer)
        return batch, metrics | compute_data_metrics(batch, run.use_critic)

    # ------------------------------------------------------------------ generation (rollouter thread)
    def generate(self, prompts: DataProto) -> DataProto:
        out = self.rollout_client.generate_sequences(prompts)
        newest = max(int(v.max()) for v in out.non_tensor_batch["token_weight_versions"])
        if newest > self.served_version:
            raise RuntimeError(f"a token was sampled with weight version {newest}, but the servers were synced to "
                               f"version {self.served_version}: a server was updated behind the trainer's back")
        return out

    def claim(self, batches: Iterator[DataProto]) -> tuple[DataProto, int] | None:
        """The next loader batch and its index (the rollouter's lock keeps them in order)."""
        batch = next(batches, None)
        if batch is None:
            return None
        self.produced += 1
        batch.meta_info.update(steps.step_meta(self.run.cfg, self.produced))
        return batch, self.produced

    def roll(self, claimed: tuple[DataProto, int]) -> DataProto:
        batch, index = claimed
        return steps.rollout(self.run, batch, index, self.generate, StageTimer())

    # ------------------------------------------------------------------ the trainer's side
    def take(self, rollouter: Rollouter) -> tuple[DataProto | None, float, int]:
        """The next batch within the staleness bound (None: the data ran out), the seconds waited for it and the
        samples of the batches above the bound (drop), counted and skipped."""
        started, dropped = time.perf_counter(), 0
        while True:
            if self.capacity == 0 and rollouter.ready.empty():
                rollouter.request()
            rolled = rollouter.take()
            if rolled is None or self.trainable(rolled):
                return rolled, time.perf_counter() - started, dropped
            dropped += len(rolled)
            self.dropped_total += len(rolled)
            logger.warning("dropped a batch of %d samples above async_training.max_staleness=%d",
                           len(rolled), self.max_staleness)

    def lag(self, versions: np.ndarray) -> np.ndarray:
        return self.run.state.global_steps - versions.astype(np.int64)

    def trainable(self, rolled: DataProto) -> bool:
        if self.stale_samples == "drop":
            return bool((self.lag(rolled.non_tensor_batch["weight_version"]) <= self.max_staleness).all())
        newest = np.asarray([v.max() for v in rolled.non_tensor_batch["token_weight_versions"]])
        return bool((self.lag(newest) <= self.max_staleness).any())

    def buffer_metrics(self, batch: DataProto, step: int, rollouter: Rollouter, wait_s: float,
                       dropped: int) -> dict[str, float]:
        """Staleness, partial and dropped samples, the buffer; with ``stale_samples=mask`` the tokens above the
        bound leave ``response_mask``."""
        metrics = {"async/gen_wait_s": wait_s}
        versions = batch.non_tensor_batch["weight_version"]
        metrics |= staleness_metrics(versions, policy_version=self.run.state.global_steps)
        token_versions = batch.non_tensor_batch["token_weight_versions"]
        metrics["async/partial_samples"] = float(sum(len(set(v.tolist())) > 1 for v in token_versions))
        metrics["async/dropped_samples"] = float(dropped)
        metrics["async/dropped_samples_total"] = float(self.dropped_total)
        metrics["async/buffer_batches"] = float(rollouter.generated())
        metrics["async/generating_batches"] = float(rollouter.generating())
        if self.stale_samples == "mask":
            metrics["async/masked_tokens"] = self.mask_stale_tokens(batch, token_versions)
        elif metrics["async/staleness_max"] > self.max_staleness:
            raise RuntimeError(f"step {step} got samples {metrics['async/staleness_max']:.0f} versions old past the "
                               f"drop check (async_training.max_staleness={self.max_staleness})")
        return metrics

    def mask_stale_tokens(self, batch: DataProto, token_versions: np.ndarray) -> float:
        mask = batch.batch["response_mask"]
        masked = 0
        for row, versions in enumerate(token_versions):
            stale = np.flatnonzero(self.lag(versions) > self.max_staleness)
            if stale.size:
                mask[row, stale] = 0
                masked += stale.size
        return float(masked)

    def paused_sync(self, rollouter: Rollouter | None, version: int) -> dict[str, float]:
        """The weight sync with the servers paused around it (partial rollouts: the rows in flight go on with the
        new weights), or once the batches in flight finished (``partial_rollout=false``)."""
        client, started = self.rollout_client, time.perf_counter()
        if self.partial_rollout:
            client.pause_generation()
        elif rollouter is not None:
            rollouter.hold()
        try:
            # paused servers hold every /generate until they continue, the verification probe's too
            metrics = self.sync_workers(version, self.partial_rollout)
            self.served_version = version
        finally:
            if self.partial_rollout:
                client.continue_generation()
            elif rollouter is not None:
                rollouter.release()
        paused_s = time.perf_counter() - started
        if self.partial_rollout:
            metrics = {**metrics, **self.run.actor_rollout.verify_weights()}
        return {**metrics, "async/sync_pause_s": paused_s}

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, rollouter: Rollouter) -> Path:
        """With the rollouter held: the loader's position is then right after the last batch it produced."""
        rollouter.hold()
        try:
            return loop.save_checkpoint(self.run, partial(self.save_buffer, rollouter))
        finally:
            if not self.run.stop.heeded:  # a stopping run starts no batch its checkpoint would not hold
                rollouter.release()

    def save_buffer(self, rollouter: Rollouter, directory: Path) -> None:
        buffered = rollouter.buffered()
        for i, rolled in enumerate(buffered):
            rolled.save_to_disk(directory / BUFFER_FILE.format(i))
        (directory / STATE_FILE).write_text(json.dumps({"produced": self.produced, "buffered": len(buffered),
                                                        "dropped_total": self.dropped_total}))

    def resume(self) -> int:
        """Restore the newest checkpoint (with its generated batches); the step training continues from."""
        path = loop.resume(self.run)
        if path is None:
            return 0
        state_file = path / STATE_FILE
        if not state_file.is_file():
            raise FileNotFoundError(f"{state_file} is missing: {path} was not saved by async_training.mode=fully_async")
        state = json.loads(state_file.read_text())
        self.produced, self.dropped_total = int(state["produced"]), int(state["dropped_total"])
        self.resumed = [DataProto.load_from_disk(path / BUFFER_FILE.format(i)) for i in range(state["buffered"])]
        logger.info("resumed with %d rollout batches generated before the checkpoint", len(self.resumed))
        self.paused_sync(None, self.run.state.global_steps)  # the servers generate with the restored weights
        return self.run.state.global_steps
