"""Config parsing, refusal messages and size arithmetic (no Megatron import, milliseconds)."""

import json

import pytest

from megatron_rl.models.hf_config import UnsupportedModelError, load_hf_config, parse_hf_config
from megatron_rl.models.sizes import check_parallel_fit, padded_vocab_size

BASE = {
    "vocab_size": 300,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-5,
}


def cfg(arch: str = "LlamaForCausalLM", **fields):
    return {**BASE, "architectures": [arch], **fields}


@pytest.mark.parametrize(
    "arch, qkv_bias, qk_norm",
    [
        ("LlamaForCausalLM", False, False),
        ("Qwen2ForCausalLM", True, False),
        ("Qwen3ForCausalLM", False, True),
        ("MistralForCausalLM", False, False),
    ],
)
def test_families_map_to_megatron_features(arch, qkv_bias, qk_norm):
    hf = parse_hf_config(cfg(arch, head_dim=16))
    assert (hf.qkv_bias, hf.qk_norm) == (qkv_bias, qk_norm)
    assert hf.head_dim == 16 and hf.q_size == 64 and hf.kv_size == 32


def test_head_dim_defaults_to_hidden_over_heads_and_kv_heads_to_heads():
    hf = parse_hf_config({**cfg(), "num_key_value_heads": None})
    assert hf.head_dim == 8 and hf.num_key_value_heads == 4


def test_rope_read_from_transformers_5_and_4_formats():
    v5 = parse_hf_config(
        cfg(
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 5e5,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            }
        )
    )
    v4 = parse_hf_config(cfg(rope_theta=5e5, rope_scaling={"type": "linear", "factor": 2.0}))
    assert (v5.rope_theta, v5.rope_scaling.kind, v5.rope_scaling.factor) == (5e5, "llama3", 8.0)
    assert (v4.rope_theta, v4.rope_scaling.kind, v4.rope_scaling.factor) == (5e5, "linear", 2.0)


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"architectures": ["GemmaForCausalLM"]}, "supported: LlamaForCausalLM, Qwen2ForCausalLM"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
        ({"attention_bias": True}, "attention_bias=true"),
        ({"mlp_bias": True}, "mlp_bias=true"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "rope type 'yarn'"),
        (
            {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "high_freq_factor": 2.0}},
            "high_freq_factor=2.0",
        ),
        ({"num_key_value_heads": 3}, "not a multiple of num_key_value_heads=3"),
    ],
)
def test_unsupported_configs_are_refused_with_the_field(fields, message):
    with pytest.raises(UnsupportedModelError, match=message.replace("(", r"\(")):
        parse_hf_config({**cfg(), **fields}, source="x/config.json")


def test_qwen_per_layer_sliding_windows_refused_mistral_window_kept():
    with pytest.raises(UnsupportedModelError, match="use_sliding_window"):
        parse_hf_config(cfg("Qwen2ForCausalLM", use_sliding_window=True))
    assert parse_hf_config(cfg("MistralForCausalLM", sliding_window=4096)).sliding_window == 4096
    assert parse_hf_config(cfg("LlamaForCausalLM", sliding_window=4096)).sliding_window is None


def test_load_hf_config_reads_directory_and_names_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_hf_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(cfg("Qwen2ForCausalLM", tie_word_embeddings=True)))
    hf = load_hf_config(tmp_path)
    assert hf.tie_word_embeddings and hf.source.endswith("config.json") and hf.raw["vocab_size"] == 300


def test_padded_vocab_size():
    assert padded_vocab_size(300, tp=1) == 384
    assert padded_vocab_size(300, tp=2) == 512
    assert padded_vocab_size(256, tp=2) == 256
    assert padded_vocab_size(151936, tp=8, divisible_by=128) == 152576


@pytest.mark.parametrize(
    "tp, pp, vpp, message",
    [
        (3, 1, None, "num_attention_heads=4 is not divisible by TP=3"),
        (1, 3, None, r"num_hidden_layers=4 is not divisible by PP\*VPP=3\*1=3"),
        (1, 2, 4, r"PP\*VPP=2\*4=8"),
    ],
)
def test_parallel_fit_errors_name_the_numbers(tp, pp, vpp, message):
    with pytest.raises(ValueError, match=message):
        check_parallel_fit(parse_hf_config(cfg()), tp, pp, vpp)


