"""Dry-run planner: GPUs, batch arithmetic and memory per GPU of a config, before anything starts.

``python -m megatron_rl.plan +experiment=grpo_70b`` (console script ``megatron-rl-plan``) and
``python -m megatron_rl.train --dry-run`` print it; docs/launching.md explains the formulas.

The planner imports Megatron-Core (it plans with Megatron's own TransformerConfig); ``plan.validate``, which every
start runs first, does not. Names are exported at first use (PEP 562), so a config that ``validate`` refuses is
refused without importing Megatron-Core (or TorchDynamo with it).
"""
from importlib import import_module
from typing import Any

_EXPORTS = {"main": "cli", "Plan": "report", "PlanError": "report", "build_plan": "planner",
            "check_launch": "planner", "print_plan": "planner"}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(f"{__name__}.{_EXPORTS[name]}"), name)
