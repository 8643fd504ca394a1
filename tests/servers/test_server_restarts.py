"""Rollout servers killed (SIGKILL) during a run and replaced (actor_rollout_ref.rollout.server_restarts;
servers/restarts.py): two real HF-engine server processes synced by the trainer's own server engine
over a gloo update group. The async loops' client re-issues a killed server's held rows to the survivor and
every token keeps the version that sampled it; the replacement refuses to generate until the next sync joins it
to a fresh update group; the synchronous loop's workers re-sync the current version and generate the batch
again; once the restarts are used up, a death fails naming the server, its exit code and the key."""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from test_hf_server import _post, server_replica

from megatron_rl.distributed.spawn import run_multiprocess
from megatron_rl.servers.fleet import ServerProcessPool
from megatron_rl.servers.hf_launch import HFServerLaunch
from megatron_rl.servers.pool import RolloutServerDied
from megatron_rl_testing.rollout_models import PAD, prompt_batch, source_model, tiny_qwen2_config

pytestmark = [pytest.mark.distributed]

LENGTH = 8
NEVER_EOS = [10_000]  # a stop token the tiny vocabulary never samples: every response is LENGTH tokens


class _ReplicaWorkers:
    """What the actor/rollout workers do in server mode, in one process: sync (weights of ``source``),
    generate, and point the engine at replaced servers."""

    def __init__(self, replica, source) -> None:
        self.replica, self.source = replica, source

    def sync_weights(self, version: int, defer_verify: bool = False) -> dict:
        return self.replica.sync(lambda _plan: self.source.state_dict().items(), version=version,
                                 defer_verify=defer_verify)

    def verify_weights(self) -> dict:
        return self.replica.verify_pending()

    def generate_sequences(self, prompts):
        return self.replica.generate(prompts)

    def replace_rollout_servers(self, urls: list[str]) -> list[str]:
        return self.replica.replace_servers(urls)


def _kill(pool: ServerProcessPool, index: int) -> None:
    os.kill(pool.servers[index].proc.pid, signal.SIGKILL)
    pool.servers[index].proc.wait()


