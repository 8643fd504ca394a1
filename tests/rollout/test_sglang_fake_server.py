"""SGLangEngine in server mode against the SGLang stand-in's HTTP servers (tests/stand_ins/sglang_server.py):
weight pushes over the update group and as flattened-bucket tensors, the 0.5.23 session rule and the
pre-session branch (a server answering as 0.5.15), batch splitting across servers. After a push the
servers' generations match the trainer's model."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from megatron_rl.config.schema import RolloutConfig, SGLangConfig
from megatron_rl.rollout.base import WeightUpdateError
from megatron_rl.rollout.sglang import SGLangEngine, SGLangServerError, build_sglang_engine
from megatron_rl.rollout.sglang.contract import checked
from megatron_rl.weights.sync import sync_weights
from megatron_rl_testing.rollout_models import (
    EOS, PAD, prompt_batch, source_model, tiny_qwen2_config, trainer_log_probs,
)

R = 8
pytestmark = pytest.mark.distributed  # three server processes and a gloo group across them


SERVER = Path(__file__).resolve().parents[1] / "stand_ins" / "sglang_server.py"


@pytest.fixture(scope="module")
def servers(sglang_stand_in_module, tmp_path_factory):
    """Two 0.5.23 servers and a 0.5.15 one, TP 1 each, on GPUs 0, 1, 2 of this (simulated) node; a tensor
    payload from this process (device 0) is on server 0's GPU, as a same-node tensor transport needs."""
    spec = importlib.util.spec_from_file_location("sglang_stand_in_server", SERVER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    model_dir = tmp_path_factory.mktemp("server_model")
    tiny_qwen2_config().save_pretrained(model_dir)
    started = [module.start(str(model_dir), tp_size=1, base_gpu_id=gpu, version=version)
               for gpu, version in ((0, "0.5.23"), (1, "0.5.23"), (2, "0.5.15"))]
    yield {"current": [url for _, url in started[:2]], "old": started[2][1]}
    for proc, _ in started:
        proc.terminate()
        proc.wait(timeout=60)


def client(urls, weight_transport: str) -> SGLangEngine:
    sglang = SGLangConfig(weight_transport=weight_transport, update_group_backend="gloo", master_address="127.0.0.1")
    cfg = RolloutConfig(name="sglang", mode="server", server_urls=list(urls), response_length=R, dtype="float32",
                        sglang=sglang)
    return build_sglang_engine(cfg, "unused-by-server-mode", eos_token_id=EOS, pad_token_id=PAD)


def expected_greedy(model, prompts) -> torch.Tensor:
    out = model.generate(
        input_ids=prompts.batch["input_ids"],
        attention_mask=prompts.batch["attention_mask"],
        max_new_tokens=R,
        do_sample=False,
        eos_token_id=EOS,
        pad_token_id=PAD,
    )
    out = out[:, prompts.batch["input_ids"].shape[1] :]
    return torch.nn.functional.pad(out, (0, R - out.shape[1]), value=PAD)


def assert_serves(engine: SGLangEngine, model, version: int) -> None:
    prompts = prompt_batch([3, 5, 2, 4, 1, 5], do_sample=False)
    out = engine.generate_sequences(prompts)
    assert torch.equal(out.batch["responses"], expected_greedy(model, prompts))
    torch.testing.assert_close(
        out.batch["rollout_log_probs"], trainer_log_probs(model)(out), atol=1e-5, rtol=0
    )
    assert out.meta_info["weight_version"] == version


def test_distributed_push_to_two_servers_then_generations_match_the_trainer(servers):
    engine = client(servers["current"], weight_transport="distributed")
    try:
        assert engine.uses_session and engine.sglang_version == "0.5.23"
        for version, seed in ((1, 21), (2, 22)):  # the second sync must replace the first everywhere
            source = source_model(seed)
            stats = sync_weights(source.state_dict().items(), engine, version=version, bucket_bytes=4096)
            assert stats.num_buckets > 3
            assert_serves(engine, source, version)
    finally:
        engine.shutdown()


def test_tensor_push_as_flattened_buckets(servers):
    engine = client(servers["current"][:1], weight_transport="tensor")
    try:
        source = source_model(23)
        sync_weights(source.state_dict().items(), engine, version=5, bucket_bytes=4096)
        assert_serves(engine, source, 5)
        sampled = engine.generate_sequences(prompt_batch([4, 2, 3], temperature=1.0))
        mask = sampled.batch["response_mask"].bool()
        torch.testing.assert_close(
            sampled.batch["rollout_log_probs"], trainer_log_probs(source)(sampled), atol=1e-5, rtol=0
        )
        assert (sampled.batch["responses"][~mask] == PAD).all()
    finally:
        engine.shutdown()


def test_pre_session_server_gets_no_begin_or_end(servers):
    """0.5.15 has no /begin_weight_update route (the server answers 404): the adapter must not call it."""
    engine = client([servers["old"]], weight_transport="distributed")
    try:
        assert not engine.uses_session
        source = source_model(24)
        sync_weights(source.state_dict().items(), engine, version=1, bucket_bytes=1 << 20)
        assert_serves(engine, source, 1)
    finally:
        engine.shutdown()


def test_session_rule_and_server_errors_surface_with_sglang_message(servers):
    engine = client(servers["current"][:1], weight_transport="tensor")
    server = engine.transport._servers[0]
    body = {"serialized_named_tensors": ["AA=="], "load_format": "flattened_bucket", "flush_cache": False}
    with pytest.raises(
        SGLangServerError,
        match=r"answered 400: .*must run between begin_weight_update\(\) and end_weight_update\(\)",
    ):
        server.request("/update_weights_from_tensor", body)
    engine.begin_weight_update(1)
    with pytest.raises(WeightUpdateError, match="session is already open"):
        engine.begin_weight_update(2)
    with pytest.raises(SGLangServerError, match="session is already open"):
        server.request("/begin_weight_update", {})
    with pytest.raises(SGLangServerError, match="model.norm.weight"):
        engine.load_named_tensors([("model.norm.weight", torch.zeros(3))])
    engine.abort_weight_update("test")
    with pytest.raises(RuntimeError, match="cannot generate yet: test"):
        engine.generate_sequences(prompt_batch([2]))
    engine.shutdown()


def test_undeclared_fields_never_reach_sglang():
    with pytest.raises(AssertionError, match=r"\['bogus'\] not declared in SGLANG_CONTRACT"):
        checked("route", "/generate", {"input_ids": [], "bogus": 1})
    with pytest.raises(AssertionError, match="min_p"):
        checked("sampling", None, {"temperature": 1.0, "min_p": 0.1})


def test_update_group_address_must_reach_remote_servers():
    from megatron_rl.rollout.sglang.server_transport import update_group_address

    assert update_group_address("127.0.0.1", ["http://127.0.0.1:30000"]) == "127.0.0.1"
    with pytest.raises(ValueError, match="master_address resolves to loopback .*other hosts"):
        update_group_address("127.0.0.1", ["http://10.1.2.3:30000"])


def test_an_external_server_started_with_api_key_takes_the_runs_header(tmp_path, monkeypatch):
    """SGLang's ``--api-key``: the server refuses requests without ``Authorization: Bearer <key>``; with
    MEGATRON_RL_SERVER_API_KEY set to that key the trainer's transport sends it on every request (issue 33)."""
    from megatron_rl.rollout.sglang.contract import SGLangServerError
    from megatron_rl.rollout.sglang.server_transport import ServerHTTP

    spec = importlib.util.spec_from_file_location("sglang_stand_in_server_key", SERVER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    tiny_qwen2_config().save_pretrained(tmp_path)
    proc, url = module.start(str(tmp_path), tp_size=1, base_gpu_id=3, api_key="external-key")
    try:
        monkeypatch.setenv("MEGATRON_RL_SERVER_API_KEY", "another-key")
        with pytest.raises(SGLangServerError, match="answered 401"):
            ServerHTTP(url, 30).request("/server_info", method="GET")
        monkeypatch.setenv("MEGATRON_RL_SERVER_API_KEY", "external-key")
        engine = client([url], "distributed")  # reads /server_info, with the header
        engine.shutdown()
    finally:
        proc.terminate()
        proc.wait(timeout=60)
