"""Context parallelism before launch (issue 35, item 4): the refusals, each naming its key and why, and the
planner's CP accounting (the real split's padding, the CP attention's K/V, the long-context preset's fit)."""
from __future__ import annotations

import json

import pytest

from megatron_rl.config import ConfigError, load_config, typed_config
from megatron_rl.plan import PlanError, build_plan
from megatron_rl.plan import memory
from megatron_rl.plan.memory import Layout, Recompute
from megatron_rl.plan.model_facts import load_model_facts
from megatron_rl.plan.validate import validate

GIB = 2**30
ACTOR = "actor_rollout_ref.actor.megatron"
BASE = ["trainer.nnodes=1", "trainer.n_gpus_per_node=4", "data.train_batch_size=8", "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2"]
CP2 = [f"{ACTOR}.context_parallel_size=2", f"{ACTOR}.packed_sequences=true"]


def cfg_with(*overrides: str):
    return load_config(overrides=[*BASE, *overrides])


# ---------------------------------------------------------------------------- refusals (validate: every start)
def test_cp_with_packed_sequences_is_accepted():
    validate(cfg_with(*CP2))
    validate(cfg_with(*CP2, f"+{ACTOR}.override_transformer_config.cp_comm_type=a2a"))
    validate(cfg_with(*CP2, "trainer.device=cpu", f"+{ACTOR}.override_transformer_config.cp_comm_type=all_gather"))


@pytest.mark.parametrize("overrides, message", [
    # padded micro-batches: the actor, and the reference / critic / reward model's trunk with their own keys
    ((f"{ACTOR}.context_parallel_size=2",),
     r"actor_rollout_ref.actor.megatron.context_parallel_size=2 needs actor_rollout_ref.actor.megatron."
     r"packed_sequences=true: .*padded \[rows, longest\] micro-batches .* are not built for CP"),
    ((*CP2, "actor_rollout_ref.actor.use_kl_loss=true"),
     r"actor_rollout_ref.ref.megatron.context_parallel_size=2 needs actor_rollout_ref.ref.megatron.packed_sequences=true"),
    ((*CP2, "algorithm.adv_estimator=gae"),
     r"critic.megatron.context_parallel_size=2 needs critic.megatron.packed_sequences=true"),
    ((*CP2, "reward_model.enable=true", "reward_model.model.path=/rm", "reward_model.enable_resource_pool=true",
      "reward_model.megatron.context_parallel_size=2"),
     r"reward_model.megatron.context_parallel_size=2 needs reward_model.megatron.packed_sequences=true"),
    # shared prompts
    ((*CP2, f"{ACTOR}.share_prompts=true"),
     r"actor_rollout_ref.actor.megatron.context_parallel_size=2 with actor_rollout_ref.actor.megatron.share_prompts=true "
     r"is not built: a shared-prompt sequence"),
    # cp_comm_type
    ((*CP2, f"+{ACTOR}.override_transformer_config.cp_comm_type=ring"),
     r"actor_rollout_ref.actor.megatron.override_transformer_config.cp_comm_type='ring' with .* is not built: choose p2p"),
    ((*CP2, f"+{ACTOR}.override_transformer_config.cp_comm_type=a2a+p2p"),
     r"cp_comm_type='a2a\+p2p' .* is not built.*hierarchical_context_parallel_sizes"),
    ((*CP2, f"+{ACTOR}.override_transformer_config.cp_comm_type=[p2p,a2a]"),
     r"cp_comm_type=\['p2p', 'a2a'\] .* not a list per layer"),
    ((*CP2, "trainer.device=cuda", f"+{ACTOR}.override_transformer_config.cp_comm_type=all_gather"),
     r"cp_comm_type='all_gather' .*Transformer Engine 2.11's all-gather CP attention refuses packed \(THD\)"),
    # CP divides the world like TP and PP
    ((*CP2, f"{ACTOR}.tensor_model_parallel_size=2", f"{ACTOR}.context_parallel_size=3"),
     r"TP\*PP\*CP = 2\*1\*3 = 6 does not divide the world size 4"),
])
def test_cp_combinations_not_built_are_refused_naming_the_key(overrides, message):
    """Before issue 35 each was refused with the generic 'context parallelism is not built' (or, for the
    colocated roles, accepted by the layout rules and refused by SDPAttention after start-up)."""
    with pytest.raises(ConfigError, match=message):
        validate(cfg_with(*overrides))


