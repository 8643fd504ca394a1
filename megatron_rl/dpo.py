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


def run(cfg: PPOTrainerConfig, dry_run: bool = False):
    """Check, then train (or, for a dry run, check the rows too and print the sizes). The RunResult of a run."""
    # torch, transformers and the trainer: imported once Hydra composed a config (a bad override fails fast)
    from megatron_rl.trainer.dpo import preference_dataset, run_dpo_training
    from megatron_rl.trainer.preflight import check_dpo_start

    sizes = check_dpo_start(cfg)
    if dry_run:
        from megatron_rl.data import load_tokenizer  # transformers, as above

        tokenizer = load_tokenizer(cfg.data.tokenizer or cfg.actor_rollout_ref.model.path, cfg.data.trust_remote_code)
        pairs = len(preference_dataset(cfg, tokenizer, "train_files"))
        if train.is_rank0():
            print(f"{pairs} training pairs\n{sizes.summary()}", flush=True)
        return None
    if not train.is_rank0():  # rank 0 holds the run lock for every rank
        return run_dpo_training(cfg, sizes)
    from megatron_rl.trainer.run_lock import holding  # as the trainer above

    with holding(cfg.trainer.default_local_dir):
        result = run_dpo_training(cfg, sizes)
    if result.stopped:
        print(f"stopped by {result.stopped} after step {result.last_step}: resumable; run the same command again",
              flush=True)
    else:
        print(f"metrics: {result.metrics_path}\nfinal HF checkpoint: {result.hf_dir}", flush=True)
    return result


if __name__ == "__main__":
    train.main(run)
