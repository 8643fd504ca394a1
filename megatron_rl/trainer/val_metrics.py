"""Validation metrics as verl 0.9.1 reports them (its ``process_validation_metrics`` and the trainer's
``_val_metrics_update``), plus pass@k. Pure arithmetic on lists: one value per response, responses grouped
by (data_source, uid), one uid per prompt.

Per prompt and variable (``reward``, and each numeric column the reward function returned: ``score``,
``acc``, ...; ``None`` values are left out): ``mean@N`` and, with N > 1, ``std@N`` and for k in 2, 4, 8, ...,
N a bootstrap of 1000 draws of k responses (with replacement, seeded 42 for every call as verl does):
``best@k/{mean,std}``, ``worst@k/{mean,std}`` and, when every response has a ``pred``, ``maj@k/{mean,std}``
(the value of the first response carrying the most frequent ``pred`` of the draw). Each is then averaged over
the prompts of the data source. Names: ``{val-core|val-aux}/{data_source}/{var}/{metric}``; val-core are the
mean/maj/best metrics at the largest N of the core variable (``acc`` when there is one, else ``reward``).

Ours: ``val-aux/{data_source}/acc/pass@k`` for the same k, the unbiased estimator 1 - C(N-c, k) / C(N, k) of
each prompt (c of its N responses have ``acc >= 1``, i.e. full credit), averaged over the prompts.
"""
from __future__ import annotations

import functools
import math
import numbers
from collections.abc import Sequence
from typing import Any

import numpy as np

N_BOOTSTRAP = 1000
BOOTSTRAP_SEED = 42  # verl's default, never configured by its trainer
VOTE_KEY = "pred"
PASS_VAR = "acc"
CORE_PREFIXES = ("mean", "maj", "best")


def subset_sizes(n: int) -> list[int]:
    """The k of best@k / worst@k / maj@k / pass@k for N = ``n`` responses: 2, 4, 8, ... below n, then n."""
    if n <= 1:
        return []
    sizes, k = [], 2
    while k < n:
        sizes.append(k)
        k *= 2
    return sizes + [n]


@functools.lru_cache(maxsize=64)
def bootstrap_indices(n_data: int, k: int, seed: int = BOOTSTRAP_SEED, n_bootstrap: int = N_BOOTSTRAP) -> np.ndarray:
    """[n_bootstrap, k] draws with replacement; a fresh RandomState(seed) gives the stream verl's
    ``np.random.seed(seed); np.random.choice(...)`` gives, without touching the global generator. The same for
    every prompt of N responses, so made once (read-only)."""
    idx = np.random.RandomState(seed).choice(n_data, size=(n_bootstrap, k), replace=True)
    idx.flags.writeable = False
    return idx


def majority_positions(votes: Sequence[Any], idx: np.ndarray) -> np.ndarray:
    """Per draw (row of ``idx``), the position of the response whose value maj@k reports: the first response
    carrying the most frequent vote, ties going to the vote that appears first in the draw (verl's
    ``calc_maj_val``: a dict in insertion order and ``max``). Votes compare as Python dict keys do."""
    codes: dict[Any, int] = {}
    try:
        coded = np.array([codes.setdefault(v, len(codes)) for v in votes])
    except TypeError as err:
        raise TypeError(f"validation: the reward function's {VOTE_KEY!r} values must be hashable to vote on, "
                        f"got {type(votes[0]).__name__}") from err
    drawn = coded[idx]  # [B, k]
    counts = (drawn[:, :, None] == drawn[:, None, :]).sum(-1)  # how often each position's vote occurs in its draw
    # the first position holding a top count is the first appearance of the earliest top vote
    return np.argmax(counts == counts.max(axis=1, keepdims=True), axis=1)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one prompt with ``c`` correct of ``n`` responses: 1 - C(n-c, k) / C(n, k)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def _numeric(values: list[Any]) -> bool:
    return all(isinstance(v, (numbers.Real, np.bool_)) for v in values)


