"""`megatron-rl-plan` / `python -m megatron_rl.plan`: print the plan of a config, exit 1 when it cannot run."""
from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

from megatron_rl.config import ConfigError, load_config
from megatron_rl.config.loggers import config_problem, package_problem
from megatron_rl.plan.planner import print_plan


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="megatron-rl-plan",
        description="Resolve a megatron-rl config and print GPUs, batch arithmetic and memory per GPU; "
                    "exit 1 when the plan does not factor or does not fit. Nothing is started.",
        epilog="example: megatron-rl-plan +experiment=grpo_70b trainer.nnodes=16",
    )
    parser.add_argument("--config-name", default="ppo_trainer", help="config in configs/ (default: ppo_trainer)")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, as for python -m megatron_rl.train")
    return parser.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    try:
        cfg = load_config(args.config_name, args.overrides)
        # trainer.logger: a wrong value is refused; a package missing here may be on the launch machine: a warning
        problem = config_problem(cfg.trainer.logger)
        if problem is not None:
            raise ConfigError(problem)
        missing = package_problem(cfg.trainer.logger)
        if missing is not None:
            print(f"megatron-rl-plan: warning: {missing} (on the machine that launches the run)", file=sys.stderr)
        print_plan(cfg, title=f"plan for {args.config_name} {' '.join(args.overrides)}".rstrip())
    except ConfigError as err:
        print(f"megatron-rl-plan: rejected: {err}", file=sys.stderr)
        return 1
    return 0
