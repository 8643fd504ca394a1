"""Entry point: `python -m megatron_rl.train [+experiment=NAME] [key=value ...] [--dry-run]`.

Hydra composes configs/ppo_trainer.yaml with the overrides; the config is validated (and the derived
sizes printed) before Ray, torchrun ranks or any worker start. `--dry-run` prints the plan — sizes and
per-GPU memory estimate — and exits without starting anything.
"""
from __future__ import annotations

import logging
import sys

import hydra
from omegaconf import DictConfig

from megatron_rl.config import CONFIG_DIR, ConfigError, register_configs, validate

logger = logging.getLogger("megatron_rl.train")
DRY_RUN_FLAG = "--dry-run"


def run(cfg: DictConfig, dry_run: bool = False):
    """Validate, then plan (dry run) or train. Returns the RunResult of a training run."""
    sizes = validate(cfg)
    if dry_run:
        from megatron_rl.plan import print_plan

        print_plan(cfg)
        return None
    print(sizes.summary(), flush=True)
    from megatron_rl.trainer.runner import run_training

    result = run_training(cfg, sizes)
    print(f"metrics: {result.metrics_path}\ntensorboard: {result.tensorboard_dir}\n"
          f"curves: {result.plot_path}\nfinal HF checkpoint: {result.hf_dir}", flush=True)
    return result


def main() -> None:
    dry_run = DRY_RUN_FLAG in sys.argv
    if dry_run:
        sys.argv.remove(DRY_RUN_FLAG)
    register_configs()

    @hydra.main(config_path=str(CONFIG_DIR), config_name="ppo_trainer", version_base="1.3")
    def _main(cfg: DictConfig) -> None:
        try:
            run(cfg, dry_run=dry_run)
        except ConfigError as err:
            # A bad config is the user's to fix: one clear line, no traceback, non-zero exit.
            print(f"config error: {err}", file=sys.stderr)
            sys.exit(2)

    _main()


if __name__ == "__main__":
    main()
