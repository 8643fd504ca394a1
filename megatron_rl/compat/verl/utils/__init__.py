"""verl.utils on megatron-rl (only ``reward_score`` is mirrored)."""
