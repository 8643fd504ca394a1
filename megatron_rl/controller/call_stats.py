"""Where the time of a worker-group call goes: the driver's wall time against the slowest rank's own time
in the method, and (when recording is on) the bytes of DataProto arguments and results moved per call.

``RayWorkerGroup`` times every call; the difference ``wall - worker`` is Ray's dispatch, serialisation and
transfer (plus the driver's planning and collecting). Recording is off by default, as sizing a payload
means serialising it once more; ``benchmarks/test_step_breakdown.py`` turns it on.
"""
from __future__ import annotations

import pickle
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from megatron_rl.protocol import DataProto

__all__ = ["CallTotals", "payload_bytes", "recording", "record_call"]


@dataclass
class CallTotals:
    """Sums over the recorded calls of one method."""

    calls: int = 0
    wall_s: float = 0.0  # driver: submit -> combined result
    worker_s: float = 0.0  # the slowest rank's time inside the method
    sent_bytes: int = 0  # DataProto arguments, once per distinct object (Ray stores a shared one once)
    received_bytes: int = 0  # results the driver fetched

    def add(self, other: "CallTotals") -> None:
        self.calls += other.calls
        self.wall_s += other.wall_s
        self.worker_s += other.worker_s
        self.sent_bytes += other.sent_bytes
        self.received_bytes += other.received_bytes

    @property
    def overhead_s(self) -> float:
        """Dispatch, (de)serialisation, transfer, planning and collecting."""
        return self.wall_s - self.worker_s


@dataclass
class _Recorder:
    totals: dict[str, CallTotals] = field(default_factory=lambda: defaultdict(CallTotals))


_active: _Recorder | None = None


@contextmanager
def recording() -> Iterator[dict[str, CallTotals]]:
    """Record the calls made inside the block; yields {method: CallTotals}, filled as calls finish."""
    global _active
    previous, _active = _active, _Recorder()
    try:
        yield _active.totals
    finally:
        _active = previous


def is_recording() -> bool:
    return _active is not None


def payload_bytes(values: list[Any]) -> int:
    """Serialised size of the DataProto among ``values`` (each distinct object once); 0 for the rest."""
    seen: dict[int, int] = {}
    for value in values:
        if isinstance(value, DataProto) and id(value) not in seen:
            seen[id(value)] = len(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL))
    return sum(seen.values())


def record_call(method: str, wall_s: float, worker_s: float, sent_bytes: int, received_bytes: int) -> None:
    if _active is None:
        return
    _active.totals[method].add(CallTotals(1, wall_s, worker_s, sent_bytes, received_bytes))
