"""Dispatch and collect without Ray: how each mode splits a call and combines the ranks' results."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from controller_workers import ActorRole, CriticRole, fake_megatron_mesh, tag_rows
from megatron_rl.controller import Dispatch, Execute, RankMesh, ResourcePoolManager, RoleGroup, Worker, register
from megatron_rl.controller.colocation import create_colocated_worker_cls
from megatron_rl.controller.decorator import MethodSpec, registered_methods
from megatron_rl.controller.dispatch import plan_call
from megatron_rl.controller.mesh import check_mesh
from megatron_rl.controller.ray_init import _worker_pythonpath
from megatron_rl.protocol import DataProto


def rows(n: int) -> DataProto:
    return DataProto.from_dict({"ids": torch.arange(n)}, {"uid": [f"u{i}" for i in range(n)]}, {"step": 7})


def spec(mode: Dispatch, execute: Execute = Execute.ALL) -> MethodSpec:
    return MethodSpec(mode, execute, blocking=True)


def run(plan, fn):
    """Execute a plan locally: fn(rank, *args, **kwargs) for each planned rank, then collect."""
    return plan.collect([fn(rank, *args, **kwargs) for rank, (args, kwargs) in zip(plan.ranks, plan.calls)])


def test_one_to_all_sends_the_same_arguments_and_lists_results_by_rank():
    plan = plan_call(spec(Dispatch.ONE_TO_ALL), ("x",), {"k": 1}, world_size=3, method="m")
    assert plan.ranks == [0, 1, 2] and all(call == (("x",), {"k": 1}) for call in plan.calls)
    assert run(plan, lambda rank, x, k: f"{x}{k}{rank}") == ["x10", "x11", "x12"]


def test_rank_zero_runs_everywhere_but_returns_rank_zeros_result():
    plan = plan_call(spec(Dispatch.RANK_ZERO), (), {}, world_size=4, method="m")
    assert plan.ranks == [0, 1, 2, 3]
    assert run(plan, lambda rank: rank + 10) == 10


def test_execute_rank_zero_runs_only_rank_zero():
    plan = plan_call(spec(Dispatch.ONE_TO_ALL, Execute.RANK_ZERO), (5,), {}, world_size=4, method="m")
    assert plan.ranks == [0]
    assert run(plan, lambda rank, v: v * 2) == 10


def test_all_to_all_gives_each_rank_its_item():
    plan = plan_call(spec(Dispatch.ALL_TO_ALL), ([1, 2, 3],), {"factor": [10, 20, 30]}, world_size=3, method="m")
    assert run(plan, lambda rank, v, factor: v * factor) == [10, 40, 90]


@pytest.mark.parametrize("bad", [[1, 2], "abc", 5])
def test_all_to_all_rejects_arguments_without_one_item_per_rank(bad):
    with pytest.raises(ValueError, match=r"actor.scale \(ALL_TO_ALL\): argument 0 must be a list with one item per rank \(3\)"):
        plan_call(spec(Dispatch.ALL_TO_ALL), (bad,), {}, world_size=3, method="actor.scale")


@pytest.mark.parametrize("n", [8, 5, 1, 11])
def test_dp_compute_proto_splits_in_order_pads_and_unpads(n):
    world = 4
    plan = plan_call(spec(Dispatch.DP_COMPUTE_PROTO), (rows(n),), {}, world_size=world, method="m")
    shard = -(-n // world)
    for rank, (args, _) in enumerate(plan.calls):
        expected = [(rank * shard + i) % n for i in range(shard)]  # padding repeats leading rows
        assert args[0].batch["ids"].tolist() == expected
        assert args[0].meta_info == {"step": 7}
    out = run(plan, lambda rank, data: tag_rows(data, rank))
    assert out.batch["ids"].tolist() == list(range(n))
    assert out.batch["rank"].tolist() == [i // shard for i in range(n)]
    assert list(out.non_tensor_batch["uid"]) == [f"u{i}" for i in range(n)]
    assert out.meta_info == {"step": 7}


def test_dp_collect_of_row_less_results_ignores_the_padding():
    # an update returns only metrics (meta_info): nothing to unpad even when the input was padded
    plan = plan_call(spec(Dispatch.DP_COMPUTE_PROTO), (rows(5),), {}, world_size=2, method="m")
    out = run(plan, lambda rank, data: DataProto(meta_info={"metrics": {"loss": 1.0}}))
    assert len(out) == 0 and out.meta_info == {"metrics": {"loss": [1.0, 1.0]}}  # every rank's, as verl merges them


def test_dp_compute_proto_passes_other_arguments_unchanged_and_lists_non_proto_results():
    plan = plan_call(spec(Dispatch.DP_COMPUTE_PROTO), (rows(6),), {"extra": 100}, world_size=3, method="m")
    assert run(plan, lambda rank, data, extra: len(data) + extra) == [102, 102, 102]


def test_dp_compute_proto_needs_a_data_proto_and_equal_lengths():
    with pytest.raises(ValueError, match="needs at least one DataProto"):
        plan_call(spec(Dispatch.DP_COMPUTE_PROTO), (3,), {}, world_size=2, method="m")
    with pytest.raises(ValueError, match=r"differ in length: \{0: 4, 'other': 3\}"):
        plan_call(spec(Dispatch.DP_COMPUTE_PROTO), (rows(4),), {"other": rows(3)}, world_size=2, method="m")


def test_dp_collect_rejects_mixed_result_types():
    plan = plan_call(spec(Dispatch.DP_COMPUTE_PROTO), (rows(4),), {}, world_size=2, method="actor.f")
    with pytest.raises(TypeError, match=r"actor.f: collecting ranks returned a mix .*\{0: 'DataProto', 1: 'int'\}"):
        run(plan, lambda rank, data: data if rank == 0 else 3)


def megatron_mesh(world: int, tp: int, pp: int) -> list[RankMesh]:
    meshes = []
    for rank in range(world):
        m = fake_megatron_mesh(rank, world, tp, pp)
        meshes.append(RankMesh(m["dp_rank"], m["dp_size"], m["tp_rank"], m["pp_rank"],
                               is_collect=m["tp_rank"] == 0 and m["pp_rank"] == pp - 1))
    return meshes


def test_megatron_sends_one_shard_per_dp_group_and_collects_from_last_stage_tp0():
    mesh = megatron_mesh(world=8, tp=2, pp=2)  # dp=2; collectors: rank 4 (dp 0) and rank 6 (dp 1)
    plan = plan_call(spec(Dispatch.MEGATRON_COMPUTE_PROTO), (rows(5),), {}, world_size=8, method="m", mesh=mesh)
    for rank, (args, _) in enumerate(plan.calls):
        expected = [0, 1, 2] if mesh[rank].dp_rank == 0 else [3, 4, 0]
        assert args[0].batch["ids"].tolist() == expected, rank
    out = run(plan, lambda rank, data: tag_rows(data, rank if mesh[rank].is_collect else -1))
    assert out.batch["ids"].tolist() == [0, 1, 2, 3, 4]
    assert out.batch["rank"].tolist() == [4, 4, 4, 6, 6]


def test_rollout_dispatch_sends_one_shard_per_engine_replica_to_its_leader_only():
    # 4 ranks, rollout TP 2: replica 0 led by rank 1 (its lowest GPU), replica 1 by rank 2
    mesh = [RankMesh(0, 1, is_collect=rank == 0, rollout_replica=r, rollout_replicas=2, is_rollout_leader=lead)
            for rank, (r, lead) in enumerate(((0, False), (0, True), (1, True), (1, False)))]
    plan = plan_call(spec(Dispatch.ROLLOUT_COMPUTE_PROTO), (rows(5),), {}, world_size=4, method="m", mesh=mesh)
    assert plan.ranks == [1, 2]
    assert [args[0].batch["ids"].tolist() for args, _ in plan.calls] == [[0, 1, 2], [3, 4, 0]]
    out = run(plan, lambda rank, data: tag_rows(data, rank))
    assert out.batch["ids"].tolist() == [0, 1, 2, 3, 4] and out.batch["rank"].tolist() == [1, 1, 1, 2, 2]
    two_leaders = [RankMesh(0, 1, is_collect=rank == 0) for rank in range(2)]
    with pytest.raises(RuntimeError, match=r"exactly one leader; replica -> leaders \{0: \[0, 1\]\}"):
        plan_call(spec(Dispatch.ROLLOUT_COMPUTE_PROTO), (rows(2),), {}, world_size=2, method="m", mesh=two_leaders)


def test_megatron_dispatch_requires_a_reported_mesh():
    with pytest.raises(ValueError, match="needs the group's mesh"):
        plan_call(spec(Dispatch.MEGATRON_COMPUTE_PROTO), (rows(2),), {}, world_size=2, method="m")


def test_check_mesh_names_what_is_inconsistent():
    with pytest.raises(RuntimeError, match=r"critic: ranks \[1\] have not reported .*set_mesh"):
        check_mesh([RankMesh(0, 1), None], "critic")
    with pytest.raises(RuntimeError, match="disagree on dp_size"):
        check_mesh([RankMesh(0, 1), RankMesh(0, 2)], "actor")
    with pytest.raises(RuntimeError, match=r"DP group 0 \(ranks \[0, 1\]\) must have exactly one collecting rank, found \[0, 1\]"):
        check_mesh([RankMesh(0, 1), RankMesh(0, 1)], "actor")
    with pytest.raises(RuntimeError, match="no rank reported dp_rank 1"):
        check_mesh([RankMesh(0, 2), RankMesh(0, 2, tp_rank=1, is_collect=False)], "actor")
    with pytest.raises(ValueError, match="dp_rank 2 is outside dp_size 2"):
        RankMesh(2, 2)


def test_register_validates_and_is_found_on_subclasses():
    with pytest.raises(ValueError, match="RANK_ZERO cannot be combined with DP_COMPUTE_PROTO"):
        register(Dispatch.DP_COMPUTE_PROTO, execute_mode=Execute.RANK_ZERO)
    with pytest.raises(TypeError, match="dispatch_mode must be a Dispatch member"):
        register("one_to_all")

    class Base(Worker):
        @register(Dispatch.DP_COMPUTE_PROTO, blocking=False)
        def f(self, data):
            return data

    class Child(Base):
        def plain(self):
            return 1

    assert registered_methods(Child) == {"f": MethodSpec(Dispatch.DP_COMPUTE_PROTO, Execute.ALL, False)}


def test_worker_reads_launcher_variables_and_reports_its_mesh(monkeypatch):
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("MASTER_PORT", "1234")
    worker = Worker()
    assert (worker.rank, worker.world_size, worker.master_port) == (3, 4, 1234)
    assert worker.mesh_info() is None
    worker.set_mesh(dp_rank=1, dp_size=2, tp_rank=0, pp_rank=1, pp_size=2)
    assert worker.mesh_info() == RankMesh(1, 2, 0, 1, 0, is_collect=True)
    worker.set_mesh(dp_rank=1, dp_size=2, tp_rank=1, pp_rank=1, pp_size=2)
    assert not worker.mesh_info().is_collect
    monkeypatch.setenv("RANK", "4")
    with pytest.raises(ValueError, match="RANK=4 is outside WORLD_SIZE=4"):
        Worker()
    monkeypatch.setenv("RANK", "x")
    with pytest.raises(ValueError, match="RANK='x' is not an integer"):
        Worker()


def test_colocated_class_routes_each_role_to_its_own_instance():
    cls = create_colocated_worker_cls({"actor": ActorRole, "critic": CriticRole})
    worker = cls(actor={"scale": 2}, critic={"offset": 0.5})
    data = DataProto.from_dict({"ids": torch.arange(3)})
    assert worker.actor__compute_log_prob(data).batch["old_log_probs"].tolist() == [0.0, 2.0, 4.0]
    assert worker.critic__compute_values(data).batch["values"].tolist() == [0.5, 1.5, 2.5]
    assert worker.actor__mesh_info() == RankMesh(0, 1, 0)
    assert worker.critic__mesh_info() is None
    specs = registered_methods(cls)
    assert specs["actor__compute_log_prob"].dispatch_mode is Dispatch.MEGATRON_COMPUTE_PROTO
    assert specs["critic__compute_values"].dispatch_mode is Dispatch.DP_COMPUTE_PROTO
    with pytest.raises(TypeError, match=r"init_args name roles \['reward'\]"):
        cls(reward={})


def test_colocation_and_pool_mapping_reject_bad_input():
    with pytest.raises(ValueError, match="role name 'a__b'"):
        create_colocated_worker_cls({"a__b": ActorRole})
    with pytest.raises(TypeError, match="role 'x'"):
        create_colocated_worker_cls({"x": object})
    with pytest.raises(ValueError, match=r"undefined resource pools: \{'critic': 'gpu2'\}"):
        ResourcePoolManager({"global": [2]}, {"actor": "global", "critic": "gpu2"})
    manager = ResourcePoolManager({"global": [2], "critic_pool": [1, 1]}, {"actor": "global", "ref": "global", "critic": "critic_pool"})
    assert manager.roles_by_pool() == {"global": ["actor", "ref"], "critic_pool": ["critic"]}
    assert manager.pool_for("critic").world_size == 2


def test_worker_pythonpath_puts_the_package_first_and_keeps_user_entries(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "/from/env")
    parts = _worker_pythonpath("/user/a:/from/env").split(":")
    assert parts[1:] == ["/user/a", "/from/env"]
    assert (Path(parts[0]) / "megatron_rl" / "protocol.py").is_file()


def test_a_worker_method_may_not_shadow_the_group_api():
    class Clashing(Worker):
        @register(Dispatch.ONE_TO_ALL)
        def execute_all(self):
            return 0

    group = SimpleNamespace(world_size=1, timeout_s=1.0)
    with pytest.raises(ValueError, match="Clashing.execute_all: the name 'execute_all' is taken by the worker group"):
        RoleGroup(group, "actor", "", Clashing)
