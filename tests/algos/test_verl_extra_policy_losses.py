"""verl 0.9's other policy loss modes (dppo_tv, dppo_kl, sapo, gpg, clip_cov, kl_cov, geo_mean, dro, cispo):
hand-computed cases that always run, the registry names, and verl 0.9.1's functions as the oracle
(random and edge-case inputs, every aggregation mode) when MEGATRON_RL_VERL_PATH provides verl."""

from __future__ import annotations

import math

import pytest
import torch
from algos_data import random_mask

from megatron_rl import algos
from megatron_rl.algos import policy_loss as pl
from megatron_rl.algos.loss_agg import GlobalBatchInfo
from megatron_rl.compat.verl.trainer.ppo import core_algos as compat

NEW = ("dppo_tv", "dppo_kl", "sapo", "gpg", "clip_cov", "kl_cov", "geo_mean", "dro", "cispo")
TOL = dict(atol=1e-5, rtol=1e-5)
CFG = pl.PolicyLossConfig(clip_ratio=0.2, clip_ratio_low=0.1, clip_ratio_high=0.28, clip_ratio_c=3.0,
                          dro_beta=0.05, clip_cov_ratio=0.2, kl_cov_ratio=0.2, ppo_kl_coef=0.5)


def fn(name):
    return getattr(pl, f"compute_policy_loss_{name}")


# ---------------------------------------------------------------- registry and compat names


@pytest.mark.parametrize("name", NEW)
def test_registry_name_selects_the_loss_and_compat_exports_it(name):
    assert algos.get_policy_loss(name) is fn(name)
    assert compat.get_policy_loss_fn(name) is fn(name)
    assert getattr(compat, f"compute_policy_loss_{name}") is fn(name)
    assert f"compute_policy_loss_{name}" in compat.__all__


def test_loss_specific_keys_are_read_flat_or_from_a_nested_policy_loss():
    flat = pl.PolicyLossConfig.from_actor_config({"clip_ratio": 0.3, "dro_beta": 0.1, "tau_pos": 2.0})
    assert (flat.dro_beta, flat.tau_pos, flat.clip_cov_ratio) == (0.1, 2.0, 0.0002)
    nested = pl.PolicyLossConfig.from_actor_config(
        {"policy_loss": {"loss_mode": "kl_cov", "kl_cov_ratio": 0.01, "ppo_kl_coef": None, "dro_beta": None}}
    )
    assert (nested.kl_cov_ratio, nested.ppo_kl_coef, nested.dro_beta) == (0.01, 0.1, None)
    ours = pl.PolicyLossConfig.from_actor_config({"policy_loss": "cispo", "clip_cov_lb": 0.5})
    assert ours.clip_cov_lb == 0.5


# ---------------------------------------------------------------- hand-computed cases (always run)

OLD = torch.tensor([[-1.0, -0.7, -0.2], [-0.5, -2.0, -1.0]])
LOGP = torch.tensor([[-0.8, -0.9, -0.1], [-0.5, -1.0, -1.2]])
ADV = torch.tensor([[2.0, -1.5, 9.0], [1.0, 1.0, 1.0]])
MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])


def token_mean(values):
    return sum(v for v, m in zip(values.flatten().tolist(), MASK.flatten().tolist()) if m) / MASK.sum().item()


def run(name, cfg=CFG, mode="token-mean", **kw):
    log_prob = LOGP.clone().requires_grad_()
    loss, metrics = fn(name)(OLD, log_prob, ADV, MASK, mode, cfg, **kw)
    return loss, metrics, log_prob


def test_gpg_and_dro_by_hand():
    loss, metrics, _ = run("gpg")
    assert metrics == {}
    assert loss.item() == pytest.approx(token_mean(-LOGP * ADV), abs=1e-6)
    loss, metrics, lp = run("dro")
    d = LOGP - OLD
    assert loss.item() == pytest.approx(token_mean(-(LOGP * ADV - 0.025 * d * d)), abs=1e-6)
    loss.backward()  # dl/dlogp = (-A + beta * d) / n
    torch.testing.assert_close(lp.grad, (-ADV + 0.05 * d) * MASK / 5)
    assert metrics["actor/ppo_kl"] == pytest.approx(token_mean(-d), abs=1e-6)
    with pytest.raises(ValueError, match="dro_beta"):
        run("dro", pl.PolicyLossConfig())


