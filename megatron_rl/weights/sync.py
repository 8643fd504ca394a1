"""Trainer -> rollout engine weight sync: bucketed streaming and versioning (verification: ``weights/verify.py``).

``sync_weights`` consumes a stream of sealed ``WeightBucket``s (``weights.export_hf_buckets`` in training: each
is handed to the engine as is, no copy) or of (HF name, full tensor) pairs (an HF ``state_dict().items()`` in
tests), which it packs into fixed-size byte buckets, casting to the engine's dtype in the copy. For an engine
whose loads finish before they return (HF), two buckets alternate: while the engine loads one (on a helper thread), the exporter fills the other, and a
bucket is refilled only after its load returned. An engine that may read a bucket after its load returned
(``async_loads``: SGLang's CUDA IPC copies) or must be called from its own thread gets a fresh buffer per
load, on the calling thread, and no buffer is ever rewritten. A tensor larger than a bucket travels alone
in its own buffer. Peak extra memory is about 2 x bucket size either way.

Failure safety: the engine refuses to generate while its weight-update session is open and after a
failed sync (``abort_weight_update``), so partially updated weights never produce samples.
"""
from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from megatron_rl.bucket import DEFAULT_BUCKET_BYTES, WeightBucket
from megatron_rl.rollout.base import RolloutEngine
from megatron_rl.rollout.checksum import TensorChecksum, tensor_checksum

__all__ = ["WeightItem", "WeightSyncError", "WeightSyncStats", "sync_weights"]

logger = logging.getLogger(__name__)

WeightItem = WeightBucket | tuple[str, torch.Tensor]  # what a weight stream yields


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


class _Packer:
    """One sync's bookkeeping: what was sent (names once each, bytes, checksums) and how each item reaches the
    pusher: a sealed bucket as is when it can, everything else copied into the pusher's buckets."""

    def __init__(self, pusher: Any, bucket_bytes: int, dtype: torch.dtype, compute_checksums: bool) -> None:
        self.pusher, self.bucket_bytes, self.dtype = pusher, bucket_bytes, dtype
        self.checksums: dict[str, TensorChecksum] | None = {} if compute_checksums else None
        self.seen: set[str] = set()
        self.total_bytes = 0

    def add(self, item: WeightItem) -> None:
        _check_item(item)
        if not isinstance(item, WeightBucket):
            self._copy_in(*item)
        elif len(item) and not self._push_as_is(item):
            for name, tensor in item.named_tensors():
                self._copy_in(name, tensor)

    def _cast_of(self, tensor: torch.Tensor) -> torch.dtype:
        return self.dtype if tensor.is_floating_point() else tensor.dtype

    def _sent(self, name: str, nbytes: int, tensor: torch.Tensor) -> None:
        if name in self.seen:
            raise WeightSyncError(f"tensor {name!r} was exported twice in one sync")
        self.seen.add(name)
        self.total_bytes += nbytes
        if self.checksums is not None:
            self.checksums[name] = tensor_checksum(tensor)

    def _copy_in(self, name: str, tensor: torch.Tensor) -> None:
        cast = self._cast_of(tensor)
        nbytes = tensor.numel() * cast.itemsize
        if nbytes > self.bucket_bytes:
            sent = WeightBucket.wrapping(name, tensor.detach().to(cast))
            self.pusher.push_current()  # keep the stream's order: an engine loads whole layers as they complete
            self.pusher.push_alone(sent)
        else:
            if not self.pusher.current.fits(nbytes, cast):
                self.pusher.push_current()
            self.pusher.current.add(name, tensor, cast)
            sent = self.pusher.current
        self._sent(name, nbytes, sent.tensor(-1))

    def _push_as_is(self, bucket: WeightBucket) -> bool:
        """A sealed bucket in the cast dtype and within ``bucket_bytes`` (or holding one tensor) goes as is."""
        if not bucket.sealed or (bucket.used > self.bucket_bytes and len(bucket) > 1):
            return False  # larger than the caller's bucket: copied, keeping its memory bound
        if any(self._cast_of(bucket.tensor(i)) != entry.dtype for i, entry in enumerate(bucket.entries)):
            return False
        for i, entry in enumerate(bucket.entries):
            self._sent(entry.name, entry.end - entry.start, bucket.tensor(i))
        self.pusher.push_current()  # keep the engine's load order
        self.pusher.push_sealed(bucket)
        return True


def sync_weights(
    stream: Iterable[WeightItem],
    engine: RolloutEngine,
    *,
    version: int,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    dtype: torch.dtype | None = None,
    compute_checksums: bool = False,
) -> WeightSyncStats:
    """Push every weight of ``stream`` into ``engine`` as weight version ``version``.

    ``stream`` yields sealed ``WeightBucket``s, pushed as they are when they hold the cast dtype and fit
    ``bucket_bytes`` (else their tensors are copied), or (HF name, full tensor) pairs, copied into buckets.
    ``dtype``: what floating-point tensors are cast to (default: the engine's dtype). Buckets live on the
    device of the first tensor. ``compute_checksums``: also return per-tensor checksums of what was sent
    (for ``verify_sync``; costs one extra read of the weights).
    """
    if bucket_bytes <= 0:
        raise ValueError(f"rollout.weight_sync.bucket_size_mb must be positive, got {bucket_bytes} bytes")
    start = time.perf_counter()
    stream = iter(stream)
    first = next(stream, None)
    if first is None:
        raise WeightSyncError("sync_weights got no tensors: the exporter yielded nothing")
    _check_item(first)
    device = first.device if isinstance(first, WeightBucket) else first[1].device
    pusher_cls = _FreshBucketPusher if engine.async_loads or engine.thread_affine else _DoubleBufferedPusher
    pusher = pusher_cls(engine, bucket_bytes, device)
    packer = _Packer(pusher, bucket_bytes, dtype or engine.dtype, compute_checksums)
    engine.begin_weight_update(version)
    try:
        # itertools.chain, not a generator with ``yield from``: closing that would close the caller's stream,
        # which must stay open after a failure (replica.py drains it so the other ranks' export completes).
        for item in itertools.chain([first], stream):
            packer.add(item)
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
    stats = WeightSyncStats(version, seconds, packer.total_bytes, len(packer.seen), pusher.num_buckets,
                            packer.checksums)
    logger.info(
        "weight sync v%d: %d tensors, %.1f MB in %d buckets, %.2f s (%.2f GB/s)",
        version, len(packer.seen), packer.total_bytes / 1e6, pusher.num_buckets, seconds,
        stats.metrics()["weight_sync/GBps"],
    )
    return stats


def _check_item(item: object) -> None:
    if isinstance(item, WeightBucket):
        return
    if not (
        isinstance(item, tuple)
        and len(item) == 2
        and isinstance(item[0], str)
        and isinstance(item[1], torch.Tensor)
    ):
        raise WeightSyncError(
            f"the weight stream must yield WeightBuckets or (str name, torch.Tensor) pairs, got {type(item).__name__}: {item!r:.80}"
        )
