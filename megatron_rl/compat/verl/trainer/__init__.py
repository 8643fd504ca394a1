"""verl.trainer on megatron-rl (only ``ppo.core_algos`` is mirrored)."""
