"""Trainer -> rollout engine weight sync: bucketed streaming, versioning, verification.

``sync_weights`` consumes any iterator of (HF name, full tensor) — ``megatron_rl.models.export_hf_weights``
in training, an HF ``state_dict().items()`` in tests — and streams it into fixed-size byte buckets,
casting to the engine's dtype in the copy. For an engine whose loads finish before they return (HF), two
buckets alternate: while the engine loads one (on a helper thread), the exporter fills the other, and a
bucket is refilled only after its load returned. An engine that may read a bucket after its load returned
(``async_loads``: SGLang's CUDA IPC copies) or must be called from its own thread gets a fresh buffer per
load, on the calling thread, and no buffer is ever rewritten. A tensor larger than a bucket travels alone
in its own buffer. Peak extra memory is about 2 x bucket size either way.

Failure safety: the engine refuses to generate while its weight-update session is open and after a
failed sync (``abort_weight_update``), so partially updated weights never produce samples.

``verify_sync`` has the engine answer a fixed set of probe prompts greedily, scores the same tokens in the
trainer, and reports ``rollout/logprob_diff_mean|max`` (engine's sampler log-probs vs trainer's); above
the threshold it raises ``WeightSyncError`` naming the first tensors whose checksums differ between
what the trainer sent and what the engine holds. Going through generation (not a separate scoring call)
checks the path samples actually take and works for every engine, SGLang included.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from megatron_rl.protocol import DataProto
from megatron_rl.rollout.base import RolloutEngine
from megatron_rl.rollout.bucket import WeightBucket, sealed_bucket_of
from megatron_rl.rollout.checksum import TensorChecksum, mismatched_tensors, tensor_checksum

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "WeightSyncError",
    "WeightSyncStats",
    "check_logprob_diff",
    "explain_mismatch",
    "logprob_diff",
    "probe_rollout",
    "sync_weights",
    "verify_sync",
]

logger = logging.getLogger(__name__)

DEFAULT_BUCKET_BYTES = 512 << 20  # rollout.weight_sync.bucket_size_mb default


class WeightSyncError(RuntimeError):
    """A sync that failed or a verification above threshold; the message names the tensors."""


@dataclass
class WeightSyncStats:
    version: int
    seconds: float
    bytes: int  # tensor bytes pushed, in the engine's dtype
    num_tensors: int
    num_buckets: int
    checksums: dict[str, TensorChecksum] | None  # sender side, of the cast tensors actually sent

    def metrics(self) -> dict[str, float]:
        return {
            "weight_sync/seconds": self.seconds,
            "weight_sync/bytes": float(self.bytes),
            "weight_sync/GBps": self.bytes / max(self.seconds, 1e-12) / 1e9,
            "weight_sync/num_buckets": float(self.num_buckets),
            "weight_sync/version": float(self.version),
        }


class _DoubleBufferedPusher:
    """Two buckets: fill one while the engine loads the other on a single helper thread. Only for engines
    whose loads are done when they return (a bucket is refilled after its load returned)."""

    def __init__(self, engine: RolloutEngine, capacity: int, device: torch.device) -> None:
        self._engine = engine
        self._buckets = [WeightBucket(capacity, device), WeightBucket(capacity, device)]
        self._pending: list[Future | None] = [None, None]
        self._index = 0
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="weight-sync")
        self._sealed: Future | None = None
        self.num_buckets = 0

    @property
    def current(self) -> WeightBucket:
        return self._buckets[self._index]

    def push_current(self) -> None:
        """Hand the current bucket to the engine and continue in the other buffer once the engine has
        taken what was pushed from it before."""
        if not len(self.current):
            return
        self._pending[self._index] = self._submit(self.current)
        self._index = 1 - self._index
        self._wait(self._index)
        self.current.clear()

    def push_alone(self, bucket: WeightBucket) -> None:
        """A tensor larger than a bucket travels in its own buffer; return once the engine has taken it."""
        self._submit(bucket).result()

    def push_sealed(self, bucket: WeightBucket) -> None:
        """A producer's sealed bucket (never rewritten): load it as is on the helper thread; at most one such
        load is in flight, so the producer makes the next bucket meanwhile."""
        if self._sealed is not None:
            self._sealed.result()
        self._sealed = self._submit(bucket)

    def _submit(self, bucket: WeightBucket) -> Future:
        _sync_device(bucket)
        self.num_buckets += 1
        return self._pool.submit(self._engine.load_weight_bucket, bucket)

    def _wait(self, slot: int) -> None:
        future, self._pending[slot] = self._pending[slot], None
        if future is not None:
            future.result()

    def drain(self) -> None:
        for slot in (0, 1):
            self._wait(slot)
        if self._sealed is not None:
            future, self._sealed = self._sealed, None
            future.result()

    def close(self) -> None:
        self._pool.shutdown(wait=True)


class _FreshBucketPusher:
    """A new buffer for every load, loaded on the calling thread: for engines that read a bucket after their
    load returned (SGLang copies from CUDA IPC handles asynchronously) or must be called from their own thread.

    A handed-out buffer is never written again. The pusher drops its reference one load later (by then the
    engine has opened it: loads run in order); on CUDA its memory goes back to the allocator only when the
    engine released its IPC handle, which torch's IPC reference counting does after synchronising the
    engine's stream. Peak extra memory: about 2 buckets (3 while the engine still holds its last handle)."""

    def __init__(self, engine: RolloutEngine, capacity: int, device: torch.device) -> None:
        self._engine, self._capacity, self._device = engine, capacity, device
        self.current = WeightBucket(capacity, device)
        self._previous: WeightBucket | None = None
        self.num_buckets = 0

    def push_current(self) -> None:
        if not len(self.current):
            return
        self._push(self.current)
        self.current = WeightBucket(self._capacity, self._device)

    def push_alone(self, bucket: WeightBucket) -> None:
        self._push(bucket)

    def push_sealed(self, bucket: WeightBucket) -> None:
        self._push(bucket)  # never rewritten by its producer: the no-reuse rule holds without a copy

    def _push(self, bucket: WeightBucket) -> None:
        _sync_device(bucket)
        self.num_buckets += 1
        self._engine.load_weight_bucket(bucket)
        self._previous = bucket
        if bucket.device.type == "cuda":
            torch.cuda.ipc_collect()  # free the buffers whose IPC handles the engine has released

    def drain(self) -> None:
        pass

    def close(self) -> None:
        self._previous = None


