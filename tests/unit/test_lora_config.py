"""LoRA's config surface (issue 36, item 1): verl's Megatron block ``model.lora``, its older flat keys folded into
it at load time, and every refusal before launch naming the key (validate, preflight)."""
from __future__ import annotations

import json

import pytest

from megatron_rl.config import ConfigError, load_config, typed_config
from megatron_rl.config.lora import fold_lora_aliases, hf_modules_to_megatron, lora_targets
from megatron_rl.config.schema import LoRAConfig
from megatron_rl.plan.validate import context_parallel_roles, validate
from megatron_rl.trainer import preflight

BASE = ["actor_rollout_ref.model.path=/m", "data.train_files=[/d.parquet]", "trainer.nnodes=1", "trainer.n_gpus_per_node=2", "data.train_batch_size=8", "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2"]
M = "actor_rollout_ref.model"
L = f"{M}.lora"
ALL = ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]


def cfg_with(*overrides: str):
    return load_config(overrides=[*BASE, *overrides])


# ---------------------------------------------------------------------------- the block
def test_defaults_are_off_and_the_engine_reads_a_typed_lora_config():
    cfg = cfg_with()
    validate(cfg)
    typed = typed_config(cfg)
    for lora in (typed.actor_rollout_ref.model.lora, typed.critic.model.lora):
        assert isinstance(lora, LoRAConfig)
        assert (lora.rank, lora.alpha, lora.enabled, lora.target_modules) == (0, None, False, ALL)
        assert (lora.merge, lora.dropout_position, lora.lora_A_init_method, lora.lora_B_init_method) == \
            (True, "pre", "xavier", "zero")


def test_rank_alone_takes_verls_default_alpha_16():
    cfg = cfg_with(f"{L}.rank=8")
    validate(cfg)
    lora = typed_config(cfg).actor_rollout_ref.model.lora
    assert (lora.rank, lora.alpha, lora.scaling, lora.enabled) == (8, 16.0, 2.0, True)


def test_verls_megatron_example_is_accepted():
    cfg = cfg_with(f"{L}.rank=32", f"{L}.alpha=64", f"{L}.lora_A_init_method=kaiming", f"{L}.dropout=0.05",
                   f"{L}.target_modules=[linear_qkv,'decoder.layers.0.*.linear_fc1']",
                   f"{L}.exclude_modules=['decoder.layers.1.*']", f"{L}.dtype=fp32")
    validate(cfg)
    lora = typed_config(cfg).actor_rollout_ref.model.lora
    assert lora.scaling == 2.0
    assert lora_targets(lora, 0) == ["linear_qkv", "linear_fc1"]
    assert lora_targets(lora, 1) == []
    assert lora_targets(lora, 2) == ["linear_qkv"]


# ---------------------------------------------------------------------------- refusals, each naming the key
@pytest.mark.parametrize("overrides, message", [
    ((f"{L}.rank=-1",), rf"{L}.rank=-1 must be an integer >= 0"),
    ((f"{L}.alpha=8",), rf"{L}.alpha=8.0 set, but LoRA is off because {L}.rank=0"),
    ((f"{L}.dropout=0.1", f"{L}.merge=false"), rf"{L}.dropout=0.1, {L}.merge=False set, but LoRA is off"),
    ((f"{L}.adapter_path=/x",), rf"{L}.adapter_path='/x' set, but LoRA is off because {L}.rank=0"),
    ((f"{L}.rank=8", f"{L}.target_modules=[linear_qkv,lm_head]"),
     rf"{L}.target_modules: 'lm_head' is not a linear an adapter is built for; known: linear_qkv"),
    ((f"{L}.rank=8", f"{L}.target_modules=[q_proj]"), r"'q_proj' \(HF's name; Megatron's is linear_qkv\)"),
    ((f"{L}.rank=8", f"{L}.target_modules=['decoder.layers.*']"),
     rf"{L}.target_modules: the pattern 'decoder.layers.\*' names none of the linears"),
    ((f"{L}.rank=8", f"{L}.target_modules=[]"), rf"{L}.target_modules is empty with {L}.rank=8"),
    ((f"{L}.rank=8", f"{L}.exclude_modules=[embedding]"), rf"{L}.exclude_modules: 'embedding' is not a linear"),
    ((f"{L}.rank=8", f"{L}.type=dora"), rf"{L}.type='dora' is not built: only plain LoRA"),
    ((f"{L}.rank=8", f"{L}.type=canonical_lora"), rf"{L}.type='canonical_lora' is not built"),
    ((f"{L}.rank=8", f"{L}.type=ia3"), rf"{L}.type='ia3' is unknown; built: lora"),
    ((f"{L}.rank=8", f"{L}.dropout_position=post"), rf"{L}.dropout_position='post' is not built"),
    ((f"{L}.rank=8", f"{L}.dropout=1.0"), rf"{L}.dropout=1.0 must lie in \[0, 1\)"),
    ((f"{L}.rank=8", f"{L}.alpha=0"), rf"{L}.alpha=0.0 must be > 0"),
    ((f"{L}.rank=8", f"{L}.merge=false"), rf"{L}.merge=false .* is not built: the engines get the merged weights"),
    ((f"{L}.rank=8", f"{L}.lora_A_init_method=uniform"), rf"{L}.lora_A_init_method='uniform' is not built; built: "
                                                         r"xavier, kaiming, normal"),
    ((f"{L}.rank=8", f"{L}.lora_B_init_method=ones"), rf"{L}.lora_B_init_method='ones' is not built"),
    ((f"{L}.rank=8", f"{L}.dtype=fp16"), rf"{L}.dtype='fp16' is unknown; known: fp32, bf16"),
    (("critic.model.lora.rank=8",), r"critic.model.lora.rank=8 but no critic runs"),
    (("algorithm.adv_estimator=gae", "critic.ppo_micro_batch_size_per_gpu=2", "critic.model.lora.alpha=4"),
     r"critic.model.lora.alpha=4.0 set, but LoRA is off because critic.model.lora.rank=0"),
])
def test_refusals_name_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        validate(cfg_with(*overrides))


