"""``save_sharded``: Megatron's ``dist_checkpointing.save``, synchronous as ours all are, without the process it
would otherwise start in every saving rank.

Megatron's torch_dist writer returns its write results through a module-level queue that it makes at a
process's first save from a ``spawn``-context ``multiprocessing.Manager`` (``_get_write_results_queue`` in
megatron/core/dist_checkpointing/strategies/filesystem_async.py), so that the writer of an *asynchronous* save,
another process, can reach it. The Manager is a fresh Python process that re-runs the rank's main module (in a
Ray worker, Ray's worker script: 4-5 CPU-s and ~100 MB per rank) and lives as long as the rank. A synchronous
save writes from the saving process itself (``AsyncRequest.execute_sync``; the per-file writers it forks report
to a queue of their own), so both ends of that queue are in one process and an in-process queue serves it the
same. An asynchronous save (``async_sharded_save``, which we never ask for) would need Megatron's own queue back.
"""
from __future__ import annotations

import queue
from typing import Any

from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.strategies import filesystem_async


def save_sharded(sharded_state_dict: dict[str, Any], directory: str) -> None:
    """``dist_checkpointing.save(sharded_state_dict, directory)``, synchronously, starting no process but the
    per-file writers Megatron forks and joins (collective over all ranks, like the call it wraps)."""
    if getattr(filesystem_async, "_results_queue", None) is None:
        filesystem_async._results_queue = queue.Queue()
    dist_checkpointing.save(sharded_state_dict, directory)