def test_the_rollout_engine_is_not_affected_by_the_trainers_cp():
    cfg = cfg_with(*CP2, "actor_rollout_ref.rollout.tensor_model_parallel_size=4", "actor_rollout_ref.rollout.name=sglang",
                   "trainer.device=cuda")
    assert validate(cfg).actor.model_parallel_size == 2  # rollout TP 4 over the 4 GPUs, actor CP 2 x DP 2


# ---------------------------------------------------------------------------- refusals that need the model
def _write_model(path, **fields):
    config = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 64,
              "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "vocab_size": 256, "tie_word_embeddings": False, **fields}
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    return path


MOE = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "num_experts": 4,
       "num_experts_per_tok": 2, "moe_intermediate_size": 32, "head_dim": 16}


def test_cp_on_an_moe_model_is_accepted_by_the_preflight_and_planned(tmp_path):
    """Issue 51: CP x MoE is built (tests/workers/test_context_parallel_moe.py); it was refused by name."""
    from megatron_rl.trainer.preflight import check_context_parallel_models

    model_dir = _write_model(tmp_path / "model", **MOE)
    cfg = cfg_with(*CP2, f"actor_rollout_ref.model.path={model_dir}")
    validate(cfg)
    typed = typed_config(cfg)
    check_context_parallel_models(typed, load_model_facts(typed))
    assert build_plan(cfg).actor_layout.cp == 2


@pytest.mark.parametrize("fields, extra, message", [
    ({}, (f"+{ACTOR}.override_transformer_config.cp_comm_type=a2a", f"{ACTOR}.context_parallel_size=4"),
     r"cp_comm_type=a2a with actor_rollout_ref.actor.megatron.context_parallel_size=4 splits each TP rank's heads .* "
     r"4 query and 2 KV heads"),
    ({"architectures": ["MistralForCausalLM"], "model_type": "mistral", "sliding_window": 32}, (),
     r"context_parallel_size=2 with a sliding-window model .*sliding_window=32\) needs "
     r"actor_rollout_ref.actor.megatron.override_transformer_config.cp_comm_type=a2a"),
    # MLA under CP: a raw pin_memory RuntimeError in the workers' model build on CPU before it was refused here
    ("deepseek_v3", (), r"context_parallel_size=2 with multi-latent attention .*DeepseekV3ForCausalLM\) is not built"),
])
def test_cp_against_the_model_is_refused_by_the_preflight_and_the_plan(tmp_path, fields, extra, message):
    """The model's own limits: refused by the start's preflight (config.json at the model path) and by the
    dry run's plan, before Ray; with plan.architecture alone, by the plan."""
    from megatron_rl.trainer.preflight import check_context_parallel_models

    if fields == "deepseek_v3":
        from megatron_rl_testing.tiny_models import tiny_hf_config

        fields = {**tiny_hf_config("deepseek_v3").to_dict(), "architectures": ["DeepseekV3ForCausalLM"]}
    model_dir = _write_model(tmp_path / "model", **fields)
    cfg = cfg_with(*CP2, *extra, f"actor_rollout_ref.model.path={model_dir}")
    validate(cfg)
    typed = typed_config(cfg)
    with pytest.raises(ConfigError, match=message):
        check_context_parallel_models(typed, load_model_facts(typed))
    with pytest.raises(ConfigError, match=message):
        build_plan(cfg)
    fine = typed_config(cfg_with(f"actor_rollout_ref.model.path={model_dir}", *extra[:1]))
    check_context_parallel_models(fine, load_model_facts(fine))  # CP 1: the same model is fine


