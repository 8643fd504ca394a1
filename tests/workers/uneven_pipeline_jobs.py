"""Rank jobs of test_uneven_pipeline.py: the actor of a 3-layer model at PP=1 and at PP=2 with an uneven split."""

from __future__ import annotations

from typing import Any

from cp_jobs import _megatron, cp_batch
from workers_jobs import actor_config, make_actor, update, weights

from megatron_rl.distributed import destroy_model_parallel, init_model_parallel


def uneven_job(model_dir: str, pp: int, first: int | None = None, last: int | None = None) -> dict[str, Any]:
    """Log-probs, one update's metrics and the HF weights after it, at PP=``pp`` with ``first`` / ``last`` layers on
    the first / last stage (None: Megatron's even split); the global numbers of the layers this rank holds."""
    init_model_parallel(pp=pp)
    layout: dict[str, Any] = {"pipeline_model_parallel_size": pp}
    uneven = {key: value for key, value in (("num_layers_in_first_pipeline_stage", first),
                                            ("num_layers_in_last_pipeline_stage", last)) if value is not None}
    if uneven:
        layout["override_transformer_config"] = uneven
    data = cp_batch()
    actor = make_actor(model_dir, _megatron(actor_config(), layout))
    out: dict[str, Any] = {"log_probs": actor.compute_log_prob(data).batch["old_log_probs"]}
    out["metrics"] = update(actor, data)
    out["weights"] = weights(actor)
    out["layers"] = [layer.layer_number for layer in actor.engine.model[0].module.decoder.layers]
    destroy_model_parallel()
    return out
