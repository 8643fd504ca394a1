"""Worker groups under an embedded Ray: every dispatch mode over real actors, the mesh the workers
report, async calls, the wired torch.distributed rendezvous, and colocated roles."""
from __future__ import annotations

import pytest
import torch

from controller_workers import ActorRole, ConfigReceiver, CriticRole, ProbeWorker
from megatron_rl.controller import (
    PendingCall,
    RayResourcePool,
    RayWorkerGroup,
    ResourcePoolManager,
    init_ray,
    spawn_role_groups,
)
from megatron_rl.config import load_config, typed_config
from megatron_rl.controller.resource_pool import master_endpoint
from megatron_rl.protocol import DataProto

pytestmark = pytest.mark.distributed

WORLD = 4  # PP=2 x DP=2: DP groups {0, 2} and {1, 3}, collected from the last stage (ranks 2, 3)


def rows(n: int) -> DataProto:
    return DataProto.from_dict({"ids": torch.arange(n)}, {"uid": [f"u{i}" for i in range(n)]}, {"temperature": 0.7})


@pytest.fixture(scope="module")
def probes(ray_cluster) -> RayWorkerGroup:
    pool = RayResourcePool([2, 2], cpus_per_process=0.5, name="probes")  # leaves 2 of 4 CPUs free
    group = RayWorkerGroup(pool, ProbeWorker, {"tag": "p"}, name_prefix="probe",
                           env_vars={"FAKE_TP": "1", "FAKE_PP": "2"}, timeout_s=120)
    yield group
    group.kill()
    pool.release()


def test_ranks_get_their_place_and_one_rendezvous_address(probes):
    infos = probes.whoami("!")
    assert [info["rank"] for info in infos] == list(range(WORLD))
    assert {info["tag"] for info in infos} == {"p!"}
    assert len({info["pid"] for info in infos}) == WORLD
    envs = [info["env"] for info in infos]
    assert [e["LOCAL_RANK"] for e in envs] == ["0", "1"] * 2
    assert {e["WORLD_SIZE"] for e in envs} == {str(WORLD)}
    assert {(e["MASTER_ADDR"], e["MASTER_PORT"]) for e in envs} == {(probes.master_addr, str(probes.master_port))}


def test_gloo_all_reduce_through_the_wired_master_address(probes):
    assert probes.all_reduce_ranks() == [float(sum(range(WORLD)))] * WORLD


def test_all_to_all_and_rank_zero_modes(probes):
    assert probes.scale(list(range(WORLD)), factor=[2] * WORLD) == [2 * r for r in range(WORLD)]
    assert probes.rank_value() == 100


def test_execute_rank_zero_runs_on_rank_zero_only(probes):
    before = probes.execute_all("rank_zero_call_count")
    assert probes.count_rank_zero_call() == 0
    after = probes.execute_all("rank_zero_call_count")
    assert [a - b for a, b in zip(after, before)] == [1] + [0] * (WORLD - 1)