def test_a_sliding_window_at_cp_is_accepted_on_cpu(tmp_path):
    """Only TE's p2p ring refuses windows: on CPU SDPAttention's all-gather masks them exactly
    (tests/workers/test_context_parallel.py runs a windowed model at CP=2)."""
    from megatron_rl.trainer.preflight import check_context_parallel_models

    model_dir = _write_model(tmp_path / "model", architectures=["MistralForCausalLM"], model_type="mistral",
                             sliding_window=32)
    cfg = typed_config(cfg_with(*CP2, "trainer.device=cpu", f"actor_rollout_ref.model.path={model_dir}"))
    check_context_parallel_models(cfg, load_model_facts(cfg))
    build_plan(cfg)


# ---------------------------------------------------------------------------- the planner's CP accounting
def test_cp_split_pads_each_sequence_to_2cp_times_tp_under_sequence_parallelism():
    cp2 = Layout(tp=1, pp=1, cp=2, dp=1)
    assert memory.cp_split_multiple(cp2) == 4
    # ceil(len / 4) x 4 per sequence, half of it per rank: 5 -> 8, 3 -> 4, 8 -> 8, 1 -> 4 (shorter than 2 CP)
    assert memory.cp_rank_tokens([5, 3, 8, 1], cp2) == (8 + 4 + 8 + 4) // 2 == 12
    sp = Layout(tp=2, pp=1, cp=2, dp=1, sequence_parallel=True)
    assert memory.cp_split_multiple(sp) == 8  # 2 CP x TP: each rank's tokens split over TP again
    assert memory.cp_rank_tokens([5, 9], sp) == (8 + 16) // 2
    assert memory.cp_rank_tokens([5, 9], Layout(tp=2, pp=1, cp=2, dp=1)) == (8 + 12) // 2  # no SP: 2 CP only
    assert memory.cp_rank_tokens([5, 9], Layout(tp=1, pp=1, cp=1, dp=1)) == 14  # CP 1 pads nothing
    # worst case: 2 CP m - 1 pad tokens per sequence
    assert memory.cp_padded_length(17, sp) - 17 == 7


def test_cp_attention_kernel_and_its_bytes():
    model = load_model_facts(typed_config(load_config(overrides=["+experiment=grpo_8b_long_context"])))
    assert memory.cp_attention_kernel(1, None) is None
    assert memory.cp_attention_kernel(4, None) == memory.cp_attention_kernel(4, "p2p") == memory.TE_CP_P2P
    assert memory.cp_attention_kernel(4, "a2a") == memory.TE_CP_A2A
    assert memory.cp_attention_kernel(4, "p2p", transformer_engine=False) == memory.SDPA_CP_ALL_GATHER
    layout = Layout(tp=2, pp=1, cp=4, dp=2, sequence_parallel=True)
    T = 34_816
    kv = 4 * 128  # 8 KV heads / TP 2 x head dim 128
    q = 16 * 128
    # SDPA all-gather keeps the whole micro-batch's K and V per layer (3/4 of it beyond the local share),
    # and holds them plus their gradients while a layer runs
    stored, transient = memory.cp_attention_bytes(memory.SDPA_CP_ALL_GATHER, model, layout, T, 1, "first")
    assert stored == 32 * (T - T / 4) * 2 * kv * 2
    assert transient == 2 * T * 2 * kv * 2
    # TE p2p: nothing stored beyond q, k, v, out; the ring's chunks (the whole K/V) and per-step outputs
    stored, transient = memory.cp_attention_bytes(memory.TE_CP_P2P, model, layout, T, 1, "first")
    assert stored == 0 and transient == (T * 2 * kv + T * q + T / 4 * q) * 2
    # a2a: the head-split output TE saves, apart from the output projection's input
    stored, _ = memory.cp_attention_bytes(memory.TE_CP_A2A, model, layout, T, 1, "first")
    assert stored == 32 * T / 4 * q * 2
    assert memory.cp_attention_bytes(memory.TE_CP_A2A, model, layout, T, 1, "first", Recompute("selective"))[0] == 0
    assert memory.cp_attention_bytes(memory.TE_CP_P2P, model, Layout(tp=2, pp=1, cp=1, dp=8), T, 1, "first") == (0, 0)


