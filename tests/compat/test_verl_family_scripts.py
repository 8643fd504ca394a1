"""verl's example scripts for the model families of issue 52 (verl-project/verl at 1dda039b9, recorded with a stub
python3 as tests/compat/test_verl_current_scripts.py records its scripts; VERL_USE_UV=0, HOME=/HOME, and for the
scripts that require them MODEL_PATH / HDFS_ROOT / DATA_ROOT / RAY_DATA_HOME set to /HOME paths): through the verl
entry with each model's config.json facts, a family megatron-rl does not build is refused first, by its
architecture, with what is missing (models/unbuilt.py; before, the scripts stopped at the first of their keys
instead), and the DeepSeek-V3 ones reach the layout and key checks:

- grpo_trainer/run_deepseek_v3_671b_megatron.sh: its rollout engines of TP 32 span four nodes, which colocated
  engines here cannot;
- grpo_trainer/run_moonlight_16b_a3b_megatron.sh: it starts from a converted Megatron checkpoint
  (use_dist_checkpointing=True); megatron-rl loads the HF checkpoint, and without that key the script plans.
- mtp_trainer/run_mimo_7b_mtp_megatron.sh: it trains the MTP layer (detach_encoder) at CP 2, where the MTP loss is
  not built; at CP 1 it plans, the MTP layer counted.
- run_hy_v3_megatron.sh: Hy3 is built; its rollout engines of TP 16 span two nodes, which colocated engines here
  cannot (at TP 8 its weights leave no KV cache: the planner says so); its optim.min_lr maps to min_lr_ratio and
  its override_transformer_config repeats moe_router_enable_expert_bias=True, which config.json sets already.
- refused by architecture: grpo_trainer/run_qwen3_5_35b_megatron.sh (Gated DeltaNet, a VL model),
  run_kimi_k2_6_glm5_1_megatron_lite.sh (both variants: Kimi-K2.6 is a VL model, GLM-5.1 needs DSA),
  run_nemotron_nano_v3_30b_a3b_megatron.sh (Mamba layers), run_deepseek_v4_flash_megatron.sh (compressed sparse
  attention)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_rl.compat.verl.trainer.main_ppo import translate
from megatron_rl.config import ConfigError, load_config
from megatron_rl.plan import build_plan
from megatron_rl.plan.validate import validate

SCRIPTS = Path(__file__).with_name("verl_scripts") / "families"
DEEPSEEK_V3 = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 7168,
               "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
               "num_nextn_predict_layers": 1, "num_attention_heads": 128, "num_key_value_heads": 128,
               "n_shared_experts": 1, "n_routed_experts": 256, "routed_scaling_factor": 2.5, "kv_lora_rank": 512,
               "q_lora_rank": 1536, "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128,
               "topk_method": "noaux_tc", "n_group": 8, "topk_group": 4, "num_experts_per_tok": 8, "moe_layer_freq": 1,
               "first_k_dense_replace": 3, "norm_topk_prob": True, "scoring_func": "sigmoid", "hidden_act": "silu",
               "max_position_embeddings": 163840, "rms_norm_eps": 1e-6, "rope_theta": 10000,
               "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                                "original_max_position_embeddings": 4096, "type": "yarn"},
               "tie_word_embeddings": False, "vocab_size": 129280, "attention_bias": False}
MOONLIGHT_16B = {**DEEPSEEK_V3, "hidden_size": 2048, "intermediate_size": 11264, "moe_intermediate_size": 1408,
                 "num_hidden_layers": 27, "num_attention_heads": 16, "num_key_value_heads": 16, "n_shared_experts": 2,
                 "n_routed_experts": 64, "routed_scaling_factor": 2.446, "q_lora_rank": None, "n_group": 1,
                 "topk_group": 1, "num_experts_per_tok": 6, "first_k_dense_replace": 1, "max_position_embeddings": 8192,
                 "rms_norm_eps": 1e-5, "rope_theta": 50000.0, "rope_scaling": None, "vocab_size": 163840,
                 "num_nextn_predict_layers": 0}

# MiMo-7B: Qwen2's block (q/k/v bias) and one multi-token-prediction layer
MIMO_7B = {"architectures": ["MiMoForCausalLM"], "model_type": "mimo", "attention_bias": True, "hidden_act": "silu",
           "hidden_size": 4096, "intermediate_size": 11008, "max_position_embeddings": 32768,
           "num_attention_heads": 32, "num_hidden_layers": 36, "num_key_value_heads": 8,
           "num_nextn_predict_layers": 1, "rms_norm_eps": 1e-5, "rope_theta": 640000, "tie_word_embeddings": False,
           "use_sliding_window": False, "vocab_size": 151680}

# Hy3 (transformers' HYV3Config defaults, the Hy3-preview checkpoint's sizes): Qwen3's attention, 192 sigmoid-routed
# experts with the correction bias, one shared expert, the first layer dense, one MTP layer (skipped)
HY3 = {"architectures": ["HYV3ForCausalLM"], "model_type": "hy_v3", "vocab_size": 120832, "hidden_size": 4096,
       "intermediate_size": 13312, "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8,
       "head_dim": 128, "num_experts": 192, "num_experts_per_tok": 8, "num_shared_experts": 1,
       "moe_intermediate_size": 1536, "router_scaling_factor": 2.826, "max_position_embeddings": 131072,
       "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "num_nextn_predict_layers": 1,
       "rope_parameters": {"rope_theta": 11158840.0, "rope_type": "default"}}


def _declared(architecture: str) -> dict:
    """A family refused by name: only its declared architecture is read before the refusal."""
    return {"architectures": [architecture], "hidden_size": 4096, "num_hidden_layers": 48, "num_attention_heads": 32,
            "vocab_size": 151936}


# script -> (its model's config.json facts, the refusal it meets)
EXPECTED = {
    "deepseek_v3_671b": (DEEPSEEK_V3, r"rollout.tensor_model_parallel_size=32 does not divide trainer.n_gpus_per_node="
                                      r"8: a colocated engine cannot span two nodes"),
    "moonlight_16b_a3b": (MOONLIGHT_16B, r"megatron.use_dist_checkpointing=True: megatron-rl loads HF checkpoints"),
    "mimo_7b_mtp": (MIMO_7B, r"mtp.enable_train=true with actor_rollout_ref.actor.megatron.context_parallel_size=2: "
                             r"the MTP loss under context parallelism is not built here"),
    "qwen3_5_35b": (_declared("Qwen3_5MoeForConditionalGeneration"),
                    r"Qwen3_5MoeForConditionalGeneration is not supported: a vision-language model.*Gated DeltaNet.*"
                    r"flash-linear-attention's Triton kernels"),
    "hy_v3": (HY3, r"rollout.tensor_model_parallel_size=16 does not divide trainer.n_gpus_per_node=8: a colocated "
                   r"engine cannot span two nodes"),
    "kimi_k2_6_lite": (_declared("Kimi_K25ForConditionalGeneration"),
                       r"Kimi_K25ForConditionalGeneration is not supported: a vision-language model"),
    "glm5_1_lite": (_declared("GlmMoeDsaForCausalLM"), r"GlmMoeDsaForCausalLM is not supported: GLM-5's DeepSeek "
                                                       r"sparse attention"),
    "nemotron_nano_v3_30b_a3b": (_declared("NemotronHForCausalLM"),
                                 r"NemotronHForCausalLM is not supported: hybrid Mamba-2 .* mamba_ssm"),
    "deepseek_v4_flash": (_declared("DeepseekV4ForCausalLM"),
                          r"DeepseekV4ForCausalLM is not supported: compressed sparse and heavily compressed attention"),
}


def script_args(name: str, tmp_path: Path, facts: dict) -> list[str]:
    args = (SCRIPTS / f"{name}.args").read_text().splitlines()
    model = next(a.split("=", 1)[1] for a in args if a.startswith("actor_rollout_ref.model.path="))
    (tmp_path / "model").mkdir(exist_ok=True)
    (tmp_path / "model" / "config.json").write_text(json.dumps(facts))
    return [a.replace(model, str(tmp_path / "model")).replace("/HOME/data", str(tmp_path / "data")) for a in args]


def test_the_recorded_scripts_are_here():
    assert sorted(p.stem for p in SCRIPTS.glob("*.args")) == sorted(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_each_script_meets_its_named_refusal_first(name, tmp_path):
    facts, message = EXPECTED[name]
    with pytest.raises(ConfigError, match=message):
        validate(load_config(overrides=translate(script_args(name, tmp_path, facts))))


def test_moonlight_from_its_hf_checkpoint_plans(tmp_path):
    """Without verl's converted-checkpoint switch (megatron-rl starts from model.path's HF weights) the Moonlight
    script composes, validates and plans: DeepSeek-V3's architecture with multi-latent attention and no q
    compression, 64 experts over EP 8."""
    args = [a for a in script_args("moonlight_16b_a3b", tmp_path, MOONLIGHT_16B)
            if "use_dist_checkpointing" not in a and "dist_checkpointing_path" not in a]
    cfg = load_config(overrides=translate(args))
    validate(cfg)
    text = build_plan(cfg).format()
    assert "DeepseekV3ForCausalLM" in text, text
    # the report names MLA's latents (its KV cache), not "16 KV heads"
    assert "16 heads of multi-latent attention (no q latent, kv latent 512 + rope 64)" in text, text


def test_mimo_mtp_script_plans_at_cp_1_with_its_mtp_layer(tmp_path):
    """At CP 1 the MiMo script composes, validates and plans: the MTP layer built (model.mtp.enable), trained alone
    (detach_encoder), its weights on the last stage and its activations in the actor's update."""
    cp1 = [f"actor_rollout_ref.{role}.megatron.context_parallel_size=1" for role in ("actor", "ref")]
    cfg = load_config(overrides=translate(script_args("mimo_7b_mtp", tmp_path, MIMO_7B) + cp1))
    mtp = cfg.actor_rollout_ref.model.mtp
    assert (mtp.enable, mtp.enable_train, mtp.detach_encoder, mtp.mtp_loss_scaling_factor) == (True, True, True, 0.1)
    validate(cfg)
    text = build_plan(cfg).format()
    assert "MiMoForCausalLM" in text and "actor MTP layers' activations" in text, text
    assert "36 layers + 1 MTP" in text, text


def test_hy3_min_lr_maps_to_the_ratio_of_its_lr(tmp_path):
    """verl's optim.min_lr (an absolute floor) becomes optim.min_lr_ratio = min_lr / lr: Hy3's script decays from
    1e-6 to 1e-6 (ratio 1.0)."""
    cfg = load_config(overrides=translate(script_args("hy_v3", tmp_path, HY3)))
    optim = cfg.actor_rollout_ref.actor.optim
    assert (optim.lr, optim.min_lr_ratio) == (1e-6, 1.0)
    with pytest.raises(ConfigError, match=r"min_lr=2e-06 must lie in \[0, actor_rollout_ref.actor.optim.lr=1e-06\]"):
        translate(script_args("hy_v3", tmp_path, HY3) + ["actor_rollout_ref.actor.optim.min_lr=2e-6"])
