"""Fixture for the data tests: a tiny tokenizer trained on the synthetic tasks' texts."""

from __future__ import annotations

import pytest

from megatron_rl.data.tasks import make_rows, task_texts
from megatron_rl.data.tokenizer import build_tiny_tokenizer


@pytest.fixture(scope="session")
def tokenizer(tmp_path_factory: pytest.TempPathFactory):
    texts = task_texts(
        make_rows("copy", 50, seed=0, split="train") + make_rows("arith", 50, seed=0, split="train")
    )
    return build_tiny_tokenizer(tmp_path_factory.mktemp("tokenizer"), texts, vocab_size=200)
