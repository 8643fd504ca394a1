"""Validation: the pass over the validation data (``validate``, on the loop's ``generate``) and its metrics per
data_source: mean@n of the score and of the scorer's ``acc`` (verl's
`val-core/<source>/reward/mean@<n>`, `val-core/<source>/acc/mean@<n>`), and the mean response length in
tokens, finishing token included (`val-aux/<source>/response_length/mean@<n>`): whether a model learned to
stop shows there, not in the score."""
from __future__ import annotations

from collections import defaultdict
from typing import TYPE_CHECKING

import numpy as np

from megatron_rl.protocol import DataProto
from megatron_rl.trainer.steps import Generate, pop_for_generation

if TYPE_CHECKING:
    from megatron_rl.trainer.loop import Run


def validate(run: Run, generate: Generate) -> dict[str, float]:
    """``rollout.val_kwargs.n`` responses per validation prompt, sampled with the val_kwargs, scored."""
    vk = run.cfg.actor_rollout_ref.rollout.val_kwargs
    scored = []
    for batch in run.val_batches():
        batch.meta_info.update(validate=True, do_sample=vk.do_sample, temperature=vk.temperature,
                               top_p=vk.top_p, top_k=vk.top_k, seed=run.cfg.actor_rollout_ref.rollout.seed)
        gen = pop_for_generation(run.cfg, batch)
        out = generate(gen.repeat(vk.n, interleave=True))
        full = batch.repeat(vk.n, interleave=True).union(out)
        scores = run.reward_fn(full)
        scores.meta_info.pop("reward_metrics", None)
        scored.append(full.union(scores))
    return validation_metrics(DataProto.concat(scored), n=vk.n)


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
