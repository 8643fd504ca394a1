"""Run scoring calls with a per-call time limit that is actually enforced.

Threads cannot be stopped, so a hanging scorer in a thread pool would hold its thread (and the step)
forever. :class:`ScoringPool` runs calls in worker processes, hands each worker one call at a time, and
kills a worker whose call runs past ``timeout_s`` (starting a fresh one in its place). A worker that
dies (segfault, ``os._exit``) fails only the call it was running.

Workers are fresh interpreters (``python -m megatron_rl.reward.pool``), not forks of the threaded
trainer process and not ``multiprocessing`` children (which re-import the caller's ``__main__``); a
scorer therefore has to be importable by module and name. This module imports nothing heavy, so a
worker starts in a fraction of a second.
"""

from __future__ import annotations

import atexit
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any

__all__ = ["Call", "InlineRunner", "InlineTimeout", "Outcome", "ScoringPool"]

Call = tuple[Callable[..., Any], Mapping[str, Any]]  # (function, keyword arguments)
_READY = b"ready"
_START_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class Outcome:
    value: Any = None
    error: str | None = None  # "ExceptionType: message" when the call failed
    timed_out: bool = False

    @property
    def ok(self) -> bool:
        return self.error is None


def _call(fn: Callable[..., Any], kwargs: Mapping[str, Any]) -> Outcome:
    try:
        return Outcome(value=fn(**kwargs))
    except (Exception, SystemExit) as e:  # a scorer's error or sys.exit must not end the worker or the step
        return Outcome(error=f"{type(e).__name__}: {e}")


