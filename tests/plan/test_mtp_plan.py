"""The planner counts the multi-token-prediction layers the actor builds (issue 52 item 6): parameters against
Megatron's built model (TP 1 and 2, PP 2: the MTP layer and Megatron's embedding copy on the last stage) for a tiny
MiMo and DeepSeek-V3 checkpoint, and DeepSeek-V3-671B's MTP module against its published size; the engines' weights
and the reference leave it out."""

from __future__ import annotations

import dataclasses

import pytest

from megatron_rl.distributed import run_multiprocess
from megatron_rl.models.hf_config import load_hf_config, parse_hf_config
from megatron_rl.models.mtp import with_mtp
from megatron_rl.plan import memory
from megatron_rl.plan.memory import Layout
from megatron_rl_testing.mtp_models import make_mtp_checkpoint

from test_mla_plan import DEEPSEEK_V3_671B


def test_deepseek_v3_671b_mtp_module_is_its_published_size():
    """The model card: 671 B main model + 14 B MTP module (685 B); the module includes its copies of the embedding
    and the output head (2 x 129,280 x 7,168), which Megatron shares with the main model and the planner counts
    once."""
    model = with_mtp(parse_hf_config(DEEPSEEK_V3_671B), True)
    module = memory.mtp_layer_params(model)
    h, vocab = 7168, 129280
    assert module == 2 * h * h + memory.layer_params(model, 60)
    main = dataclasses.replace(model, mtp=None)
    # the checkpoint's 685 B (the model card's 671 B + 14 B, each rounded): 684.5 B here
    assert abs((memory.numel(main) + module + 2 * vocab * h) / 1e9 - 685.0) < 1.0
    assert memory.total_params(model) == memory.total_params(main) + module
    assert memory.rollout_weight_bytes(model, 8) == memory.rollout_weight_bytes(main, 8)


def built_job(model_dir: str, layouts: list[tuple[int, int]]) -> dict:
    """Per (TP, PP): the weight matrices on this rank (norms left out), and whether it is the last stage."""
    from megatron.core import parallel_state

    from megatron_rl.distributed import destroy_model_parallel, init_model_parallel
    from megatron_rl.models.builder import build_gpt_model

    out: dict = {}
    for tp, pp in layouts:
        init_model_parallel(tp=tp, pp=pp)
        chunks = build_gpt_model(with_mtp(load_hf_config(model_dir), True))
        params = sum(p.numel() for c in chunks for n, p in c.named_parameters() if p.dim() >= 2)
        out[tp, pp] = (params, parallel_state.is_pipeline_last_stage())
        destroy_model_parallel()
    return out


@pytest.mark.distributed
@pytest.mark.parametrize("family", ["mimo", "deepseek_v3"])
def test_stage_params_count_the_built_mtp_layer(tmp_path, family):
    model_dir = make_mtp_checkpoint(tmp_path / family, family, num_layers=2, vocab_size=300)
    layouts = [(1, 1), (2, 1), (1, 2)]
    ranks = run_multiprocess(built_job, 2, str(model_dir), layouts, timeout_s=600)
    model = with_mtp(load_hf_config(model_dir), True)
    for tp, pp in layouts:
        layout = Layout(tp=tp, pp=pp, cp=1, dp=2 // (tp * pp))
        for rank in ranks:
            built, last = rank[tp, pp]
            stage = "last" if last else "first"
            planned = memory.stage_params(model, layout, stage)
            # as for every MoE family, the planner splits the (replicated) routers over TP
            routers = 0
            if model.moe is not None:
                layers = sum(model.moe.is_moe_layer(i) for i in memory.stage_layers(model, layout, stage))
                routers = (layers + int(last and model.mtp.moe_layer)) * model.moe.num_experts * model.hidden_size
            assert built == planned + routers * (tp - 1) // tp, (family, tp, pp, last)
    assert memory.mtp_stage_params(model, Layout(tp=1, pp=1, cp=1, dp=1)) == memory.mtp_layer_params(model)