@pytest.mark.parametrize("n", [16, 11])
def test_dp_compute_proto_splits_by_rank_and_concatenates_in_order(probes, n):
    out = probes.tag_dp(rows(n))
    shard = -(-n // WORLD)
    assert out.batch["ids"].tolist() == list(range(n))
    assert out.batch["rank"].tolist() == [i // shard for i in range(n)]
    assert list(out.non_tensor_batch["uid"]) == [f"u{i}" for i in range(n)]
    assert out.meta_info["temperature"] == 0.7
    seen = probes.execute_all("last_seen")
    assert seen[-1] == [(i + (WORLD - 1) * shard) % n for i in range(shard)]  # the last rank holds the padding


def test_dp_compute_proto_lists_non_proto_results_by_rank(probes):
    assert probes.count_rows(rows(8), extra=1) == [3] * WORLD


def test_megatron_mode_uses_the_reported_mesh(probes):
    mesh = probes.mesh()
    assert [(m.dp_rank, m.pp_rank) for m in mesh] == [(0, 0), (1, 0), (0, 1), (1, 1)]
    assert [r for r, m in enumerate(mesh) if m.is_collect] == [2, 3]
    out = probes.tag_megatron(rows(5))
    assert out.batch["ids"].tolist() == [0, 1, 2, 3, 4]
    assert out.batch["rank"].tolist() == [2, 2, 2, 3, 3]
    seen = probes.execute_all("last_seen")
    assert seen == [[0, 1, 2] if m.dp_rank == 0 else [3, 4, 0] for m in mesh]


def test_async_calls_return_pending_results(probes):
    pending = probes.delayed_echo("a", 0.2)  # registered with blocking=False
    assert isinstance(pending, PendingCall)
    also = probes.tag_dp.async_(rows(8))
    assert isinstance(also, PendingCall) and len(also.refs) == WORLD
    assert pending.get() == [f"a@{r}" for r in range(WORLD)]
    assert also.get().batch["ids"].tolist() == list(range(8))
    assert also.done()


def test_unknown_method_is_named(probes):
    with pytest.raises(AttributeError, match="probe: worker class ProbeWorker has no method 'nope'"):
        probes.execute_all("nope")


def test_init_ray_is_idempotent(probes):
    init_ray(num_cpus=1)  # already running: keeps the cluster (and the group) as they are
    assert probes.rank_value() == 100


def test_master_port_is_picked_on_rank_zeros_node_by_a_remote_task(ray_cluster, monkeypatch):
    import ray

    from megatron_rl.controller import resource_pool

    monkeypatch.setattr(resource_pool, "_on_driver_node", lambda node_id: False)
    addr, port = master_endpoint(ray.get_runtime_context().get_node_id(), timeout_s=60)
    assert addr == ray.util.get_node_ip_address() and 0 < port < 65536


def test_colocated_roles_share_a_process_and_route_by_role(ray_cluster):
    pools = ResourcePoolManager({"global": [2]}, {"actor_rollout": "global", "critic": "global"}, cpus_per_process=0.5)
    handles = spawn_role_groups(pools, {"actor_rollout": ActorRole, "critic": CriticRole},
                                {"actor_rollout": {"scale": 3}, "critic": {"offset": 1.0}}, timeout_s=120)
    actor, critic = handles["actor_rollout"], handles["critic"]
    try:
        assert actor.group is critic.group and actor.world_size == 2
        assert actor.pid() == critic.pid()
        data = DataProto.from_dict({"ids": torch.arange(5)})
        assert actor.compute_log_prob(data).batch["old_log_probs"].tolist() == [0.0, 3.0, 6.0, 9.0, 12.0]
        assert critic.compute_values(data).batch["values"].tolist() == [1.0, 2.0, 3.0, 4.0, 5.0]
        assert [m.tp_rank for m in actor.mesh()] == [0, 1]
        with pytest.raises(RuntimeError, match=r"critic: ranks \[0, 1\] have not reported their parallel mesh"):
            critic.compute_values_megatron(data)
    finally:
        actor.group.kill()
        pools.pools["global"].release()


def test_calls_are_timed_and_results_nobody_reads_stay_on_the_workers(probes):
    from megatron_rl.controller import call_stats

    data = rows(8)
    with call_stats.recording() as totals:
        out = probes.tag_megatron(data)
        probes.rank_value()
    assert out.batch["ids"].tolist() == list(range(8))
    megatron, rank_zero = totals["probe.tag_megatron"], totals["probe.rank_value"]
    assert megatron.calls == rank_zero.calls == 1
    assert 0 <= megatron.worker_s <= megatron.wall_s and 0 <= rank_zero.worker_s <= rank_zero.wall_s
    # two DP shards sent (each once, shared by the DP group's two ranks); only the 2 collecting ranks' results
    # come back: together they are about the size of the whole batch, not twice it
    shards = call_stats.payload_bytes([data[:4]]) + call_stats.payload_bytes([data[4:]])
    assert megatron.sent_bytes == pytest.approx(shards, rel=0.05)
    assert megatron.received_bytes < 1.5 * shards
    assert rank_zero.sent_bytes == rank_zero.received_bytes == 0
    with call_stats.recording() as later:
        pass
    assert not later  # nothing recorded outside a block


def test_the_typed_trainer_config_reaches_ray_workers(ray_cluster):
    """Workers are given PPOTrainerConfig (typed_config), pickled as an init argument: it arrives as the same
    dataclass tree, choice fields as their StrEnums, interpolations resolved (issue 31)."""
    cfg = load_config(overrides=["algorithm.kl_penalty=low_var_kl+", "actor_rollout_ref.model.path=/m",
                                 "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-sum",
                                 "trainer.experiment_name=typed"])
    pool = RayResourcePool([1], cpus_per_process=0.5, name="config_receiver")
    group = RayWorkerGroup(pool, ConfigReceiver, {"config": typed_config(cfg)}, timeout_s=120)
    try:
        facts, = group.config_facts()
    finally:
        group.kill()
        pool.release()
    assert facts == {"type": "megatron_rl.config.schema.PPOTrainerConfig", "kl_penalty": ("KLPenalty", "low_var_kl+"),
                     "loss_agg_mode": True, "override_config": "dict", "default_local_dir": "outputs/megatron_rl/typed"}
