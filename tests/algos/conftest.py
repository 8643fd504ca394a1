"""verl's core_algos as an optional oracle for the algorithm tests.

The oracle is used only when ``verl`` imports: either installed, or an unpacked wheel named by
MEGATRON_RL_VERL_PATH (os.pathsep-separated directories prepended to sys.path), e.g.
  pip download --no-deps verl==0.9.1 -d /tmp/w && unzip /tmp/w/*.whl -d /tmp/verl_src
  pip install --no-deps --target /tmp/verl_deps tensordict pyvers cloudpickle codetiming orjson
  MEGATRON_RL_VERL_PATH=/tmp/verl_src:/tmp/verl_deps pytest tests/algos
Without it those tests skip; the loop-formula tests always run.
"""

from __future__ import annotations

import importlib
import os
import sys
from types import ModuleType

import pytest


@pytest.fixture(scope="session")
def verl_core_algos() -> ModuleType:
    for path in reversed([p for p in os.environ.get("MEGATRON_RL_VERL_PATH", "").split(os.pathsep) if p]):
        if path not in sys.path:
            sys.path.insert(0, path)
    try:
        return importlib.import_module("verl.trainer.ppo.core_algos")
    except Exception as err:  # noqa: BLE001 - any import failure means "no oracle here"
        pytest.skip(f"verl oracle unavailable ({type(err).__name__}: {err})")
