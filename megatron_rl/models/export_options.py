"""Who materialises full tensors in a weight export, and the bucket size: set around an export that another
layer creates (the actor makes the stream, the rollout replica consumes it). No Megatron import here."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable

DEFAULT_EXPORT_BUCKET_BYTES = 512 << 20  # full-tensor bytes per bucket (rollout.weight_sync.bucket_size_mb)

consumers: frozenset[int] | None = None  # None: every rank
bucket_bytes: int | None = None


@contextlib.contextmanager
def export_consumers(ranks: Iterable[int] | None, bucket: int | None = None):
    """Exports started (first ``next``) inside this block materialise full tensors only on global ``ranks``
    (None: every rank) and use ``bucket`` bytes of full tensors per bucket (None: the default)."""
    global consumers, bucket_bytes
    previous = consumers, bucket_bytes
    consumers = None if ranks is None else frozenset(int(r) for r in ranks)
    bucket_bytes = bucket
    try:
        yield
    finally:
        consumers, bucket_bytes = previous
