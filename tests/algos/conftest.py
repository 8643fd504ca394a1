"""verl's core_algos as an optional oracle for the algorithm tests (megatron_rl_testing/verl_oracle.py: used
when verl imports, e.g. from MEGATRON_RL_VERL_PATH, which `make test` sets; without it those tests skip and the
loop-formula tests still run)."""

from __future__ import annotations

from types import ModuleType

import pytest

from megatron_rl_testing.verl_oracle import verl_module


@pytest.fixture(scope="session")
def verl_core_algos() -> ModuleType:
    return verl_module("verl.trainer.ppo.core_algos")
