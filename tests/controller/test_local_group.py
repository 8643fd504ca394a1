"""LocalWorkerGroup (torchrun mode): every rank runs the driver loop and gets the same answer, but only the
results the plan reads travel — a non-collecting TP/PP rank's copy of a MEGATRON_COMPUTE_PROTO result is not
exchanged, so each rank receives the batch once instead of once per model-parallel rank."""

from __future__ import annotations

import os
import pickle

import pytest
import torch
import torch.distributed as dist

from megatron_rl.distributed.spawn import run_multiprocess
from megatron_rl_testing.collective_timeouts import PG_TIMEOUT_S, short_timeout_while_waiting

pytestmark = pytest.mark.distributed


def _gathered_bytes_of_one_megatron_call() -> dict:
    from controller_workers import ProbeWorker

    from megatron_rl.controller.local_group import LocalWorkerGroup
    from megatron_rl.protocol import DataProto

    os.environ.update(FAKE_TP="2", FAKE_PP="2")  # world 8: DP 2, collectors rank 4 (dp 0) and rank 6 (dp 1)
    group = LocalWorkerGroup(ProbeWorker(), "probe")
    sent: list[int] = []
    real = dist.all_gather_object

    def counting(outputs, obj, group=None):
        sent.append(len(pickle.dumps(obj)))
        return real(outputs, obj, group=group)

    dist.all_gather_object = counting
    try:
        rows = 64
        data = DataProto.from_dict({"ids": torch.arange(rows)}, {"uid": [f"u{i}" for i in range(rows)]})
        out = group.tag_megatron(data)
    finally:
        dist.all_gather_object = real
    return {"ids": out.batch["ids"].tolist(), "rank": out.batch["rank"].tolist(), "sent": sent[-1]}


def test_only_the_collecting_ranks_results_are_exchanged():
    reports = run_multiprocess(_gathered_bytes_of_one_megatron_call, 8, timeout_s=300)
    assert all(r["ids"] == list(range(64)) for r in reports)  # every rank drives with the same answer
    assert all(r["rank"] == [4] * 32 + [6] * 32 for r in reports)
    senders = [rank for rank, r in enumerate(reports) if r["sent"] > 100]
    assert senders == [4, 6]  # 2 shards (= the batch once) travel, not 8


def _slow_leader_call() -> str:
    import time

    from megatron_rl.controller import Dispatch, Execute, Worker, local_group, register

    class SlowLeader(Worker):
        @register(Dispatch.ONE_TO_ALL, execute_mode=Execute.RANK_ZERO)  # rank 0 alone runs it
        def generate(self, seconds: float) -> str:
            time.sleep(seconds)  # the leaders generate; the other ranks have no share of the call
            return f"generated on rank {self.rank}"

    with short_timeout_while_waiting(local_group):
        group = local_group.LocalWorkerGroup(SlowLeader(), "slow")
        return group.generate(8.0)


def test_ranks_wait_for_a_long_generation_longer_than_the_collective_timeout():
    """Issue 32, item 3: under torchrun every rank runs the driver; while rank 0 generates (8 s here, an hour on
    a cluster) the others wait for the exchange. They must wait on a long-timeout gloo group, not in the
    exchange's collective, whose timeout (3 s here, NCCL's 10 minutes on a cluster) would end the job."""
    results = run_multiprocess(_slow_leader_call, 2, timeout_s=120, pg_timeout_s=PG_TIMEOUT_S)
    assert results == ["generated on rank 0"] * 2