def test_micro_batch_activation_estimate_counts_the_split_and_scales_to_fp32():
    """memory.micro_batch_activation_bytes: the estimate a measured CP = 2 peak is compared with."""
    model = load_model_facts(typed_config(load_config(overrides=["+experiment=grpo_8b_long_context"])))
    lengths = [1000, 37, 5]
    cp2 = Layout(tp=1, pp=1, cp=2, dp=1)
    per_rank = memory.cp_rank_tokens(lengths, cp2)
    assert per_rank == (1000 + 40 + 8) // 2
    bf16 = memory.micro_batch_activation_bytes(model, cp2, lengths, cp_kernel=memory.SDPA_CP_ALL_GATHER)
    layer = memory.activation_bytes_per_token_layer(model, cp2)
    logits = per_rank * memory.padded_vocab_size(model.vocab_size, 1) * (2 + 4)
    stored, transient = memory.cp_attention_bytes(memory.SDPA_CP_ALL_GATHER, model, cp2, 2 * per_rank, 1, "first")
    assert bf16 == pytest.approx(32 * layer * per_rank + logits + stored + transient)
    fp32 = memory.micro_batch_activation_bytes(model, cp2, lengths, cp_kernel=memory.SDPA_CP_ALL_GATHER,
                                               dtype_bytes=4, logits=False)
    no_logits = memory.micro_batch_activation_bytes(model, cp2, lengths, cp_kernel=memory.SDPA_CP_ALL_GATHER,
                                                    logits=False)
    assert fp32 == pytest.approx(2 * no_logits)
    # CP 2 holds about half of CP 1's activations (plus the split's padding and the gathered K/V)
    cp1 = memory.micro_batch_activation_bytes(model, Layout(tp=1, pp=1, cp=1, dp=1), lengths, logits=False)
    assert 0.5 * cp1 < no_logits < 0.6 * cp1


def test_planner_counts_the_real_split_and_the_cp_attention_row():
    """Before issue 35 the planner divided the unpadded tokens by CP and counted no CP attention."""
    seq = 2048 + 1001  # not a multiple of 2 x CP x TP = 16: the split pads it to 3056
    plan = build_plan(load_config(overrides=["+experiment=grpo_8b_long_context", "data.max_response_length=1001"]))
    layout = Layout(tp=2, pp=1, cp=4, dp=2, sequence_parallel=True)
    assert memory.cp_padded_length(seq, layout) == 3056
    (act,) = [r for r in plan.rows if r.label == "actor activations"]
    expected = memory.activation_bytes(plan.model, layout, 3056, 64, "first") + memory.logits_bytes(plan.model, layout, 3056)
    assert act.per_phase["actor update"] == pytest.approx(expected)
    (cp_row,) = [r for r in plan.rows if r.label.startswith("actor CP attention")]
    assert cp_row.label == "actor CP attention (te_cp_p2p)" and cp_row.per_phase["generate"] == 0
    assert cp_row.per_phase["actor update"] == pytest.approx(
        sum(memory.cp_attention_bytes(memory.TE_CP_P2P, plan.model, layout, 3056, 64, "first")))
    text = plan.format()
    assert "padded to a multiple of 2 x CP x TP = 16 tokens (3049 -> 3056)" in text and "764 per rank" in text


