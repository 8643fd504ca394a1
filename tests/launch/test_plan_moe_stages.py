"""The planner's per-stage parameters of MoE models follow the layer pattern (issue 38): a dense-first model's
first pipeline stage holds a dense MLP and no experts, a Qwen2-MoE-like model's MoE layers a shared expert too,
and under a virtual pipeline each stage holds PP x VPP chunks dealt round-robin. Checked against the models
Megatron builds on 2 gloo ranks (PP=2, PP=2 x VPP=3, EP=2), counting weight matrices as the planner does."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
import shared_expert_jobs  # noqa: E402
from plan_moe_stages_jobs import built_counts_job  # noqa: E402

from megatron_rl.distributed import run_multiprocess  # noqa: E402
from megatron_rl.models.hf_config import load_hf_config  # noqa: E402
from megatron_rl.plan import memory  # noqa: E402
from megatron_rl.plan.memory import Layout  # noqa: E402

# qwen3_moe: 2 layers, layer 0 dense (mlp_only_layers=[0]); qwen2_moe: 6 layers, MoE at 1 and 5 with a gated
# shared expert, the others dense
MODELS = ("qwen3_moe", "qwen2_moe")
LAYOUTS = [(2, None, 1), (2, 3, 1), (1, None, 2)]  # (pp, vpp, ep) on 2 ranks, TP=1


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("moe_stages")
    dirs = {name: str(shared_expert_jobs.make_checkpoint(tmp / name, name)) for name in MODELS}
    ranks = run_multiprocess(built_counts_job, 2, dirs, LAYOUTS, timeout_s=900)
    return {name: load_hf_config(directory) for name, directory in dirs.items()}, ranks


def _layout(pp: int, vpp: int | None, ep: int) -> Layout:
    return Layout(tp=1, pp=pp, cp=1, dp=2 // pp, vpp=vpp, ep=ep)


# every model at every layout, except qwen3_moe's 2 layers at PP 2 x VPP 3 (they do not split into 6 chunks)
CASES = [(name, *layout) for name in MODELS for layout in LAYOUTS if (name, layout[1]) != ("qwen3_moe", 3)]


@pytest.mark.parametrize("name, pp, vpp, ep", CASES)
def test_planned_stage_params_equal_the_built_model(built, name, pp, vpp, ep):
    models, ranks = built
    model = models[name]
    assert model.num_layers % (pp * (vpp or 1)) == 0, (name, model.num_layers, pp, vpp)
    layout = _layout(pp, vpp, ep)
    first, last = (ranks[r][name, (pp, vpp, ep)] for r in (0, len(ranks) - 1))
    assert memory.stage_params(model, layout, "first") == first[0]
    assert memory.stage_params(model, layout, "last") == last[0]
    assert memory.stage_layers(model, layout, "first") == first[1]
    assert memory.stage_layers(model, layout, "last") == last[1]


def test_a_dense_first_stage_holds_no_experts(built):
    models, _ = built
    model = models["qwen3_moe"]
    layout = _layout(2, None, 1)
    assert memory.stage_expert_params(model, layout, "first") == 0
    assert memory.stage_expert_params(model, layout, "last") == memory.mlp_params(model)
    # the dense layer's MLP is intermediate_size wide, the MoE layer's shared part only the router
    assert memory.stage_params(model, layout, "first") < memory.stage_params(model, layout, "last")


# ------------------------------------------------- the planner's rows for the stage it plans (one process)
DENSE_FIRST_HALF = "[" + ",".join(str(i) for i in range(24)) + "]"


def test_the_last_stage_shards_its_own_experts_adam_state_over_expert_dp():
    """Qwen3-30B-A3B with its first 24 layers dense at TP 2 x PP 2 x EP 8 on 16 GPUs: the last stage holds
    every expert; their Adam state is sharded over expert-DP (1 rank), the rest over DP 4. The rows followed
    the first stage's experts (none), so the plan said 6.1 GiB of Adam state where 21.3 GiB are needed."""
    from megatron_rl.config import load_config
    from megatron_rl.plan import build_plan

    plan = build_plan(load_config(overrides=[
        "+experiment=grpo_qwen3_30b_a3b", "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2",
        f"plan.architecture.mlp_only_layers={DENSE_FIRST_HALF}"]))
    assert plan.actor_stage == "last"
    # per layer: attention 2048 x (4096 + 2 x 512) + 4096 x 2048 = 18,874,368 and router 128 x 2048 = 262,144,
    # over TP 2; experts 128 x 3 x 2048 x 768 = 603,979,776 over EP 8; 24 layers; the output layer
    # 152,064 (vocab padded at TP 2) x 2048 / 2
    dense = 24 * (18_874_368 + 262_144) // 2 + 152_064 * 2048 // 2
    experts = 24 * 603_979_776 // 8
    assert memory.stage_params(plan.model, plan.actor_layout, "last") == dense + experts == 2_197_291_008
    (row,) = [r for r in plan.rows if r.label.startswith("actor optimizer")]
    assert (row.label, row.per_phase["actor update"]) == (
        "actor optimizer (Adam, /4 shards, experts /1)", dense * 12 / 4 + experts * 12 / 1)
    assert row.per_phase["actor update"] == 22_899_326_976


def test_host_ram_at_save_shards_the_experts_adam_state_over_expert_dp():
    """The 30B-A3B preset (TP 2 x DP 8 x EP 8, 16 GPUs): a rank saves its own Adam shard, dense / 8 and experts
    / 2 (expert-DP), the optimizer row's 21.3 GiB; it read 6.1 GiB (everything / 8)."""
    from megatron_rl.config import load_config
    from megatron_rl.plan import build_plan
    from megatron_rl.plan.planner import checkpoint_host_ram

    cfg = load_config(overrides=["+experiment=grpo_qwen3_30b_a3b"])
    plan = build_plan(cfg)
    (row,) = [r for r in plan.rows if r.label == "actor optimizer (Adam, /8 shards, experts /2)"]
    experts = memory.stage_expert_params(plan.model, plan.actor_layout, "first")
    dense = memory.stage_params(plan.model, plan.actor_layout, "first") - experts
    assert experts == 48 * 128 * 3 * 2048 * 768 // 8
    assert row.per_phase["actor update"] == dense * 12 / 8 + experts * 12 / 2
    gib = row.per_phase["actor update"] / 2**30
    assert checkpoint_host_ram(cfg).startswith(
        f"checkpoint save, host RAM per rank for the actor's Adam state: {gib:.1f} GiB (fully_sharded_model_space;")
