"""verl's fully async launch line on megatron-rl: ``python -m megatron_rl.compat.verl.experimental.
fully_async_policy.fully_async_main`` takes the arguments of ``python -m verl.experimental.fully_async_policy.
fully_async_main`` (``--config-name=fully_async_ppo_megatron_trainer``) and runs ``async_training.mode=fully_async``
with partial rollouts on rollout servers (docs/trainer.md, "Async: fully async"; the key mapping:
docs/configuration.md, "verl's async entries")."""

from __future__ import annotations

from megatron_rl.compat.verl.experimental import entry

ENTRY = entry.FULLY_ASYNC
translate_with_notes, translate, main = ENTRY.translate_with_notes, ENTRY.translate, ENTRY.main
__all__ = ["ENTRY", "main", "translate", "translate_with_notes"]

if __name__ == "__main__":
    main()
