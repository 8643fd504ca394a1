"""Issue 49, item 6: a sync's verification runs the probe on each replica's leader while every other rank
waits for its output. That wait must be on the host group (long timeout), not in the gather of the outputs:
on GPUs the gather is an NCCL collective whose watchdog ends the job after 10 minutes, and a probe on a large
model generates longer than that. Here two replicas (rollout TP 1), the first leader's probe takes 8 s and the
default group's collectives time out after 3 s while the leaders generate (as the engine-build test of
test_sglang_replica.py does)."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from megatron_rl.distributed.spawn import run_multiprocess
from megatron_rl_testing.collective_timeouts import PG_TIMEOUT_S, WAIT_TIMEOUT_S, short_timeout_while_waiting
from megatron_rl_testing.rollout_models import make_engine, prompt_batch, source_model, trainer_log_probs

pytestmark = pytest.mark.distributed

PROBE_SECONDS = 8  # longer than WAIT_TIMEOUT_S


def _slow_probe_on_rank0() -> dict:
    import megatron_rl.weights.replica as replica_module
    from megatron_rl.config.schema import RolloutConfig, WeightSyncConfig
    from megatron_rl.distributed.device import rank_place
    from megatron_rl.rollout.mesh import build_rollout_mesh
    from megatron_rl.weights import RolloutReplica

    assert PROBE_SECONDS > WAIT_TIMEOUT_S
    torch.set_num_threads(1)
    rank = dist.get_rank()
    source = source_model(5)

    def build(_replica):
        engine = make_engine()
        if rank == 0:
            generate = engine.generate_sequences

            def slow(prompts):
                time.sleep(PROBE_SECONDS)  # a long probe generation (a cold or large engine)
                return generate(prompts)

            engine.generate_sequences = slow
        return engine

    mesh = build_rollout_mesh([rank_place(r, r) for r in range(2)], 1)
    config = RolloutConfig(weight_sync=WeightSyncConfig(bucket_size_mb=1, verify_freq=1))
    replica = RolloutReplica(config, mesh, rank, build, member_dtype=torch.float32,
                             probe_prompts=prompt_batch([3, 5]), trainer_log_prob_fn=trainer_log_probs(source))
    try:
        dist.barrier()
        with short_timeout_while_waiting(replica_module, from_now=True):
            metrics = replica.sync(lambda _plan: source.state_dict().items(), version=1)
        return {"version": replica.version, "diff": metrics["rollout/logprob_diff_max"]}
    finally:
        replica.shutdown()


def test_ranks_wait_for_a_slow_probe_on_the_host_group_not_in_a_collective():
    reports = run_multiprocess(_slow_probe_on_rank0, 2, timeout_s=300, pg_timeout_s=PG_TIMEOUT_S)
    assert [r["version"] for r in reports] == [1, 1]
    assert all(r["diff"] < 1e-5 for r in reports), reports
