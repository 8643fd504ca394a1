"""Loss aggregation (incl. split invariance), policy losses, value loss, entropy and KL loss terms."""

from __future__ import annotations

import algos_loop_reference as ref
import pytest
import torch
from algos_data import random_mask

from megatron_rl import algos
from megatron_rl.config.schema import ActorConfig

TOL = dict(atol=1e-5, rtol=1e-5)
B, T = 8, 10


def batch(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    mask = random_mask(B, T, gen, empty_rows=(5,))
    old = -torch.rand(B, T, generator=gen) * 2
    log_prob = old + 0.6 * torch.randn(B, T, generator=gen)
    advantages = torch.randn(B, T, generator=gen) * 2
    log_prob[:2, 0] = old[:2, 0] + 1.5  # ratio e^1.5 > 3 with A < 0: the dual clip binds
    advantages[:2, 0] = -1.0
    return old, log_prob, advantages, mask


def assert_scalar(actual: torch.Tensor, expected: float) -> None:
    torch.testing.assert_close(actual.double(), torch.tensor(expected, dtype=torch.float64), **TOL)


# ---------------------------------------------------------------- agg_loss


@pytest.mark.parametrize("mode", algos.LOSS_AGG_MODES)
def test_agg_loss_matches_loop(mode):
    _, loss_mat, _, mask = batch(1)
    assert_scalar(algos.agg_loss(loss_mat, mask, mode), ref.agg(loss_mat, mask, mode))
    assert_scalar(
        algos.agg_loss(
            loss_mat, mask, mode, global_num_tokens=100, global_batch_size=20, loss_scale_factor=64
        ),
        ref.agg(loss_mat, mask, mode, num_tokens=100, num_seqs=20, scale=64),
    )


@pytest.mark.parametrize("mode", algos.LOSS_AGG_MODES)
def test_agg_loss_of_an_all_masked_batch_is_zero_not_nan(mode):
    loss_mat = torch.randn(3, 4, requires_grad=True)
    loss = algos.agg_loss(loss_mat, torch.zeros(3, 4), mode)
    loss.backward()
    assert loss.item() == 0.0 and torch.all(loss_mat.grad == 0)


def test_masked_values_do_not_leak_nan_into_loss_or_gradient():
    loss_mat = torch.randn(2, 3)
    loss_mat[0, 2] = float("nan")
    loss_mat.requires_grad_(True)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    algos.agg_loss(loss_mat, mask, "token-mean").backward()
    assert torch.isfinite(loss_mat.grad).all()


SPLIT_CASES = [(mode, dp_average) for mode in algos.LOSS_AGG_MODES for dp_average in (False, True)]


@pytest.mark.parametrize("mode,dp_average", SPLIT_CASES)
def test_gradient_does_not_depend_on_micro_batch_and_dp_split(mode, dp_average):
    """One batch of 8 == 2 simulated DP ranks x 2 micro-batches (sizes 3+1 and 2+2), for every mode.

    dp_average: the DP reduction averages gradients (Megatron DDP default) and dp_size=2 undoes it;
    otherwise it sums them and dp_size stays 1.
    """
    _, loss_mat, _, mask = batch(2)
    weights = loss_mat.clone().requires_grad_(True)  # the "parameters": one per token
    algos.agg_loss(weights**2, mask, mode).backward()
    full_grad = weights.grad.clone()

    ranks = [[slice(0, 3), slice(3, 4)], [slice(4, 6), slice(6, 8)]]
    info = algos.GlobalBatchInfo.from_masks(
        [mask[s] for micro in ranks for s in micro], dp_size=2 if dp_average else 1
    )
    rank_grads = []
    for micro_batches in ranks:
        weights.grad = None
        for s in micro_batches:  # gradient accumulation on one rank
            algos.agg_loss(weights[s] ** 2, mask[s], mode, **info.agg_kwargs()).backward()
        rank_grads.append(weights.grad.clone())
    reduced = sum(rank_grads) / (2 if dp_average else 1)
    torch.testing.assert_close(reduced, full_grad, **TOL)


def test_policy_loss_gradient_is_split_invariant_with_global_batch_info():
    old, log_prob, adv, mask = batch(3)
    config = algos.PolicyLossConfig(clip_ratio_low=0.2, clip_ratio_high=0.28)
    lp = log_prob.clone().requires_grad_(True)
    algos.compute_policy_loss_vanilla(old, lp, adv, mask, "token-mean", config)[0].backward()
    full_grad = lp.grad.clone()
    lp.grad = None
    parts = [slice(0, 3), slice(3, 5), slice(5, 8)]
    info = algos.GlobalBatchInfo.from_masks([mask[s] for s in parts])
    for s in parts:
        algos.compute_policy_loss_vanilla(
            old[s], lp[s], adv[s], mask[s], "token-mean", config, global_batch=info
        )[0].backward()
    torch.testing.assert_close(lp.grad, full_grad, **TOL)


def test_agg_loss_bad_inputs():
    with pytest.raises(ValueError, match=r"unknown loss_agg_mode 'token-max'; known: \['token-mean'"):
        algos.agg_loss(torch.zeros(2, 3), torch.ones(2, 3), "token-max")
    with pytest.raises(ValueError, match=r"loss_mat \(2, 3\), loss_mask \(2, 4\)"):
        algos.agg_loss(torch.zeros(2, 3), torch.ones(2, 4), "token-mean")
    with pytest.raises(ValueError, match="dp_size=2\\) needs global_num_tokens"):
        algos.agg_loss(torch.zeros(2, 3), torch.ones(2, 3), "token-mean", dp_size=2)
    with pytest.raises(ValueError, match="needs global_batch_size"):
        algos.agg_loss(torch.zeros(2, 3), torch.ones(2, 3), "seq-mean-token-mean", dp_size=2)


def test_global_batch_info_counts_tokens_and_non_empty_sequences():
    masks = [torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]]), torch.tensor([[1.0, 0.0, 0.0]])]
    info = algos.GlobalBatchInfo.from_masks(masks, dp_size=4, loss_scale_factor=3)
    assert info == algos.GlobalBatchInfo(3.0, 2.0, 4, 3)