def test_tp_beyond_kv_heads_allowed_when_groups_split_evenly():
    check_parallel_fit(parse_hf_config(cfg(num_key_value_heads=1)), 2, 1, None)
    odd = parse_hf_config({**cfg(num_key_value_heads=1), "num_attention_heads": 8, "head_dim": 3})
    with pytest.raises(ValueError, match="q/k/v rows over 8 ranks"):
        check_parallel_fit(odd, 8, 1, None)
    with pytest.raises(ValueError, match="multiple or a divisor of TP=4"):
        check_parallel_fit(
            parse_hf_config({**cfg(num_key_value_heads=3), "num_attention_heads": 12}), 4, 1, None
        )


# ------------------------------------------------------------------ model.override_config (issue 14 item 3)
def test_override_config_reaches_the_megatron_facts_and_the_hf_engine(tmp_path):
    """actor_rollout_ref.model.override_config is applied wherever the HF config is read: the facts the
    Megatron builder uses (load_hf_config), transformers' config (load_pretrained_config) and the HF
    rollout engine the factory builds; SGLang, which reads config.json itself, refuses it by name."""
    from omegaconf import OmegaConf

    from megatron_rl.config.schema import RolloutConfig
    from megatron_rl.models.hf_config import load_hf_config, load_pretrained_config
    from megatron_rl_testing.tiny_models import make_tiny_hf_checkpoint
    from megatron_rl.rollout import build_rollout_engine

    model = make_tiny_hf_checkpoint(tmp_path / "qwen2", "qwen2", with_tokenizer=False)
    override = OmegaConf.create({"rms_norm_eps": 1e-3})
    assert load_hf_config(model).rms_norm_eps != 1e-3
    facts = load_hf_config(model, override)
    assert facts.rms_norm_eps == 1e-3 and "override_config ['rms_norm_eps']" in facts.source
    assert load_pretrained_config(model, override).rms_norm_eps == 1e-3

    engine = build_rollout_engine(RolloutConfig(name="hf"), model, response_length=2, override_config=override)
    assert engine.model.config.rms_norm_eps == 1e-3
    plain = build_rollout_engine(RolloutConfig(name="hf"), model, response_length=2)
    assert plain.model.config.rms_norm_eps != 1e-3
    with pytest.raises(ValueError, match="override_config=.*cannot reach sglang rollout servers"):
        build_rollout_engine(RolloutConfig(name="sglang", mode="server", server_urls=["http://x:1"]), model,
                             response_length=2, override_config=override)


def test_override_config_reaches_a_colocated_sglang_engine(tmp_path, monkeypatch):
    """SGLang reads config.json itself: the overrides go as its json_model_override_args (a ServerArgs
    field of 0.5.23, listed in the contract the contract test checks against the wheel)."""
    from omegaconf import OmegaConf

    from megatron_rl.config.schema import RolloutConfig
    from megatron_rl.rollout import build_rollout_engine
    from megatron_rl.rollout.sglang import SGLANG_CONTRACT, engine_transport

    seen = {}

    class Captured(Exception):
        pass

    class FakeTransport:
        def __init__(self, server_args, **kwargs):
            seen.update(server_args)
            raise Captured

    monkeypatch.setattr(engine_transport, "InProcessTransport", FakeTransport)
    override = OmegaConf.create({"rope_theta": 1e6})
    with pytest.raises(Captured):
        build_rollout_engine(RolloutConfig(name="sglang"), tmp_path, response_length=2, override_config=override)
    assert json.loads(seen["json_model_override_args"]) == {"rope_theta": 1e6}
    assert "json_model_override_args" in SGLANG_CONTRACT["server_args"]
    seen.clear()
    with pytest.raises(Captured):
        build_rollout_engine(RolloutConfig(name="sglang"), tmp_path, response_length=2)
    assert "json_model_override_args" not in seen


def test_sglang_servers_with_override_config_are_refused_before_launch():
    from megatron_rl.config import ConfigError, load_config
    from megatron_rl.plan.validate import validate

    override = "+actor_rollout_ref.model.override_config.rope_theta=1e6"
    validate(load_config(overrides=["+experiment=grpo_70b", override]))  # colocated: the engine gets it
    cfg = load_config(overrides=["+experiment=grpo_70b", override, "actor_rollout_ref.rollout.mode=server",
                                 "actor_rollout_ref.rollout.server_urls=[http://x:1]"])
    with pytest.raises(ConfigError, match="override_config=.*sglang rollout servers never see it"):
        validate(cfg)
