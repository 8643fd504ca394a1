"""Reward scoring overlapped with generation (``reward.overlap.enable``).

A step's responses are generated in ``reward.overlap.num_chunks`` engine calls, each of whole prompt groups
(the n responses of a prompt stay together). Each finished chunk is handed to one scoring thread, which runs
the reward function on it (rule scorers in their process pool, the RM worker group on its own pool, the judge)
while the driver generates the next chunk; the reward stage then waits only for what is left. The scored
chunks are put back together in sample order, as one reward call over the whole batch would return them.

    overlap = OverlappedScoring(reward_fn, num_chunks=4)
    pending = overlap.start(rows, prompts, generate, group_size=n)   # returns once the last chunk is generated
    batch = pending.wait()   # rows | responses | scores; then pending.metrics, pending.scoring_s

Samples: a chunk is an engine call with ``meta_info["seed"]`` moved on by the chunk's first row, so an engine
that seeds each row with ``seed + row`` (SGLang's ``sampling_seed``) samples exactly what one call would. The
HF engine draws every row of a call from one generator: its sampled responses differ from a one-call rollout
(as with another rollout DP size), greedy ones do not.
"""

from __future__ import annotations

import concurrent.futures
import numbers
import time
from collections.abc import Callable, Sequence

import numpy as np

from megatron_rl.protocol import DataProto

__all__ = ["OverlappedScoring", "PendingScores", "chunk_bounds", "merge_scores"]

RewardFn = Callable[[DataProto], DataProto]


def chunk_bounds(num_groups: int, num_chunks: int, group_size: int) -> list[tuple[int, int]]:
    """Row ranges [start, end) of at most ``num_chunks`` near-equal chunks of whole groups of ``group_size`` rows."""
    if not (isinstance(num_chunks, int) and num_chunks >= 1):
        raise ValueError(f"reward.overlap.num_chunks must be an integer >= 1, got {num_chunks!r}")
    edges = np.linspace(0, num_groups, min(num_chunks, max(num_groups, 1)) + 1).round().astype(int)
    return [(int(a) * group_size, int(b) * group_size) for a, b in zip(edges[:-1], edges[1:]) if b > a]


class PendingScores:
    """The chunks of one rollout, generated, and their scoring (some still running)."""

    def __init__(self, joined: list[DataProto], futures: list[concurrent.futures.Future]) -> None:
        self._joined, self._futures = joined, futures
        self.metrics: dict[str, float] = {}
        self.scoring_s = 0.0  # the scoring thread's time on these chunks (hidden behind generation or not)

    def wait(self) -> DataProto:
        """The whole batch with its scores, rows in sample order; a reward function's exception is raised here."""
        try:
            results = [future.result() for future in self._futures]
        except BaseException:
            _cancel(self._futures)
            raise
        scores = merge_scores([out for out, _ in results])
        self.metrics = scores.meta_info.pop("reward_metrics")
        self.scoring_s = sum(seconds for _, seconds in results)
        return DataProto.concat(self._joined).union(scores)