# ---------------------------------------------------------------- policy losses


CONFIGS = [
    algos.PolicyLossConfig(),  # symmetric clip 0.2, dual clip 3
    algos.PolicyLossConfig(clip_ratio=0.2, clip_ratio_low=0.1, clip_ratio_high=0.28, clip_ratio_c=1.5),
]


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("mode", algos.LOSS_AGG_MODES)
def test_vanilla_policy_loss_matches_loop(config, mode):
    old, log_prob, adv, mask = batch(4)
    loss, metrics = algos.compute_policy_loss_vanilla(old, log_prob, adv, mask, mode, config)
    losses, clip, lower, log_ratio = ref.vanilla_token_losses(
        old, log_prob, adv, config.low, config.high, config.clip_ratio_c
    )
    assert_scalar(loss, ref.agg(torch.tensor(losses), mask, mode))
    assert metrics["actor/pg_clipfrac"] == pytest.approx(ref.masked_mean(clip, mask), abs=1e-6)
    assert metrics["actor/pg_clipfrac_lower"] == pytest.approx(ref.masked_mean(lower, mask), abs=1e-6)
    assert metrics["actor/ppo_kl"] == pytest.approx(-ref.masked_mean(log_ratio, mask), abs=1e-6)
    assert (
        0 < metrics["actor/pg_clipfrac"] < 1 and 0 < metrics["actor/pg_clipfrac_lower"] < 1
    )  # both clips bind


@pytest.mark.parametrize("mode", algos.LOSS_AGG_MODES)
def test_gspo_policy_loss_matches_loop(mode):
    old, log_prob, adv, mask = batch(5)
    config = CONFIGS[1]
    loss, metrics = algos.compute_policy_loss_gspo(old, log_prob, adv, mask, mode, config)
    losses, clip = ref.gspo_token_losses(old, log_prob, adv, mask, config.low, config.high)
    assert_scalar(loss, ref.agg(torch.tensor(losses), mask, mode))
    assert metrics["actor/pg_clipfrac"] == pytest.approx(ref.masked_mean(clip, mask), abs=1e-6)
    assert metrics["actor/pg_clipfrac_lower"] == 0.0


