"""`make demo`: a tiny GRPO run on CPU whose validation exact-match visibly rises.

It writes a synthetic digit-copy task (verl-format parquet, scored by the registered `synthetic/copy`
scorer), trains a tiny tokenizer on its text, builds a random 2-layer Qwen2-architecture model sized to
that tokenizer, and runs `python -m megatron_rl.train +experiment=grpo_tiny_cpu` on them in the preset's
layout, the one a model this small should use: one rank (TP=1) holding the Megatron actor and a colocated HF
rollout engine, in this process (no Ray: controller/in_driver.py). Everything is made locally: no downloads.

`--vision` runs the vision-language demo instead: the `shapes` task (count the squares in a rendered picture,
verl's geo3k row format with the image in the row) on a random tiny Qwen2.5-VL (vision tower, mRoPE language
model, its tokenizer and processor; megatron_rl/data/vision_checkpoint.py), the same preset otherwise.

    python -m megatron_rl.demo [--vision] [--out DIR] [--seed S] [key=value overrides ...]
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from megatron_rl.config import load_config
from megatron_rl.data import build_tiny_tokenizer, load_tokenizer
from megatron_rl.data.tasks import task_texts, write_task
from megatron_rl.train import run
from megatron_rl.trainer.tracking import plot_curves, read_metrics

# Copy one digit, then stop: the longest copy a random 2-layer model learned by RL alone within the time
# budget in our runs (2 digits: exact match still ~0.03 after 250 steps; 3-5 digits: never stopped).
DEMO_TASK = "copy1"
DATA_SOURCE = "synthetic/copy"
# Count 1-4 squares, one per quarter of the picture (one image token each): the answer depends on the picture only
# (chance 0.25 once the format is learned).
VISION_TASK = "shapes"
VISION_DATA_SOURCE = "synthetic/shapes"
# What "learned the task" means for the demo: greedy exact match on the validation prompts at the end.
REQUIRED_EXACT_MATCH = 0.5
SCORE_KEY = "critic/score/mean"


def val_keys(data_source: str) -> tuple[str, str]:
    """(validation exact-match key, validation response-length key) of ``data_source``."""
    return f"val-core/{data_source}/acc/mean@1", f"val-aux/{data_source}/response_length/mean@1"


VAL_ACC_KEY, VAL_LENGTH_KEY = val_keys(DATA_SOURCE)
# The model's (query, key/value) attention heads with rollout.name=vllm: head size 32 instead of 16.
VLLM_HEADS = (2, 1)
# The demo's schedule on top of the preset (whose layout it keeps: one rank, TP=1, shared prompts).
DEMO_OVERRIDES = (
    # A small entropy bonus keeps the stop tokens alive while the digit is learned: without it the policy can
    # settle on never stopping (partial credit for a right digit among 4) before it samples "digit, stop"
    # often enough; seed 0 did so on an AVX-512 machine (0.000 exact match), 5 of 5 seeds learn with it.
    "actor_rollout_ref.actor.entropy_coeff=0.01",
    "data.max_response_length=4",  # the answer is 1 digit + eos: 2 spare tokens show whether it stops
    "trainer.total_training_steps=150",  # the preset's constant lr 5e-3; exact match jumped at steps 60-90
    "trainer.val_before_train=true",  # the step-0 point of the exact-match curve
    "trainer.test_freq=10",
)
# The vision demo's on top of DEMO_OVERRIDES: padded micro-batches (shared prompts do not carry images), room for
# the prompt's image tokens and question. The random vision tower stays frozen (verl's key); the language model learns
# at lr 1e-3 with a stronger entropy bonus and 16 samples per picture: at the preset's lr 5e-3 the policy settled on
# one answer within 60 steps (0.25-0.56); with 8 samples, seeds 1 and 2 settled too (0.22-0.27 after 300 steps);
# with 16, seeds 1 and 2 reached 1.00 by step 60-70 (docs/quickstart.md, "The vision demo").
VISION_OVERRIDES = (
    "actor_rollout_ref.actor.megatron.share_prompts=false",
    "data.max_prompt_length=64",
    "actor_rollout_ref.actor.freeze_vision_tower=true",
    "actor_rollout_ref.actor.optim.lr=1e-3",
    "actor_rollout_ref.actor.entropy_coeff=0.02",
    "actor_rollout_ref.rollout.n=16",
    "trainer.total_training_steps=120",
)


def prepare_assets(out: Path, seed: int = 0, *, task: str = "copy", n_train: int = 4096, n_val: int = 64,
                   tokenizer_kwargs: dict | None = None, max_positions: int = 64,
                   attention_heads: tuple[int, int] = (4, 2)) -> tuple[Path, Path, Path]:
    """Task data, tokenizer and a random tiny model under `out`; returns (train, val, model_dir). The preset's
    task (copy 3-5 digits) by default, which the tests train on; the demo builds DEMO_TASK and other tests
    other tasks (e.g. tool_multiply, whose turns need longer positions) the same way. ``attention_heads``:
    (query, key/value) heads of the 64-wide model; (2, 1) gives head size 32, which vLLM's CPU attention
    runs (it refuses the default's 16)."""
    import pyarrow.parquet as pq
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    paths = write_task(task, out / "data", n_train=n_train, n_val=n_val, seed=seed)
    rows = [row for path in paths.values() for row in pq.read_table(path).to_pylist()]
    model_dir = out / "model"
    tokenizer = build_tiny_tokenizer(model_dir, task_texts(rows), **(tokenizer_kwargs or {}))
    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=attention_heads[0], num_key_value_heads=attention_heads[1],
        max_position_embeddings=max_positions, tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config).save_pretrained(model_dir)
    return paths["train"], paths["val"], model_dir


