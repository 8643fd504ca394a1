"""Validation metrics per data_source: mean@n of the score and of the scorer's ``acc`` (verl's
`val-core/<source>/reward/mean@<n>`, `val-core/<source>/acc/mean@<n>`), and the mean response length in
tokens, finishing token included (`val-aux/<source>/response_length/mean@<n>`): whether a model learned to
stop shows there, not in the score."""
from __future__ import annotations

from collections import defaultdict

import numpy as np

from megatron_rl.protocol import DataProto


def validation_metrics(scored: DataProto, n: int) -> dict[str, float]:
    """`scored` holds n responses per prompt with `token_level_scores` (and `response_mask` for the length);
    its rows keep data_source."""
    scores = scored.batch["token_level_scores"].sum(-1).double().numpy()
    has_mask = "response_mask" in scored.batch.keys()
    lengths = scored.batch["response_mask"].sum(-1).double().numpy() if has_mask else None
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
        if lengths is not None:
            metrics[f"val-aux/{source}/response_length/mean@{n}"] = float(lengths[rows].mean())
    return metrics
