"""The config sections algos is handed, and reading them by attribute whatever their shape.

verl's signatures take a config object (the actor or algorithm section); megatron-rl's trainer, verl code
and verl-shaped tests pass different shapes of it: megatron_rl.config.schema's dataclasses or a DictConfig
composed on them, verl's config classes, plain dicts. The schema types cannot be named here (config sits
above algos in docs/architecture.md), so the aliases below say which section is meant; every one is read
by attribute, with ``getattr(section, key, default)`` for keys a shape may lack.
"""

from __future__ import annotations

from types import SimpleNamespace

# actor_rollout_ref.actor: config.schema.ActorConfig or verl's ActorConfig
ActorConfigLike = object
# algorithm: config.schema.AlgorithmConfig or verl's AlgoConfig
AlgoConfigLike = object
# algorithm.rollout_correction: config.schema.RolloutCorrectionConfig or verl's RolloutCorrectionConfig
RolloutCorrectionConfigLike = object


def by_attribute(section: object) -> object:
    """A plain dict viewed by attribute (verl's signatures take any config, so callers pass dicts too);
    anything else as it is."""
    return SimpleNamespace(**section) if isinstance(section, dict) else section