def _wait_until(cond, what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def _kill_and_replace(model_dir: str) -> dict:
    from megatron_rl.servers.client import ServerRolloutClient
    from megatron_rl.servers.restarts import RestartingSync, ServerRestarts

    report: dict = {}
    pool = ServerProcessPool(HFServerLaunch(model_dir, chunk_tokens=1), 2)
    source = source_model(41)
    replica = server_replica(pool.urls, source, eos_token_id=NEVER_EOS, response_length=LENGTH, temperature=1.0)
    config = replica.config
    restarts = ServerRestarts(pool, 2)
    workers = RestartingSync(_ReplicaWorkers(replica, source), restarts)
    client = ServerRolloutClient(config, pool.urls, response_length=LENGTH, eos_token_id=NEVER_EOS,
                                 pad_token_id=PAD, timeout_s=60, restarts=restarts)
    background = ThreadPoolExecutor(max_workers=1)
    try:
        workers.sync_weights(1)
        # -- async loops: server 0 dies holding paused requests; the survivor takes its rows over ----------
        batch = prompt_batch([3, 4, 5, 3], do_sample=True, seed=3)
        client.pause_generation()  # the servers hold every request until the continue: in flight at the kill
        rolled = background.submit(client.generate_sequences, batch)
        time.sleep(0.5)
        _kill(pool, 0)
        _wait_until(lambda: restarts.count == 1, "the replacement of server 0")
        status, answer = _post(pool.urls[0], "/generate", {
            "input_ids": [[5, 6]], "return_logprob": True, "sampling_params": [{"max_new_tokens": 2, "stop_token_ids": NEVER_EOS}]})
        report["fresh_refuses"] = (status, answer.get("message"))
        # inside the pause, as fully async syncs (verified after the continue: the paused servers hold the probe)
        report["sync_metrics"] = workers.sync_weights(2, True)
        client.continue_generation()
        report["sync_metrics"] |= workers.workers.verify_weights()
        out = rolled.result(timeout=120)
        report["rows"] = len(out)
        report["lengths"] = [len(v) for v in out.non_tensor_batch["token_weight_versions"]]
        report["token_versions"] = [v.tolist() for v in out.non_tensor_batch["token_weight_versions"]]
        report["served_after_sync"] = [_post_info(url) for url in pool.urls]
        again = client.generate_sequences(prompt_batch([3, 4, 5, 3], do_sample=True, seed=3))
        report["versions_after"] = sorted(set(again.non_tensor_batch["weight_version"].tolist()))
        # -- synchronous loop: server 1 dies under the workers' generation --------------------------------
        first = workers.generate_sequences(batch)
        _kill(pool, 1)
        repeated = workers.generate_sequences(batch)
        report["sync_restarts"] = restarts.count
        report["sync_version"] = repeated.meta_info["weight_version"]
        report["sync_same_samples"] = torch.equal(first.batch["responses"], repeated.batch["responses"])
        report["metrics"] = workers.sync_weights(3)
        # -- restarts used up: the next death fails, naming the server, its exit code and the key ----------
        _kill(pool, 0)
        try:
            client.generate_sequences(batch)
        except RolloutServerDied as exc:
            report["exhausted"] = str(exc)
        try:
            ServerRestarts(pool, 0).handle()
        except RolloutServerDied as exc:
            report["fail_fast"] = str(exc)
        return report
    finally:
        background.shutdown(wait=True)
        client.close()
        replica.shutdown()
        pool.close()


def _post_info(url: str) -> str:
    from megatron_rl.rollout.sglang.server_transport import ServerHTTP

    return ServerHTTP(url, 30).request("/server_info", method="GET")["weight_version"]  # with the run's secret


def test_killed_servers_are_replaced_synced_and_their_rows_reissued(tmp_path):
    tiny_qwen2_config().save_pretrained(tmp_path)
    [report] = run_multiprocess(_kill_and_replace, 1, str(tmp_path), timeout_s=300)
    # the replacement serves nothing before it has the run's weights
    status, message = report["fresh_refuses"]
    assert status == 400 and "never synced" in message, report["fresh_refuses"]
    assert report["sync_metrics"]["rollout/server_restarts"] == 1.0
    assert report["sync_metrics"]["rollout/logprob_diff_max"] < 1e-5  # both servers verified at v2
    # no row lost or duplicated, every response whole, every token sampled after the sync (v2)
    assert report["rows"] == 4 and report["lengths"] == [LENGTH] * 4
    assert report["token_versions"] == [[2] * LENGTH] * 4
    assert report["served_after_sync"] == ["2", "2"]
    assert report["versions_after"] == [2]
    # synchronous loop: replaced, synced to the current version, the batch generated again (same seeds)
    assert report["sync_restarts"] == 2 and report["sync_version"] == 2 and report["sync_same_samples"]
    assert report["metrics"]["rollout/server_restarts"] == 2.0
    assert "rollout server 0" in report["exhausted"] and "exited with code -9" in report["exhausted"]
    assert "2 of actor_rollout_ref.rollout.server_restarts=2 replacements are used" in report["exhausted"]
    assert "actor_rollout_ref.rollout.server_restarts=0" in report["fail_fast"]
    assert "exited with code -9" in report["fail_fast"]


@pytest.mark.parametrize("overrides, message", [
    (["actor_rollout_ref.rollout.server_restarts=-1"], "server_restarts=-1 must be >= 0"),
    (["actor_rollout_ref.rollout.sglang.broken_group_wait_s=0"], "broken_group_wait_s=0.0 must be > 0 seconds"),
    (["actor_rollout_ref.rollout.server_restarts=1"], "needs rollout.mode=server, rollout.name=hf"),
    (["actor_rollout_ref.rollout.server_restarts=1", "actor_rollout_ref.rollout.mode=server",
      "actor_rollout_ref.rollout.server_urls=[http://a:1]"], "servers started elsewhere are not ours to restart"),
    (["actor_rollout_ref.rollout.server_restarts=1", "actor_rollout_ref.rollout.mode=server",
      "actor_rollout_ref.rollout.num_servers=2", "trainer.launcher=torchrun"], "needs trainer.launcher=ray"),
    (["actor_rollout_ref.rollout.server_restarts=1", "actor_rollout_ref.rollout.mode=server",
      "actor_rollout_ref.rollout.num_servers=1", "trainer.launcher=ray", "async_training.mode=one_step_off"],
     "one_step_off needs rollout.num_servers >= 2"),
])
def test_server_restarts_refusals_name_the_key(overrides, message):
    from megatron_rl.config import load_config, ConfigError
    from megatron_rl.plan.validate import validate

    with pytest.raises(ConfigError, match=message):
        validate(load_config(overrides=overrides))