def test_critic_lora_is_accepted_with_a_critic():
    cfg = cfg_with("algorithm.adv_estimator=gae", "critic.ppo_micro_batch_size_per_gpu=2", "critic.model.lora.rank=4")
    validate(cfg)
    assert typed_config(cfg).critic.model.lora.alpha == 16.0


# ---------------------------------------------------------------------------- verl's flat keys
def test_flat_keys_fold_into_the_block_with_hf_names_mapped():
    cfg = cfg_with(f"{M}.lora_rank=16", f"{M}.lora_alpha=32", f"{M}.target_modules=[q_proj,k_proj,v_proj,o_proj]",
                   f"{M}.exclude_modules=['model.layers.0.self_attn.q_proj','model.layers.0.self_attn.k_proj',"
                   "'model.layers.0.self_attn.v_proj']")
    validate(cfg)
    model = typed_config(cfg).actor_rollout_ref.model
    assert (model.lora.rank, model.lora.alpha) == (16, 32.0)
    assert model.lora.target_modules == ["linear_qkv", "linear_proj"]
    assert model.lora.exclude_modules == ["decoder.layers.0.self_attention.linear_qkv"]
    assert (model.lora_rank, model.lora_alpha, model.target_modules, model.exclude_modules) == (None,) * 4
    assert lora_targets(model.lora, 0) == ["linear_proj"]
    assert lora_targets(model.lora, 1) == ["linear_qkv", "linear_proj"]


def test_all_linear_and_the_mlp_names_map_to_megatrons():
    assert hf_modules_to_megatron("all-linear", "k") == ALL
    assert hf_modules_to_megatron(["gate_proj", "up_proj", "down_proj"], "k") == ["linear_fc1", "linear_fc2"]
    cfg = cfg_with(f"{M}.lora_rank=8", f"{M}.target_modules=all-linear", f"{M}.lora_adapter_path=/a")
    model = cfg.actor_rollout_ref.model
    assert (list(model.lora.target_modules), model.lora.adapter_path, model.lora_adapter_path) == (ALL, "/a", None)


def test_critic_flat_keys_fold_too():
    cfg = cfg_with("algorithm.adv_estimator=gae", "critic.ppo_micro_batch_size_per_gpu=2", "critic.model.lora_rank=4",
                   "critic.model.lora_alpha=8")
    validate(cfg)
    assert (cfg.critic.model.lora.rank, cfg.critic.model.lora.alpha, cfg.critic.model.lora_rank) == (4, 8.0, None)


def test_verls_flat_defaults_with_lora_off_say_nothing():
    cfg = cfg_with(f"{M}.lora_rank=0", f"{M}.lora_alpha=16", f"{M}.target_modules=all-linear")
    validate(cfg)
    assert cfg.actor_rollout_ref.model.lora.rank == 0 and cfg.actor_rollout_ref.model.lora.alpha is None


