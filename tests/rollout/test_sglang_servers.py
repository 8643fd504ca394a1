"""Server mode (``rollout.mode=server``) with several trainer ranks against the stand-in's HTTP server of TP 2
(tests/stand_ins/sglang_server.py): exactly one rank (global rank 0) sends — it alone opens the server's
weight-update session and is rank 0 of the update group — and the group's world size is 1 + the servers'
real TP (from /server_info), not the local rollout config; after every sync the server serves the trainer's
weights."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from megatron_rl.distributed.spawn import run_multiprocess
from megatron_rl_testing.rollout_models import (
    EOS, PAD, prompt_batch, source_model, tiny_qwen2_config, trainer_log_probs,
)

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
SERVER = Path(__file__).resolve().parents[1] / "stand_ins" / "sglang_server.py"


@pytest.fixture(scope="module")
def server(sglang_stand_in_module, tmp_path_factory):
    spec = importlib.util.spec_from_file_location("sglang_stand_in_server", SERVER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    model_dir = tmp_path_factory.mktemp("server_model")
    tiny_qwen2_config().save_pretrained(model_dir)
    proc, url = module.start(str(model_dir), tp_size=2, env={"SGLANG_STAND_IN_NODE": "rollout-node"}, base_gpu_id=2)
    yield url
    proc.terminate()
    proc.wait(timeout=60)


def _ranks_sync_through_one_sender(url: str) -> dict:
    from megatron_rl.config.schema import RolloutConfig, SGLangConfig, WeightSyncConfig
    from megatron_rl.weights import RolloutReplica
    from megatron_rl.rollout.mesh import server_mesh
    from megatron_rl.rollout.sglang import build_sglang_engine

    torch.set_num_threads(1)
    config = RolloutConfig(
        name="sglang", mode="server", server_urls=[url], dtype="float32", response_length=5,
        tensor_model_parallel_size=1,  # the local config says 1: the servers' real TP (2) must win
        sglang=SGLangConfig(update_group_backend="gloo", master_address="127.0.0.1"),
        weight_sync=WeightSyncConfig(bucket_size_mb=1, verify_freq=1, verify_max_logprob_diff=1e-5),
    )
    source = source_model(31)
    rank = dist.get_rank()
    replica = RolloutReplica(
        config, server_mesh(dist.get_world_size()), rank,
        lambda r: build_sglang_engine(config, "unused", eos_token_id=EOS, pad_token_id=PAD),
        member_dtype=torch.float32, probe_prompts=prompt_batch([3, 4]), trainer_log_prob_fn=trainer_log_probs(source),
    )
    report = {"has_engine": replica.engine is not None}
    try:
        for version in (1, 2):
            metrics = replica.sync(lambda _plan: source.state_dict().items(), version=version)
            report[f"diff_v{version}"] = metrics["rollout/logprob_diff_max"]
            source = source_model(32)
            replica.trainer_log_prob_fn = trainer_log_probs(source)
        if replica.is_leader:
            report["world"] = 1 + sum(replica.engine.transport.server_tp)
            out = replica.generate(prompt_batch([3, 5], do_sample=False))
            report["version"] = out.meta_info["weight_version"]
        return report
    finally:
        dist.barrier()
        replica.shutdown()


def test_one_sender_and_the_servers_real_tp(server):
    reports = run_multiprocess(_ranks_sync_through_one_sender, 2, server, timeout_s=600)
    assert [r["has_engine"] for r in reports] == [True, False]
    assert reports[0]["world"] == 3 and reports[0]["version"] == 2
    assert all(r["diff_v1"] < 1e-5 and r["diff_v2"] < 1e-5 for r in reports)