def test_cispo_by_hand():
    loss, metrics, lp = run("cispo")
    w = torch.exp(LOGP - OLD).clamp(0.9, 1.28)  # ratios e^.2, e^-.2, e^.1 | 1, e^1, e^-.2
    assert loss.item() == pytest.approx(token_mean(-w * ADV * LOGP), abs=1e-6)
    loss.backward()  # the weight is detached: the gradient is -w*A/n
    torch.testing.assert_close(lp.grad, -w * ADV * MASK / 5)
    assert metrics["actor/pg_clipfrac"] == pytest.approx(3 / 5)  # e^-.2 < .9 twice, e^1 > 1.28 once
    assert metrics["actor/pg_clipfrac_lower"] == 0.0


def test_sapo_by_hand_aggregates_per_sequence():
    cfg = pl.PolicyLossConfig(tau_pos=1.0, tau_neg=2.0)
    loss, _, _ = run("sapo", cfg, mode="token-mean")  # the mode is ignored, as in verl
    r = torch.exp(LOGP - OLD)
    tau = torch.where(ADV > 0, 1.0, 2.0)
    per_tok = -torch.sigmoid(tau * (r - 1)) * 4 / tau * ADV
    rows = [(per_tok[0, :2].sum() / 2).item(), (per_tok[1].sum() / 3).item()]
    assert loss.item() == pytest.approx(sum(rows) / 2, abs=1e-6)


def test_geo_mean_by_hand():
    loss, metrics, _ = run("geo_mean")
    d = (LOGP - OLD).tolist()
    a = ADV.tolist()

    def clip(x, adv):  # the log-ratio clipped on the advantage's side only
        c = min(max(x, -0.1), 0.28)
        return min(x, c) if adv > 0 else max(x, c) if adv < 0 else x

    row0 = -((2.0 - 1.5) / 2) * math.exp((clip(d[0][0], a[0][0]) + clip(d[0][1], a[0][1])) / 2)
    row1 = -1.0 * math.exp(sum(clip(x, 1.0) for x in d[1]) / 3)
    assert loss.item() == pytest.approx((row0 + row1) / 2, abs=1e-6)
    # moved by the clamp: (1,1) d=+1 with A>0, (1,2) d=-.2 with A>0, (0,1) d=-.2 with A<0
    assert metrics["actor/pg_clipfrac"] == pytest.approx(2 / 5)
    assert metrics["actor/pg_clipfrac_lower"] == pytest.approx(1 / 5)
    # a global batch: rows summed, divided by its size, times dp_size
    g_loss, _ = fn("geo_mean")(OLD, LOGP, ADV, MASK, "token-mean", CFG,
                               global_batch=GlobalBatchInfo(global_batch_size=8, dp_size=2))
    assert g_loss.item() == pytest.approx((row0 + row1) / 8 * 2, abs=1e-6)


def test_dppo_by_hand():
    p, q = torch.exp(LOGP), torch.exp(OLD)
    loss, metrics, _ = run("dppo_tv")
    valid = torch.where(ADV > 0, p - q <= 0.28, p - q >= -0.1).float()
    r = torch.exp(LOGP - OLD)
    assert loss.item() == pytest.approx(token_mean(-ADV * r.clamp(max=3.0) * LOGP * valid), abs=1e-6)
    assert metrics["actor/pg_clipfrac"] == pytest.approx(token_mean(1 - valid), abs=1e-6)
    loss, _, _ = run("dppo_kl")
    bkl = q * (OLD - LOGP) + (1 - q) * torch.log((1 - q + 1e-8) / (1 - p + 1e-8))
    valid = torch.where(ADV > 0, (bkl <= 0.28) | (p <= q), (bkl <= 0.1) | (p >= q)).float()
    assert loss.item() == pytest.approx(token_mean(-ADV * r.clamp(max=3.0) * LOGP * valid), abs=1e-6)