@pytest.mark.parametrize("overrides, message", [
    ((f"{M}.lora_rank=8", f"{M}.target_modules=[q_proj,v_proj]"),
     rf"{M}.target_modules names q_proj, v_proj without k_proj: Megatron fuses q_proj / k_proj / v_proj into one "
     r"linear \(linear_qkv\), and its adapter covers all 3 parts"),
    ((f"{M}.lora_rank=8", f"{M}.target_modules=[gate_proj,down_proj]"),
     rf"{M}.target_modules names gate_proj without up_proj"),
    ((f"{M}.lora_rank=8", f"{M}.exclude_modules=['model.layers.0.self_attn.q_proj']"),
     rf"{M}.exclude_modules names q_proj without k_proj, v_proj"),
    ((f"{M}.lora_rank=8", f"{M}.target_modules=[lm_head]"), rf"{M}.target_modules: 'lm_head' is not a linear"),
    ((f"{M}.lora_rank=8", f"{M}.exclude_modules='.*visual.*'"), rf"{M}.exclude_modules='.\*visual.\*': a string here "
                                                                r"is PEFT's regular expression"),
    ((f"{M}.lora_rank=8", f"{L}.rank=8"), rf"{M}.lora_rank=8 and {L}.rank=8 are both set"),
    ((f"{M}.lora_alpha=32", f"{L}.alpha=64", f"{L}.rank=8"), rf"{M}.lora_alpha=32.0 and {L}.alpha=64.0 are both set"),
    ((f"{M}.target_modules=all-linear", f"{M}.lora_rank=8", f"{L}.target_modules=[linear_qkv]"),
     rf"{M}.target_modules='all-linear' and {L}.target_modules=\['linear_qkv'\] are both set"),
    ((f"{M}.lora_adapter_path=/a", f"{L}.adapter_path=/b", f"{L}.rank=8"),
     rf"{M}.lora_adapter_path='/a' and {L}.adapter_path='/b' are both set"),
    (("critic.model.lora_rank=8", "critic.model.lora.rank=8"),
     r"critic.model.lora_rank=8 and critic.model.lora.rank=8 are both set"),
    ((f"{M}.lora_alpha=32",), rf"{L}.alpha=32.0 set, but LoRA is off because {L}.rank=0"),
])
def test_flat_key_refusals_name_the_keys(overrides, message):
    with pytest.raises(ConfigError, match=message):
        validate(cfg_with(*overrides))


def test_folding_twice_changes_nothing():
    cfg = cfg_with(f"{M}.lora_rank=8")
    before = dict(cfg.actor_rollout_ref.model.lora)
    fold_lora_aliases(cfg)
    validate(cfg)
    assert dict(cfg.actor_rollout_ref.model.lora) == before


# ---------------------------------------------------------------------------- the reference is the actor
def test_with_actor_lora_no_reference_model_is_built():
    kl = ["actor_rollout_ref.actor.use_kl_loss=true"]
    assert "actor_rollout_ref.ref" in context_parallel_roles(typed_config(cfg_with(*kl)), False)
    cfg = typed_config(cfg_with(*kl, f"{L}.rank=8"))
    assert "actor_rollout_ref.ref" not in context_parallel_roles(cfg, False)
    # the reference's layout is not used: not required to match the actor's
    validate(cfg_with(*kl, f"{L}.rank=8", "actor_rollout_ref.ref.megatron.tensor_model_parallel_size=1",
                      "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2"))
    with pytest.raises(ConfigError, match="the colocated ref shares the actor's model-parallel layout"):
        validate(cfg_with(*kl, "actor_rollout_ref.ref.megatron.tensor_model_parallel_size=1",
                          "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2"))


# ---------------------------------------------------------------------------- preflight: the model and the adapter
def _model_dir(tmp_path, **extra):
    d = tmp_path / "model"
    d.mkdir()
    raw = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256, "tie_word_embeddings": False,
           **extra}
    (d / "config.json").write_text(json.dumps(raw))
    return d


def test_lora_on_an_moe_model_is_checked_before_launch(tmp_path):
    """LoRA on an MoE model builds (adapters on every expert's fc1 / fc2: tests/workers/test_lora_moe.py); before
    launch, a rank above the experts' width and TE's grouped experts (no per-expert linear) are refused by name."""
    d = _model_dir(tmp_path, architectures=["Qwen3MoeForCausalLM"], num_experts=4, num_experts_per_tok=2,
                   moe_intermediate_size=12, head_dim=16)
    preflight.check_model(cfg_with(f"{M}.path={d}", f"{L}.rank=8"))
    with pytest.raises(ConfigError, match=rf"{L}.rank=14 is larger than the model's smallest adapted dimension "
                                          r"\(12: .*moe_intermediate_size 12"):
        preflight.check_model(cfg_with(f"{M}.path={d}", f"{L}.rank=14"))
    # the experts left out, their width does not bound the rank
    preflight.check_model(cfg_with(f"{M}.path={d}", f"{L}.rank=14", f"{L}.exclude_modules=[linear_fc1,linear_fc2]"))
    grouped = "+actor_rollout_ref.actor.megatron.override_transformer_config.moe_grouped_gemm=true"
    with pytest.raises(ConfigError, match=r"actor_rollout_ref.actor.megatron.override_transformer_config."
                                          r"moe_grouped_gemm=true with LoRA on the experts"):
        preflight.check_model(cfg_with(f"{M}.path={d}", f"{L}.rank=8", grouped))
    preflight.check_model(cfg_with(f"{M}.path={d}", f"{L}.rank=8", grouped,
                                   f"{L}.exclude_modules=[linear_fc1,linear_fc2]"))


