"""One embedded Ray per test module (4 logical CPUs), with this directory on the workers' PYTHONPATH."""
from __future__ import annotations

from pathlib import Path

import pytest

from megatron_rl.controller import init_ray, shutdown_ray

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def ray_cluster():
    init_ray(num_cpus=4, runtime_env={"env_vars": {"PYTHONPATH": str(HERE)}})
    yield
    shutdown_ray()
