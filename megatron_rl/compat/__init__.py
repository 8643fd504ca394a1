"""Compatibility namespaces: other frameworks' module paths backed by megatron-rl's own code.

``megatron_rl.compat.verl`` mirrors the verl modules user code imports (``verl.protocol``,
``verl.trainer.ppo.core_algos``, ``verl.utils.reward_score``), so verl-style code runs with one
import line changed, e.g. ``from megatron_rl.compat.verl.trainer.ppo import core_algos``.
Nothing here imports verl.
"""
