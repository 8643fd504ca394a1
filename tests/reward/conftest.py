"""Fixtures for the reward tests: a tiny tokenizer and a file of custom scorers that misbehave on demand."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from megatron_rl.data.tasks import make_rows, task_texts
from megatron_rl.data.tokenizer import build_tiny_tokenizer

# Misbehaviours are chosen by the response text, so one batch can hold good and bad samples.
CUSTOM_SCORERS = textwrap.dedent("""
    import os
    import time

    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        if solution_str == "hang":
            time.sleep(3600)
        if solution_str == "raise":
            raise RuntimeError("scorer exploded")
        if solution_str == "nan":
            return float("nan")
        if solution_str == "text":
            return "high"
        if solution_str == "die":
            os._exit(3)
        right = solution_str == ground_truth
        return {"score": float(right), "acc": right, "length": len(solution_str)}

    def batch_score(data_sources, solution_strs, ground_truths, extra_infos):
        return [0.5 if s == g else 0.0 for s, g in zip(solution_strs, ground_truths)]

    def wrong_length(data_sources, solution_strs, ground_truths, extra_infos):
        return [1.0]
""")


@pytest.fixture(scope="session")
def tokenizer(tmp_path_factory: pytest.TempPathFactory):
    texts = task_texts(make_rows("copy", 50, seed=0, split="train")) + ["hang raise nan text die"]
    return build_tiny_tokenizer(tmp_path_factory.mktemp("tokenizer"), texts, vocab_size=100)


@pytest.fixture(scope="session")
def custom_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("custom") / "my_reward.py"
    path.write_text(CUSTOM_SCORERS)
    return path
