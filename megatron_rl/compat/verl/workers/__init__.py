"""verl.workers on megatron-rl (only ``config.actor``'s dataclasses)."""
