"""A rollout server SIGKILLed in the middle of a weight sync (servers/restarts.py, the broken broadcast in
rollout/sglang/server_transport.py): two real HF-engine server processes synced over a gloo update group,
server 1 killed right after the first bucket of version 2 went out (a model of several 1 MB buckets, so the
survivor holds a half-applied update at the kill).

Where the kill strikes decides whether the survivor received the failed bucket or is left stuck in its
receive (as with NCCL, nothing tells it the peer is gone); both must end the same way. Without restarts the
sync fails within seconds naming the server, its exit code, the version and the key; with a restart the dead
server is replaced (a stuck survivor too), the update group rebuilt, and version 2 synced again from the
start: both servers verified against the trainer's log-probs. With two trainer ranks (TP=2: rank 1 exports
its shards towards the sender) both ranks fail the sync together and retry it together. With fully async's
partial rollouts the servers are paused holding a batch's rows through the whole failed and retried sync: a
death while the group is joined leaves the survivor stuck in the rendezvous, every server is replaced, and the
held rows wait for the retried sync instead of failing for want of a server with the last weights."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.distributed as dist
from test_hf_server import _post, server_replica
from test_server_restarts import LENGTH, NEVER_EOS, _kill, _post_info, _ReplicaWorkers, _wait_until

from megatron_rl.distributed.spawn import run_multiprocess
from megatron_rl.servers.fleet import ServerProcessPool
from megatron_rl.servers.hf_launch import HFServerLaunch
from megatron_rl.servers.pool import RolloutServerDied
from megatron_rl_testing.rollout_models import (
    PAD, prompt_batch, source_model, tiny_qwen2_config, trainer_log_probs,
)

pytestmark = [pytest.mark.distributed]

WAIT_S = 5.0  # rollout.sglang.broken_group_wait_s: how long a survivor may take to answer the broken bucket


def _config():
    return tiny_qwen2_config(intermediate_size=4096)  # ~6 MB of weights: several 1 MB buckets


def _kill_after_first_bucket(replica, pool: ServerProcessPool, report: dict) -> list:
    """From now on: once bucket 1 of the next sync reached both servers, SIGKILL server 1 (deterministic)."""
    transport, loads = replica.engine.transport, []
    load_bucket = transport.load_bucket

    def load_then_kill(bucket) -> None:
        load_bucket(bucket)
        loads.append(len(bucket.entries))
        if len(loads) == 1:
            report["killed_pid"] = pool.servers[1].proc.pid
            _kill(pool, 1)

    transport.load_bucket = load_then_kill
    return loads


def _kill_while_joining(replica, pool: ServerProcessPool, report: dict) -> None:
    """The next update group's join: SIGKILL server 1 just before the trainer asks the servers to join, so the
    survivor is left waiting in the rendezvous for a member that never comes (deterministically stuck)."""
    transport = replica.engine.transport
    join = transport._join_update_group

    def kill_then_join():
        if "killed_pid" not in report:
            report["killed_pid"] = pool.servers[1].proc.pid
            _kill(pool, 1)
        return join()

    transport._join_update_group = kill_then_join


def _kill_joining_while_paused(model_dir: str) -> dict:
    """Fully async's partial rollouts: the servers paused with a batch's rows held on them, server 1 dies, and
    its replacement dies as the sync rebuilds the update group, leaving server 0 (holding every row by then)
    stuck in the rendezvous: replaced too. No server holds the last weights until the retried sync ends, so
    the held rows must wait for it and finish on the new version, whole."""
    from megatron_rl.servers.client import ServerRolloutClient
    from megatron_rl.servers.restarts import RestartingSync, ServerRestarts

    report: dict = {}
    pool = ServerProcessPool(HFServerLaunch(model_dir, chunk_tokens=1), 2)
    source = source_model(41, _config())
    replica = server_replica(pool.urls, source, eos_token_id=NEVER_EOS, response_length=LENGTH, temperature=1.0,
                             broken_group_wait_s=WAIT_S)
    restarts = ServerRestarts(pool, 2)
    workers = RestartingSync(_ReplicaWorkers(replica, source), restarts)
    client = ServerRolloutClient(replica.config, pool.urls, response_length=LENGTH, eos_token_id=NEVER_EOS,
                                 pad_token_id=PAD, timeout_s=120, restarts=restarts)
    background = ThreadPoolExecutor(max_workers=1)
    try:
        workers.sync_weights(1)
        client.pause_generation()  # as fully async before a sync: every request is held until the continue
        rolled = background.submit(client.generate_sequences, prompt_batch([3, 4, 5, 3], do_sample=True, seed=3))
        time.sleep(0.5)
        _kill(pool, 1)  # its held rows move to server 0
        _wait_until(lambda: restarts.count == 1, "the replacement of server 1")
        _kill_while_joining(replica, pool, report)  # the sync's fresh group: its replacement dies as it is joined
        source = source_model(42, _config())
        workers.workers.source, replica.trainer_log_prob_fn = source, trainer_log_probs(source)
        start = time.monotonic()
        report["metrics"] = workers.sync_weights(2, True)
        report["seconds"] = time.monotonic() - start
        client.continue_generation()
        report["metrics"] |= workers.workers.verify_weights()
        out = rolled.result(timeout=120)
        report["rows"] = len(out)
        report["token_versions"] = [v.tolist() for v in out.non_tensor_batch["token_weight_versions"]]
        report["served"] = [_post_info(url) for url in pool.urls]
        return report
    finally:
        background.shutdown(wait=False)
        client.close()
        replica.shutdown()
        pool.close()


def _kill_during_sync(model_dir: str, budget: int) -> dict:
    from megatron_rl.servers.restarts import RestartingSync, ServerRestarts

    report: dict = {}
    pool = ServerProcessPool(HFServerLaunch(model_dir), 2)
    source = source_model(41, _config())
    replica = server_replica(pool.urls, source, eos_token_id=NEVER_EOS, response_length=4, broken_group_wait_s=WAIT_S)
    workers = RestartingSync(_ReplicaWorkers(replica, source), ServerRestarts(pool, budget))
    try:
        workers.sync_weights(1)
        source = source_model(42, _config())  # a training step: the next version differs
        workers.workers.source, replica.trainer_log_prob_fn = source, trainer_log_probs(source)
        loads = _kill_after_first_bucket(replica, pool, report)
        start = time.monotonic()
        try:
            report["metrics"] = workers.sync_weights(2)
        except RolloutServerDied as exc:
            report["error"], report["cause"] = str(exc), str(exc.__context__)
        report["seconds"] = time.monotonic() - start
        report["loads"] = len(loads)
        report["trainer_version"] = replica.version
        if "metrics" not in report:
            if "stuck in the broken collective" not in report["cause"]:  # a stuck one answers nothing (SGLang too)
                report["survivor"] = _post(pool.urls[0], "/generate", {
                    "input_ids": [[5, 6]], "return_logprob": True,
                    "sampling_params": [{"max_new_tokens": 2, "stop_token_ids": NEVER_EOS}]})[0]
            return report
        report["served"] = [_post_info(url) for url in pool.urls]
        report["next"] = workers.sync_weights(3)  # the rebuilt group carries the next sync too
        report["generated_version"] = replica.generate(prompt_batch([3, 4], seed=1)).meta_info["weight_version"]
        return report
    finally:
        replica.shutdown()
        pool.close()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("sync_death_model")
    _config().save_pretrained(path)
    return str(path)


def test_death_during_sync_without_restarts_fails_fast_naming_the_server(model_dir):
    [report] = run_multiprocess(_kill_during_sync, 1, model_dir, 0, timeout_s=180)
    error = report.get("error", "")
    assert f"rollout server 1 (http://127.0.0.1:" in error and f"pid {report['killed_pid']}" in error, report
    assert "exited with code -9 during the weight sync to version 2" in error, error
    assert "actor_rollout_ref.rollout.server_restarts=0" in error, error
    assert report["seconds"] < WAIT_S + 15, report["seconds"]  # not the update group's 10-minute timeout
    cause = report["cause"]  # what each server did with the broken bucket
    assert "the broadcast of weight version 2" in cause and "server 1 (http://127.0.0.1:" in cause, cause
    if "survivor" in report:  # it received the bucket: a half-applied v2, which it refuses to serve
        assert "server 0 (http://127.0.0.1:" in cause and report["survivor"] == 400, report
    assert report["trainer_version"] == 1


def test_death_during_sync_with_a_restart_resyncs_every_server(model_dir):
    [report] = run_multiprocess(_kill_during_sync, 1, model_dir, 1, timeout_s=180)
    assert "error" not in report, report["error"]
    metrics = report["metrics"]
    assert metrics["rollout/server_restarts"] == 1.0  # the death; a survivor it left stuck is replaced for free
    assert metrics["rollout/stuck_servers_replaced"] in (0.0, 1.0)
    assert metrics["weight_sync/version"] == 2.0 and metrics["weight_sync/num_buckets"] > 1
    assert metrics["rollout/logprob_diff_max"] < 1e-5  # probe on both servers (one row each) against the trainer
    assert report["loads"] > metrics["weight_sync/num_buckets"]  # the first try's bucket, then all of them again
    assert report["served"] == ["2", "2"] and report["trainer_version"] == 2
    assert report["next"]["rollout/logprob_diff_max"] < 1e-5 and report["generated_version"] == 3
    assert report["seconds"] < WAIT_S + 60, report["seconds"]


def _two_ranks_kill_during_sync(model_dir: str) -> dict:
    """Rank 0 sends to the servers, rank 1 only exports (an all_reduce per tensor, as Megatron's TP export
    gathers shards). Server 1 dies during sync 2; then rank 0 replaces it and both ranks sync 2 again."""
    rank, report = dist.get_rank(), {}
    pool = ServerProcessPool(HFServerLaunch(model_dir), 2) if rank == 0 else None
    urls = [pool.urls if rank == 0 else None]
    dist.broadcast_object_list(urls, src=0)
    source = source_model(41, _config())
    replica = server_replica(urls[0], source, eos_token_id=NEVER_EOS, response_length=4, broken_group_wait_s=WAIT_S)

    def export(_plan=None):  # a collective per tensor: a rank that stopped pulling would leave the other one waiting
        for name, tensor in source.state_dict().items():
            dist.all_reduce(torch.zeros(1))
            yield name, tensor

    try:
        replica.sync(export, version=1)
        if rank == 0:
            _kill_after_first_bucket(replica, pool, report)
        start = time.monotonic()
        try:
            replica.sync(export, version=2)
        except Exception as exc:
            report["error"] = f"{type(exc).__name__}: {exc}"
        report["seconds"] = time.monotonic() - start
        urls = [None]
        if rank == 0:  # what RestartingSync does: the dead server (and a stuck survivor) replaced
            pool.replace(1)
            stuck = replica.replace_servers(pool.urls)
            for url in stuck:
                pool.replace(pool.urls.index(url))
            if stuck:
                replica.replace_servers(pool.urls)
            report["stuck"] = len(stuck)
        report["retry"] = replica.sync(export, version=2)
        report["version"] = replica.version
        return report
    finally:
        replica.shutdown()
        if pool is not None:
            pool.close()


def test_two_trainer_ranks_fail_the_sync_together_and_retry_it(model_dir):
    sender, exporter = run_multiprocess(_two_ranks_kill_during_sync, 2, model_dir, timeout_s=240)
    assert sender["error"].startswith("UpdateGroupBroken: the broadcast of weight version 2"), sender["error"]
    assert exporter["error"].startswith(
        "WeightSyncError: rank 0, the rollout servers' sender, failed the weight sync to version 2"), exporter["error"]
    for report in (sender, exporter):
        assert report["seconds"] < WAIT_S + 15, report["seconds"]
        assert report["retry"]["rollout/logprob_diff_max"] < 1e-5 and report["version"] == 2


def test_death_while_joining_with_paused_rows_replaces_the_stuck_survivor_and_finishes_them(model_dir):
    [report] = run_multiprocess(_kill_joining_while_paused, 1, model_dir, timeout_s=240)
    metrics = report["metrics"]
    # server 1 and its replacement dead, server 0 left in the rendezvous: all replaced, two against the budget
    assert metrics["rollout/server_restarts"] == 2.0 and metrics["rollout/stuck_servers_replaced"] == 1.0, metrics
    assert metrics["weight_sync/version"] == 2.0 and metrics["rollout/logprob_diff_max"] < 1e-5
    assert report["served"] == ["2", "2"]
    assert report["seconds"] < WAIT_S + 60, report["seconds"]  # not the group's 10-minute timeout
    # the rows held through it all: none lost or doubled, whole, every token sampled after the sync
    assert report["rows"] == 4 and report["token_versions"] == [[2] * LENGTH] * 4, report
