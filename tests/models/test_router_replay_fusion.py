"""Routing replay with Megatron's fused router (moe_router_fusion=true) is refused by name (issue 56).

Megatron-Core 0.16.1, moe/moe_utils.py:652-666: ``topk_routing_with_score_function`` returns Transformer Engine's
``fused_topk_with_score_function`` when ``fused`` is set, before ``compute_topk`` (lines 699-707), the only place
that consults ``router_replay``; moe/router.py:573-584 passes both ``fused=moe_router_fusion`` and the replay."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf

EXPERTS, K = 4, 2
FUSION = "override_transformer_config.moe_router_fusion"


def _router(fusion: bool) -> torch.nn.Module:
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.moe.router import TopKRouter

    from megatron_rl.models.moe_compat import bind_missing_te_names

    bind_missing_te_names()
    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1, num_moe_experts=EXPERTS,
                               moe_router_topk=K, moe_router_fusion=fusion, moe_router_dtype="fp32")
    # no parallel state: the router's groups are only read by its aux losses and token dispatch
    return TopKRouter(config=config, pg_collection=SimpleNamespace(tp=None, cp=None, tp_cp=None, tp_dp_cp=None))


def _replayed_routing_map(router: torch.nn.Module, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    from megatron.core.transformer.moe.router_replay import RouterReplay

    from megatron_rl.models.router_replay import _replay_topk

    replay = RouterReplay.__new__(RouterReplay)
    replay.target_topk_idx = target
    replay.get_replay_topk = _replay_topk.__get__(replay)
    router.router_replay = replay
    with torch.no_grad():
        return router.routing(logits[:, None, :])[1].bool()


def test_megatron_fused_router_skips_the_replay_hook(monkeypatch):
    """Why the refusal: with fusion on, the router's top-k comes from the fused kernel and the replayed experts
    are ignored without a word. TE's kernel (not on CPU) is stood in for by the unfused top-k without replay,
    which is what it computes (moe_utils.py:657: it is given no replay)."""
    from megatron.core.transformer.moe import moe_utils

    def fused_double(logits, topk, use_pre_softmax, num_groups, group_topk, scaling_factor, score_function,
                     expert_bias):
        return moe_utils.topk_routing_with_score_function(logits, topk, use_pre_softmax=use_pre_softmax,
                                                          score_function=score_function)

    monkeypatch.setattr(moe_utils, "HAVE_TE", True)
    monkeypatch.setattr(moe_utils, "fused_topk_with_score_function", fused_double, raising=False)
    logits = torch.randn(6, EXPERTS, generator=torch.Generator().manual_seed(0))
    own = torch.zeros(6, EXPERTS, dtype=torch.bool).scatter_(1, logits.topk(K).indices, True)
    target = (~own).nonzero()[:, 1].view(6, K)  # the two experts the router would not choose
    replayed = torch.zeros_like(own).scatter_(1, target, True)

    assert torch.equal(_replayed_routing_map(_router(fusion=False), logits, target), replayed)
    assert torch.equal(_replayed_routing_map(_router(fusion=True), logits, target), own)  # replay skipped


def test_an_engine_with_a_fused_router_refuses_replay_naming_both_keys():
    from megatron_rl.config.schema import MegatronParallelConfig, RouterReplayConfig
    from megatron_rl.models.router_replay import build_routing_replay

    parallel = MegatronParallelConfig(router_replay=RouterReplayConfig(mode="R3"))
    hf_config = SimpleNamespace(moe=SimpleNamespace(topk=K))
    with pytest.raises(ValueError, match=re.escape(f"actor.megatron.router_replay.mode=R3 with actor.megatron.{FUSION}"
                                                   "=true")):
        build_routing_replay([_router(fusion=True)], parallel, hf_config, "actor.megatron")
    assert build_routing_replay([_router(fusion=False)], parallel, hf_config, "actor.megatron") is not None


def _config(**settings):
    from megatron_rl.config.schema import PPOTrainerConfig

    cfg = OmegaConf.structured(PPOTrainerConfig)
    for key, value in settings.items():
        OmegaConf.update(cfg, key, value, force_add=True)
    return cfg


@pytest.mark.parametrize("role", ["actor", "ref"])
@pytest.mark.parametrize("mode", ["R2", "R3"])
def test_replay_with_router_fusion_is_refused_before_launch_naming_both_keys(role, mode):
    from megatron_rl.config.errors import ConfigError
    from megatron_rl.config.router_replay import check_router_replay

    replay = {"actor_rollout_ref.actor.megatron.router_replay.mode": mode,
              "actor_rollout_ref.rollout.enable_rollout_routing_replay": mode == "R3"}
    fused = {f"actor_rollout_ref.{role}.megatron.{FUSION}": True}
    message = (f"actor_rollout_ref.actor.megatron.router_replay.mode={mode} with "
               f"actor_rollout_ref.{role}.megatron.{FUSION}=true")
    with pytest.raises(ConfigError, match=re.escape(message)):
        check_router_replay(_config(**replay, **fused))
    check_router_replay(_config(**replay, **{f"actor_rollout_ref.{role}.megatron.{FUSION}": False}))
    check_router_replay(_config(**fused))  # fusion without replay: nothing to skip


def test_router_fusion_without_transformer_engine_is_refused_at_launch(monkeypatch):
    """Megatron's fused top-k is Transformer Engine's (moe_utils.py:653-656 raise at the first forward without it):
    refused at launch naming the key, as the other fused kernels are (before: a ValueError inside the workers)."""
    from megatron_rl.config import load_config
    from megatron_rl.models import capabilities
    from megatron_rl.plan import PlanError, check_launch, planner

    monkeypatch.setattr(capabilities, "distributed_optimizer_blocker", lambda: None)  # the preset asks for it
    cfg = load_config(overrides=["+experiment=grpo_qwen3_30b_a3b",
                                 f"++actor_rollout_ref.actor.megatron.{FUSION}=true"])
    monkeypatch.setattr(planner, "_importable", lambda module: False)
    with pytest.raises(PlanError, match=re.escape("sets ['moe_router_fusion']: fused kernels of Transformer Engine")):
        check_launch(cfg)
    monkeypatch.setattr(planner, "_importable", lambda module: True)
    check_launch(cfg)
