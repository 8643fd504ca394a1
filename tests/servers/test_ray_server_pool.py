"""HF-engine rollout servers as Ray actors on a resource pool of their own (servers/ray_pool.py), started
the way a Ray run starts them (trainer/disaggregated.py ``start_rollout_servers``): each actor's process is one
server on its own bundle of the ``rollout_servers`` placement group, on a port it picked itself; the trainer syncs
it over the gloo update group exactly as a subprocess server; an actor killed by ``ray.kill`` or SIGKILL is named
by ``check()`` and replaced on the same pool through ``ServerRestarts``; inputs that cannot fit are refused by key."""

from __future__ import annotations

import os
import signal
import time

import pytest
from test_hf_server import _post, _sync_twice_and_generate

from megatron_rl.config import load_config, ConfigError
from megatron_rl.plan.validate import validate
from megatron_rl.distributed.spawn import run_multiprocess
from megatron_rl.servers.pool import RolloutServerDied
from megatron_rl_testing.rollout_models import EOS

pytestmark = [pytest.mark.distributed]

CPUS = 3  # the embedded Ray of this module: the servers' pool takes 2, one is left for everything else


def _run_config(model_dir: str, *overrides: str):
    return load_config(overrides=[
        f"actor_rollout_ref.model.path={model_dir}", "actor_rollout_ref.rollout.mode=server",
        "actor_rollout_ref.rollout.num_servers=2", "trainer.n_gpus_per_node=1", f"ray_init.num_cpus={CPUS}",
        *overrides])


@pytest.fixture(scope="module")
def pool(model_dir):
    import ray

    from megatron_rl.controller import shutdown_ray
    from megatron_rl.trainer.disaggregated import start_rollout_servers

    cfg = _run_config(model_dir)
    validate(cfg)
    servers = start_rollout_servers(cfg)  # starts the embedded Ray of ray_init.num_cpus
    assert ray.is_initialized() and list(cfg.actor_rollout_ref.rollout.server_urls) == servers.urls
    assert cfg.actor_rollout_ref.rollout.sglang.master_address is None  # trainer rank 0 names its node's IP
    yield servers
    servers.close()  # the runner's order: the servers' pool closes, then the Ray the run started stops
    # the run's secret ends with its servers (it would outlive them in a Ray that stays up)
    assert not ray.util.list_named_actors(all_namespaces=True)
    shutdown_ray()


def _bundles(pool) -> tuple[list[dict], str]:
    from ray.util.placement_group import placement_group_table

    [group] = pool.resource_pool._placement_groups
    return [placement_group_table(group)["bundles"][i] for i in range(len(pool.servers))], group.id.hex()


def test_servers_are_ray_actors_on_their_own_pool(pool):
    from megatron_rl.servers.ray_pool import RayServerPool

    assert isinstance(pool, RayServerPool) and pool.resource_pool.name == "rollout_servers"
    bundles, group_id = _bundles(pool)
    assert bundles == [{"CPU": 1.0}, {"CPU": 1.0}]  # rollout.server_cpus=null: server_threads=1 CPU each
    for server in pool.servers:
        assert server.where["placement_group"] == group_id and server.where["resources"] == {"CPU": 1.0}
    pids = {server.pid for server in pool.servers}
    assert len(pids) == 2 and os.getpid() not in pids  # each server is a process of its own
    assert len(set(pool.urls)) == 2  # ports picked in each server's process: no collision
    # one node: loopback only, and every route needs the run's secret (issue 33)
    assert all(url.startswith("http://127.0.0.1:") for url in pool.urls), pool.urls
    assert _post(pool.urls[0], "/pause_generation", {"mode": "abort"}, auth=False) == (401, {"detail": "Unauthorized"})
    pool.check()


def test_ray_servers_take_weight_updates_and_generate(pool):
    import ray

    url = pool.urls[1]  # on loopback; the update group's master on the node's IP (the run's default) is reachable
    [report] = run_multiprocess(_sync_twice_and_generate, 1, url, ray.util.get_node_ip_address(), timeout_s=300)
    assert report["diff_v1"] < 1e-5 and report["diff_v2"] < 1e-5  # synced over gloo, verified by log-probs
    assert report["version"] == 2 and report["again"]


