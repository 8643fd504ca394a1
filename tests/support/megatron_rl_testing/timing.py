"""Wall time of a callable, best of N: for benchmarks that time inside spawned ranks, where pytest's
fixtures (benchmarks/conftest.py's ``measure``) do not reach."""

from __future__ import annotations

import time
from collections.abc import Callable


def best_seconds(rounds: int, fn: Callable[[], object]) -> float:
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best
