"""Helpers of the end-to-end tests: the tiny config, the multi-turn tool_multiply setup, metric comparison, running a
module."""
from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

from megatron_rl.config import load_config
from megatron_rl.demo import prepare_assets
from megatron_rl.trainer.tracking import read_metrics

REPO = Path(__file__).resolve().parents[2]
# Wall-clock and throughput numbers differ between runs by nature; everything else must not.
NONDETERMINISTIC_PREFIXES = ("timing_s/", "perf/", "weight_sync/seconds", "weight_sync/GBps")
# The tiny preset's layout before issue 39 (it now defaults to one rank in the driver's process): two Ray ranks,
# Megatron TP=2, no shared prompts. The end-to-end tests exercise this layout; a test's own overrides win.
TWO_RANKS = ("trainer.n_gpus_per_node=2", "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
             "actor_rollout_ref.actor.megatron.share_prompts=false")


def tiny_overrides(assets: dict[str, Path], out: Path, *extra: str) -> list[str]:
    """The demo preset on the shared assets, shortened for tests, in the two-rank layout (TWO_RANKS)."""
    return [
        "+experiment=grpo_tiny_cpu",
        *TWO_RANKS,
        f"data.train_files=[{assets['train']}]",
        f"data.val_files=[{assets['val']}]",
        f"actor_rollout_ref.model.path={assets['model']}",
        f"trainer.default_local_dir={out}",
        "data.train_batch_size=8",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16",
        "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.rollout.weight_sync.verify_freq=1",
        "trainer.total_training_steps=2",
        "trainer.test_freq=-1",
        "trainer.logger=[jsonl]",
        "trainer.save_hf_at_end=false",
        *extra,
    ]


# The multi-turn runs' stop tokens: 12 of the tool_multiply tokenizer's 200, so random weights end a turn after ~15
# tokens and samples span several turns.
TOOL_STOPS = list(range(40, 52))


def tool_multiply_assets(root: Path, n_train: int, **model_kwargs) -> dict[str, Path]:
    """The tool_multiply task (the calculator tool) under ``root``: 8 val prompts, a 200-token tokenizer, a random
    tiny model with 512 positions (the turns need them); ``model_kwargs`` go to ``prepare_assets`` (attention_heads)."""
    train, val, model = prepare_assets(root, task="tool_multiply", n_train=n_train, n_val=8,
                                       tokenizer_kwargs={"vocab_size": 200}, max_positions=512, **model_kwargs)
    return {"train": train, "val": val, "model": model}


def multi_turn_overrides(assets: dict[str, Path], out: Path, *extra: str, steps: int, response_length: int,
                         micro_batch: int, n: int) -> list[str]:
    """The tiny preset, two ranks (TWO_RANKS), multi-turn on ``tool_multiply_assets``: 4 prompts of up to 192 tokens
    a step, TOOL_STOPS, ``steps`` steps, no validation or checkpoints, jsonl metrics; ``extra`` is the test's own."""
    return [
        "+experiment=grpo_tiny_cpu",
        *TWO_RANKS,
        f"data.train_files=[{assets['train']}]",
        f"data.val_files=[{assets['val']}]",
        f"actor_rollout_ref.model.path={assets['model']}",
        f"trainer.default_local_dir={out}",
        "data.max_prompt_length=192",
        f"data.max_response_length={response_length}",
        "data.train_batch_size=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={micro_batch}",
        f"actor_rollout_ref.rollout.n={n}",
        f"actor_rollout_ref.rollout.stop_token_ids={TOOL_STOPS}",
        "actor_rollout_ref.rollout.multi_turn.enable=true",
        *extra,
        f"trainer.total_training_steps={steps}",
        "trainer.test_freq=-1",
        "trainer.save_freq=-1",
        "trainer.logger=[jsonl]",
        "trainer.save_hf_at_end=false",
    ]


def tiny_config(assets: dict[str, Path], out: Path, *extra: str):
    return load_config(overrides=tiny_overrides(assets, out, *extra))


def train_steps(metrics_path: Path) -> dict[int, dict]:
    return {r["step"]: r for r in read_metrics(metrics_path)}


def comparable(record: dict) -> dict[str, float]:
    return {k: v for k, v in record.items() if not k.startswith(NONDETERMINISTIC_PREFIXES) and k != "step"}


def assert_finite(record: dict) -> None:
    bad = {k: v for k, v in record.items() if not (isinstance(v, (int, float)) and math.isfinite(v))}
    assert not bad, f"non-finite metrics: {bad}"


def run_python(args: list[str], timeout: float = 600, **kwargs) -> subprocess.CompletedProcess:
    """``python ARGS`` from the repository root, unbuffered, its output captured."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout, **kwargs)


def run_module(args: list[str], timeout: float = 600, **kwargs) -> subprocess.CompletedProcess:
    return run_python(["-m", *args], timeout=timeout, **kwargs)


def children_left(before: set[int]) -> list[str]:
    """This process's descendants that were not there in ``before`` (pids): what a finished in-process run left
    running (a vLLM engine core and its workers, when the run did not stop its engine). Python's multiprocessing
    resource tracker is not counted: the first ``spawn`` starts it and it lives as long as this process, by design."""
    import psutil

    left = []
    for child in psutil.Process().children(recursive=True):
        try:
            if child.pid in before or child.status() == psutil.STATUS_ZOMBIE:
                continue
            command = " ".join(child.cmdline())
        except psutil.NoSuchProcess:
            continue
        if "multiprocessing.resource_tracker" not in command:
            left.append(f"{child.pid} {child.name()}: {command[:120]}")
    return left


def children_now() -> set[int]:
    import psutil

    return {p.pid for p in psutil.Process().children(recursive=True)}