class OverlappedScoring:
    """Generates chunk after chunk in the caller's thread and scores finished chunks in one thread of its own
    (one at a time, in order: reward functions need not be thread-safe)."""

    def __init__(self, reward_fn: RewardFn, num_chunks: int) -> None:
        chunk_bounds(1, num_chunks, 1)  # refuses a bad num_chunks now, not at the first step
        self.reward_fn, self.num_chunks = reward_fn, num_chunks
        self._scorer = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="reward-overlap")

    def start(self, rows: DataProto, prompts: DataProto, generate: Callable[[DataProto], DataProto],
              group_size: int) -> PendingScores:
        """``rows``: the batch's rows (prompt fields, one row per response); ``prompts``: what the engine gets, row
        for row; ``group_size``: rows per prompt. Returns once every chunk is generated; scoring may still run."""
        if len(rows) == 0 or len(rows) != len(prompts) or len(rows) % group_size:
            raise ValueError(f"reward overlap: {len(rows)} rows and {len(prompts)} generation rows must be equal, "
                             f"not 0, and a multiple of the group size {group_size}")
        seed = prompts.meta_info.get("seed")
        joined: list[DataProto] = []
        futures: list[concurrent.futures.Future] = []
        try:
            for start, end in chunk_bounds(len(rows) // group_size, self.num_chunks, group_size):
                chunk = prompts[start:end]
                if seed is not None:  # row r of the batch keeps the seed seed + r of a one-call rollout
                    chunk.meta_info["seed"] = seed + start
                out = generate(chunk)
                if seed is not None:
                    out.meta_info["seed"] = seed  # the step's seed again, as every other part of the batch has it
                joined.append(rows[start:end].union(out))
                futures.append(self._scorer.submit(self._timed_score, joined[-1]))
        except BaseException:
            _cancel(futures)
            raise
        return PendingScores(joined, futures)

    def _timed_score(self, chunk: DataProto) -> tuple[DataProto, float]:
        start = time.perf_counter()
        out = self.reward_fn(chunk)
        return out, time.perf_counter() - start


def _cancel(futures: Sequence[concurrent.futures.Future]) -> None:
    """Drop the chunks not yet scored (the one being scored finishes in the scoring thread, unused)."""
    for future in futures:
        future.cancel()


def merge_scores(parts: Sequence[DataProto]) -> DataProto:
    """The reward outputs of consecutive chunks as one reward call over all their rows would give them: rows in
    chunk order; a per-sample column that a chunk lacks (an extra none of its samples returned) is None there.
    ``meta_info["reward_metrics"]``: counts (``reward/errors``, ``.../timeouts``, ...) summed; a mean
    ``reward/<name>/mean`` recomputed over the merged column ``<name>`` or ``<name>_score`` where there is one
    (its numeric values, as the rule manager takes them), else averaged over the chunks reporting it, weighted
    by their sizes."""
    if not parts:
        raise ValueError("merge_scores needs at least one chunk's reward output")
    tensor_keys = set(parts[0].batch.keys())
    for i, part in enumerate(parts):
        if set(part.batch.keys()) != tensor_keys:
            raise ValueError(f"reward overlap: chunk {i}'s reward output has tensors {sorted(part.batch.keys())}, "
                             f"chunk 0's {sorted(tensor_keys)}")
    columns = sorted({k for part in parts for k in part.non_tensor_batch})
    metrics = [part.meta_info.get("reward_metrics", {}) for part in parts]
    filled = []
    for part in parts:
        missing = {k: _nones(len(part)) for k in columns if k not in part.non_tensor_batch}
        meta = {k: v for k, v in part.meta_info.items() if k != "reward_metrics"}
        filled.append(DataProto.from_dict(dict(part.batch.items()), {**part.non_tensor_batch, **missing}, meta))
    merged = DataProto.concat(filled)
    merged.meta_info["reward_metrics"] = _merge_metrics(metrics, [len(p) for p in parts], merged.non_tensor_batch)
    return merged


def _merge_metrics(metrics: Sequence[dict[str, float]], sizes: Sequence[int],
                   columns: dict[str, np.ndarray]) -> dict[str, float]:
    merged: dict[str, float] = {}
    for key in dict.fromkeys(k for m in metrics for k in m):
        reporting = [(m[key], size) for m, size in zip(metrics, sizes, strict=True) if key in m]
        if not key.endswith("/mean"):
            merged[key] = float(sum(value for value, _ in reporting))
            continue
        name = key.removeprefix("reward/").removesuffix("/mean")
        column = columns.get(name, columns.get(f"{name}_score"))
        values = [] if column is None else [float(v) for v in column if isinstance(v, numbers.Real)]
        if values:
            merged[key] = float(np.mean(values))
        else:
            total = sum(size for _, size in reporting)
            merged[key] = float(sum(value * size for value, size in reporting) / total) if total else 0.0
    return merged


def _nones(n: int) -> np.ndarray:
    column = np.empty(n, dtype=object)
    column[:] = [None] * n
    return column