def test_killed_actors_are_named_and_replaced_on_the_pool(pool):  # last of the pool's tests: it replaces both
    import ray

    from megatron_rl.servers.restarts import ServerRestarts

    first, second = pool.servers
    ray.kill(first.actor)
    os.kill(second.pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while len(pool.dead()) < 2 and time.monotonic() < deadline:  # Ray sees a SIGKILLed worker a moment later
        time.sleep(0.05)
    restarts = ServerRestarts(pool, 2)
    with pytest.raises(RolloutServerDied) as died:
        ServerRestarts(pool, 0).check()  # no restarts left: the death fails, naming the server and how
    assert f"rollout server 0 ({first.url}, Ray actor pid {first.pid}) died" in str(died.value)
    assert "killed by `ray.kill`" in str(died.value) and "server_restarts=0" in str(died.value)
    with pytest.raises(RolloutServerDied, match=r"rollout server 1 .* died \(The actor is dead because its worker"):
        pool.check()
    restarts.check()
    assert restarts.count == 2 and not restarts.serving(0) and not restarts.serving(1)  # unsynced replacements
    pool.check()
    bundles, group_id = _bundles(pool)
    assert {server.where["placement_group"] for server in pool.servers} == {group_id}
    assert not {first.url, second.url} & set(pool.urls) and not {first.pid, second.pid} & {s.pid for s in pool.servers}
    status, answer = _post(pool.urls[0], "/generate", {"input_ids": [[5, 6]], "return_logprob": True, "sampling_params":
                                                      [{"max_new_tokens": 3, "stop_token_ids": [EOS]}]})
    assert status == 400 and "never synced" in answer["message"]  # a replacement serves after the next sync


def test_a_pool_with_too_few_cpus_names_the_keys(pool, model_dir):
    from megatron_rl.servers.hf_launch import HFServerLaunch
    from megatron_rl.servers.ray_pool import RayServerPool

    with pytest.raises(RolloutServerDied, match=r"num_servers=4 servers of actor_rollout_ref.rollout.server_cpus=1 "
                                                r"CPUs do not fit: .*largest node has CPU=3"):
        RayServerPool(HFServerLaunch(model_dir), 4, cpus_per_server=1.0)
    with pytest.raises(ValueError, match="actor_rollout_ref.rollout.server_cpus must be > 0"):
        RayServerPool(HFServerLaunch(model_dir), 1, cpus_per_server=0.0)


@pytest.mark.parametrize("overrides, message", [
    (["actor_rollout_ref.rollout.num_servers=3"],
     r"num_servers=3 servers of server_cpus=1 CPUs and the trainer's 1 ranks .* need 4 CPUs, but ray_init.num_cpus=3"),
    (["actor_rollout_ref.rollout.server_cpus=2"], r"server_cpus=2 CPUs .* need 5 CPUs"),
    (["actor_rollout_ref.rollout.server_cpus=0"], r"actor_rollout_ref.rollout.server_cpus must be > 0"),
    (["reward_model.enable=true", "reward_model.enable_resource_pool=true", "reward_model.judge.enable=true"],
     r"trainer's 1 ranks .* and the judge's actor \(1 CPU\) need 4 CPUs"),
    (["reward_model.enable=true", "reward_model.enable_resource_pool=true", "reward_model.model.path=/rm"],
     r"and the reward model's 1 ranks \(reward_model_pool, one CPU each\) need 4 CPUs"),
])
def test_config_refuses_servers_that_do_not_fit(model_dir, overrides, message):
    with pytest.raises(ConfigError, match=message):
        validate(_run_config(model_dir, *overrides))


def test_torchrun_runs_keep_the_subprocess_pool(model_dir, monkeypatch):
    from megatron_rl.trainer import disaggregated

    started = []

    class Recorded:
        def __init__(self, spec, num_servers: int) -> None:
            started.append((spec.model_path, num_servers))
            self.urls = [f"http://127.0.0.1:{9000 + i}" for i in range(num_servers)]

    monkeypatch.setattr(disaggregated, "ServerProcessPool", Recorded)
    cfg = _run_config(model_dir, "trainer.launcher=torchrun")
    assert isinstance(disaggregated.start_rollout_servers(cfg), Recorded) and started == [(model_dir, 2)]
