"""Entry point of supervised fine-tuning: `python -m megatron_rl.sft [+experiment=NAME] [key=value ...] [--dry-run]`.

The same config as `python -m megatron_rl.train` (configs/ppo_trainer.yaml): ``actor_rollout_ref.model.path``,
the actor's layout, optimizer and micro-batching, ``data.train_files`` / ``val_files`` of conversations (data/sft.py)
and ``trainer.*``; under torchrun (`trainer.launcher=torchrun`) or in one process. The checks run before anything
starts (trainer/preflight.py ``check_sft_start``, then every row); `--dry-run` stops after them and prints the sizes.
The run ends with ``<trainer.default_local_dir>/hf_final``, an HF checkpoint the RL trainer takes. docs/sft.md.
"""
from __future__ import annotations

from typing import Any, Callable

from megatron_rl import train
from megatron_rl.config import PPOTrainerConfig


def run(cfg: PPOTrainerConfig, dry_run: bool = False):
    """Check, then train (or, for a dry run, check the rows too and print the sizes). The RunResult of a run."""
    # torch, transformers and the trainer: imported once Hydra composed a config (a bad override fails fast)
    from megatron_rl.trainer.preflight import check_sft_start
    from megatron_rl.trainer.sft import SFT

    return run_post_training(cfg, dry_run, check_sft_start, SFT, "conversations")


def run_post_training(cfg: PPOTrainerConfig, dry_run: bool, check: Callable[[PPOTrainerConfig], Any], kind: Any,
                      items: str):
    """A post-training run's start (SFT here, DPO in megatron_rl/dpo.py): ``check`` (its preflight), then the dry
    run's row check and sizes, or the run under the directory's lock. ``kind``: trainer/sft.py ``PostTraining``;
    ``items``: what a training row is called in the dry run's count."""
    from megatron_rl.trainer.sft import run_post_training as train_run  # the trainer: as in run()

    sizes = check(cfg)
    if dry_run:
        from megatron_rl.data import load_tokenizer  # transformers, as above

        tokenizer = load_tokenizer(cfg.data.tokenizer or cfg.actor_rollout_ref.model.path, cfg.data.trust_remote_code)
        rows = len(kind.dataset(cfg, tokenizer, "train_files"))
        if train.is_rank0():
            print(f"{rows} training {items}\n{sizes.summary()}", flush=True)
        return None
    if not train.is_rank0():  # rank 0 holds the run lock for every rank
        return train_run(cfg, sizes, kind)
    from megatron_rl.trainer.run_lock import holding  # as the trainer above

    with holding(cfg.trainer.default_local_dir):
        result = train_run(cfg, sizes, kind)
    if result.stopped:
        print(f"stopped by {result.stopped} after step {result.last_step}: resumable; run the same command again",
              flush=True)
    else:
        print(f"metrics: {result.metrics_path}\nfinal HF checkpoint: {result.hf_dir}", flush=True)
    return result


if __name__ == "__main__":
    train.main(run)