def stop_token_ids(model_dir: Path) -> list[int]:
    """The tokens other than eos that decode to nothing the scorer reads: special tokens (the reward decodes
    without them, verl's rule) and bare whitespace (the scorer strips it). A response could pad itself with
    them for free and never stop; ending the response on them (`rollout.stop_token_ids`, SGLang's key, as
    evaluation harnesses stop one-line answers at a newline) leaves stopping as the only way to be short."""
    tokenizer = load_tokenizer(model_dir)
    return [i for i in range(len(tokenizer)) if i != tokenizer.eos_token_id
            and not tokenizer.decode([i], skip_special_tokens=True).strip()]


@dataclass(frozen=True)
class LearningSummary:
    """First and last validation points, and the mean training score of the first and last 5 steps."""
    first_exact_match: float
    last_exact_match: float
    first_length: float
    last_length: float
    first_score: float
    last_score: float

    @property
    def learned(self) -> bool:
        return self.last_exact_match >= REQUIRED_EXACT_MATCH

    def describe(self) -> str:
        return (f"validation exact match {self.first_exact_match:.3f} -> {self.last_exact_match:.3f} "
                f"(needed {REQUIRED_EXACT_MATCH}), validation response length {self.first_length:.2f} -> "
                f"{self.last_length:.2f} tokens (eos included), mean {SCORE_KEY} of the first/last 5 steps "
                f"{self.first_score:.3f} -> {self.last_score:.3f}: "
                + ("learned" if self.learned else "did NOT learn enough"))


def learning_summary(metrics_path: Path, data_source: str = DATA_SOURCE) -> LearningSummary:
    """The demo's verdict from its metrics.jsonl (validation of ``data_source`` must have run at least twice)."""
    records = read_metrics(metrics_path)
    acc, length = val_keys(data_source)
    val = [r for r in records if acc in r and length in r]
    scores = [r[SCORE_KEY] for r in records if SCORE_KEY in r]
    if len(val) < 2 or len(scores) < 10:
        raise RuntimeError(f"{metrics_path} has {len(val)} validations with {acc} and {len(scores)} steps "
                           f"with {SCORE_KEY}; the demo needs at least 2 and 10 (trainer.test_freq > 0)")
    return LearningSummary(val[0][acc], val[-1][acc], val[0][length], val[-1][length],
                           float(np.mean(scores[:5])), float(np.mean(scores[-5:])))


