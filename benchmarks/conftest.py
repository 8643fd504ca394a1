"""Measurement helpers shared by the benchmarks: best-of-N wall time and peak extra memory."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
from megatron_rl_testing import export_support_path

export_support_path()  # the processes benchmarks start import the test tools too

PROC_STATUS = "/proc/self/status"

def _synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _rss_kib(field: str) -> int:
    with open(PROC_STATUS) as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} missing from {PROC_STATUS}")


class Measure:
    """Times and memory of a callable; `setup` (untimed) returns the call's argument tuple."""

    def best_seconds(
        self, fn: Callable, rounds: int = 3, setup: Callable[[], tuple] | None = None, device: str = "cpu"
    ) -> float:
        times = []
        for _ in range(rounds):
            args = setup() if setup else ()
            _synchronize(device)
            start = time.perf_counter()
            fn(*args)
            _synchronize(device)
            times.append(time.perf_counter() - start)
        return min(times)

    def peak_extra_bytes(
        self, fn: Callable, setup: Callable[[], tuple] | None = None, device: str = "cpu"
    ) -> int | None:
        """Peak memory during fn above what was held before it (CPU: resident set; CUDA: allocator).

        CPU peaks come from VmHWM, reset through /proc/self/clear_refs; None where that is unavailable.
        """
        args = setup() if setup else ()
        if device == "cuda":
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            fn(*args)
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated() - before
        try:
            with open("/proc/self/clear_refs", "w") as clear:
                clear.write("5")  # resets VmHWM to the current resident set
        except OSError:
            return None
        before = _rss_kib("VmRSS")
        result: Any = fn(*args)
        del result
        return (_rss_kib("VmHWM") - before) * 1024


@pytest.fixture(scope="session")
def measure() -> Measure:
    return Measure()
