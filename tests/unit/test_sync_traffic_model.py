"""The weight-sync traffic model: its per-rank figures follow the closed-form formulas of docs/rollout.md, and
the planner prints it; the 70B preset's modelled shard-first sync is under 1 s (the previous path: > 2 s).
(The model's byte counts against a real instrumented run: tests/plan/test_weight_sync_traffic.py.)"""

from __future__ import annotations

import pytest

from megatron_rl.models.hf_config import parse_hf_config
from megatron_rl.plan.traffic import model_sync_traffic, shard_groups

LLAMA_70B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 8192, "num_hidden_layers": 80,
    "num_attention_heads": 64, "num_key_value_heads": 8, "intermediate_size": 28672, "vocab_size": 128256,
    "tie_word_embeddings": False, "rms_norm_eps": 1e-5, "max_position_embeddings": 8192,
}


@pytest.mark.parametrize("tp, pp, dp", [(8, 4, 2), (2, 2, 2), (4, 1, 2)])
def test_per_rank_figures_follow_the_closed_forms(tp, pp, dp):
    hf = parse_hf_config(LLAMA_70B)
    groups = shard_groups(hf, tp, pp, 2)
    shard = [sum(g.shard_bytes for g in groups if g.stage == s) for s in range(pp)]
    full = [sum(sum(g.hf_bytes) for g in groups if g.stage == s) for s in range(pp)]
    split_shard = [sum(g.shard_bytes for g in groups if g.stage == s and g.kind == "split") for s in range(pp)]
    new = model_sync_traffic(hf, tp, pp, dp, tp * dp, path="shard_first")  # one stage per node
    old = model_sync_traffic(hf, tp, pp, dp, tp * dp, path="tensorwise")
    for rank in range(tp * pp * dp):
        s = rank // (tp * dp)
        assert new.per_rank[rank]["inter_recv"] == sum(shard) - shard[s]
        assert new.per_rank[rank]["intra_recv"] == (tp - 1) * sum(shard)
        assert old.per_rank[rank]["inter_recv"] == sum(full) - full[s]
        assert old.per_rank[rank]["intra_recv"] == (tp - 1) * split_shard[s]


def test_70b_on_8x8_h100_is_modelled_under_one_second():
    hf = parse_hf_config(LLAMA_70B)
    new = model_sync_traffic(hf, 8, 4, 2, 8, path="shard_first", rollout_tp=8)
    old = model_sync_traffic(hf, 8, 4, 2, 8, path="tensorwise", rollout_tp=8)
    assert new.seconds < 1.0 < 2.0 < old.seconds, (new.seconds, old.seconds)
    assert old.worst("inter_recv") > 7 * new.worst("inter_recv")  # ~8x less over the network
    assert new.worst("collectives") < old.worst("collectives")


def test_the_planner_prints_both_paths(capsys):
    from megatron_rl.config import load_config
    from megatron_rl.plan.planner import print_plan

    print_plan(load_config("ppo_trainer", ["+experiment=grpo_70b",
                                           "actor_rollout_ref.actor.megatron.use_distributed_optimizer=false"]))
    out = capsys.readouterr().out
    assert "weight sync (TP 8 x PP 4 x DP 2" in out and "today (tensorwise)" in out and "shard-first" in out


@pytest.mark.parametrize("family", ["mimo", "deepseek_v3"])
def test_mtp_layers_are_counted_when_the_engines_draft_with_them(tmp_path, family):
    """The traffic model's groups carry what the export sends: the MTP layers (on the last stage) only when the
    engines draft with them (the dense model's hand-written groups against the export's own list; an MoE model
    (DeepSeek-V3) goes through the export's list, its MTP layer numbered past the model's layers)."""
    import dataclasses

    from megatron_rl.models.hf_config import load_hf_config
    from megatron_rl.models.layout import hf_tensor_groups
    from megatron_rl.models.mtp import with_mtp
    from megatron_rl_testing.mtp_models import make_mtp_checkpoint

    hf = with_mtp(load_hf_config(make_mtp_checkpoint(tmp_path / family, family, num_layers=2)), True)
    bare = dataclasses.replace(hf, mtp=None)
    exported = sum(t.shape[0] * (t.shape[1] if len(t.shape) > 1 else 1) for g in hf_tensor_groups(hf)
                   for t in g.tensors) * 2
    if hf.moe is None:
        groups = shard_groups(hf, 2, 2, 2)
        assert sum(sum(g.hf_bytes) for g in groups) == exported
        mtp_groups = groups[len(shard_groups(bare, 2, 2, 2)):]
        assert mtp_groups and {g.stage for g in mtp_groups} == {1}
    with_layers = model_sync_traffic(hf, 2, 2, 1, 4, path="shard_first")
    without = model_sync_traffic(bare, 2, 2, 1, 4, path="shard_first")
    assert with_layers.per_rank[0]["inter_recv"] + with_layers.per_rank[0]["intra_recv"] > \
        without.per_rank[0]["inter_recv"] + without.per_rank[0]["intra_recv"]
