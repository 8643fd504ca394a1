"""The demo's task, tokenizer and tiny model, made once for all end-to-end tests."""
from __future__ import annotations

from pathlib import Path

import pytest

from megatron_rl.demo import prepare_assets


@pytest.fixture(scope="session")
def tiny_assets(tmp_path_factory) -> dict[str, Path]:
    train, val, model = prepare_assets(tmp_path_factory.mktemp("assets"))
    return {"train": train, "val": val, "model": model}