def test_kl_cov_and_clip_cov_by_hand():
    # 5 valid tokens, ratio .2 -> exactly one token is selected
    loss, metrics, _ = run("kl_cov")
    valid = MASK.bool()
    a, lp = ADV[valid], LOGP[valid]
    cov = (a - a.mean()) * (lp - lp.mean())
    top = int(cov.argmax())
    per_tok = (-ADV * torch.exp(LOGP - OLD))[valid]
    per_tok[top] += 0.5 * (LOGP - OLD)[valid].abs()[top]
    assert loss.item() == pytest.approx(per_tok.mean().item(), abs=1e-6)
    assert metrics == {"actor/ppo_kl": pytest.approx((LOGP - OLD)[valid].abs().mean().item(), abs=1e-6)}
    # clip_cov with a window nothing falls in equals the PPO clip without dual clip
    cfg = pl.PolicyLossConfig(clip_ratio_low=0.1, clip_ratio_high=0.28, clip_cov_lb=100.0, clip_cov_ub=200.0)
    loss, metrics, _ = run("clip_cov", cfg)
    r = torch.exp(LOGP - OLD)
    ppo = torch.maximum(-ADV * r, -ADV * r.clamp(0.9, 1.28))
    assert loss.item() == pytest.approx(token_mean(ppo), abs=1e-6)
    assert metrics["actor/pg_clipfrac"] == 0.0
    # a window holding every unclipped token: one of them (ratio .2 of 5) is dropped
    cfg = pl.PolicyLossConfig(clip_ratio_low=0.1, clip_ratio_high=0.28, clip_cov_ratio=0.2, clip_cov_lb=-1e9,
                              clip_cov_ub=1e9)
    _, metrics, _ = run("clip_cov", cfg)
    assert metrics["actor/pg_clipfrac"] == pytest.approx(1 / 5)


@pytest.mark.parametrize("name", NEW)
def test_zero_advantages_and_bad_inputs(name):
    zero = torch.zeros_like(ADV)
    loss, _ = fn(name)(OLD, LOGP, zero, MASK, "token-mean", CFG)
    expected = token_mean(0.025 * (LOGP - OLD) ** 2) if name == "dro" else 0.0
    if name == "kl_cov":  # all covariances tie at 0: one valid token (topk's pick) gets the |log-ratio| penalty
        assert any(loss.item() == pytest.approx(0.5 * d / 5, abs=1e-6) for d in (LOGP - OLD)[MASK.bool()].abs().tolist())
    else:
        assert loss.item() == pytest.approx(expected, abs=1e-6)
    with pytest.raises(ValueError):
        fn(name)(OLD, LOGP[:, :2], ADV, MASK, "token-mean", CFG)
    with pytest.raises(ValueError):
        fn(name)(OLD, LOGP, ADV, MASK, "token-mean", CFG, -torch.ones_like(ADV))


def test_cov_losses_refuse_a_zero_ratio():
    with pytest.raises(ValueError, match="clip_cov_ratio"):
        fn("clip_cov")(OLD, LOGP, ADV, MASK, "token-mean", {"clip_cov_ratio": 0.0})
    with pytest.raises(ValueError, match="kl_cov_ratio"):
        fn("kl_cov")(OLD, LOGP, ADV, MASK, "token-mean", {"kl_cov_ratio": 0.0})


# ---------------------------------------------------------------- verl 0.9.1 as the oracle


def batch(seed, kind="random"):
    gen = torch.Generator().manual_seed(seed)
    B, T = 8, 12
    mask = random_mask(B, T, gen, empty_rows=(3,))
    old = -torch.rand(B, T, generator=gen) * 3
    log_prob = old + 0.4 * torch.randn(B, T, generator=gen)
    adv = torch.randn(B, T, generator=gen)
    if kind == "seq_adv":
        adv = adv[:, :1].expand(B, T).clone()
    elif kind == "extreme":  # log-ratios of +-15 (and +-25 for the losses that clamp at 20)
        log_prob[:, 0] = old[:, 0] + 15.0
        log_prob[:, 1] = old[:, 1] - 15.0
        log_prob[0, 2] = old[0, 2] + 25.0
        log_prob[1, 2] = old[1, 2] - 25.0
    elif kind == "zero_adv":
        adv[:4] = 0.0
    log_prob = log_prob.clamp(max=-1e-4)
    old = old.clamp(max=-1e-4)
    return old, log_prob, adv, mask


def verl_config(global_batch_info=None):
    from verl.workers.config import ActorConfig, PolicyLossConfig

    cfg = ActorConfig(
        strategy="megatron", clip_ratio=0.2, clip_ratio_low=0.1, clip_ratio_high=0.28, clip_ratio_c=3.0,
        ppo_micro_batch_size_per_gpu=1, rollout_n=2, tau_pos=1.0, tau_neg=1.05,
        policy_loss=PolicyLossConfig(clip_cov_ratio=0.05, clip_cov_lb=0.0, clip_cov_ub=5.0, kl_cov_ratio=0.05,
                                     ppo_kl_coef=0.3, dro_beta=0.05),
    )
    if global_batch_info:
        cfg.global_batch_info.update(global_batch_info)
    return cfg


