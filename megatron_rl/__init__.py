"""megatron-rl: RL post-training of LLMs on Megatron-Core (PPO, GRPO, RLOO, ReMax, REINFORCE++)."""
__version__ = "0.1.0"
