"""Fixtures of the rollout tests; the helpers live in rollout_models.py."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from rollout_models import make_engine, tiny_qwen2_config

from megatron_rl.rollout.hf_engine import HFEngine


@pytest.fixture
def engine() -> HFEngine:
    return make_engine()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    """A tiny Qwen2 checkpoint directory (config only: servers start unsynced) for a module's servers."""
    path = tmp_path_factory.mktemp("tiny_qwen2_model")
    tiny_qwen2_config().save_pretrained(path)
    return str(path)


@pytest.fixture(autouse=True)
def single_thread():
    """The models here are tiny: intra-op threads only fight the other test processes for the cores."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _activate_module():
    path = Path(__file__).resolve().parents[1] / "stand_ins" / "activate.py"
    spec = importlib.util.spec_from_file_location("sglang_stand_in_activate", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def sglang_stand_in(tmp_path):
    """The strict SGLang 0.5.23 stand-in (tests/stand_ins/sglang) as ``sglang``, 4 GPUs per node, for one test."""
    with _activate_module().sglang_stand_in(tmp_path / "sglang_registry", gpus_per_node=4) as root:
        yield root


@pytest.fixture(scope="module")
def sglang_stand_in_module(tmp_path_factory):
    """The stand-in for a whole test module (servers shared by its tests)."""
    root = tmp_path_factory.mktemp("sglang_registry")
    with _activate_module().sglang_stand_in(root, gpus_per_node=4) as active:
        yield active


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    """The demo's task, tokenizer and tiny model (megatron_rl.demo), for the trainer runs of a module."""
    from megatron_rl.demo import prepare_assets

    train, val, model = prepare_assets(tmp_path_factory.mktemp("assets"))
    return {"train": train, "val": val, "model": model}
