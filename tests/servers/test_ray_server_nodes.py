"""Rollout servers over several Ray nodes (rollout.servers_per_node, servers/ray_pool.py) on a real
multi-node Ray cluster stand-in: ``ray.cluster_utils.Cluster`` with a CPU-less head (the driver's node, as on a
cluster whose head runs no servers) and two 2-CPU worker nodes, each on an IP of its own (127.0.0.2/3), so a
server that advertised the wrong node's address, or a sender that named the driver's node as the weight-update
group's master, would show. Checked: each node's servers land on a node of their own and listen on its IP, a
sender on a worker node names its own IP and syncs every server, a killed server comes back on its node, and
pools that cannot fit are refused naming the keys."""

from __future__ import annotations

import os

import pytest
from test_hf_server import server_replica, source_model

from megatron_rl.config import load_config, ConfigError
from megatron_rl.plan.validate import validate
from megatron_rl.distributed.spawn import run_multiprocess
from megatron_rl.rollout.server_key import API_KEY_ENV
from megatron_rl.servers.pool import RolloutServerDied
from megatron_rl_testing import SUPPORT

pytestmark = [pytest.mark.distributed]

NODE_IPS = ("127.0.0.2", "127.0.0.3")


def _run_config(model_dir: str, address: str | None, *overrides: str):
    return load_config(overrides=[
        f"actor_rollout_ref.model.path={model_dir}", "actor_rollout_ref.rollout.mode=server",
        "actor_rollout_ref.rollout.num_servers=4", "actor_rollout_ref.rollout.servers_per_node=2",
        "trainer.n_gpus_per_node=1", *([f"ray_init.address={address}"] if address else ["ray_init.num_cpus=8"]),
        *overrides])


@pytest.fixture(scope="module")
def cluster():
    import ray
    from ray.cluster_utils import Cluster

    from megatron_rl.controller import shutdown_ray

    shutdown_ray()
    # the nodes must not inherit a server key an earlier test left in this process: their workers ask the
    # run's key holder, as a trainer rank on another node does
    saved_key = os.environ.pop(API_KEY_ENV, None)
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    for ip in NODE_IPS:
        cluster.add_node(num_cpus=2, node_ip_address=ip)
    # the sender task runs this module's functions: its workers import them (and the test tools they import,
    # tests/support) as the test run does
    here = os.path.dirname(os.path.abspath(__file__))
    ray.init(address=cluster.address, runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join([here, SUPPORT])}})
    yield cluster
    shutdown_ray()
    cluster.shutdown()
    if saved_key is not None:
        os.environ[API_KEY_ENV] = saved_key


@pytest.fixture(scope="module")
def pool(cluster, model_dir):
    from megatron_rl.trainer.disaggregated import start_rollout_servers

    cfg = _run_config(model_dir, cluster.address)
    validate(cfg)
    servers = start_rollout_servers(cfg)  # joins the running cluster (ray_init.address)
    assert cfg.actor_rollout_ref.rollout.sglang.master_address is None  # the sender names its own node
    yield servers
    servers.close()


def _node_ips() -> dict[str, str]:
    import ray

    return {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]}


def test_servers_spread_two_a_node_each_on_its_node_ip(pool):
    ips = _node_ips()
    by_node: dict[str, list[int]] = {}
    for server in pool.servers:
        by_node.setdefault(server.where["node_id"], []).append(server.index)
        assert server.where["node_ip"] == ips[server.where["node_id"]]
        assert server.url.startswith(f"http://{ips[server.where['node_id']]}:")  # reachable on its node's IP
    assert sorted(by_node.values()) == [[0, 1], [2, 3]]  # servers_per_node=2: one node per pair, in order
    assert sorted(ips[node] for node in by_node) == list(NODE_IPS)  # not the CPU-less head (the driver's node)
    assert len(set(pool.urls)) == 4
    assert "on node" in pool.servers[0].placement() and pool.servers[0].where["node_ip"] in pool.servers[0].placement()


