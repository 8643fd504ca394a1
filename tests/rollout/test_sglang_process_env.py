"""sglang.Engine() rewrites its caller's process (0.5.23 ``_set_envs_and_config``: NCCL/CUDA variables, the
multiprocessing start method, SIGQUIT/SIGTERM handlers), and only the replica leader builds one: after the
engine starts, leader and member must still create communicators with the same settings, and the leader keeps
its own start method and handlers (issue 32, item 13). 2 gloo ranks, rollout TP 2, the SGLang stand-in."""

from __future__ import annotations

import multiprocessing
import os
import signal
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from megatron_rl.distributed.spawn import run_multiprocess
from megatron_rl_testing.rollout_models import prompt_batch, tiny_qwen2_config

pytestmark = pytest.mark.distributed

PER_RANK = ("RANK", "LOCAL_RANK", "MEGATRON_RL_DEVICE_INDEX", "CUDA_VISIBLE_DEVICES")


def _trainers_sigterm(signum, frame):  # the trainer's stop-and-checkpoint handler, as far as the test cares
    pass


def _trainers_sigquit(signum, frame):
    pass


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in PER_RANK and not k.startswith("SGLANG_")}


def _start_engine(model_dir: str) -> dict:
    from megatron_rl.config.schema import RolloutConfig, WeightSyncConfig
    from megatron_rl.distributed.device import rank_place
    from megatron_rl.rollout.mesh import build_rollout_mesh
    from megatron_rl.rollout.sglang import build_sglang_engine
    from megatron_rl.weights import RolloutReplica
    from megatron_rl.workers.hybrid import agree_with_the_rollout_engine

    torch.set_num_threads(1)
    signal.signal(signal.SIGTERM, _trainers_sigterm)
    signal.signal(signal.SIGQUIT, _trainers_sigquit)
    multiprocessing.set_start_method("forkserver", force=True)
    config = RolloutConfig(name="sglang", tensor_model_parallel_size=2, dtype="float32", response_length=5,
                           weight_sync=WeightSyncConfig(bucket_size_mb=1, verify_freq=0))
    before = _env()
    agree_with_the_rollout_engine(SimpleNamespace(actor_rollout_ref=SimpleNamespace(rollout=config)))  # worker init
    rank = dist.get_rank()
    places = [None] * dist.get_world_size()
    dist.all_gather_object(places, rank_place(rank, rank))

    def build(replica):
        return build_sglang_engine(config, model_dir, replica_index=replica.index, base_gpu_id=replica.base_gpu_id,
                                   eos_token_id=2, pad_token_id=0)

    replica = RolloutReplica(config, build_rollout_mesh(places, 2), rank, build, member_dtype=torch.float32,
                             probe_prompts=prompt_batch([3, 4]), trainer_log_prob_fn=None)
    try:
        after = _env()
        return {
            "leader": replica.is_leader,
            "changed": {k: after.get(k) for k in set(before) | set(after) if before.get(k) != after.get(k)},
            "env": after,
            "start_method": multiprocessing.get_start_method(allow_none=True),
            "sigterm_kept": signal.getsignal(signal.SIGTERM) is _trainers_sigterm,
            "sigquit_kept": signal.getsignal(signal.SIGQUIT) is _trainers_sigquit,
        }
    finally:
        replica.shutdown()
        dist.barrier()


def test_engine_start_leaves_leader_and_member_with_the_same_process_settings(sglang_stand_in, tmp_path,
                                                                              monkeypatch):
    tiny_qwen2_config().save_pretrained(tmp_path / "model")
    # the ranks start from this process's environment, where an earlier test's `import vllm` may have set these
    for name in ("NCCL_CUMEM_ENABLE", "NCCL_NVLS_ENABLE"):
        monkeypatch.delenv(name, raising=False)
    leader, member = run_multiprocess(_start_engine, 2, str(tmp_path / "model"), timeout_s=300)
    assert leader["leader"] and not member["leader"]
    # what every rank must agree on is set on every rank, to SGLang's values, before any communicator
    assert member["changed"] == leader["changed"] == {"NCCL_CUMEM_ENABLE": "0", "NCCL_NVLS_ENABLE": "0"}
    assert leader["env"] == member["env"]  # nothing else the engine wrote stayed in the leader's environment
    assert leader["start_method"] == member["start_method"] == "forkserver"
    assert leader["sigterm_kept"] and leader["sigquit_kept"]