def _serve(requests: Connection, replies: Connection) -> None:
    """Worker loop: receive a pickled call, run it, reply ``(value, error)``."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the driver's to handle
    replies.send_bytes(_READY)
    while True:
        try:
            payload = requests.recv_bytes()
        except (EOFError, OSError):  # the driver closed the pool
            return
        try:
            outcome = _call(*pickle.loads(payload))
        except Exception as e:  # e.g. the scorer's module does not import here
            outcome = Outcome(error=f"{type(e).__name__} while loading the scorer: {e}")
        # Plain tuples cross the pipe: this module runs as __main__ here, so its classes would not unpickle.
        try:
            replies.send((outcome.value, outcome.error))
        except Exception as e:  # the scorer returned something that cannot be pickled
            replies.send((None, f"result could not be sent back: {type(e).__name__}: {e}"))


class _Worker:
    def __init__(self) -> None:
        request_r, request_w = os.pipe()
        reply_r, reply_w = os.pipe()
        # The worker imports scorers by module name, so it gets this process's import path.
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p or os.getcwd() for p in sys.path)}
        self.process = subprocess.Popen(
            [sys.executable, "-m", "megatron_rl.reward.pool", str(request_r), str(reply_w)],
            pass_fds=(request_r, reply_w),
            env=env,
            stdin=subprocess.DEVNULL,
        )
        os.close(request_r)
        os.close(reply_w)
        self.requests = Connection(request_w, readable=False)
        self.replies = Connection(reply_r, writable=False)

    def wait_ready(self) -> None:
        """Fail loudly when a worker cannot start: that is a broken environment, not a scorer error."""
        try:
            if self.replies.poll(_START_TIMEOUT_S) and self.replies.recv_bytes() == _READY:
                return
        except (EOFError, OSError):
            pass
        self.stop()
        raise RuntimeError(
            f"a reward scoring worker (python -m megatron_rl.reward.pool) did not start within "
            f"{_START_TIMEOUT_S:g} s (exit code {self.process.returncode}); its error is printed above"
        )

    def receive(self) -> Outcome:
        value, error = self.replies.recv()
        return Outcome(value=value, error=error)

    def stop(self) -> None:
        self.process.kill()
        self.process.wait()
        self.requests.close()
        self.replies.close()


class InlineTimeout(RuntimeError):
    """An inline call ran past its time limit; it cannot be stopped, so the caller must not go on as if scored."""

    def __init__(self, call_index: int, timeout_s: float) -> None:
        super().__init__(f"scoring call {call_index} ran past {timeout_s:g} s")
        self.call_index = call_index
        self.timeout_s = timeout_s


class InlineRunner:
    """Runs calls one after another in this process (``reward.num_workers=0``: for debugging, and where starting
    processes is not wanted). Each call runs in a daemon thread that the caller waits on for ``timeout_s``: the
    caller's thread stays free to run signal handlers (SIGTERM stops a run whose scorer hangs), and a call past
    the limit raises :class:`InlineTimeout` (a thread cannot be killed, so its sample cannot score 0 and go on
    the way a worker process's can). Scorers that need the main thread (signal-based timeouts) see a thread."""

    def __init__(self, timeout_s: float) -> None:
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.timeout_s = timeout_s

    def run(self, calls: Sequence[Call]) -> list[Outcome]:
        return [self._run_one(index, fn, kwargs) for index, (fn, kwargs) in enumerate(calls)]

    def _run_one(self, index: int, fn: Callable[..., Any], kwargs: Mapping[str, Any]) -> Outcome:
        box: list[Outcome] = []
        thread = threading.Thread(target=lambda: box.append(_call(fn, kwargs)), name=f"inline-scorer-{index}",
                                  daemon=True)  # daemon: a hung one does not keep the interpreter from exiting
        thread.start()
        thread.join(self.timeout_s)
        if not box:
            raise InlineTimeout(index, self.timeout_s)
        return box[0]

    def close(self) -> None:
        pass


class ScoringPool:
    """``num_workers`` scoring processes; ``run`` returns one Outcome per call, in order."""

    def __init__(self, num_workers: int, timeout_s: float) -> None:
        if num_workers < 1:
            raise ValueError(f"ScoringPool needs num_workers >= 1, got {num_workers}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.num_workers = num_workers
        self.timeout_s = timeout_s
        self._workers: list[_Worker] = []  # started on first use
        self.workers_replaced = 0  # killed after a timeout or found dead
        _LIVE_POOLS.add(self)

    def run(self, calls: Sequence[Call]) -> list[Outcome]:
        # Pickled up front: an unpicklable scorer is a programming error and raises here, in the caller.
        payloads = [pickle.dumps((fn, dict(kwargs))) for fn, kwargs in calls]
        started = [_Worker() for _ in range(min(self.num_workers, len(calls)) - len(self._workers))]
        for worker in started:  # started together, so they boot in parallel
            worker.wait_ready()
        self._workers += started
        outcomes: list[Outcome | None] = [None] * len(calls)
        pending = deque(range(len(calls)))
        idle = list(self._workers)
        busy: dict[_Worker, tuple[int, float]] = {}  # worker -> (call index, deadline)
        while pending or busy:
            while pending and idle:
                worker, index = idle.pop(), pending.popleft()
                try:
                    worker.requests.send_bytes(payloads[index])
                except OSError:  # the worker died while idle: use a fresh one
                    worker = self._replace(worker)
                    worker.requests.send_bytes(payloads[index])
                busy[worker] = (index, time.monotonic() + self.timeout_s)
            next_deadline = min(deadline for _, deadline in busy.values())
            ready = wait([w.replies for w in busy], timeout=max(0.0, next_deadline - time.monotonic()))
            for worker in [w for w in busy if w.replies in ready]:
                index, _ = busy.pop(worker)
                try:
                    outcomes[index] = worker.receive()
                    idle.append(worker)
                except (EOFError, OSError):
                    outcomes[index] = Outcome(
                        error=f"scoring worker died (exit code {worker.process.wait()})"
                    )
                    idle.append(self._replace(worker))
            now = time.monotonic()
            for worker, (index, deadline) in list(busy.items()):
                if now >= deadline:
                    del busy[worker]
                    outcomes[index] = Outcome(
                        error=f"timed out after {self.timeout_s:g} s (reward.timeout_s)", timed_out=True
                    )
                    idle.append(self._replace(worker))
        return outcomes  # type: ignore[return-value]  # every slot is filled above

    def _replace(self, worker: _Worker) -> _Worker:
        worker.stop()
        fresh = _Worker()
        fresh.wait_ready()
        self._workers[self._workers.index(worker)] = fresh
        self.workers_replaced += 1
        return fresh

    def close(self) -> None:
        for worker in self._workers:
            worker.stop()
        self._workers = []

    def __enter__(self) -> ScoringPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# Idle workers exit when this process's end of their pipe closes; a worker stuck in a scorer would not,
# so pools still open at interpreter exit are closed (their workers killed) explicitly.
_LIVE_POOLS: weakref.WeakSet[ScoringPool] = weakref.WeakSet()
atexit.register(lambda: [pool.close() for pool in list(_LIVE_POOLS)])


if __name__ == "__main__":
    _serve(Connection(int(sys.argv[1]), writable=False), Connection(int(sys.argv[2]), readable=False))