def _sync_all(urls: list[str], master_address: str, key: str) -> float:
    os.environ[API_KEY_ENV] = key  # as a trainer rank holds it: asked of the run's key holder (below)
    source = source_model(41)
    replica = server_replica(urls, source, response_length=5, master_address=master_address)
    try:
        return replica.sync(lambda _plan: source.state_dict().items(), version=1)["rollout/logprob_diff_max"]
    finally:
        replica.shutdown()


def _sender_on_its_node(urls: list[str]) -> tuple[str, float]:
    """Trainer rank 0 as a Ray task on a worker node: the update group's master it names, then one sync of
    every server through it (the sync runs in a child process, as the trainer's rank runs torch.distributed)."""
    from megatron_rl.rollout.server_key import server_api_key
    from megatron_rl.rollout.sglang.server_transport import update_group_address

    key = server_api_key()  # this worker's node started without it in its environment (the cluster fixture)
    assert key, "a Ray worker on another node could not get the run's server key from its key holder"
    address = update_group_address(None, urls)
    [diff] = run_multiprocess(_sync_all, 1, urls, address, key, timeout_s=300)
    return address, diff


def test_a_sender_on_a_worker_node_names_its_ip_and_syncs_servers_on_every_node(pool):
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    [sender_node] = [node for node, ip in _node_ips().items() if ip == NODE_IPS[1]]
    task = ray.remote(num_cpus=0)(_sender_on_its_node).options(
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=sender_node, soft=False))
    address, diff = ray.get(task.remote(pool.urls), timeout=300)
    assert address == NODE_IPS[1] != ray.util.get_node_ip_address()  # the sender's node, not the driver's
    assert diff < 1e-5  # every server on both nodes joined the group at that address and took the weights


def test_a_killed_server_is_replaced_on_its_node(pool):  # after the sync test: the replacement is unsynced
    import ray

    first = pool.servers[2]
    ray.kill(first.actor)
    url = pool.replace(2)
    fresh = pool.servers[2]
    assert fresh.where["node_id"] == first.where["node_id"] and url.startswith(f"http://{first.where['node_ip']}:")
    assert fresh.pid != first.pid and fresh.where["placement_group"] == first.where["placement_group"]
    pool.check()


def test_pools_that_cannot_fit_are_refused_naming_the_keys(pool, model_dir):
    from megatron_rl.servers.hf_launch import HFServerLaunch
    from megatron_rl.servers.ray_pool import RayServerPool

    # refused from what the nodes hold (not what is free now), at once: start_timeout_s would be waited out
    with pytest.raises(RolloutServerDied, match=r"num_servers=3 servers of actor_rollout_ref.rollout.server_cpus=1 "
                       r"CPUs at actor_rollout_ref.rollout.servers_per_node=1 do not fit: .*3 different nodes must .*"
                       r"only 2 of the 3 alive nodes"):
        RayServerPool(HFServerLaunch(model_dir), 3, cpus_per_server=1.0, servers_per_node=1, start_timeout_s=5)
    with pytest.raises(RolloutServerDied, match=r"servers_per_node=3 do not fit: .*no node can hold 3 processes"):
        RayServerPool(HFServerLaunch(model_dir), 3, cpus_per_server=1.0, servers_per_node=3, start_timeout_s=5)
    with pytest.raises(ValueError, match=r"actor_rollout_ref.rollout.servers_per_node must be >= 1"):
        RayServerPool(HFServerLaunch(model_dir), 2, cpus_per_server=1.0, servers_per_node=0)


@pytest.mark.parametrize("overrides, message", [
    ([], r"num_servers=4 at servers_per_node=2 spread over 2 Ray nodes, but without ray_init.address"),
    (["actor_rollout_ref.rollout.servers_per_node=0"], r"actor_rollout_ref.rollout.servers_per_node must be >= 1"),
])
def test_config_refuses_a_spread_an_embedded_ray_cannot_hold(model_dir, overrides, message):
    with pytest.raises(ConfigError, match=message):
        validate(_run_config(model_dir, None, *overrides))


def test_servers_per_node_at_num_servers_is_one_node(model_dir):
    validate(_run_config(model_dir, None, "actor_rollout_ref.rollout.servers_per_node=4"))