def _sync_device(bucket: WeightBucket) -> None:
    if bucket.device.type == "cuda":
        torch.cuda.current_stream(bucket.device).synchronize()  # the engine reads it from another stream


def sync_weights(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    engine: RolloutEngine,
    *,
    version: int,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    dtype: torch.dtype | None = None,
    compute_checksums: bool = False,
) -> WeightSyncStats:
    """Push every (HF name, full tensor) into ``engine`` as weight version ``version``.

    ``dtype``: what floating-point tensors are cast to (default: the engine's dtype). Buckets live on the
    device of the first tensor. ``compute_checksums``: also return per-tensor checksums of what was sent
    (for ``verify_sync``; costs one extra read of the weights).
    """
    if bucket_bytes <= 0:
        raise ValueError(f"rollout.weight_sync.bucket_size_mb must be positive, got {bucket_bytes} bytes")
    target_dtype = dtype or engine.dtype
    start = time.perf_counter()
    stream = iter(named_tensors)
    first = next(stream, None)
    if first is None:
        raise WeightSyncError("sync_weights got no tensors: the exporter yielded nothing")
    _check_item(first)
    pusher_cls = _FreshBucketPusher if engine.async_loads or engine.thread_affine else _DoubleBufferedPusher
    pusher = pusher_cls(engine, bucket_bytes, first[1].device)
    checksums: dict[str, TensorChecksum] | None = {} if compute_checksums else None
    seen: set[str] = set()
    total_bytes = 0
    engine.begin_weight_update(version)

    def copy_in(name: str, tensor: torch.Tensor, cast: torch.dtype, nbytes: int) -> None:
        if nbytes > bucket_bytes:
            sent = WeightBucket.wrapping(name, tensor.detach().to(cast))
            pusher.push_alone(sent)
        else:
            if not pusher.current.fits(nbytes, cast):
                pusher.push_current()
            pusher.current.add(name, tensor, cast)
            sent = pusher.current
        if checksums is not None:
            checksums[name] = tensor_checksum(sent.tensor(-1))

    # A run of tensors that are, in order, the entries of a producer's sealed bucket (the Megatron export makes
    # them) no larger than ``bucket_bytes`` is pushed as that bucket: no copy. If the stream leaves the run early,
    # what was taken is copied.
    adopting: WeightBucket | None = None
    taken = 0
    try:
        # itertools.chain, not a generator with ``yield from``: closing that would close the caller's stream,
        # which must stay open after a failure (replica.py drains it so the other ranks' export completes).
        for name, tensor in itertools.chain([first], stream):
            _check_item((name, tensor))
            if name in seen:
                raise WeightSyncError(f"tensor {name!r} was exported twice in one sync")
            seen.add(name)
            cast = target_dtype if tensor.is_floating_point() else tensor.dtype
            nbytes = tensor.numel() * cast.itemsize
            total_bytes += nbytes
            if adopting is not None:
                if _is_entry(adopting, taken, name, tensor):
                    taken += 1
                    if checksums is not None:
                        checksums[name] = tensor_checksum(tensor)
                    if taken == len(adopting):
                        pusher.push_sealed(adopting)
                        adopting = None
                    continue
                for i in range(taken):  # the stream left the bucket's run: copy what was taken
                    entry = adopting.entries[i]
                    copy_in(entry.name, adopting.tensor(i), entry.dtype, entry.end - entry.start)
                adopting = None
            sealed = sealed_bucket_of(tensor) if cast == tensor.dtype else None
            if sealed is not None and (sealed.used > bucket_bytes and len(sealed) > 1):
                sealed = None  # larger than the caller's bucket: copy, keeping its memory bound
            if sealed is not None and _is_entry(sealed, 0, name, tensor):
                pusher.push_current()  # keep the engine's load order
                if checksums is not None:
                    checksums[name] = tensor_checksum(tensor)
                if len(sealed) == 1:
                    pusher.push_sealed(sealed)
                else:
                    adopting, taken = sealed, 1
                continue
            copy_in(name, tensor, cast, nbytes)
        if adopting is not None:
            for i in range(taken):
                entry = adopting.entries[i]
                copy_in(entry.name, adopting.tensor(i), entry.dtype, entry.end - entry.start)
            adopting = None
        pusher.push_current()
        pusher.drain()
    except BaseException as exc:
        pusher.close()
        try:
            engine.abort_weight_update(f"sync to version {version} failed: {exc}")
        except Exception:
            logger.exception("closing the failed weight-update session also failed")
        raise
    engine.end_weight_update()
    pusher.close()  # after the session ends: the last bucket stays referenced until the engine is done
    seconds = time.perf_counter() - start
    stats = WeightSyncStats(version, seconds, total_bytes, len(seen), pusher.num_buckets, checksums)
    logger.info(
        "weight sync v%d: %d tensors, %.1f MB in %d buckets, %.2f s (%.2f GB/s)",
        version,
        len(seen),
        total_bytes / 1e6,
        pusher.num_buckets,
        seconds,
        stats.metrics()["weight_sync/GBps"],
    )
    return stats


