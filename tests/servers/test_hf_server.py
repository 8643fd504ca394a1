"""The HF-engine rollout server (megatron_rl/rollout/hf_server.py) driven by the trainer's own SGLang server
client (rollout.name=hf, rollout.mode=server): weights over a gloo update group, verified against the
trainer's log-probs after each sync, versions on every result, refusals by name, a killed server named."""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request

import pytest
import torch
import torch.distributed as dist

from megatron_rl.config.schema import RolloutConfig
from megatron_rl.distributed.spawn import run_multiprocess
from megatron_rl.servers.client import ServerRolloutClient
from megatron_rl.servers.fleet import ServerProcessPool
from megatron_rl.servers.hf_launch import HFServerLaunch
from megatron_rl.servers.pool import RolloutServerDied
from megatron_rl_testing.rollout_models import (
    EOS, PAD, prompt_batch, source_model, tiny_qwen2_config, trainer_log_probs,
)

pytestmark = [pytest.mark.distributed]


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    model_dir = tmp_path_factory.mktemp("hf_server_model")
    tiny_qwen2_config().save_pretrained(model_dir)
    servers = ServerProcessPool(HFServerLaunch(str(model_dir)), 1)
    yield servers
    servers.close()


def _headers(auth: bool) -> dict:
    """The run's own header (the secret the pool gave its servers, in this process's environment), or none."""
    key = os.environ.get("MEGATRON_RL_SERVER_API_KEY")
    return {"Authorization": f"Bearer {key}"} if auth and key else {}


