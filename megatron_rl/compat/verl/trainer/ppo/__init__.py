"""verl.trainer.ppo on megatron-rl."""