def test_lora_on_the_experts_chooses_one_mlp_per_expert():
    from megatron_rl.models.moe_experts import choose_expert_layer

    assert choose_expert_layer(None, cuda=True, te=True).grouped  # where grouped can run, it is the default
    choice = choose_expert_layer(None, cuda=True, te=True, lora_on_experts=True)
    assert not choice.grouped and "LoRA on the experts" in choice.reason
    with pytest.raises(ValueError, match="moe_grouped_gemm=true with LoRA on the experts"):
        choose_expert_layer(True, cuda=True, te=True, lora_on_experts=True)


def test_a_rank_above_the_models_dimensions_is_refused(tmp_path):
    d = _model_dir(tmp_path)
    with pytest.raises(ConfigError, match=rf"{L}.rank=32 is larger than the model's smallest adapted dimension \(16"):
        preflight.check_model(cfg_with(f"{M}.path={d}", f"{L}.rank=32"))


def _adapter(tmp_path, weights=True, **fields):
    d = tmp_path / "adapter"
    d.mkdir()
    raw = {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj",
                                                                             "gate_proj", "up_proj", "down_proj"],
           "bias": "none", **fields}
    (d / "adapter_config.json").write_text(json.dumps(raw))
    if weights:
        from safetensors.torch import save_file

        save_file({}, str(d / "adapter_model.safetensors"))  # preflight parses it (tests/trainer/test_input_integrity.py)
    return d


def test_a_matching_peft_adapter_is_accepted(tmp_path):
    d = _adapter(tmp_path)
    preflight.check_lora_files(cfg_with(f"{L}.rank=8", f"{L}.adapter_path={d}"))
    preflight.check_lora_files(cfg_with(f"{M}.lora_rank=8", f"{M}.lora_adapter_path={d}"))


@pytest.mark.parametrize("fields, overrides, message", [
    ({}, (f"{L}.rank=4",), r"adapter_config.json: r=8 differs from actor_rollout_ref.model.lora.rank=4"),
    ({}, (f"{L}.rank=8", f"{L}.alpha=32"), r"adapter_config.json: lora_alpha=16 differs from "
                                           r"actor_rollout_ref.model.lora.alpha=32"),
    ({"target_modules": ["q_proj", "k_proj", "v_proj"]}, (f"{L}.rank=8",),
     r"adapter_config.json: target_modules=\['q_proj', 'k_proj', 'v_proj'\] are the Megatron linears "
     r"\['linear_qkv'\], but actor_rollout_ref.model.lora.target_modules gives"),
    ({"target_modules": ["q_proj", "v_proj"]}, (f"{L}.rank=8",), r"adapter_config.json: target_modules names q_proj, "
                                                                 r"v_proj without k_proj"),
    ({"use_dora": True}, (f"{L}.rank=8",), r"adapter_config.json: use_dora=true: DoRA adapters are not built"),
    ({"modules_to_save": ["lm_head"]}, (f"{L}.rank=8",), r"modules_to_save=\['lm_head'\]"),
    ({"rank_pattern": {"q_proj": 4}}, (f"{L}.rank=8",), r"rank_pattern="),
])
def test_an_inconsistent_peft_adapter_is_refused_naming_file_and_field(tmp_path, fields, overrides, message):
    d = _adapter(tmp_path, **fields)
    with pytest.raises(ConfigError, match=message):
        preflight.check_lora_files(cfg_with(*overrides, f"{L}.adapter_path={d}"))


def test_a_missing_adapter_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=rf"{L}.adapter_path=.*nothing: does not exist"):
        preflight.check_lora_files(cfg_with(f"{L}.rank=8", f"{L}.adapter_path={tmp_path / 'nothing'}"))
    d = _adapter(tmp_path, weights=False)
    with pytest.raises(ConfigError, match=rf"{L}.adapter_path=.* has no adapter_model.safetensors"):
        preflight.check_lora_files(cfg_with(f"{L}.rank=8", f"{L}.adapter_path={d}"))
