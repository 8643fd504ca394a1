"""The suite's own machinery (tests/conftest.py, megatron_rl_testing/shared_ray.py): the order `make test` hands
files out in, and the one shared Ray never standing in for, or stopping, a Ray a test module started itself.
A pytest run in a subprocess over test files written here, with a copy of the suite's conftest.py."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]

_SHARED = """
def test_uses_the_shared_ray(shared_ray):
    import ray
    assert ray.is_initialized()
"""

# as tests/controller/conftest.py's ray_cluster: init_ray does nothing while a Ray is up
_OWN = """
import pytest
import ray
from megatron_rl.controller import init_ray, shutdown_ray

@pytest.fixture(scope="module")
def own_ray():
    init_ray(num_cpus=1)
    yield
    shutdown_ray()

def test_a_module_gets_a_ray_of_its_own(own_ray):
    assert ray.is_initialized(), "the module's Ray was stopped"
    assert ray.cluster_resources()["CPU"] == 1, "the module runs on the shared Ray, not its own"
"""


def _suite(tmp_path: Path, files: dict[str, str], durations: dict[str, float]) -> Path:
    (tmp_path / "conftest.py").write_text((TESTS / "conftest.py").read_text())
    (tmp_path / "durations.json").write_text(json.dumps(durations))
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    return tmp_path


def _pytest(root: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS / "support"), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-c", os.devnull,
                           "--rootdir", str(root), *args, str(root)], cwd=root, env=env, capture_output=True,
                          text=True, timeout=600)


def test_files_go_out_longest_first_each_in_its_own_order(tmp_path):
    two = "def test_2(): pass\ndef test_1(): pass\n"
    root = _suite(tmp_path, {"test_short.py": two, "test_long.py": two, "test_new.py": two},
                  {"test_short.py": 1.0, "test_long.py": 9.0})  # test_new.py has no entry: it goes first
    proc = _pytest(root, "--collect-only", "-q")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    ids = [line for line in proc.stdout.splitlines() if "::" in line]
    assert ids == [f"{name}::test_{i}" for name in ("test_new.py", "test_long.py", "test_short.py") for i in (2, 1)]


@pytest.mark.distributed
def test_a_modules_own_ray_is_neither_the_shared_one_nor_stopped_by_it(tmp_path):
    # the CI run that found it: tests/controller's module Ray after a shared-Ray file on the same xdist worker
    root = _suite(tmp_path, {"test_a_shared.py": _SHARED, "test_b_own.py": _OWN},
                  {"test_a_shared.py": 2.0, "test_b_own.py": 1.0})
    proc = _pytest(root, "-q")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "2 passed" in proc.stdout


@pytest.mark.distributed
def test_the_shared_ray_leaves_a_ray_that_replaced_it_alone():
    import ray

    from megatron_rl.controller import init_ray, shutdown_ray
    from megatron_rl_testing.shared_ray import SharedRay

    shared = SharedRay()
    shared.start()
    try:
        shutdown_ray()  # a module shuts ours down and starts its own, as tests/servers/test_ray_server_nodes.py
        init_ray(num_cpus=1)
        shared.stop()
        assert ray.is_initialized() and ray.cluster_resources()["CPU"] == 1
        with pytest.raises(RuntimeError, match="own Ray is still up"):
            shared.start()
    finally:
        shutdown_ray()
