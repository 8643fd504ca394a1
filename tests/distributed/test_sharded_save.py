"""save_sharded (megatron_rl/distributed/sharded_save.py): a synchronous Megatron save starts no process that
outlives it (Megatron's own call leaves a spawned multiprocessing Manager in every saving rank, for the rank's
life), and what it writes loads back, rank by rank, bit for bit. Gloo, 2 ranks."""
from __future__ import annotations

import multiprocessing

import pytest
import torch

from megatron_rl.distributed.spawn import run_multiprocess

pytestmark = pytest.mark.distributed


def _state(rank: int, world: int, fill: float) -> dict:
    from megatron.core.dist_checkpointing import ShardedTensor

    shard = torch.arange(6, dtype=torch.float32).reshape(2, 3) * (rank + 1) + fill
    return {"weight": ShardedTensor.from_rank_offsets("weight", shard, (0, rank, world))}


def save_then_load(directory: str, megatrons_own: bool) -> dict:
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    from megatron_rl.distributed import install_cpu_compat
    from megatron_rl.distributed.sharded_save import save_sharded

    install_cpu_compat()  # Megatron's save synchronises CUDA; on CPU the compatibility layer answers for it
    rank, world = dist.get_rank(), dist.get_world_size()
    saved = _state(rank, world, fill=0.5)
    (dist_checkpointing.save if megatrons_own else save_sharded)(saved, directory)
    children = [child.name for child in multiprocessing.active_children()]
    loaded = dist_checkpointing.load(_state(rank, world, fill=0.0), directory)
    return {"children": children, "equal": torch.equal(loaded["weight"], saved["weight"].data)}


def test_a_save_leaves_no_process_behind_and_loads_back(tmp_path):
    results = run_multiprocess(save_then_load, 2, str(tmp_path), False)
    for rank, result in enumerate(results):
        assert result["children"] == [], f"rank {rank}: the save left {result['children']} running"
        assert result["equal"], f"rank {rank}: its shard did not load back as saved"


def test_megatrons_own_save_leaves_its_manager_running(tmp_path):
    """The cost save_sharded removes, pinned: if a Megatron release stops starting the Manager, this fails and
    save_sharded can go."""
    results = run_multiprocess(save_then_load, 2, str(tmp_path), True)
    assert all(any("Manager" in name for name in result["children"]) for result in results), results
