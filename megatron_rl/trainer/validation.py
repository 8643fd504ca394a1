"""Validation metrics: mean@n of the score per data_source (verl's `val-core/<source>/reward/mean@<n>`)."""
from __future__ import annotations

from collections import defaultdict

import numpy as np

from megatron_rl.protocol import DataProto


def validation_metrics(scored: DataProto, n: int) -> dict[str, float]:
    """`scored` holds n responses per prompt with `token_level_scores`; its rows keep data_source."""
    scores = scored.batch["token_level_scores"].sum(-1).double().numpy()
    sources = scored.non_tensor_batch.get("data_source", np.array(["unknown"] * len(scored), dtype=object))
    acc = scored.non_tensor_batch.get("acc")
    by_source: dict[str, list[int]] = defaultdict(list)
    for i, source in enumerate(sources):
        by_source[str(source)].append(i)
    metrics: dict[str, float] = {}
    for source, rows in by_source.items():
        metrics[f"val-core/{source}/reward/mean@{n}"] = float(scores[rows].mean())
        if acc is not None:
            metrics[f"val-core/{source}/acc/mean@{n}"] = float(np.mean(acc[rows].astype(np.float64)))
    return metrics
