"""Rollout replicas on several ranks (gloo processes) against the strict SGLang stand-in: 4 trainer ranks with
rollout TP 2 build exactly 2 engines, each on its own 2 GPUs; every rank serializes its bucket on its own GPU
and the leader hands the engine one payload per TP rank; after every sync both engines hold the trainer's
weights exactly; engines started at the same moment by ranks seeded alike do not collide on a port."""

from __future__ import annotations

import os
import random

import pytest
import torch
import torch.distributed as dist

from megatron_rl.distributed.device import DEVICE_INDEX_ENV
from megatron_rl.distributed.spawn import run_multiprocess
from megatron_rl_testing.collective_timeouts import PG_TIMEOUT_S, short_timeout_while_waiting
from megatron_rl_testing.rollout_models import (
    prompt_batch, source_model, tiny_qwen2_config, trainer_log_probs,
)

pytestmark = pytest.mark.distributed


def _replica(model_dir: str, rollout_tp: int, **sync):
    from megatron_rl.config.schema import RolloutConfig, WeightSyncConfig
    from megatron_rl.distributed.device import rank_place
    from megatron_rl.weights import RolloutReplica
    from megatron_rl.rollout.mesh import build_rollout_mesh
    from megatron_rl.rollout.sglang import build_sglang_engine

    rank = dist.get_rank()
    place = rank_place(rank, rank)  # init_distributed bound this process to it
    places = [None] * dist.get_world_size()
    dist.all_gather_object(places, place)
    config = RolloutConfig(name="sglang", tensor_model_parallel_size=rollout_tp, dtype="float32", response_length=5,
                           weight_sync=WeightSyncConfig(bucket_size_mb=1, **sync))

    def build(replica):
        return build_sglang_engine(config, model_dir, replica_index=replica.index, base_gpu_id=replica.base_gpu_id,
                                   eos_token_id=2, pad_token_id=0)

    return RolloutReplica(config, build_rollout_mesh(places, rollout_tp), rank, build, member_dtype=torch.float32,
                          probe_prompts=prompt_batch([3, 4]), trainer_log_prob_fn=_TrainerLogProbs())


class _TrainerLogProbs:
    """The trainer's side of verification: the current source model, on every rank."""

    model = None

    def __call__(self, batch):
        return trainer_log_probs(self.model)(batch)


def _exact(engine, model) -> list[str]:
    held, sent = engine.transport._engine.stand_in_state_dict(), model.state_dict()
    return [name for name in sent if not torch.equal(held[name], sent[name])]


def _four_ranks_two_engines(model_dir: str) -> dict:
    torch.set_num_threads(1)
    replica = _replica(model_dir, 2)
    report = {"leader": replica.is_leader, "replica": replica.replica.index}
    try:
        for version, seed in ((0, 5), (1, 6)):
            source = source_model(seed)
            replica.trainer_log_prob_fn.model = source
            metrics = replica.sync(lambda _plan: source.state_dict().items(), version=version)
            if replica.is_leader:
                report[f"bad_v{version}"] = _exact(replica.engine, source)
            report[f"diff_v{version}"] = metrics["rollout/logprob_diff_max"]
        replica.release()  # a training phase: the engines give their memory back ...
        if replica.is_leader:
            report["released"] = sorted(replica.engine.released)
        replica.trainer_log_prob_fn.model = source = source_model(7)
        replica.sync(lambda _plan: source.state_dict().items(), version=2)  # ... and the next sync brings it back, current
        if replica.is_leader:
            stand_in = replica.engine.transport._engine
            report["bad_v2"] = _exact(replica.engine, source)
            report["gpus"] = stand_in.stand_in_gpus()
            out = replica.generate(prompt_batch([3, 5, 2]))
            report["version"] = out.meta_info["weight_version"]
        return report
    finally:
        replica.shutdown()
        dist.barrier()


def test_four_ranks_with_rollout_tp2_build_two_engines_that_hold_the_trainers_weights(sglang_stand_in, tmp_path):
    tiny_qwen2_config().save_pretrained(tmp_path / "model")
    reports = run_multiprocess(_four_ranks_two_engines, 4, str(tmp_path / "model"), timeout_s=600)
    leaders = [r for r in reports if r["leader"]]
    assert [r["replica"] for r in reports] == [0, 0, 1, 1] and len(leaders) == 2
    node = leaders[0]["gpus"][0][0]
    assert [r["gpus"] for r in leaders] == [[(node, 0), (node, 1)], [(node, 2), (node, 3)]]
    for r in leaders:
        assert r["bad_v0"] == r["bad_v1"] == r["bad_v2"] == [] and r["version"] == 2
        assert r["released"] == ["cuda_graph", "kv_cache", "weights"]
    assert all(r["diff_v0"] < 1e-5 and r["diff_v1"] < 1e-5 for r in reports)


def _unbound_ranks(model_dir: str) -> str:
    replica = _replica(model_dir, 2, verify_freq=0)
    os.environ[DEVICE_INDEX_ENV] = "0"  # every rank on device 0, as when the bundle index picked the GPU
    try:
        replica.sync(lambda _plan: source_model(5).state_dict().items(), version=0)
        return "synced"
    except Exception as exc:  # noqa: BLE001 - the leader's error is the assertion
        return str(exc)
    finally:
        dist.barrier()
        replica.shutdown()


