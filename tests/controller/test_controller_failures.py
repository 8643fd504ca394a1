"""A worker that raises, exits, hangs or cannot start: the driver gets an error naming role, method and
rank (with the worker's traceback) instead of hanging."""
from __future__ import annotations

import pytest

from controller_workers import FaultyWorker
from megatron_rl.controller import (
    RayResourcePool,
    RayWorkerGroup,
    WorkerDiedError,
    WorkerRaisedError,
    WorkerTimeoutError,
    init_ray,
)

pytestmark = pytest.mark.distributed


def start(ranks: int, timeout_s: float = 120, **init_args) -> RayWorkerGroup:
    return RayWorkerGroup(RayResourcePool([ranks], cpus_per_process=0.5), FaultyWorker, init_args,
                          name_prefix="actor", timeout_s=timeout_s)


@pytest.fixture
def group(ray_cluster):
    started = []

    def make(ranks: int, timeout_s: float = 120, **init_args) -> RayWorkerGroup:
        started.append(start(ranks, timeout_s, **init_args))
        return started[-1]

    yield make
    for wg in started:
        wg.kill()
        wg.resource_pool.release()


def test_a_raising_worker_names_role_rank_and_shows_its_traceback(group):
    wg = group(2)
    with pytest.raises(WorkerRaisedError) as info:
        wg.raise_on(1)
    message = str(info.value)
    assert message.startswith("actor rank 1 raised in raise_on():")
    assert "_inner_failure" in message and "ValueError: bad value on purpose" in message
    assert (info.value.role, info.value.rank, info.value.method) == ("actor", 1, "raise_on")
    assert wg.ping() == [0, 1]  # an exception does not end the worker


def test_a_worker_process_that_exits_fails_the_call_without_waiting_for_the_others(group):
    wg = group(2, timeout_s=90)  # rank 0 sleeps 300 s: only fail-fast can beat the 90 s deadline
    with pytest.raises(WorkerDiedError) as info:
        wg.exit_on(1)
    assert str(info.value).startswith("actor rank 1 died during exit_on():")
    assert info.value.rank == 1
    wg.kill()
    with pytest.raises(WorkerDiedError, match=r"actor rank [01] died during ping\(\)"):
        wg.ping()


def test_a_peers_death_is_reported_rather_than_the_error_it_caused(group):
    """Rank 0 raises (a collective's error) half a second before rank 1's process vanishes: the driver names the
    death, the cause. Before, it named rank 0's error (seen in a clean-clone run: the killed-worker e2e test
    got "rank 0 raised in sync_weights(): ... Connection reset by peer" instead of the death)."""
    wg = group(2)
    with pytest.raises(WorkerDiedError) as info:
        wg.raise_then_peer_exits(0, 1)
    assert str(info.value).startswith("actor rank 1 died during raise_then_peer_exits():")


def test_a_hanging_worker_times_out_naming_method_and_ranks(group):
    wg = group(1)
    with pytest.raises(WorkerTimeoutError, match=r"actor.hang\(\): ranks \[0\] gave no result within 2 s") as info:
        wg.hang.async_().get(timeout_s=2)  # the group's deadline (timeout_s) applies when none is given
    assert info.value.pending_ranks == [0]


def test_a_constructor_failure_names_the_rank_and_frees_the_pool(ray_cluster):
    pool = RayResourcePool([2], cpus_per_process=0.5)
    with pytest.raises(WorkerDiedError) as info:
        RayWorkerGroup(pool, FaultyWorker, {"fail_init_on_rank": 1}, name_prefix="critic", timeout_s=120)
    message = str(info.value)
    assert message.startswith("critic rank 1 died during __init__():")
    assert "constructor failing on purpose on rank 1" in message
    pool.release()


def test_an_impossible_pool_fails_at_once(ray_cluster):
    with pytest.raises(RuntimeError, match=r"resource pool 'huge': no node can hold 64 processes of \{'CPU': 1.0\}"):
        RayResourcePool([64], name="huge").rank_slots(timeout_s=600)


def test_bad_worker_classes_and_ray_arguments_are_rejected(ray_cluster):
    import ray

    pool = RayResourcePool([1])
    with pytest.raises(TypeError, match="plain worker class, not ray.remote"):
        RayWorkerGroup(pool, ray.remote(FaultyWorker))
    with pytest.raises(TypeError, match="subclass of megatron_rl.controller.Worker"):
        RayWorkerGroup(pool, dict)
    with pytest.raises(ValueError, match="num_cpus=2 applies only to a local Ray"):
        init_ray(address="auto", num_cpus=2)
