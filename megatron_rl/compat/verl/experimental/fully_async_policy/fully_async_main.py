"""verl's fully async launch line on megatron-rl: ``python -m megatron_rl.compat.verl.experimental.
fully_async_policy.fully_async_main`` takes the arguments of ``python -m verl.experimental.fully_async_policy.
fully_async_main`` (``--config-name=fully_async_ppo_megatron_trainer``) and runs ``async_training.mode=fully_async``
with partial rollouts on rollout servers (docs/trainer.md, "Async: fully async"; the key mapping:
docs/configuration.md, "verl's async entries")."""

from __future__ import annotations

from megatron_rl.compat.verl.experimental import entry
from megatron_rl.compat.verl.keys import Translation

ENTRY = entry.FULLY_ASYNC
__all__ = ["ENTRY", "main", "translate", "translate_with_notes"]


def translate_with_notes(argv: list[str], with_verl_defaults: bool = True) -> Translation:
    return entry.translate_with_notes(ENTRY, argv, with_verl_defaults)


def translate(argv: list[str], with_verl_defaults: bool = True) -> list[str]:
    return entry.translate(ENTRY, argv, with_verl_defaults)


def main(argv: list[str] | None = None) -> None:
    entry.run(ENTRY, argv)


if __name__ == "__main__":
    main()
