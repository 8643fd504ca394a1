"""Run a function on N local processes joined by a gloo/nccl group — for tests and small tools.

Each rank's return value comes back to the caller; an exception on any rank is re-raised in the
caller with that rank's traceback, and a hang fails after ``timeout_s`` instead of blocking.
"""

from __future__ import annotations

import os
import pickle
import queue
import signal
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.multiprocessing as mp

from megatron_rl.distributed.ports import free_port
from megatron_rl.distributed.process_group import init_distributed


# What a rank imports anyway (~8 s on a 2-core machine); a forkserver that imported it once forks ranks that start
# in a fraction of a second. The ranks stay fresh processes: nothing is initialised in the server.
_PRELOAD = ["torch", "torch.distributed", "megatron.core.parallel_state", "megatron.core.models.gpt",
            "megatron_rl.distributed.process_group"]


def _context():
    """The start method of the ranks: spawn where CUDA is (a forkserver that imported TE could hold a CUDA
    context its forks inherit), else a forkserver that has the heavy imports done."""
    if torch.cuda.is_available():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def _worker(fn: Callable, rank: int, world_size: int, port: int, threads: int, results, args, kwargs,
            pg_timeout_s: float = 120.0, env: dict[str, str] | None = None):
    import torch.distributed as dist

    if env is not None:  # a forkserver's child has the server's environment, not the caller's
        os.environ.clear()
        os.environ.update(env)
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    torch.set_num_threads(threads)
    # Own process group, so the parent can kill helpers this rank starts (e.g. checkpoint writers).
    os.setpgid(0, 0)
    try:
        init_distributed(timeout=timedelta(seconds=pg_timeout_s))
        # Plain pickle (by value): torch's queue pickler would share tensor memory through file
        # descriptors that die with this process.
        results.put((rank, True, pickle.dumps(fn(*args, **kwargs))))
    except BaseException:  # noqa: BLE001 - every failure must reach the parent, with its traceback
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _kill_process_group(proc) -> None:
    """Kill the rank and anything it started (its process group), then reap it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass  # already gone, or never got to create its group
    if proc.is_alive():
        proc.kill()
    proc.join()


def run_multiprocess(
    fn: Callable,
    world_size: int,
    *args: Any,
    timeout_s: float = 300.0,
    threads_per_rank: int = 1,
    pg_timeout_s: float = 120.0,
    **kwargs: Any,
) -> list[Any]:
    """Call ``fn(*args, **kwargs)`` on ``world_size`` spawned ranks; return the results by rank.

    ``fn`` must be importable (a module-level function) and its result picklable. The default
    process group is initialised before ``fn`` runs and destroyed after; its collectives time out after
    ``pg_timeout_s`` (tests of waits longer than a collective's timeout make it short).
    """
    ctx = _context()
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_worker,
            args=(fn, rank, world_size, port, threads_per_rank, results, args, kwargs, pg_timeout_s,
                  dict(os.environ)),
            daemon=False,
        )
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    outputs: dict[int, Any] = {}
    start = time.monotonic()
    try:
        while len(outputs) < world_size:
            time_left = timeout_s - (time.monotonic() - start)
            if time_left <= 0:
                missing = sorted(set(range(world_size)) - set(outputs))
                raise TimeoutError(f"{fn.__name__}: ranks {missing} did not finish within {timeout_s:.0f} s")
            try:
                rank, ok, value = results.get(timeout=min(time_left, 1.0))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if r not in outputs and p.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(
                        f"{fn.__name__}: rank {dead[0]} exited with code {procs[dead[0]].exitcode} "
                        "without reporting (killed? out of memory?)"
                    ) from None
                continue
            if not ok:
                raise RuntimeError(f"{fn.__name__} failed on rank {rank}:\n{value}")
            outputs[rank] = pickle.loads(value)
    finally:
        # After a failure the other ranks may sit in a collective: do not wait for them.
        grace_s = 10 if len(outputs) == world_size else 0
        for proc in procs:
            proc.join(timeout=grace_s)
            _kill_process_group(proc)
    return [outputs[rank] for rank in range(world_size)]
