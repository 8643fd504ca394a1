"""Entry point of preference training (DPO, IPO, SimPO): `python -m megatron_rl.dpo [+experiment=NAME] [key=value ...]
[--dry-run]`.

The SFT entry's config (megatron_rl/sft.py: ``actor_rollout_ref.model.path``, the actor's layout, optimizer and
micro-batching, ``data.*``, ``trainer.*``) with the ``dpo:`` section (beta, loss_type, reference; docs/dpo.md);
``data.train_files`` / ``val_files`` hold preference rows (data/preference.py). The checks run before anything starts
(trainer/preflight.py ``check_dpo_start``, then every row); `--dry-run` stops after them and prints the sizes. The run
ends with ``<trainer.default_local_dir>/hf_final``.
"""
from __future__ import annotations

from megatron_rl import train
from megatron_rl.config import PPOTrainerConfig
from megatron_rl.sft import run_post_training


def run(cfg: PPOTrainerConfig, dry_run: bool = False):
    """Check, then train (or, for a dry run, check the rows too and print the sizes). The RunResult of a run."""
    # torch, transformers and the trainer: imported once Hydra composed a config (a bad override fails fast)
    from megatron_rl.trainer.dpo import DPO
    from megatron_rl.trainer.preflight import check_dpo_start

    return run_post_training(cfg, dry_run, check_dpo_start, DPO, "pairs")


if __name__ == "__main__":
    train.main(run)
