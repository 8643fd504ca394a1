"""verl's experimental async trainers on megatron-rl: ``python -m megatron_rl.compat.verl.experimental.
one_step_off_policy.main_ppo`` and ``... .fully_async_policy.fully_async_main`` take the arguments of verl's
``verl.experimental.one_step_off_policy.main_ppo`` / ``verl.experimental.fully_async_policy.fully_async_main``
(entry.py: the translation they share with ``compat/verl/trainer/main_ppo.py``; async_keys.py: their own keys)."""
