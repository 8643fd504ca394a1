"""Dry-run planner: GPUs, batch arithmetic and memory per GPU of a config, before anything starts.

``python -m megatron_rl.plan +experiment=grpo_70b`` (console script ``megatron-rl-plan``) and
``python -m megatron_rl.train --dry-run`` print it; docs/launching.md explains the formulas.
"""
from megatron_rl.plan.cli import main
from megatron_rl.plan.planner import Plan, PlanError, build_plan, check_launch, print_plan

__all__ = ["Plan", "PlanError", "build_plan", "check_launch", "main", "print_plan"]
