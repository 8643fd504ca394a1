"""Suite-wide: the processes tests start import the test tools too (tests/support); one Ray shared by the tests
that ask for it (``shared_ray``, megatron_rl_testing/shared_ray.py); the test files run longest first."""
import json
from pathlib import Path

import pytest

from megatron_rl_testing import export_support_path
from megatron_rl_testing.shared_ray import SharedRay

export_support_path()


SHARED_RAY = pytest.StashKey[SharedRay]()


def pytest_configure(config):
    config.stash[SHARED_RAY] = SharedRay()


def pytest_unconfigure(config):
    config.stash[SHARED_RAY].stop()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """A test that does not ask for the shared Ray finds it stopped before its first fixture: a module fixture
    that starts a Ray of its own (init_ray does nothing while one is up) must not find ours and use it."""
    if "shared_ray" not in item.fixturenames:
        item.config.stash[SHARED_RAY].stop()


@pytest.fixture(scope="session")
def _shared_ray_manager(request):
    return request.config.stash[SHARED_RAY]


@pytest.fixture
def shared_ray(_shared_ray_manager):
    """An embedded Ray (4 logical CPUs) kept up across consecutive tests that ask for it; a run started in the
    test finds it up and leaves it up."""
    _shared_ray_manager.start()
    yield
    _shared_ray_manager.check_clean()


DURATIONS = Path(__file__).with_name("durations.json")  # scripts/test_durations.py writes it from a run's JUnit XML


def pytest_collection_modifyitems(config, items):
    """Longest files first (a file missing from durations.json counts as longest), each file's tests in their own
    order. `make test` hands whole files to two processes in this order (``--dist loadfile
    --no-loadscope-reorder``): longest first leaves short files for the end, so both processes finish together,
    and the Ray runs of the end-to-end files follow one another on the one shared Ray."""
    seconds = json.loads(DURATIONS.read_text()) if DURATIONS.is_file() else {}
    items.sort(key=lambda item: -seconds.get(item.nodeid.split("::", 1)[0], float("inf")))