def compare(verl_core_algos, name, inputs, mode, rollout_is_weights=None, global_batch_info=None):
    old, log_prob, adv, mask = inputs
    cfg = verl_config(global_batch_info)
    ours_lp, verl_lp = log_prob.clone().requires_grad_(), log_prob.clone().requires_grad_()
    torch.manual_seed(1234)  # clip_cov draws from torch's global RNG
    ours, ours_metrics = fn(name)(old, ours_lp, adv, mask, mode, cfg, rollout_is_weights)
    torch.manual_seed(1234)
    theirs, verl_metrics = getattr(verl_core_algos, f"compute_policy_loss_{name}")(
        old, verl_lp, adv, mask, mode, cfg, rollout_is_weights
    )
    ours.backward()
    theirs.backward()
    torch.testing.assert_close(ours, theirs, **TOL)
    torch.testing.assert_close(ours_lp.grad, verl_lp.grad, **TOL)
    assert ours_metrics == pytest.approx(verl_metrics, abs=1e-6)
    assert set(ours_metrics) == set(verl_metrics)


@pytest.mark.parametrize("mode", algos.LOSS_AGG_MODES)
@pytest.mark.parametrize("name", NEW)
@pytest.mark.parametrize("kind", ["random", "seq_adv", "extreme", "zero_adv"])
def test_matches_verl(verl_core_algos, name, mode, kind):
    for seed in range(3):
        compare(verl_core_algos, name, batch(seed, kind), mode)


@pytest.mark.parametrize("name", NEW)
def test_matches_verl_with_is_weights_and_global_batch(verl_core_algos, name):
    old, log_prob, adv, mask = batch(7)
    weights = torch.rand(old.shape, generator=torch.Generator().manual_seed(3)) * 2
    compare(verl_core_algos, name, (old, log_prob, adv, mask), "token-mean", weights)
    if name != "geo_mean":  # geo_mean: verl ignores the global batch (documented difference)
        compare(verl_core_algos, name, (old, log_prob, adv, mask), "seq-mean-token-mean", weights,
                {"dp_size": 2, "batch_num_tokens": 70, "global_batch_size": 9})


def test_verl_registers_no_loss_we_lack(verl_core_algos):
    assert set(verl_core_algos.POLICY_LOSS_REGISTRY) <= set(algos.list_policy_losses())


def test_verls_dro_test_passes_on_compat(verl_core_algos):
    """verl 0.9.1's tests/trainer/ppo/test_dynamic_policy_losses_on_cpu.py body, on compat's function."""
    from verl.workers.config.actor import ActorConfig, PolicyLossConfig

    def actor(dro_beta=None):
        return ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, clip_ratio=0.2,
                           clip_ratio_low=0.2, clip_ratio_high=0.2, loss_agg_mode="token-mean",
                           policy_loss=PolicyLossConfig(loss_mode="dro", dro_beta=dro_beta))

    old = torch.tensor([[-1.0, -0.7, -0.2]])
    log_prob = torch.tensor([[-0.8, -0.9, -0.1]], requires_grad=True)
    adv = torch.tensor([[2.0, -1.5, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    loss, _ = compat.compute_policy_loss_dro(old, log_prob, adv, mask, "token-mean", actor(0.05))
    d = log_prob - old
    expected = (-(log_prob * adv - 0.025 * d.square()) * mask).sum() / mask.sum()
    torch.testing.assert_close(loss, expected)
    with pytest.raises(ValueError, match="dro_beta"):
        compat.compute_policy_loss_dro(old, log_prob, adv, mask, "token-mean", actor())


@pytest.mark.parametrize("name", NEW)
def test_all_masked_batch_is_a_zero_loss_with_zero_gradient(name):
    """verl gives NaN here (0/0 in token-mean); ours is 0, as for the other losses (docs/algorithms.md)."""
    log_prob = LOGP.clone().requires_grad_()
    loss, _ = fn(name)(OLD, log_prob, ADV, torch.zeros_like(MASK), "token-mean", CFG)
    loss.backward()
    assert loss.item() == 0.0
    assert torch.count_nonzero(log_prob.grad) == 0