def test_gspo_gradient_flows_through_each_token_with_the_sequence_ratio():
    """d loss / d logp_t = -A_t * s_i / N_tokens where the clip does not bind, 0 where it does."""
    old, log_prob, adv, mask = batch(6)
    lp = log_prob.clone().requires_grad_(True)
    config = algos.PolicyLossConfig(clip_ratio=10.0)  # never clips
    algos.compute_policy_loss_gspo(old, lp, adv, mask, "token-mean", config)[0].backward()
    seq = ((log_prob - old) * mask).sum(-1) / mask.sum(-1).clamp(min=1)
    expected = -adv * seq.exp().unsqueeze(-1) * mask / mask.sum()
    torch.testing.assert_close(lp.grad, expected, **TOL)


@pytest.mark.parametrize("name", ["vanilla", "gspo"])
def test_truncated_importance_sampling(name):
    old, log_prob, adv, mask = batch(7)
    rollout = old + 0.5 * torch.randn(B, T, generator=torch.Generator().manual_seed(7))
    loss_fn = algos.get_policy_loss(name)
    plain, _ = loss_fn(old, log_prob, adv, mask, "token-mean", CONFIGS[0])
    ignored, _ = loss_fn(old, log_prob, adv, mask, "token-mean", CONFIGS[0], rollout_log_probs=rollout)
    assert torch.equal(plain, ignored)  # off by default even when rollout log-probs are present

    capped = algos.PolicyLossConfig(tis_imp_ratio_cap=1.5)
    loss, metrics = loss_fn(old, log_prob, adv, mask, "token-mean", capped, rollout_log_probs=rollout)
    if name == "vanilla":
        token_losses = torch.tensor(ref.vanilla_token_losses(old, log_prob, adv, 0.2, 0.2, 3.0)[0])
    else:
        token_losses = torch.tensor(ref.gspo_token_losses(old, log_prob, adv, mask, 0.2, 0.2)[0])
    weights = [
        [min(torch.tensor(o - r).exp().item(), 1.5) for o, r in zip(orow, rrow)]
        for orow, rrow in zip(ref.rows(old), ref.rows(rollout))
    ]
    assert_scalar(
        loss, ref.agg(token_losses * torch.tensor(weights, dtype=torch.float64), mask, "token-mean")
    )
    assert 0 < metrics["actor/tis_clipfrac"] < 1
    assert metrics["actor/tis_weight_mean"] == pytest.approx(ref.masked_mean(weights, mask), abs=1e-5)

    with pytest.raises(ValueError, match="tis_imp_ratio_cap=1.5 is set but rollout_log_probs is None"):
        loss_fn(old, log_prob, adv, mask, "token-mean", capped)


def test_policy_loss_config_validation_and_actor_config():
    assert algos.PolicyLossConfig.from_actor_config(
        ActorConfig(clip_ratio_high=0.28)
    ) == algos.PolicyLossConfig(clip_ratio=0.2, clip_ratio_high=0.28)
    with pytest.raises(ValueError, match=r"clip_ratio_c must be > 1 \(dual-clip bound\), got 1.0"):
        algos.PolicyLossConfig(clip_ratio_c=1.0)
    with pytest.raises(ValueError, match="tis_imp_ratio_cap must be > 0 or null"):
        algos.PolicyLossConfig(tis_imp_ratio_cap=0.0)
    with pytest.raises(ValueError, match=r"log_prob \(8, 9\)"):
        algos.compute_policy_loss_vanilla(
            torch.zeros(8, 10), torch.zeros(8, 9), torch.zeros(8, 10), torch.ones(8, 10)
        )


def test_policy_loss_registry():
    assert algos.list_policy_losses()[:2] == ["vanilla", "gspo"]
    with pytest.raises(
        ValueError,
        match=r"unknown policy loss 'ppo' \(actor_rollout_ref.actor.policy_loss\); "
        r"known: \['vanilla', 'gspo'",
    ):
        algos.get_policy_loss("ppo")
    with pytest.raises(ValueError, match="'vanilla' is already registered"):
        algos.register_policy_loss("vanilla")(lambda *a, **k: None)


