"""SGLang's routed experts (routing replay R3) through the adapter, against the strict 0.5.23 stand-in: the
engine is started with enable_return_routed_experts, every request asks for them, each result's base64 int32
[prompt + output - 1, layers, top-k] payload lands at its row of batch['routed_experts'] (-1 on padding and on
the last token); requests without the server flag, results without the payload, bad payloads are refused."""

from __future__ import annotations

import base64

import pytest
import torch

from megatron_rl.config.schema import RolloutConfig
from megatron_rl.rollout.routed_experts import decode_sglang_routing
from megatron_rl.rollout.sglang import build_sglang_engine
from megatron_rl.rollout.sglang.contract import SGLangServerError
from megatron_rl.weights.sync import sync_weights
from megatron_rl_testing.rollout_models import prompt_batch
from megatron_rl_testing.tiny_models import make_tiny_hf_checkpoint


@pytest.fixture
def moe_dir(tmp_path):
    return str(make_tiny_hf_checkpoint(tmp_path / "moe", "qwen3_moe", with_tokenizer=False))


def engine_for(model_dir: str, **rollout):
    config = RolloutConfig(name="sglang", response_length=4, dtype="float32", **rollout)
    return build_sglang_engine(config, model_dir, eos_token_id=2, pad_token_id=0)


def routers_of(model_dir: str, tokens: list[int]) -> torch.Tensor:
    """[tokens, layers, k] the HF model's routers choose for ``tokens`` in one padding-free forward."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    seen = {}
    for j, m in enumerate(r for r in model.modules() if type(r).__name__.endswith("TopKRouter")):
        m.register_forward_hook(lambda mod, i, o, j=j: seen.__setitem__(j, o[2]))
    with torch.no_grad():
        model(input_ids=torch.tensor([tokens]))
    return torch.stack([seen[j] for j in sorted(seen)], dim=1)


def test_routed_experts_arrive_at_their_rows(sglang_stand_in, moe_dir):
    from transformers import AutoModelForCausalLM

    engine = engine_for(moe_dir, enable_rollout_routing_replay=True)
    try:
        assert engine.transport._engine.get_server_info()["enable_return_routed_experts"] is True
        sync_weights(AutoModelForCausalLM.from_pretrained(moe_dir).state_dict().items(), engine, version=0)
        out = engine.generate_sequences(prompt_batch([3, 5], temperature=1.0, seed=1))
    finally:
        engine.shutdown()
    routed, mask = out.batch["routed_experts"], out.batch["attention_mask"].bool()
    assert routed.dtype == torch.int16 and routed.shape == (*mask.shape, 2, 2) and (routed[~mask] == -1).all()
    for row in range(2):
        tokens = out.batch["input_ids"][row][mask[row]].tolist()
        real = routed[row][mask[row]]
        assert (real[-1] == -1).all()  # the last sampled token was never computed
        expected = routers_of(moe_dir, tokens[:-1])
        assert torch.equal(real[:-1].sort(-1).values, expected.to(torch.int16).sort(-1).values), row


def test_the_stand_in_refuses_routed_experts_without_the_server_flag(sglang_stand_in, moe_dir):
    engine = engine_for(moe_dir)
    try:
        sglang_engine = engine.transport._engine
        with pytest.raises(ValueError, match="needs the engine started with enable_return_routed_experts=True"):
            sglang_engine.generate(input_ids=[[3, 4]], sampling_params={"max_new_tokens": 2}, return_routed_experts=True)
        engine.transport.routed_experts = False
        engine.routing_shape = (2, 2)  # an adapter asking for routing whose results carry none: refused by row
        sync_weights(__import__("transformers").AutoModelForCausalLM.from_pretrained(moe_dir).state_dict().items(),
                     engine, version=0)
        with pytest.raises(RuntimeError, match=r"SGLang result 0 has no meta_info.routed_experts"):
            engine.generate_sequences(prompt_batch([3], temperature=1.0))
    finally:
        engine.shutdown()


def test_bad_payloads_and_dense_models_are_refused(tmp_path):
    good = torch.arange(3 * 2 * 2, dtype=torch.int32).numpy()
    assert decode_sglang_routing(base64.b64encode(good.tobytes()).decode(), 2, 2, "r").shape == (3, 2, 2)
    with pytest.raises(ValueError, match=r"r: meta_info.routed_experts holds 44 bytes, not a multiple of 4 x 2 layers"):
        decode_sglang_routing(base64.b64encode(good[:-1].tobytes()).decode(), 2, 2, "r")
    dense = make_tiny_hf_checkpoint(tmp_path / "dense", "qwen2", with_tokenizer=False)
    with pytest.raises(ValueError, match=r"enable_rollout_routing_replay=true needs an MoE model; SGLang's model"):
        engine_for(str(dense), enable_rollout_routing_replay=True)


def _server_mode_routing(url: str, model_dir: str) -> dict:
    """Trainer rank 0 in server mode against the stand-in's HTTP server: sync the MoE weights, generate with R3."""
    from transformers import AutoModelForCausalLM

    from megatron_rl.config.schema import SGLangConfig

    torch.set_num_threads(1)
    config = RolloutConfig(name="sglang", mode="server", server_urls=[url], response_length=4, dtype="float32",
                           enable_rollout_routing_replay=True,
                           sglang=SGLangConfig(update_group_backend="gloo", master_address="127.0.0.1"))
    engine = build_sglang_engine(config, model_dir, eos_token_id=2, pad_token_id=0)
    try:
        sync_weights(AutoModelForCausalLM.from_pretrained(model_dir).state_dict().items(), engine, version=1)
        out = engine.generate_sequences(prompt_batch([3, 5], temperature=1.0, seed=1))
        return {k: out.batch[k] for k in ("input_ids", "attention_mask", "routed_experts")}
    finally:
        engine.shutdown()


