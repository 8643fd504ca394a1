"""verl's one-step-off launch line on megatron-rl: ``python3 -m megatron_rl.compat.verl.experimental.
one_step_off_policy.main_ppo`` takes the arguments of ``python3 -m verl.experimental.one_step_off_policy.main_ppo``
(``--config-name=one_step_off_ppo_megatron_trainer``) and runs ``async_training.mode=one_step_off`` on rollout servers
(docs/trainer.md, "Async: one step off-policy"; the key mapping: docs/configuration.md, "verl's async entries")."""

from __future__ import annotations

from megatron_rl.compat.verl.experimental import entry

ENTRY = entry.ONE_STEP_OFF
translate_with_notes, translate, main = ENTRY.translate_with_notes, ENTRY.translate, ENTRY.main
__all__ = ["ENTRY", "main", "translate", "translate_with_notes"]

if __name__ == "__main__":
    main()