def _is_entry(bucket: WeightBucket, index: int, name: str, tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is exactly entry ``index`` of ``bucket`` (same name, dtype, shape and bytes)."""
    if index >= len(bucket):
        return False
    entry = bucket.entries[index]
    return (
        entry.name == name
        and entry.dtype == tensor.dtype
        and entry.shape == tuple(tensor.shape)
        and tensor.is_contiguous()
        and tensor.data_ptr() == bucket.buffer.data_ptr() + entry.start
    )


def _check_item(item: object) -> None:
    if not (
        isinstance(item, tuple)
        and len(item) == 2
        and isinstance(item[0], str)
        and isinstance(item[1], torch.Tensor)
    ):
        raise WeightSyncError(
            f"the weight stream must yield (str name, torch.Tensor) pairs, got {type(item).__name__}: {item!r:.80}"
        )


def probe_rollout(engine: RolloutEngine, probe_prompts: DataProto) -> DataProto:
    """The engine's greedy answer to the fixed probe prompts (its ``rollout_log_probs`` at T = 1)."""
    probe = probe_prompts.select(meta_info_keys=[])
    probe.meta_info.update(do_sample=False, temperature=1.0)  # greedy log-probs are at T = 1
    return engine.generate_sequences(probe)


def logprob_diff(probe_batch: DataProto, trainer_lp: torch.Tensor) -> dict[str, float]:
    """``rollout/logprob_diff_mean|max``: |engine - trainer| log-prob over the valid response tokens."""
    engine_lp = probe_batch.batch["rollout_log_probs"].float().cpu()
    trainer_lp = trainer_lp.float().cpu()
    if engine_lp.shape != trainer_lp.shape:
        raise WeightSyncError(
            f"log-prob shapes differ: engine {tuple(engine_lp.shape)}, trainer {tuple(trainer_lp.shape)}"
        )
    mask = probe_batch.batch["response_mask"].bool().cpu()
    if not bool(mask.any()):
        raise WeightSyncError("the probe batch has no valid response token (response_mask is all zero)")
    diff = (engine_lp - trainer_lp).abs()[mask]
    return {"rollout/logprob_diff_mean": float(diff.mean()), "rollout/logprob_diff_max": float(diff.max())}


def check_logprob_diff(metrics: Mapping[str, float], threshold: float, what: str, explain: Callable[[], str]) -> None:
    """Raise WeightSyncError when the mean difference exceeds ``threshold``; ``explain`` says why."""
    if metrics["rollout/logprob_diff_mean"] > threshold:
        raise WeightSyncError(
            f"rollout and trainer disagree after {what}: mean |logprob diff| "
            f"{metrics['rollout/logprob_diff_mean']:.3g} > {threshold:g} (max {metrics['rollout/logprob_diff_max']:.3g}); "
            + explain()
        )


def verify_sync(
    trainer_log_prob_fn: Callable[[DataProto], torch.Tensor],
    engine: RolloutEngine,
    probe_prompts: DataProto,
    *,
    threshold: float,
    source_checksums: Mapping[str, TensorChecksum] | None = None,
) -> dict[str, float]:
    """Generate greedily for ``probe_prompts`` (left-padded prompts, kept fixed across steps), score the
    result with ``trainer_log_prob_fn`` (DataProto -> [B, R], at meta_info temperature, here 1.0) and
    compare with the engine's ``rollout_log_probs``. Returns ``rollout/logprob_diff_mean|max`` over valid
    response tokens; raises WeightSyncError when the mean exceeds ``threshold``. (One engine in this process;
    ``rollout.replica.RolloutReplica`` verifies every replica of a mesh.)
    """
    probe_batch = probe_rollout(engine, probe_prompts)
    with torch.no_grad():
        metrics = logprob_diff(probe_batch, trainer_log_prob_fn(probe_batch))
    check_logprob_diff(metrics, threshold, f"weight sync v{engine.weight_version}",
                       lambda: explain_mismatch(engine, source_checksums))
    return metrics


def explain_mismatch(engine: RolloutEngine | None, source: Mapping[str, TensorChecksum] | None) -> str:
    if source is None:
        return "no sender checksums were recorded (run sync_weights with compute_checksums=True to name the tensor)"
    held = engine.weight_checksums() if engine is not None else None
    if held is None:
        return f"{type(engine).__name__} cannot report per-tensor checksums, so the tensor cannot be named"
    bad = mismatched_tensors(source, held)
    if bad:
        return f"checksums differ for {len(bad)} tensors, first: {bad[:5]}"
    return (
        f"all {len(source)} tensor checksums agree, so the engine holds exactly what the trainer sent: "
        "look at the export (Megatron -> HF conversion) or at the engine's numerics"
    )
