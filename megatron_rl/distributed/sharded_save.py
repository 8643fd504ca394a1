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

The per-file writers ignore SIGINT and SIGTERM: ctrl-C reaches every process of the terminal's group, and a
writer ended by it never reports, so the rank would wait for it forever (``count_queue.join()`` has no time
limit). The rank's own handler decides: finish the save and stop, or exit (trainer/signals.py, issue 56). A writer
that dies all the same (killed, OOM) is seen by a watchdog, which fails the save naming it (issue 56).
"""
from __future__ import annotations

import logging
import multiprocessing
import queue
import signal
import threading
from contextlib import contextmanager
from multiprocessing import util as mp_util
from typing import Any, Iterator

from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.strategies import filesystem_async

logger = logging.getLogger(__name__)


def save_sharded(sharded_state_dict: dict[str, Any], directory: str) -> None:
    """``dist_checkpointing.save(sharded_state_dict, directory)``, synchronously, starting no process but the
    per-file writers Megatron forks and joins (collective over all ranks, like the call it wraps)."""
    if getattr(filesystem_async, "_results_queue", None) is None:
        filesystem_async._results_queue = queue.Queue()
    with children_ignore_stop_signals(), failing_on_a_dead_writer(directory):
        dist_checkpointing.save(sharded_state_dict, directory)


class _Registration:
    """A weakly referenceable token for ``register_after_fork`` (a bare ``object()`` is not)."""


def _ignore_stop_signals(_owner: object) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


@contextmanager
def children_ignore_stop_signals() -> Iterator[None]:
    """``multiprocessing`` children started inside (Megatron's forked per-file writers) ignore SIGINT and SIGTERM
    from their first line of Python; this process keeps its handlers."""
    owner = _Registration()  # the registry (weak values) holds its entry only while this object lives
    mp_util.register_after_fork(owner, _ignore_stop_signals)
    try:
        yield
    finally:
        del owner


class WriterDied(RuntimeError):
    """A checkpoint writer process ended without reporting: the save it belonged to cannot finish."""


@contextmanager
def failing_on_a_dead_writer(directory: str, poll_s: float = 0.2) -> Iterator[None]:
    """Inside, a ``multiprocessing`` child started inside that exits with an error fails the block with
    :class:`WriterDied` (raised in the main thread through SIGUSR2, which wakes it from Megatron's unbounded
    wait), instead of a save that waits for it forever. Off the main thread the death is logged only."""
    # multiprocessing's own record of this process's children: `active_children()` would reap (and forget) one
    # that died between two looks before its exit code was read.
    children = multiprocessing.process._children  # type: ignore[attr-defined]
    before = set(children)
    done = threading.Event()
    dead: list[str] = []
    main = threading.current_thread() is threading.main_thread()

    def raise_writer_died(_signum: int, _frame: Any) -> None:
        raise WriterDied(f"saving the checkpoint into {directory}: {dead[0]} ended without reporting, so the save "
                         f"cannot finish (killed? out of memory?)")

    def watch() -> None:
        while not done.wait(poll_s):
            for child in set(children) - before:
                if child.exitcode not in (0, None):  # exitcode: the child's status if it has ended (not blocking)
                    dead.append(f"its writer process {child.pid} (exit code {child.exitcode})")
                    logger.error("saving the checkpoint into %s: %s ended without reporting", directory, dead[0])
                    if main:
                        signal.pthread_kill(threading.main_thread().ident, signal.SIGUSR2)
                    return

    previous = signal.signal(signal.SIGUSR2, raise_writer_died) if main else None
    watcher = threading.Thread(target=watch, name="checkpoint-writer-watchdog", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        done.set()
        watcher.join()
        if main:
            signal.signal(signal.SIGUSR2, previous)
