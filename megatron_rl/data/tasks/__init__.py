"""Synthetic tasks with verifiable answers, written as verl-format parquet files.

``python -m megatron_rl.data.tasks <task> --out DIR --train N --val M --seed S`` writes
``DIR/train.parquet`` and ``DIR/val.parquet`` (and, with ``--tokenizer``, a tiny tokenizer trained on the
prompts and answers in ``DIR/tokenizer``). Each row's ``data_source`` is ``synthetic/<task>``, for which
``megatron_rl.reward`` registers a scorer. Vision tasks (``VISION_TASKS``) carry images in verl's multimodal
format; their model and tokenizer come from ``--vl-checkpoint`` (megatron_rl.data.vision_checkpoint).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from megatron_rl.data.tasks.arithmetic import make_arithmetic_rows
from megatron_rl.data.tasks.digits import DIGIT_OPS, make_digit_rows
from megatron_rl.data.tasks.shapes import make_colour_rows, make_shapes_rows
from megatron_rl.data.tasks.tool_multiply import make_tool_multiply_rows

__all__ = ["TASKS", "VISION_TASKS", "make_rows", "sft_rows", "task_texts", "write_sft_task", "write_task"]

# task name -> rows(n, rng, split)
TASKS: dict[str, Callable[[int, random.Random, str], list[dict[str, Any]]]] = {
    **{op: partial(make_digit_rows, op) for op in DIGIT_OPS},
    # copy with a fixed number of digits (data_source synthetic/copy, same scorer): every answer digit and
    # the stop sit at the same place in every row, which a random 2-layer model learns by RL in minutes
    **{f"copy{k}": partial(make_digit_rows, "copy", min_digits=k, max_digits=k) for k in (1, 2, 3)},
    "arith": make_arithmetic_rows,
    "tool_multiply": make_tool_multiply_rows,
    "shapes": make_shapes_rows,
    "shape_colour": make_colour_rows,
}
VISION_TASKS = frozenset({"shapes", "shape_colour"})  # rows with images: they need a vision-language model


def make_rows(task: str, n: int, seed: int, split: str) -> list[dict[str, Any]]:
    """``n`` rows of ``task``; train and val use separate random streams of the same seed."""
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; known: {sorted(TASKS)}")
    if n < 0:
        raise ValueError(f"number of {split} rows must be >= 0, got {n}")
    return TASKS[task](n, random.Random(f"{task}/{split}/{seed}"), split)


def task_texts(rows: list[dict[str, Any]]) -> list[str]:
    """The text a tokenizer for these rows must cover: prompts and answers."""
    # verl's <image> placeholder becomes an image part, never text the tokenizer sees
    texts = [message["content"].replace("<image>", "") for row in rows for message in row["prompt"]]
    texts += [row["extra_info"].get("answer", row["reward_model"]["ground_truth"]) for row in rows]
    return texts


def write_task(task: str, out_dir: str | Path, n_train: int, n_val: int, seed: int) -> dict[str, Path]:
    """Write ``train.parquet`` and ``val.parquet`` under ``out_dir``; returns their paths."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {}
    for split, n in (("train", n_train), ("val", n_val)):
        paths[split] = out_dir / f"{split}.parquet"
        pq.write_table(pa.Table.from_pylist(make_rows(task, n, seed, split)), paths[split])
    return paths


def sft_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows as verl's SFT conversations (``messages``: the prompt, then the answer as the assistant's turn;
    data/sft.py): what a model learns the task from by SFT alone."""
    return [{"messages": [*row["prompt"], {"role": "assistant", "content": str(
        row["extra_info"].get("answer", row["reward_model"]["ground_truth"]))}]} for row in rows]


def write_sft_task(task: str, out_dir: str | Path, n_train: int, n_val: int, seed: int) -> dict[str, Path]:
    """``write_task``'s rows as SFT conversations, in ``sft_train.parquet`` and ``sft_val.parquet``."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {}
    for split, n in (("train", n_train), ("val", n_val)):
        paths[split] = out_dir / f"sft_{split}.parquet"
        pq.write_table(pa.Table.from_pylist(sft_rows(make_rows(task, n, seed, split))), paths[split])
    return paths
