"""Fixtures shared by the test folders of the rollout, its servers, the weight sync and the agent loop; each
folder's conftest.py imports the ones its tests use (``single_thread`` is autouse there)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch


@pytest.fixture(autouse=True)
def single_thread():
    """The models here are tiny: intra-op threads only fight the other test processes for the cores."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _activate_module():
    path = Path(__file__).resolve().parents[2] / "stand_ins" / "activate.py"
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