def _post(url: str, route: str, body: dict, auth: bool = True) -> tuple[int, dict]:
    req = urllib.request.Request(url + route, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json", **_headers(auth)})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def _get(url: str, route: str, auth: bool = True) -> tuple[int, dict]:
    req = urllib.request.Request(url + route, headers=_headers(auth))
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def server_replica(urls: list[str], source, *, eos_token_id=EOS, master_address: str = "127.0.0.1",
                   broken_group_wait_s: float = 30.0, model_path: str = "unused", **rollout: object):
    """This process as the trainer's rank 0 in server mode: the replica whose engine syncs the HF-engine
    servers at ``urls`` over gloo (every sync verified against ``source``'s log-probs). ``model_path``: the
    served model's directory (routing replay reads its layers and top-k)."""
    from megatron_rl.config.schema import RolloutConfig, SGLangConfig, WeightSyncConfig
    from megatron_rl.weights import RolloutReplica
    from megatron_rl.rollout import build_rollout_engine
    from megatron_rl.rollout.mesh import server_mesh

    torch.set_num_threads(1)
    config = RolloutConfig(
        name="hf", mode="server", server_urls=list(urls), dtype="auto",
        sglang=SGLangConfig(update_group_backend="gloo", master_address=master_address,
                            broken_group_wait_s=broken_group_wait_s),
        weight_sync=WeightSyncConfig(bucket_size_mb=1, verify_freq=1, verify_max_logprob_diff=1e-5), **rollout,
    )
    return RolloutReplica(
        config, server_mesh(dist.get_world_size()), dist.get_rank(),
        lambda r: build_rollout_engine(config, model_path, eos_token_id=eos_token_id, pad_token_id=PAD),
        member_dtype=torch.float32, probe_prompts=prompt_batch([3, 4]), trainer_log_prob_fn=trainer_log_probs(source),
    )


def _sync_twice_and_generate(url: str, master_address: str = "127.0.0.1") -> dict:
    source = source_model(41)
    replica = server_replica([url], source, response_length=5, master_address=master_address)
    report: dict = {"dtype": str(replica.engine.dtype)}
    try:
        for version in (1, 2):
            metrics = replica.sync(lambda _plan: source.state_dict().items(), version=version)
            report[f"diff_v{version}"] = metrics["rollout/logprob_diff_max"]
            source = source_model(42)
            replica.trainer_log_prob_fn = trainer_log_probs(source)
        replica.release()  # a training phase: servers keep serving (an async loop generates during it)
        out = replica.generate(prompt_batch([3, 5], do_sample=True, seed=7))
        report["version"] = out.meta_info["weight_version"]
        report["again"] = torch.equal(out.batch["responses"],
                                      replica.generate(prompt_batch([3, 5], do_sample=True, seed=7)).batch["responses"])
        return report
    finally:
        replica.shutdown()


def test_trainer_syncs_and_verifies_through_the_gloo_update_group(pool):
    url = pool.urls[0]
    status, answer = _post(url, "/generate", {"input_ids": [[5, 6]], "return_logprob": True, "sampling_params":
                                             [{"max_new_tokens": 3, "stop_token_ids": [EOS]}]})
    assert status == 400 and "never synced" in answer["message"]  # random weights are never served
    [report] = run_multiprocess(_sync_twice_and_generate, 1, url, timeout_s=300)
    assert report["dtype"] == "torch.float32"  # rollout.dtype=auto on the CPU servers
    assert report["diff_v1"] < 1e-5 and report["diff_v2"] < 1e-5
    assert report["version"] == 2 and report["again"]  # same seed, same samples
    status, info = _get(url, "/server_info")
    assert status == 200 and info["weight_version"] == "2" and info["tp_size"] == 1


def test_refusals_name_the_route_and_field(pool):
    url = pool.urls[0]
    status, answer = _post(url, "/generate", {"input_ids": [[5]], "sampling_params": [{}], "text": "hi"})
    assert status == 400 and "unknown fields ['text']" in answer["message"]
    status, answer = _post(url, "/update_weights_from_distributed", {
        "names": ["x"], "dtypes": ["float32"], "shapes": [[1]], "group_name": "nope",
        "flush_cache": False, "load_format": "flattened_bucket", "weight_version": "3"})
    assert status == 400 and "group 'nope'" in answer["message"]
    status, answer = _post(url, "/resume_memory_occupation", {"tags": ["kv_cache"]})
    assert status == 400 and "never released" in answer["message"]


def _foreign_sync(url: str) -> str:
    """Someone else on this host, without the run's secret: hosts a weight-update group, has the server join it
    and broadcasts weights of their own as version 666 (SGLang's routes, through the project's own client)."""
    os.environ.pop("MEGATRON_RL_SERVER_API_KEY", None)
    try:
        replica = server_replica([url], source_model(66), response_length=3)
        try:
            replica.sync(lambda _plan: source_model(66).state_dict().items(), version=666)
        finally:
            replica.shutdown()
    except Exception as exc:  # noqa: BLE001 - the refusal is the result
        return f"refused: {exc}"
    return "replaced"


def test_a_client_without_the_run_secret_is_refused(pool):
    """Issue 33, item 2. Before: any process that reached the port could pause generation, release memory and
    replace the served weights (a foreign version 666 was served). Now every route needs the run's secret
    (``Authorization: Bearer``); without it: 401 and no detail; the run's own client still works."""
    url = pool.urls[0]
    [outcome] = run_multiprocess(_foreign_sync, 1, url, timeout_s=300)
    status, info = _get(url, "/server_info")
    assert status == 200 and info["weight_version"] != "666", "a client without the secret replaced the weights"
    assert outcome.startswith("refused") and "401" in outcome
    for route, body in [("/pause_generation", {"mode": "abort"}), ("/release_memory_occupation", {"tags": None}),
                        ("/begin_weight_update", {}), ("/generate", {"input_ids": [[5]], "sampling_params": [{}]}),
                        ("/nope", {})]:
        status, answer = _post(url, route, body, auth=False)
        assert status == 401 and answer == {"detail": "Unauthorized"}, (route, status, answer)
    for route in ("/server_info", "/health"):
        assert _get(url, route, auth=False) == (401, {"detail": "Unauthorized"}), route
    wrong = urllib.request.Request(url + "/health", headers={"Authorization": "Bearer not-the-secret"})
    with pytest.raises(urllib.error.HTTPError, match="401"):
        urllib.request.urlopen(wrong, timeout=30)
    assert _get(url, "/health")[0] == 200 and _post(url, "/continue_generation", {})[0] == 200  # the run's own


def test_a_killed_server_is_named_and_replaced(pool):  # last: it replaces the module's server
    victim = pool.servers[0]
    victim.proc.kill()
    victim.proc.wait()
    with pytest.raises(RolloutServerDied, match=rf"rollout server 0 \({victim.url}, pid {victim.proc.pid}\) exited"):
        pool.check()
    client = ServerRolloutClient(RolloutConfig(), pool.urls, response_length=3, eos_token_id=EOS, pad_token_id=PAD,
                                 timeout_s=30, pool=pool)
    with pytest.raises(RolloutServerDied, match=r"rollout server 0 .* exited with code -9"):
        client.generate_sequences(prompt_batch([3]))  # a generation on a dead server fails fast, naming it
    client.close()
    new_url = pool.replace(0)
    pool.check()
    assert new_url != victim.url and pool.urls == [new_url]
    status, answer = _post(new_url, "/generate", {"input_ids": [[5, 6]], "return_logprob": True, "sampling_params":
                                                 [{"max_new_tokens": 3, "stop_token_ids": [EOS]}]})
    assert status == 400 and "never synced" in answer["message"]  # a replacement serves after the next sync
