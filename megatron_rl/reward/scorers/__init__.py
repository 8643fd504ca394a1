"""Built-in scorers; importing this package registers them (see megatron_rl.reward.registry)."""

from megatron_rl.reward.scorers import digits, gsm8k, math, shapes, tool_multiply, verl_sources

__all__ = ["digits", "gsm8k", "math", "shapes", "tool_multiply", "verl_sources"]