# ---------------------------------------------------------------- value, entropy, KL loss


def test_value_loss_matches_loop():
    _, _, _, mask = batch(8)
    gen = torch.Generator().manual_seed(8)
    vpreds, returns, values = (torch.randn(B, T, generator=gen) for _ in range(3))
    loss, clipfrac = algos.compute_value_loss(vpreds, returns, values, mask, cliprange_value=0.5)
    per_token, clipped_flags = [], []
    for vr, rr, olds in zip(ref.rows(vpreds), ref.rows(returns), ref.rows(values)):
        per_token.append([]), clipped_flags.append([])
        for v, r, o in zip(vr, rr, olds):
            clipped = (min(max(v, o - 0.5), o + 0.5) - r) ** 2
            per_token[-1].append(max((v - r) ** 2, clipped))
            clipped_flags[-1].append(float(clipped > (v - r) ** 2))
    assert_scalar(loss, 0.5 * ref.agg(torch.tensor(per_token), mask, "token-mean"))
    assert clipfrac.item() == pytest.approx(ref.masked_mean(clipped_flags, mask), abs=1e-6)
    assert 0 < clipfrac.item() < 1


def test_entropy_and_kl_loss_terms():
    old, log_prob, _, mask = batch(9)
    entropy = torch.rand(B, T)
    assert_scalar(
        algos.compute_entropy_loss(entropy, mask, "seq-mean-token-mean"),
        ref.agg(entropy, mask, "seq-mean-token-mean"),
    )
    kl = [
        [ref.kl_value(a, b, "low_var_kl") for a, b in zip(ar, br)]
        for ar, br in zip(ref.rows(log_prob), ref.rows(old))
    ]
    assert_scalar(algos.compute_kl_loss(log_prob, old, mask), ref.agg(torch.tensor(kl), mask, "token-mean"))


# ---------------------------------------------------------------- verl itself (optional oracle)


@pytest.mark.parametrize("mode", algos.LOSS_AGG_MODES)
def test_losses_match_verl(verl_core_algos, mode):
    from verl.workers.config import ActorConfig as VerlActorConfig

    old, log_prob, adv, mask = batch(10)
    ours_cfg = CONFIGS[1]
    verl_cfg = VerlActorConfig(
        strategy="megatron",
        clip_ratio=0.2,
        clip_ratio_low=0.1,
        clip_ratio_high=0.28,
        clip_ratio_c=1.5,
        ppo_micro_batch_size_per_gpu=1,
        rollout_n=2,
    )
    for ours_fn, verl_fn in (
        (algos.compute_policy_loss_vanilla, verl_core_algos.compute_policy_loss_vanilla),
        (algos.compute_policy_loss_gspo, verl_core_algos.compute_policy_loss_gspo),
    ):
        ours_lp, verl_lp = log_prob.clone().requires_grad_(), log_prob.clone().requires_grad_()
        ours, ours_metrics = ours_fn(old, ours_lp, adv, mask, mode, ours_cfg)
        theirs, verl_metrics = verl_fn(old, verl_lp, adv, mask, mode, verl_cfg)
        ours.backward()
        theirs.backward()
        torch.testing.assert_close(ours, theirs, **TOL)
        torch.testing.assert_close(ours_lp.grad, verl_lp.grad, **TOL)
        assert ours_metrics == pytest.approx(verl_metrics, abs=1e-6)
    assert_scalar(algos.agg_loss(adv, mask, mode), verl_core_algos.agg_loss(adv, mask, mode).item())
    gen = torch.Generator().manual_seed(10)
    vpreds, returns, values = (torch.randn(B, T, generator=gen) for _ in range(3))
    ours_v = algos.compute_value_loss(vpreds, returns, values, mask, 0.3, mode)
    verl_v = verl_core_algos.compute_value_loss(vpreds, returns, values, mask, 0.3, mode)
    for a, b in zip(ours_v, verl_v):
        torch.testing.assert_close(a, b, **TOL)
