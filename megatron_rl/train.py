"""Entry point: `python -m megatron_rl.train [+experiment=NAME] [key=value ...] [--dry-run]`.

Hydra composes configs/ppo_trainer.yaml with the overrides; the config is validated (and the derived
sizes printed) before Ray, torchrun ranks or any worker start. `--dry-run` prints the plan — sizes and
per-GPU memory estimate — and exits without starting anything.
"""
from __future__ import annotations

import logging
import os
import sys
import traceback
from typing import Any, Callable

import hydra
from megatron_rl.config import CONFIG_DIR, ConfigError, PPOTrainerConfig, load_config, register_configs
from megatron_rl.controller.deferred_compile import deferred_compile
from megatron_rl.plan.validate import validate  # Megatron-free: a refused config never imports Megatron-Core
from megatron_rl.trainer.signals import EXIT_CONFIG_ERROR, EXIT_FINISHED, EXIT_STOPPED_RESUMABLE

logger = logging.getLogger("megatron_rl.train")
DRY_RUN_FLAG = "--dry-run"


def is_rank0() -> bool:
    """Under torchrun every rank runs this; only rank 0 prints the summaries."""
    return os.environ.get("RANK", "0") == "0"


def _planner():
    """megatron_rl.plan.planner, imported without TorchDynamo (issue 39, start-up): it imports Megatron-Core."""
    with deferred_compile():  # Megatron-Core
        from megatron_rl.plan import planner
    return planner


def run(cfg: PPOTrainerConfig, dry_run: bool = False):
    """Validate and check the files (the same checks for a dry run and a real start), then plan (dry run) or
    train. Returns the RunResult of a training run.

    A real start holds the output directory's run lock (trainer/run_lock.py) from before preflight reads the
    directory to the end of the run; a dry run takes nothing and writes nothing there."""
    # torch and transformers: the CLI imports them only once Hydra composed a config (a bad override fails fast)
    from megatron_rl.trainer.preflight import check_start

    if dry_run:
        check_start(cfg)
        _planner().print_plan(cfg)
        return None
    validate(cfg)  # a config that cannot run is refused before the lock creates the directory
    if not is_rank0():  # under torchrun rank 0 holds the lock for every rank
        return _start(cfg)
    from megatron_rl.trainer.run_lock import holding  # as check_start above

    with holding(cfg.trainer.default_local_dir):
        return _start(cfg)


def _start(cfg: PPOTrainerConfig):
    from megatron_rl.trainer.preflight import check_start  # as in run()

    sizes = check_start(cfg)  # the same check as --dry-run's
    _planner().check_launch(cfg)  # e.g. a distributed optimizer this environment cannot give: refused with the reason
    if is_rank0():
        print(sizes.summary(), flush=True)
    from megatron_rl.trainer.runner import run_training  # as in run()

    result = run_training(cfg, sizes)
    if is_rank0():
        print(f"metrics: {result.metrics_path}\ntensorboard: {result.tensorboard_dir}\ncurves: {result.plot_path}",
              flush=True)
        if result.stopped:
            print(f"stopped by {result.stopped} after step {result.last_step}: not finished, resumable; run the "
                  f"same command again to continue from the last checkpoint in {result.output_dir} "
                  f"(exit code {EXIT_STOPPED_RESUMABLE})", flush=True)
        else:
            print(f"final HF checkpoint: {result.hf_dir}", flush=True)
    return result


def exit_code(result) -> int:
    """0 only for a finished run; EXIT_STOPPED_RESUMABLE for one stopped by a signal (docs/trainer.md)."""
    return EXIT_STOPPED_RESUMABLE if result is not None and result.stopped else EXIT_FINISHED


def _to_log_file(message: str) -> None:
    """Write to the run's train.log (Hydra's file handler) without repeating it on the console."""
    record = logger.makeRecord(logger.name, logging.ERROR, __file__, 0, message, None, None)
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler):
            handler.handle(record)


def _output_dir_of(args: list[str]) -> str | None:
    """trainer.default_local_dir as Hydra will compose it from ``args``; None when that cannot be told here (Hydra's
    own flags, a config that does not compose: Hydra reports those itself)."""
    if any(a.startswith("-") for a in args):
        return None
    try:
        cfg = load_config(overrides=[a for a in args if not a.startswith(("hydra.", "hydra/", "+hydra"))])
        return str(cfg.trainer.default_local_dir)
    except Exception:  # noqa: BLE001 - the real composition below says what is wrong
        return None


def _before_hydra(dry_run: bool) -> None:
    """Hydra writes ``.hydra/`` and ``train.log`` into the run directory (hydra.run.dir) before the run starts.
    A dry run sends them to a temporary directory (nothing of it lands in trainer.default_local_dir); a real start
    takes the directory's run lock first, so a second run is refused before it writes anything there."""
    if dry_run:
        import atexit
        import shutil
        import tempfile

        scratch = tempfile.mkdtemp(prefix="megatron_rl_dry_run_")
        atexit.register(shutil.rmtree, scratch, True)
        sys.argv += [f"hydra.run.dir={scratch}", "hydra.output_subdir=null"]
        return
    if not is_rank0():
        return
    directory = _output_dir_of(sys.argv[1:])
    if directory is None:
        return  # run() takes the lock, still before preflight reads the directory
    from megatron_rl.trainer.run_lock import acquire

    try:
        acquire(directory)  # held to the end of the process (released at exit)
    except ConfigError as err:
        print(f"config error: {err}", file=sys.stderr)
        sys.exit(EXIT_CONFIG_ERROR)


def main(start: Callable[..., Any] | None = None) -> None:
    """The CLI of ``start(cfg, dry_run=...)`` (default: this module's RL ``run``; megatron_rl/sft.py passes SFT's):
    Hydra composes the config, a config error is one line and the config-error exit code."""
    start = start or run
    dry_run = DRY_RUN_FLAG in sys.argv
    if dry_run:
        sys.argv.remove(DRY_RUN_FLAG)
    register_configs()
    _before_hydra(dry_run)

    @hydra.main(config_path=str(CONFIG_DIR), config_name="ppo_trainer", version_base="1.3")
    def _main(cfg: PPOTrainerConfig) -> None:
        try:
            result = start(cfg, dry_run=dry_run)
        except ConfigError as err:
            # A bad config is the user's to fix: one clear line, no traceback, non-zero exit.
            print(f"config error: {err}", file=sys.stderr)
            _to_log_file(f"config error: {err}")
            sys.exit(EXIT_CONFIG_ERROR)
        except Exception:
            _to_log_file("the run failed:\n" + traceback.format_exc())  # train.log holds the error
            raise
        sys.exit(exit_code(result))

    _main()


if __name__ == "__main__":
    main()
