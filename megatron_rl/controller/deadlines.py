"""Deadlines of the driver's calls into the workers, by call kind (docs/launching.md, 'Deadlines').

One ``ray_init.timeout_s`` for every call made a 70B ``init_model`` (loading 140 GB of weights on 64
ranks, building the engines) share the bound of a 10 s log-prob pass. Each kind of call has its key:

    ray_init.init_timeout_s      init_model, load_checkpoint (weights and optimizer state from disk)
    ray_init.generate_timeout_s  generate_sequences (a whole rollout batch)
    ray_init.update_timeout_s    update_actor, update_critic (every mini-batch of a step)
    ray_init.save_timeout_s      save_checkpoint, save_hf (the final HF export)
    ray_init.timeout_s           everything else (log-probs, values, weight sync, small calls)

A key left at null takes ``ray_init.timeout_s``. A call past its deadline fails with the key named.
"""

from __future__ import annotations

from typing import Any

CALL_KINDS: dict[str, tuple[str, ...]] = {
    "init_timeout_s": ("init_model", "load_checkpoint"),
    "generate_timeout_s": ("generate_sequences",),
    "update_timeout_s": ("update_actor", "update_critic"),
    "save_timeout_s": ("save_checkpoint", "save_hf"),
}


def call_deadlines(ray_init: Any) -> dict[str, tuple[float, str]]:
    """method -> (seconds, config key) for ``RayWorkerGroup(method_timeouts=...)``."""
    out: dict[str, tuple[float, str]] = {}
    for field, methods in CALL_KINDS.items():
        value = getattr(ray_init, field, None)
        key = f"ray_init.{field}" if value is not None else "ray_init.timeout_s"
        seconds = float(value if value is not None else ray_init.timeout_s)
        if seconds <= 0:
            raise ValueError(f"{key} must be > 0, got {seconds}")
        out.update({method: (seconds, key) for method in methods})
    return out