@pytest.mark.distributed
def test_server_mode_asks_the_servers_for_routing_and_refuses_servers_without_the_flag(sglang_stand_in, moe_dir):
    """rollout.mode=server with R3: each /generate asks return_routed_experts and the rows get the servers' routing;
    servers started without --enable-return-routed-experts are refused before generating (their /server_info),
    and the stand-in's HTTP server answers such a request with a 400, as the Engine refuses it."""
    import sglang_server

    from megatron_rl.distributed.spawn import run_multiprocess
    from megatron_rl.rollout.sglang.server_transport import ServerHTTP

    env = {"SGLANG_STAND_IN_NODE": "rollout-node"}
    with_flag, url = sglang_server.start(moe_dir, tp_size=1, env=env, enable_return_routed_experts=True)
    without, bare_url = sglang_server.start(moe_dir, tp_size=1, env=env, base_gpu_id=1)
    try:
        [got] = run_multiprocess(_server_mode_routing, 1, url, moe_dir, timeout_s=300)
        body = {"input_ids": [[3, 4]], "sampling_params": [{"max_new_tokens": 2}], "return_routed_experts": True}
        with pytest.raises(SGLangServerError, match="400.*needs the engine started with enable_return_routed_experts"):
            ServerHTTP(bare_url, 30).request("/generate", body)
        config = RolloutConfig(name="sglang", mode="server", server_urls=[bare_url], response_length=4,
                               dtype="float32", enable_rollout_routing_replay=True)
        with pytest.raises(ValueError, match=r"the SGLang servers \['http.*'\] do not report routed experts: start "
                                             "them with --enable-return-routed-experts"):
            build_sglang_engine(config, moe_dir, eos_token_id=2, pad_token_id=0)
    finally:
        for proc in (with_flag, without):
            proc.terminate()
            proc.wait(timeout=60)
    routed, mask = got["routed_experts"], got["attention_mask"].bool()
    assert routed.shape == (*mask.shape, 2, 2) and (routed[~mask] == -1).all()
    for row in range(2):
        tokens = got["input_ids"][row][mask[row]].tolist()
        real = routed[row][mask[row]]
        assert (real[-1] == -1).all()
        expected = routers_of(moe_dir, tokens[:-1])
        assert torch.equal(real[:-1].sort(-1).values, expected.to(torch.int16).sort(-1).values), row