def prompt_metrics(values: list[Any], votes: list[Any] | None, seed: int = BOOTSTRAP_SEED) -> dict[str, float]:
    """One prompt's metrics of one variable (``values``: its responses' values, None already left out)."""
    n = len(values)
    metrics = {f"mean@{n}": float(np.mean(values))}
    if n <= 1:
        return metrics
    metrics[f"std@{n}"] = float(np.std(values))
    as_float = np.asarray(values, dtype=np.float64)
    for k in subset_sizes(n):
        idx = bootstrap_indices(n, k, seed)
        drawn = as_float[idx]
        for name, picked in (("best", drawn.max(axis=1)), ("worst", drawn.min(axis=1))):
            metrics[f"{name}@{k}/mean"], metrics[f"{name}@{k}/std"] = float(np.mean(picked)), float(np.std(picked))
        if votes is not None:
            maj = as_float[idx[np.arange(len(idx)), majority_positions(votes, idx)]]
            metrics[f"maj@{k}/mean"], metrics[f"maj@{k}/std"] = float(np.mean(maj)), float(np.std(maj))
    return metrics


def prompt_pass_at_k(acc: list[Any]) -> dict[str, float]:
    """pass@k of one prompt for k in subset_sizes(N); a response is correct when its acc is >= 1."""
    n, c = len(acc), sum(float(a) >= 1 for a in acc)
    return {f"pass@{k}": pass_at_k(n, c, k) for k in subset_sizes(n)}


def _check_lengths(data_sources: Sequence[Any], uids: Sequence[Any], infos: dict[str, Sequence[Any]]) -> None:
    rows = len(data_sources)
    if len(uids) != rows:
        raise ValueError(f"validation: {len(uids)} uids for {rows} responses (data_source rows)")
    for key, column in infos.items():
        if len(column) != rows:
            raise ValueError(f"validation: the reward column {key!r} has {len(column)} values for {rows} responses")


def per_source_metrics(data_sources: Sequence[Any], uids: Sequence[Any], infos: dict[str, Sequence[Any]],
                       seed: int = BOOTSTRAP_SEED) -> dict[str, dict[str, dict[str, float]]]:
    """{data_source: {var: {metric: mean over the source's prompts}}}, verl's process_validation_metrics."""
    _check_lengths(data_sources, uids, infos)
    groups: dict[Any, dict[Any, list[int]]] = {}
    for row, (source, uid) in enumerate(zip(data_sources, uids)):
        groups.setdefault(source, {}).setdefault(uid, []).append(row)
    out: dict[str, dict[str, dict[str, float]]] = {}
    for source, prompts in groups.items():
        collected: dict[str, dict[str, list[float]]] = {}
        for rows in prompts.values():
            votes = [infos[VOTE_KEY][r] for r in rows] if VOTE_KEY in infos else None
            for var, column in infos.items():
                values = [column[r] for r in rows if column[r] is not None]
                if not values or isinstance(values[0], str) or not _numeric(values):
                    continue  # text (pred) is voted on, not averaged; other non-numbers are skipped
                voting = votes is not None and len(votes) == len(values) and all(v is not None for v in votes)
                metrics = prompt_metrics(values, votes if voting else None, seed)
                if var == PASS_VAR:
                    metrics |= prompt_pass_at_k(values)
                for name, value in metrics.items():
                    collected.setdefault(var, {}).setdefault(name, []).append(value)
        out[str(source)] = {var: {name: float(np.mean(vals)) for name, vals in names.items()}
                            for var, names in collected.items()}
    return out


def section(var: str, core_var: str, metric: str, n_max: int) -> str:
    """verl's split: val-core holds the core variable's mean/maj/best metrics at the largest N."""
    core = var == core_var and metric.startswith(CORE_PREFIXES) and f"@{n_max}" in metric
    return "val-core" if core else "val-aux"


def validation_metric_names(by_source: dict[str, dict[str, dict[str, float]]]) -> dict[str, float]:
    """The flat ``{val-core|val-aux}/{source}/{var}/{metric}`` dict (verl's _val_metrics_update)."""
    flat: dict[str, float] = {}
    for source, by_var in by_source.items():
        core_var = "acc" if "acc" in by_var else "reward"
        for var, metrics in by_var.items():
            verl_names = [m for m in metrics if not m.startswith("pass@")]  # N from verl's names only
            n_max = max(int(m.split("@")[-1].split("/")[0]) for m in verl_names)
            for metric, value in metrics.items():
                flat[f"{section(var, core_var, metric, n_max)}/{source}/{var}/{metric}"] = value
    return flat


def compute_validation_metrics(data_sources: Sequence[Any], uids: Sequence[Any], infos: dict[str, Sequence[Any]],
                               seed: int = BOOTSTRAP_SEED) -> dict[str, float]:
    """Everything above for one validation pass: ``infos`` maps a variable to one value per response."""
    return validation_metric_names(per_source_metrics(data_sources, uids, infos, seed))