def prepare_vision_assets(out: Path, seed: int = 0, *, n_train: int = 4096, n_val: int = 64) -> tuple[Path, Path, Path]:
    """The shapes task and a random tiny Qwen2.5-VL with its tokenizer and processor under `out`; returns
    (train, val, model_dir)."""
    import pyarrow.parquet as pq  # as prepare_assets: the demo's start-up imports only what its task needs

    from megatron_rl.data.vision_checkpoint import build_tiny_vl_checkpoint  # transformers' VL model: vision only

    paths = write_task(VISION_TASK, out / "data", n_train=n_train, n_val=n_val, seed=seed)
    rows = [row for path in paths.values() for row in pq.read_table(path).to_pylist()]
    # head size 32 (2 query heads, 1 KV head): the one vLLM's CPU attention runs (docs/rollout.md, "vLLM")
    model_dir = build_tiny_vl_checkpoint(out / "model", task_texts(rows), seed=seed, attention_heads=VLLM_HEADS)
    return paths["train"], paths["val"], model_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megatron_rl.demo", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("outputs/demo"), help="where data, model and run go")
    parser.add_argument("--seed", type=int, default=0, help="seed of the data, the initial model and the run")
    parser.add_argument("--vision", action="store_true",
                        help=f"the vision-language demo: the {VISION_TASK} task on a tiny Qwen2.5-VL")
    parser.add_argument("overrides", nargs="*", help="extra Hydra overrides, e.g. trainer.total_training_steps=80")
    args = parser.parse_args(argv)

    data_source, extra = (VISION_DATA_SOURCE, VISION_OVERRIDES) if args.vision else (DATA_SOURCE, ())
    if args.vision:
        print(f"preparing the {VISION_TASK} task and a random tiny Qwen2.5-VL under {args.out}/assets ...")
        train, val, model_dir = prepare_vision_assets(args.out / "assets", seed=args.seed)
    else:
        print(f"preparing the {DEMO_TASK} task, a tiny tokenizer and a random Qwen2 model under {args.out}/assets ...")
        # vLLM's CPU attention runs head size 32, not the default model's 16 (docs/rollout.md, "vLLM")
        heads = VLLM_HEADS if "actor_rollout_ref.rollout.name=vllm" in args.overrides else (4, 2)
        train, val, model_dir = prepare_assets(args.out / "assets", seed=args.seed, task=DEMO_TASK,
                                               attention_heads=heads)
    cfg = load_config(overrides=[
        "+experiment=grpo_tiny_cpu",
        f"data.train_files=[{train}]",
        f"data.val_files=[{val}]",
        f"actor_rollout_ref.model.path={model_dir}",
        f"actor_rollout_ref.rollout.stop_token_ids={stop_token_ids(model_dir)}",
        f"trainer.default_local_dir={args.out / 'run'}",
        "trainer.resume_mode=disable",
        "trainer.overwrite=true",  # the demo always starts over in its own directory
        f"data.seed={args.seed}",
        f"actor_rollout_ref.rollout.seed={args.seed}",
        *DEMO_OVERRIDES,
        *extra,
        *args.overrides,
    ])
    result = run(cfg)
    # the runner's curves.png shows score and length; the demo's also shows what it is judged by
    acc, length = val_keys(data_source)
    plot_curves(result.metrics_path, result.output_dir / "curves.png", keys=(SCORE_KEY, acc, "response_length/mean",
                                                                           length))
    summary = learning_summary(result.metrics_path, data_source)
    print("\n" + summary.describe())
    return 0 if summary.learned else 1


if __name__ == "__main__":
    sys.exit(main())
