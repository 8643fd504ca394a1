"""Rollout correction (algos/rollout_corr.py): loop formulas always; verl's rollout_corr_helper as the oracle
when verl imports; config keys rejected by name; the trainer uses it with rollout_log_probs."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_rl.algos import rollout_corr as rc
from megatron_rl.config import ConfigError, load_config, validate


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
    with pytest.raises(ConfigError, match="rollout_correction.rollout_is must be one of"):
        validate(_cfg("algorithm.rollout_correction.rollout_is=seq"))
    with pytest.raises(ConfigError, match="loss_type='reinforce' with bypass_mode=true"):
        validate(_cfg("algorithm.rollout_correction.bypass_mode=true", "algorithm.rollout_correction.loss_type=reinforce"))


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
