"""CLI: ``python -m megatron_rl.data.tasks <task> --out DIR --train N --val M --seed S [--tokenizer]
[--vl-checkpoint]``."""

from __future__ import annotations

import argparse

import pyarrow.parquet as pq

from megatron_rl.data.tasks import TASKS, VISION_TASKS, task_texts, write_task
from megatron_rl.data.tokenizer import build_tiny_tokenizer


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m megatron_rl.data.tasks", description=__doc__)
    parser.add_argument("task", choices=sorted(TASKS))
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--train", type=int, default=4096, help="number of training rows")
    parser.add_argument("--val", type=int, default=256, help="number of validation rows")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--tokenizer",
        action="store_true",
        help="also train a tiny tokenizer on the generated texts and save it to OUT/tokenizer (text tasks)",
    )
    parser.add_argument(
        "--vl-checkpoint",
        action="store_true",
        help="also build a random tiny vision-language model (tokenizer, processor, weights) trained on the "
        "generated texts in OUT/model (vision tasks: " + ", ".join(sorted(VISION_TASKS)) + ")",
    )
    parser.add_argument("--vocab-size", type=int, default=128, help="target vocabulary size of the tokenizer")
    args = parser.parse_args(argv)
    if args.tokenizer and args.task in VISION_TASKS:
        parser.error(f"{args.task} has images: a text tokenizer cannot encode them; use --vl-checkpoint, which "
                     f"writes a tokenizer with the vision tokens together with its processor and model")

    paths = write_task(args.task, args.out, args.train, args.val, args.seed)
    for split, path in paths.items():
        print(f"wrote {path} ({pq.read_metadata(path).num_rows} {split} rows)")
    if args.tokenizer or args.vl_checkpoint:
        rows = [row for path in paths.values() for row in pq.read_table(path).to_pylist()]
    if args.tokenizer:
        tokenizer = build_tiny_tokenizer(
            f"{args.out}/tokenizer", task_texts(rows), vocab_size=args.vocab_size
        )
        print(f"wrote {args.out}/tokenizer ({len(tokenizer)} tokens)")
    if args.vl_checkpoint:
        from megatron_rl.data.vision_checkpoint import build_tiny_vl_checkpoint  # transformers' VL model: only here

        model_dir = build_tiny_vl_checkpoint(f"{args.out}/model", task_texts(rows), seed=args.seed,
                                             vocab_size=args.vocab_size)
        print(f"wrote {model_dir} (a random tiny Qwen2.5-VL model with its tokenizer and processor)")


if __name__ == "__main__":
    main()
