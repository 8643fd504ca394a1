"""`make demo`: a tiny GRPO run on CPU whose reward visibly rises.

It writes the synthetic "copy the digits" task (verl-format parquet), trains a tiny tokenizer on its
text, builds a random 2-layer Qwen2-architecture model sized to that tokenizer, and runs
`python -m megatron_rl.train +experiment=grpo_tiny_cpu` on them under an embedded Ray (Megatron
actor at TP=2 on two ranks, HF rollout colocated). Everything is made locally: no downloads.

    python -m megatron_rl.demo [--out DIR] [key=value overrides ...]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from megatron_rl.config import load_config
from megatron_rl.trainer.tracking import read_metrics

# What "visibly learns" means for the demo: the mean score of the last 5 steps beats the first 5 by this.
REQUIRED_RISE = 0.3
SCORE_KEY = "critic/score/mean"


def prepare_assets(out: Path, seed: int = 0, *, task: str = "copy", n_train: int = 4096, n_val: int = 64,
                   tokenizer_kwargs: dict | None = None, max_positions: int = 64) -> tuple[Path, Path, Path]:
    """Task data, tokenizer and a random tiny model under `out`; returns (train, val, model_dir). The demo's
    task by default; the tests build other tasks (e.g. tool_multiply, whose turns need longer positions) the
    same way."""
    import pyarrow.parquet as pq
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    from megatron_rl.data import build_tiny_tokenizer
    from megatron_rl.data.tasks import task_texts, write_task

    paths = write_task(task, out / "data", n_train=n_train, n_val=n_val, seed=seed)
    rows = [row for path in paths.values() for row in pq.read_table(path).to_pylist()]
    model_dir = out / "model"
    tokenizer = build_tiny_tokenizer(model_dir, task_texts(rows), **(tokenizer_kwargs or {}))
    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions, tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config).save_pretrained(model_dir)
    return paths["train"], paths["val"], model_dir


def learning_summary(metrics_path: Path) -> tuple[float, float]:
    """Mean score of the first 5 and the last 5 training steps."""
    scores = [r[SCORE_KEY] for r in read_metrics(metrics_path) if SCORE_KEY in r]
    if len(scores) < 10:
        raise RuntimeError(f"{metrics_path} has {len(scores)} steps with {SCORE_KEY}; the demo needs at least 10")
    return float(np.mean(scores[:5])), float(np.mean(scores[-5:]))


def main(argv: list[str] | None = None) -> int:
    from megatron_rl.train import run

    parser = argparse.ArgumentParser(prog="python -m megatron_rl.demo", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("outputs/demo"), help="where data, model and run go")
    parser.add_argument("overrides", nargs="*", help="extra Hydra overrides, e.g. trainer.total_training_steps=80")
    args = parser.parse_args(argv)

    print(f"preparing the copy task, a tiny tokenizer and a random Qwen2 model under {args.out}/assets ...")
    train, val, model_dir = prepare_assets(args.out / "assets")
    cfg = load_config(overrides=[
        "+experiment=grpo_tiny_cpu",
        f"data.train_files=[{train}]",
        f"data.val_files=[{val}]",
        f"actor_rollout_ref.model.path={model_dir}",
        f"trainer.default_local_dir={args.out / 'run'}",
        "trainer.resume_mode=disable",
        "trainer.overwrite=true",  # the demo always starts over in its own directory
        *args.overrides,
    ])
    result = run(cfg)
    first, last = learning_summary(result.metrics_path)
    verdict = "learned" if last - first >= REQUIRED_RISE else "did NOT learn enough"
    print(f"\nmean {SCORE_KEY}: first 5 steps {first:.3f} -> last 5 steps {last:.3f} "
          f"(rise {last - first:+.3f}, needed {REQUIRED_RISE}): {verdict}")
    return 0 if last - first >= REQUIRED_RISE else 1


if __name__ == "__main__":
    sys.exit(main())
