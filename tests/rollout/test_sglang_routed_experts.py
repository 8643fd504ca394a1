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
