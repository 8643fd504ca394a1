"""Algorithms on multi-turn data, end to end from the agent loop's batch: GAE, GRPO and REINFORCE++ (and the
policy loss, the KL penalty in the reward and the KL loss) treat observation tokens as if they were not
there. Property: on a multi-turn batch every quantity on the model tokens equals the same quantity computed
on the "compacted" batch (observation tokens removed, model tokens moved together), and nothing trains on
observation tokens (zero gradient), even with garbage log-probs / values planted on them."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from megatron_rl.algos import apply_kl_penalty, compute_advantage, compute_kl_loss, get_kl_controller
from megatron_rl.algos.policy_loss import get_policy_loss
from megatron_rl.reward.placement import place_scores
from megatron_rl_testing.agent_support import CALL, run_scripted, tiny_tokenizer

Q = "What is 123456 * 654321? Use the calculator tool."
BAD = '<tool_call>{"name": "calculator", "arguments": {"expression": </tool_call>'


@pytest.fixture(scope="module")
def batch(tmp_path_factory):
    tok = tiny_tokenizer(tmp_path_factory.mktemp("agent_tok"))
    scripts = [[CALL, "#### 80779853376"], [CALL, CALL, "#### 1"], [BAD, "#### 2"], ["#### 3"],
               [CALL, "#### 80779853376"], [BAD, CALL, "#### 4"]]
    out, _ = run_scripted(tok, [Q + " " * i for i in range(6)], scripts, settings={"max_assistant_turns": 5},
                          response_length=200)
    mask = out.batch["response_mask"]
    real = out.batch["attention_mask"][:, -mask.shape[1]:]
    assert ((real == 1) & (mask == 0)).any(-1).sum() == 5  # five samples carry observation tokens
    out.non_tensor_batch["uid"] = np.array(["a", "a", "a", "b", "b", "b"], dtype=object)
    g = torch.Generator().manual_seed(0)
    obs = (real == 1) & (mask == 0)
    garbage = torch.where(obs, torch.full_like(mask, 1, dtype=torch.float32) * 7.0, 0.0)
    b = out.batch
    b["token_level_scores"] = place_scores(torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 0.0]), mask)
    b["old_log_probs"] = (-torch.rand(mask.shape, generator=g)) * mask + garbage
    b["ref_log_prob"] = (-torch.rand(mask.shape, generator=g)) * mask - garbage
    b["values"] = torch.randn(mask.shape, generator=g) * mask  # the critic zeroes values off the mask
    return out


def compact(t: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    out = torch.zeros_like(t)
    for i in range(t.shape[0]):
        kept = t[i][mask[i].bool()]
        out[i, : kept.numel()] = kept
    return out


def compacted(data):
    c = data.select(deepcopy=True)
    mask = data.batch["response_mask"]
    for key in ("token_level_scores", "old_log_probs", "ref_log_prob", "values", "response_mask"):
        c.batch[key] = compact(data.batch[key].float(), mask).to(data.batch[key].dtype)
    return c


def _model_tokens_equal(multi, comp, mask, atol=1e-6):
    assert torch.allclose(compact(multi, mask), comp * compact(mask.float(), mask), atol=atol)


@pytest.mark.parametrize("estimator", ["gae", "grpo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "rloo"])
def test_advantages_on_model_tokens_ignore_observations(batch, estimator):
    multi, comp = batch.select(deepcopy=True), compacted(batch)
    for data in (multi, comp):
        data.batch["token_level_rewards"] = data.batch["token_level_scores"]
        compute_advantage(data, estimator, gamma=0.99, lam=0.95)
    mask = multi.batch["response_mask"]
    _model_tokens_equal(multi.batch["advantages"], comp.batch["advantages"], mask)
    _model_tokens_equal(multi.batch["returns"], comp.batch["returns"], mask)
    assert multi.batch["advantages"][mask.bool()].abs().sum() > 0


def test_kl_in_reward_only_on_model_tokens(batch):
    ctrl_cfg = OmegaConf.create({"type": "fixed", "kl_coef": 0.1, "target_kl": 0.1, "horizon": 100})
    multi, comp = batch.select(deepcopy=True), compacted(batch)
    (multi, m1), (comp, m2) = (apply_kl_penalty(d, get_kl_controller(ctrl_cfg), "kl") for d in (multi, comp))
    mask = multi.batch["response_mask"]
    obs = mask == 0
    # observation tokens: the score only (0 there), whatever their (garbage) log-probs are
    assert torch.equal(multi.batch["token_level_rewards"][obs], multi.batch["token_level_scores"][obs])
    _model_tokens_equal(multi.batch["token_level_rewards"], comp.batch["token_level_rewards"], mask)
    assert m1["actor/reward_kl_penalty"] == pytest.approx(m2["actor/reward_kl_penalty"], rel=1e-6)


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
def test_policy_loss_and_kl_loss_train_only_model_tokens(batch, agg):
    data = batch.select(deepcopy=True)
    data.batch["token_level_rewards"] = data.batch["token_level_scores"]
    compute_advantage(data, "grpo")
    mask = data.batch["response_mask"]
    config = OmegaConf.create({"clip_ratio": 0.2, "clip_ratio_low": 0.2, "clip_ratio_high": 0.28, "clip_ratio_c": 3.0})
    g = torch.Generator().manual_seed(1)
    log_prob = (data.batch["old_log_probs"] + 0.1 * torch.randn(mask.shape, generator=g)).requires_grad_(True)
    loss, _ = get_policy_loss("vanilla")(data.batch["old_log_probs"], log_prob, data.batch["advantages"], mask, agg, config)
    kl = compute_kl_loss(log_prob, data.batch["ref_log_prob"], mask, "low_var_kl", agg)
    (loss + kl).backward()
    grad = log_prob.grad
    assert torch.all(grad[mask == 0] == 0) and grad[mask == 1].abs().sum() > 0
    # the same loss as on the compacted batch
    c = compacted(data)
    c_adv = compact(data.batch["advantages"], mask)
    c_lp = compact(log_prob.detach(), mask)
    c_loss, _ = get_policy_loss("vanilla")(c.batch["old_log_probs"], c_lp, c_adv, c.batch["response_mask"], agg, config)
    c_kl = compute_kl_loss(c_lp, c.batch["ref_log_prob"], c.batch["response_mask"], "low_var_kl", agg)
    assert float(loss) == pytest.approx(float(c_loss), rel=1e-5, abs=1e-7)
    assert float(kl) == pytest.approx(float(c_kl), rel=1e-5, abs=1e-7)
