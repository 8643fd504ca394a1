"""verl 0.9.1 as a numerical oracle for the tests: its modules when they import, else the test skips.

``make test`` installs the oracle into .cache/verl-oracle (no dependencies, the venv untouched) and points
MEGATRON_RL_VERL_PATH at it; by hand, e.g.
  pip download --no-deps verl==0.9.1 -d /tmp/w && unzip /tmp/w/*.whl -d /tmp/verl_src
  pip install --no-deps --target /tmp/verl_deps tensordict pyvers cloudpickle codetiming orjson
  MEGATRON_RL_VERL_PATH=/tmp/verl_src:/tmp/verl_deps pytest tests/algos
"""
from __future__ import annotations

import importlib
import os
import sys
from types import ModuleType

import pytest


def verl_module(name: str) -> ModuleType:
    """``importlib.import_module(name)`` with MEGATRON_RL_VERL_PATH's directories first on sys.path; skips the
    calling test when verl does not import here."""
    for path in reversed([p for p in os.environ.get("MEGATRON_RL_VERL_PATH", "").split(os.pathsep) if p]):
        if path not in sys.path:
            sys.path.insert(0, path)
    try:
        return importlib.import_module(name)
    except Exception as err:  # noqa: BLE001 - any import failure means "no oracle here"
        pytest.skip(f"verl oracle unavailable ({type(err).__name__}: {err})")