def test_a_rank_that_did_not_bind_its_gpu_is_caught(sglang_stand_in, tmp_path):
    tiny_qwen2_config().save_pretrained(tmp_path / "model")
    leader, _member = run_multiprocess(_unbound_ranks, 2, str(tmp_path / "model"), timeout_s=300)
    assert "payload for TP rank 1 was produced on" in leader and "GPU 0" in leader


def _engine_port(model_dir: str) -> int:
    from megatron_rl.config.schema import RolloutConfig
    from megatron_rl.rollout.sglang import build_sglang_engine

    rank = dist.get_rank()
    random.seed(0)  # ranks seeded alike: SGLang's own port draw would give both the same port
    dist.barrier()  # start both engines at the same moment, as colocated ranks of one node do
    engine = build_sglang_engine(RolloutConfig(name="sglang", dtype="float32", response_length=5), model_dir,
                                 replica_index=rank, base_gpu_id=rank)
    try:
        port = engine.transport._engine.stand_in_port()
        dist.barrier()
        return port
    finally:
        engine.shutdown()


def test_engines_started_together_by_ranks_seeded_alike_get_distinct_ports(sglang_stand_in, tmp_path):
    tiny_qwen2_config().save_pretrained(tmp_path / "model")
    ports = run_multiprocess(_engine_port, 2, str(tmp_path / "model"), timeout_s=300)
    assert len(set(ports)) == 2


def _training_cache_on_every_gpu(model_dir: str) -> dict:
    from sglang._stand_in import devices

    torch.set_num_threads(1)
    replica = _replica(model_dir, 2, verify_freq=0)
    report: dict = {"leader": replica.is_leader}
    try:
        replica.sync(lambda _plan: source_model(5).state_dict().items(), version=0)
        replica.release()  # a training phase starts: the engine gives its memory back ...
        devices.hold_trainer_cache(64 << 20)  # ... and training leaves memory cached on every rank's GPU
        dist.barrier()
        source = source_model(6)
        try:
            replica.sync(lambda _plan: source.state_dict().items(), version=1)
            if replica.is_leader:
                report["bad"] = _exact(replica.engine, source)
                report["version"] = replica.generate(prompt_batch([3, 4])).meta_info["weight_version"]
        except Exception as exc:  # noqa: BLE001 - the leader's error is the assertion
            report["error"] = str(exc)
        report["still_held"] = devices.trainer_cache_on(devices.stand_in_root(), devices.node_name(),
                                                         devices.current_physical_gpu())
        return report
    finally:
        dist.barrier()
        replica.shutdown()


def test_every_rank_gives_its_cached_memory_back_before_the_kv_cache_resumes(sglang_stand_in, tmp_path):
    """Issue 32, item 1: training leaves memory reserved in every rank's caching allocator; the engine's KV
    cache and CUDA graphs resume on every GPU it spans, so the member must empty its cache too, and before the
    leader resumes (the stand-in's scheduler runs out of memory otherwise)."""
    tiny_qwen2_config().save_pretrained(tmp_path / "model")
    leader, member = run_multiprocess(_training_cache_on_every_gpu, 2, str(tmp_path / "model"), timeout_s=300)
    assert "error" not in leader, leader["error"]
    assert leader["bad"] == [] and leader["version"] == 1
    assert leader["still_held"] == {} and member["still_held"] == {}


def _slow_engine_build(model_dir: str) -> dict:
    import megatron_rl.weights.replica as replica_module

    rank = dist.get_rank()
    if rank == 0:
        os.environ["SGLANG_STAND_IN_BUILD_DELAY_S"] = "8"  # the leader's cold build outlasts the 3 s timeout

    def export(_plan):
        dist.all_reduce(torch.ones(1))  # the actor's export starts with collectives (Megatron's TP gathers)
        return source_model(5).state_dict().items()

    with short_timeout_while_waiting(replica_module):
        replica = _replica(model_dir, 2, verify_freq=0)
        os.environ.pop("SGLANG_STAND_IN_BUILD_DELAY_S", None)
        try:
            replica.sync(export, version=0)
            return {"leader": replica.is_leader, "version": replica.version}
        finally:
            replica.shutdown()


def test_members_wait_for_a_slow_engine_build_on_a_long_timeout_group(sglang_stand_in, tmp_path):
    """Issue 32, item 5: the leader builds its engine (here 8 s) while the members would start the first sync's
    collectives, whose timeout (here 3 s, 10 minutes on a cluster) ends the job; they wait on a gloo group with
    a long timeout until every engine exists."""
    tiny_qwen2_config().save_pretrained(tmp_path / "model")
    reports = run_multiprocess(
        _slow_engine_build, 2, str(tmp_path / "model"), timeout_s=300, pg_timeout_s=PG_TIMEOUT_S
    )
    assert [r["version"] for r in reports] == [0, 0]
