"""The rollout mesh: one engine per rollout-TP group of consecutive GPUs of one node, led by its first GPU's
rank; the planner and the workers get their engine count from the same function."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from megatron_rl.distributed.device import GPU_ID_ENV, NODE_ID_ENV, RankPlace, rank_place
from megatron_rl.rollout.mesh import build_rollout_mesh, default_places, server_mesh


def test_70b_layout_is_eight_engines_of_eight_gpus_one_per_node():
    mesh = build_rollout_mesh(default_places(64, 8), 8)
    assert mesh.num_engines == 8 and mesh.leaders == [0, 8, 16, 24, 32, 40, 48, 56]
    for i, replica in enumerate(mesh.replicas):
        assert replica.ranks == tuple(range(8 * i, 8 * i + 8)) and replica.gpus == tuple(range(8))
        assert replica.node == f"node{i}" and replica.base_gpu_id == 0
    assert mesh.replica_of(13).index == 1 and mesh.is_leader(8) and not mesh.is_leader(9)


def test_two_engines_per_node_start_at_their_own_gpu():
    mesh = build_rollout_mesh(default_places(8, 4), 2)
    assert [r.ranks for r in mesh.replicas] == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert [r.base_gpu_id for r in mesh.replicas] == [0, 2, 0, 2]
    assert [r.node for r in mesh.replicas] == ["node0", "node0", "node1", "node1"]


def test_ray_gpu_order_decides_the_engine_not_the_rank_order():
    # Ray may give bundle 0 GPU 3: an engine's ranks are those on consecutive GPUs, led by the lowest GPU.
    places = [RankPlace(0, "a", 3, 3), RankPlace(1, "a", 0, 0), RankPlace(2, "a", 2, 2), RankPlace(3, "a", 1, 1)]
    mesh = build_rollout_mesh(places, 2)
    assert [(r.ranks, r.gpus, r.leader) for r in mesh.replicas] == [((2, 0), (2, 3), 2), ((1, 3), (0, 1), 1)]


@pytest.mark.parametrize(
    ("places", "tp", "message"),
    [
        (default_places(6, 3), 2, "node node0 holds 3 ranks, not a multiple of .*tensor_model_parallel_size=2"),
        ([RankPlace(0, "a", 0, 0), RankPlace(1, "a", 2, 2)], 2, "needs 2 consecutive GPUs"),
        ([RankPlace(0, "a", 0, 0), RankPlace(1, "a", 0, 0)], 1, "two ranks on one GPU"),
        ([RankPlace(0, "a", 0, 0), RankPlace(2, "a", 1, 1)], 1, "must cover ranks 0..1"),
        (default_places(2, 2), 0, "must be >= 1"),
    ],
)
def test_layouts_an_engine_cannot_have_are_named(places, tp, message):
    with pytest.raises(ValueError, match=message):
        build_rollout_mesh(places, tp)


def test_server_mode_has_one_sender():
    mesh = server_mesh(4)
    assert mesh.num_engines == 1 and mesh.leaders == [0] and mesh.replica_of(3).ranks == (0, 1, 2, 3)


def test_rank_place_under_torchrun_and_under_ray():
    torchrun = {"LOCAL_RANK": "1", "GROUP_RANK": "1"}
    assert rank_place(5, 1, torchrun).gpu == 1 and rank_place(5, 1, torchrun).node.endswith("/1")
    # Ray with all GPUs visible: the device is the GPU Ray assigned, whatever the bundle index
    ray_env = {"LOCAL_RANK": "0", GPU_ID_ENV: "6", NODE_ID_ENV: "n1", "CUDA_VISIBLE_DEVICES": "4,5,6,7"}
    assert rank_place(2, 0, ray_env) == RankPlace(2, "n1", 6, 2)
    with pytest.raises(ValueError, match="GPU 6 .* is not among the visible devices"):
        rank_place(2, 0, {GPU_ID_ENV: "6", "CUDA_VISIBLE_DEVICES": "0"})
    with pytest.raises(ValueError, match="LOCAL_RANK=3 but only 2 devices are visible"):
        rank_place(3, 3, {"CUDA_VISIBLE_DEVICES": "0,1"})


def test_the_plan_prints_the_engines_the_workers_build():
    out = subprocess.run(
        [sys.executable, "-m", "megatron_rl.plan", "+experiment=grpo_70b"],
        capture_output=True, text=True, timeout=300, check=True,
    ).stdout
    engines, tp = map(int, re.search(r"rollout: (\d+) \w+ engines of TP (\d+)", out).groups())
    assert (engines, tp) == (build_rollout_mesh(default_places(64, 8), 8).num_engines, 8) == (8, 8)
