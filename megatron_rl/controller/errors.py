"""Waiting for the ranks of a call, and turning Ray's failures into errors that name role, method and rank.

The driver never waits without a deadline, and it raises at the first rank that fails instead of
waiting for the others (which may be stuck in a collective with the dead rank). A rank that raised is
reported as the cause unless a peer died within a few seconds of it: then the death is (the others'
collectives fail because of it).
"""
from __future__ import annotations

import time
from typing import Any, Sequence

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayError, RayTaskError

__all__ = ["WorkerError", "WorkerRaisedError", "WorkerDiedError", "WorkerTimeoutError", "wait_for_results"]


class WorkerError(RuntimeError):
    """A call on a worker group failed; ``role``, ``method`` and ``rank`` say where."""

    def __init__(self, message: str, *, role: str, method: str, rank: int | None) -> None:
        super().__init__(message)
        self.role, self.method, self.rank = role, method, rank


class WorkerRaisedError(WorkerError):
    """The method raised inside the worker; the message holds the worker's traceback."""


class WorkerDiedError(WorkerError):
    """The worker process is gone (crashed, killed, exited, or its constructor raised)."""


class WorkerTimeoutError(WorkerError, TimeoutError):
    """No result within the deadline; ``pending_ranks`` lists the ranks still running."""

    def __init__(self, message: str, *, role: str, method: str, pending_ranks: list[int]) -> None:
        super().__init__(message, role=role, method=method, rank=pending_ranks[0] if pending_ranks else None)
        self.pending_ranks = pending_ranks


def _convert(err: RayError, role: str, method: str, rank: int) -> WorkerError:
    where = f"{role} rank {rank}"
    if isinstance(err, RayTaskError):
        return WorkerRaisedError(f"{where} raised in {method}():\n{err}", role=role, method=method, rank=rank)
    if isinstance(err, RayActorError):
        return WorkerDiedError(f"{where} died during {method}(): {err}", role=role, method=method, rank=rank)
    return WorkerDiedError(f"{where} failed in {method}() ({type(err).__name__}): {err}",
                           role=role, method=method, rank=rank)


def wait_for_results(
    refs: Sequence[ray.ObjectRef], ranks: Sequence[int], role: str, method: str, timeout_s: float,
    timeout_key: str = "ray_init.timeout_s",
) -> list[Any]:
    """Results of ``refs`` (one per rank in ``ranks``), in order.

    Raises the first failure as soon as it arrives, and WorkerTimeoutError naming the ranks still
    running once ``timeout_s`` has passed.
    """
    rank_of = {ref: rank for ref, rank in zip(refs, ranks)}
    results: dict[ray.ObjectRef, Any] = {}
    pending = list(refs)
    deadline = time.monotonic() + timeout_s

    def timed_out(late: list[int]) -> WorkerTimeoutError:
        return WorkerTimeoutError(
            f"{role}.{method}(): ranks {late} gave no result within {timeout_s:g} s "
            f"(a hang, or a step slower than the deadline: raise {timeout_key})",
            role=role, method=method, pending_ranks=late,
        )

    while pending:
        remaining = max(deadline - time.monotonic(), 0.0)
        ready, pending = ray.wait(pending, num_returns=1, timeout=remaining)
        if not ready:
            raise timed_out(sorted(rank_of[ref] for ref in pending))
        for ref in ready:
            try:
                # the object is ready; the deadline only bounds fetching it from another node
                results[ref] = ray.get(ref, timeout=max(remaining, 1.0))
            except GetTimeoutError:
                raise timed_out([rank_of[ref]]) from None
            except RayError as err:
                failure = _convert(err, role, method, rank_of[ref])
                if isinstance(failure, WorkerRaisedError):  # maybe a collective's error because a peer died
                    failure = _died_among(pending, rank_of, role, method) or failure
                raise failure from err
    return [results[ref] for ref in refs]


# How long a rank's exception waits for news of a peer's death. When a rank dies in a collective, the others
# raise (gloo: "Connection reset by peer") at about the moment Ray learns of the death; the death is the cause.
PEER_DEATH_GRACE_S = 5.0


def _died_among(pending: list, rank_of: dict, role: str, method: str) -> WorkerDiedError | None:
    """The death of a rank still pending, if Ray reports one within PEER_DEATH_GRACE_S, else None."""
    if not pending:
        return None
    ready, _ = ray.wait(pending, num_returns=len(pending), timeout=PEER_DEATH_GRACE_S)
    for ref in ready:
        try:
            ray.get(ref, timeout=1.0)
        except RayActorError as err:
            return _convert(err, role, method, rank_of[ref])
        except RayError:
            continue
    return None
