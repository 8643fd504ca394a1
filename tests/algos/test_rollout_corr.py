"""Rollout correction (algos/rollout_corr.py): loop formulas always; verl's rollout_corr_helper as the oracle
when verl imports; config keys rejected by name; the trainer uses it with rollout_log_probs."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_rl.algos import rollout_corr as rc
from megatron_rl.config import ConfigError, load_config
from megatron_rl.plan.validate import validate


def _batch(seed=0, b=10, t=8):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(b, t, generator=g) * 2
    roll = old + 0.4 * torch.randn(b, t, generator=g)
    mask = (torch.rand(b, t, generator=g) > 0.2).float()
    mask[:, 0] = 1
    return old, roll, mask


def test_token_truncated_weights_follow_the_formula():
    old, roll, mask = _batch(1)
    w, out_mask, metrics = rc.compute_rollout_correction_and_rejection_mask(old, roll, mask, rollout_is="token",
                                                                            rollout_is_threshold=1.5)
    for i in range(old.shape[0]):
        for t in range(old.shape[1]):
            want = min(math.exp(old[i, t] - roll[i, t]), 1.5) * mask[i, t].item()
            assert w[i, t].item() == pytest.approx(want, rel=1e-5, abs=1e-7)
    assert torch.equal(out_mask, mask)
    assert metrics["rollout_corr/rollout_is_max"] <= 1.5 and "rollout_corr/rollout_is_eff_sample_size" in metrics


def test_sequence_weights_and_icepop_masking():
    old, roll, mask = _batch(2)
    w, _, _ = rc.compute_rollout_correction_and_rejection_mask(old, roll, mask, rollout_is="sequence",
                                                               rollout_is_threshold="0.5_2.0")
    for i in range(old.shape[0]):
        raw = math.exp(sum((old[i, t] - roll[i, t]).item() * mask[i, t].item() for t in range(old.shape[1])))
        want = raw if 0.5 <= raw <= 2.0 else 0.0
        assert w[i][mask[i].bool()] == pytest.approx([want] * int(mask[i].sum()), rel=1e-5)


def test_rejection_drops_tokens_and_whole_responses():
    old, roll, mask = _batch(3)
    _, tok, m = rc.compute_rollout_correction_and_rejection_mask(old, roll, mask, rollout_rs="token_k2",
                                                                 rollout_rs_threshold=0.02)
    k2 = 0.5 * (old - roll) ** 2
    assert torch.equal(tok, mask * (k2 <= 0.02).float())
    assert 0 < m["rollout_corr/rollout_rs_masked_fraction"] < 1
    _, seq, _ = rc.compute_rollout_correction_and_rejection_mask(old, roll, mask, rollout_rs="seq_max_k2",
                                                                 rollout_rs_threshold=0.05)
    for i in range(old.shape[0]):
        keep = float((k2[i][mask[i].bool()]).max() <= 0.05)
        assert torch.equal(seq[i], mask[i] * keep)


def test_bad_settings_name_the_key():
    with pytest.raises(ValueError, match="rollout_correction.rollout_is must be one of"):
        rc.RolloutCorrection(rollout_is="tokens")
    with pytest.raises(ValueError, match="rollout_rs has unknown option 'token_k9'"):
        rc.RolloutCorrection(rollout_rs="token_k9", rollout_rs_threshold=1.0)
    with pytest.raises(ValueError, match="needs algorithm.rollout_correction.rollout_rs_threshold"):
        rc.RolloutCorrection(rollout_rs="token_k1")
    with pytest.raises(ValueError, match="rollout_is_threshold='a_b' is neither"):
        rc.RolloutCorrection(rollout_is="token", rollout_is_threshold="a_b")
    with pytest.raises(ValueError, match=r"unknown keys \['rollout_token_veto_threshold'\]"):
        rc.RolloutCorrection.from_config({"rollout_token_veto_threshold": 1e-4})


def _cfg(*overrides):
    return load_config(overrides=["trainer.nnodes=1", "trainer.n_gpus_per_node=1", "data.train_batch_size=2",
                                  "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
                                  "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2", *overrides])


def test_validate_checks_the_rollout_correction_keys():
    validate(_cfg("algorithm.rollout_correction.rollout_is=token", "algorithm.rollout_correction.rollout_is_threshold=0.5_3"))
    unknown = r"algorithm.rollout_correction.rollout_is='seq' is unknown; known: \['token', 'sequence'\]"
    with pytest.raises(ConfigError, match=unknown):  # the enum refuses it as the config is composed
        validate(_cfg("algorithm.rollout_correction.rollout_is=seq"))
    with pytest.raises(ConfigError, match="loss_type='reinforce' with bypass_mode=true"):
        validate(_cfg("algorithm.rollout_correction.bypass_mode=true", "algorithm.rollout_correction.loss_type=reinforce"))
    for keys in (("rollout_is=token",), ("rollout_rs=token_k1", "rollout_rs_threshold=2.0")):
        with pytest.raises(ConfigError, match="bypass_mode=true with rollout_is/rollout_rs set"):
            validate(_cfg("algorithm.rollout_correction.bypass_mode=true", *(f"algorithm.rollout_correction.{k}" for k in keys)))


CASES = [
    dict(rollout_is="token"),
    dict(rollout_is="sequence", rollout_is_threshold=5.0),
    dict(rollout_is="token", rollout_is_threshold="0.5_1.5", rollout_is_batch_normalize=True),
    dict(rollout_rs="token_k1", rollout_rs_threshold="0.6_1.6"),
    dict(rollout_rs="seq_mean_k3,token_k2", rollout_rs_threshold="0.05,0.1"),
    dict(rollout_is="sequence", rollout_rs="seq_max_k2", rollout_rs_threshold=0.3),
    dict(rollout_rs="seq_sum_k1", rollout_rs_threshold=3.0),
]


@pytest.mark.parametrize("kwargs", CASES)
def test_matches_verl(verl_core_algos, kwargs):
    from verl.trainer.ppo import rollout_corr_helper as verl_rc

    old, roll, mask = _batch(4, 16, 12)
    w, m, met = rc.compute_rollout_correction_and_rejection_mask(old, roll, mask, **kwargs)
    vw, vm, vmet = verl_rc.compute_rollout_correction_and_rejection_mask(
        old_log_prob=old, rollout_log_prob=roll, response_mask=mask, **kwargs)
    torch.testing.assert_close(m.float(), vm.float())
    if vw is None:
        assert w is None
    else:
        torch.testing.assert_close(w, vw.batch["rollout_is_weights"], rtol=1e-5, atol=1e-6)
    shared = [k for k in met if k in vmet]
    assert len(shared) >= 4
    assert {k: met[k] for k in shared} == pytest.approx({k: float(vmet[k]) for k in shared}, abs=1e-5)


# ---------------------------------------------------------------- off-policy metrics, per-option rejection statistics


def test_offpolicy_metrics_follow_their_formulas():
    old, roll, mask = _batch(3, b=4, t=6)
    m = rc.compute_offpolicy_metrics(old, roll, mask)
    n = mask.sum(-1)
    seq_old, seq_roll = (old * mask).sum(-1) / n, (roll * mask).sum(-1) / n
    ratio = torch.exp(old - roll)
    assert m["training_ppl"] == pytest.approx(torch.exp(-seq_old).mean().item(), rel=1e-5)
    assert m["rollout_log_ppl"] == pytest.approx((-seq_roll).mean().item(), rel=1e-5)
    assert m["log_ppl_diff_max"] == pytest.approx((seq_roll - seq_old).max().item(), rel=1e-5)
    assert m["ppl_ratio"] == pytest.approx(torch.exp(seq_roll - seq_old).mean().item(), rel=1e-5)
    assert m["chi2_token"] == pytest.approx(((ratio**2 * mask).sum() / mask.sum() - 1).item(), rel=1e-5)
    seq_ratio = torch.exp(((old - roll) * mask).sum(-1))
    assert m["chi2_seq"] == pytest.approx((seq_ratio**2).mean().item() - 1, rel=1e-5)
    assert set(rc.compute_offpolicy_metrics(old, None, mask)) == {"training_ppl", "training_log_ppl"}
    _, _, prefixed = rc.compute_rollout_correction_and_rejection_mask(old, roll, mask)
    assert prefixed["rollout_corr/chi2_seq"] == pytest.approx(m["chi2_seq"])  # always reported


def test_rejection_option_statistics_count_sequences_for_sequence_options():
    old, roll, mask = _batch(4, b=5, t=7)
    _, _, m = rc.compute_rollout_correction_and_rejection_mask(old, roll, mask, rollout_rs="seq_mean_k3,token_k2",
                                                               rollout_rs_threshold="0.02,0.05")
    lr = old - roll
    k3 = torch.exp(lr) - 1 - lr
    seq_k3 = (k3 * mask).sum(-1) / mask.sum(-1)
    assert m["rollout_corr/rollout_rs_seq_mean_k3_max"] == pytest.approx(seq_k3.max().item(), rel=1e-5)
    assert m["rollout_corr/rollout_rs_seq_mean_k3_fraction_high"] == pytest.approx((seq_k3 > 0.02).float().mean().item())
    k2 = 0.5 * lr**2
    assert m["rollout_corr/rollout_rs_token_k2_fraction_high"] == pytest.approx(
        ((k2 > 0.05).float() * mask).sum().item() / mask.sum().item(), rel=1e-5)
    assert m["rollout_corr/rollout_rs_token_k2_fraction_low"] == 0.0  # one-sided option


def test_an_all_padding_batch_is_refused_by_name():
    old, roll, mask = _batch(5)
    with pytest.raises(ValueError, match="response_mask has no valid token"):
        rc.compute_rollout_correction_and_rejection_mask(old, roll, torch.zeros_like(mask), rollout_is="token")


def test_boolean_threshold_is_a_type_error_that_is_also_a_value_error():
    with pytest.raises(TypeError, match="not a boolean"):
        rc.parse_is_threshold(True)
    with pytest.raises(ValueError):
        rc.RolloutCorrection(rollout_is="token", rollout_is_threshold=False)


# ---------------------------------------------------------------- bypass mode, REINFORCE loss


class _ActorCfg(dict):
    """A verl-shaped actor config: attribute access, policy_loss.rollout_correction inside."""

    __getattr__ = dict.get


def _bypass_cfg(**corr):
    return _ActorCfg(policy_loss={"rollout_correction": {"bypass_mode": True, **corr}})


def test_reinforce_bypass_without_is_is_plain_policy_gradient():
    old, roll, mask = _batch(6)
    logp = (old + 0.1).requires_grad_()
    adv = torch.randn_like(old)
    loss, m = rc.compute_policy_loss_bypass_mode(roll, logp, adv, mask, "token-mean", _bypass_cfg(loss_type="reinforce"))
    want = (-adv * logp * mask).sum() / mask.sum()
    torch.testing.assert_close(loss, want)  # no weight at all when rollout_is is null
    assert m["actor/ppo_kl"] == pytest.approx(((roll - logp) * mask).sum().item() / mask.sum().item(), rel=1e-5)
    assert "rollout_corr/kl" in m


def test_reinforce_bypass_with_token_is_weights_the_log_prob_by_the_truncated_ratio():
    old, roll, mask = _batch(7)
    logp = (old + 0.05 * torch.randn_like(old)).requires_grad_()
    adv = torch.randn_like(old)
    cfg = _bypass_cfg(loss_type="reinforce", rollout_is="token", rollout_is_threshold=1.2)
    loss, _ = rc.compute_policy_loss_bypass_mode(roll, logp, adv, mask, "seq-mean-token-sum", cfg)
    w = torch.clamp(torch.exp(logp.detach() - roll), max=1.2) * mask
    want = ((-adv * logp * w * mask).sum(-1)).sum() / (mask.sum(-1) > 0).sum()
    torch.testing.assert_close(loss, want)
    loss.backward()
    torch.testing.assert_close(logp.grad, -adv * w * mask / (mask.sum(-1) > 0).sum())  # the weight is detached


def test_bypass_ppo_clip_does_not_apply_the_weights_twice():
    old, roll, mask = _batch(8)
    logp, adv = old + 0.1, torch.randn_like(old)
    cfg = _bypass_cfg(rollout_is="token", rollout_is_threshold=1.5)
    loss, m = rc.compute_policy_loss_bypass_mode(roll, logp, adv, mask, "token-mean", cfg)
    plain, _ = rc.compute_policy_loss_vanilla(roll, logp, adv, mask, "token-mean")
    torch.testing.assert_close(loss, plain)
    assert "rollout_corr/rollout_is_mean" in m  # reported only


def test_bypass_mode_is_a_registered_policy_loss():
    from megatron_rl.algos import get_policy_loss_fn

    assert get_policy_loss_fn("bypass_mode") is rc.compute_policy_loss_bypass_mode
    with pytest.raises(ValueError, match="config.policy_loss.rollout_correction"):
        rc.compute_policy_loss_bypass_mode(*_batch(9)[:2], torch.zeros(10, 8), _batch(9)[2])