def test_dynamic_batching_counts_the_pad_of_the_sequences_under_the_cap():
    plan = build_plan(load_config(overrides=[
        "+experiment=grpo_8b_long_context", "data.max_response_length=1001",
        "actor_rollout_ref.actor.use_dynamic_bsz=true", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=6100"]))
    layout = Layout(tp=2, pp=1, cp=4, dp=2, sequence_parallel=True)
    # the cap is per GPU: CP 4 x 6100 real tokens per micro-batch (workers/forward.pack_batch, as verl), i.e.
    # ceil(24400 / 3049) = 9 sequences, each padded 3049 -> 3056
    tokens = 4 * 6100 + 9 * 7
    (act,) = [r for r in plan.rows if r.label == "actor activations"]
    assert act.per_phase["actor update"] == pytest.approx(
        memory.activation_bytes(plan.model, layout, tokens, 64, "first") + memory.logits_bytes(plan.model, layout, tokens))


# ---------------------------------------------------------------------------- the long-context preset
def test_long_context_preset_fits_80gb_at_32k_and_at_64k_with_cp8():
    """The figures docs/launching.md and the preset's header give."""
    plan = build_plan(load_config(overrides=["+experiment=grpo_8b_long_context"]))
    assert plan.fits and plan.gpu_memory == 79.6 * GIB
    assert plan.sequence_length == 2048 + 32768
    layout = plan.actor_layout
    assert (layout.tp, layout.pp, layout.cp, layout.dp, layout.sequence_parallel) == (2, 1, 4, 2, True)
    assert plan.sizes.world_size == 16
    assert round(plan.total("generate") / GIB, 1) == 65.8 and plan.peak_phase() == "generate"
    assert round(plan.total("actor update") / GIB, 1) == 60.9
    (act,) = [r for r in plan.rows if r.label == "actor activations"]
    assert round(act.per_phase["actor update"] / GIB, 1) == 21.2
    assert plan.rollout.kv_tokens // plan.sequence_length == 21

    long = build_plan(load_config(overrides=["+experiment=grpo_8b_long_context", "data.max_response_length=65536",
                                             f"{ACTOR}.context_parallel_size=8"]))
    assert long.fits and long.actor_layout.dp == 1
    assert round(long.total("generate") / GIB, 1) == 65.8 and round(long.total("actor update") / GIB, 1) == 60.5
    # 64k at CP 4: 81.1 GiB in the update, over by less than its activations' error: warned, not refused (issue 51)
    edge = build_plan(load_config(overrides=["+experiment=grpo_8b_long_context", "data.max_response_length=65536"]))
    assert round(edge.total("actor update") / GIB, 1) == 81.1 and not edge.fits and not edge.over_beyond_error
    assert "WARNING: the plan's actor update phase needs 81.1 GiB" in edge.edge_warning()


# ---------------------------------------------------------------------------- uneven pipeline stages (issue 51)
@pytest.mark.parametrize("layers, pp, first, last, counts", [
    (94, 8, 11, 11, [11, 12, 12, 12, 12, 12, 12, 11]), (3, 2, 1, None, [1, 2]), (7, 3, None, 1, [3, 3, 1]),
    (8, 4, None, None, [2, 2, 2, 2]),
])
def test_stage_layer_counts_cut_as_megatron_does(layers, pp, first, last, counts):
    from megatron_rl.models.sizes import stage_layer_counts

    assert stage_layer_counts(layers, pp, first, last) == counts


@pytest.mark.parametrize("overrides, message", [
    (["first=10", "last=10"], r"num_layers_in_first/last_pipeline_stage=10/10 leave 74 of num_hidden_layers=94 for "
                              r"the 6 stages between, which do not split them evenly"),
    (["first=11", "last=11", "vpp=2"], r"num_layers_in_first/last_pipeline_stage with a virtual pipeline \(VPP=2\) "
                                       r"is not built here"),
    (["first=0"], r"num_layers_in_first_pipeline_stage=0 must lie in \[1, 93\]"),
])
def test_an_uneven_split_that_megatron_cannot_cut_is_refused_naming_it(overrides, message):
    from megatron_rl.models.sizes import check_parallel_fit

    class Facts:
        source, num_attention_heads, num_key_value_heads, head_dim, intermediate_size = "m", 64, 4, 128, 12288
        num_layers, moe = 94, None

    kwargs = dict(o.split("=") for o in overrides)
    with pytest.raises(ValueError, match=message):
        check_parallel_fit(Facts(), 4, 8, int(kwargs["vpp"]) if "vpp" in kwargs else None,
                           first=int(kwargs["first"]) if "first" in kwargs else None,
                           last=int(kwargs["last"]) if "last" in kwargs else None)
