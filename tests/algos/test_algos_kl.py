"""KL estimators, KL controllers, and the reward shaping that uses them."""

from __future__ import annotations

import math

import algos_loop_reference as ref
import numpy as np
import pytest
import torch
from algos_data import random_mask

from megatron_rl import algos
from megatron_rl.protocol import DataProto


def log_prob_pair(seed: int, shape=(6, 9)):
    gen = torch.Generator().manual_seed(seed)
    logprob = -torch.rand(shape, generator=gen) * 3
    ref_logprob = logprob + torch.randn(shape, generator=gen)
    ref_logprob[0, 0] = logprob[0, 0] - 25.0  # exercises the +-20 clamp of k3
    return logprob, ref_logprob


@pytest.mark.parametrize("kind", algos.KL_PENALTIES)
def test_kl_penalty_value_and_gradient_match_formulas(kind):
    logprob, ref_logprob = log_prob_pair(0)
    logprob.requires_grad_(True)
    value = algos.kl_penalty(logprob, ref_logprob, kind)
    value.sum().backward()
    flat_lp, flat_ref = logprob.detach().flatten().tolist(), ref_logprob.flatten().tolist()
    expected_value = [ref.kl_value(a, b, kind) for a, b in zip(flat_lp, flat_ref)]
    expected_grad = [ref.kl_grad(a, b, kind) for a, b in zip(flat_lp, flat_ref)]
    torch.testing.assert_close(
        value.detach().flatten().double(),
        torch.tensor(expected_value, dtype=torch.float64),
        atol=1e-5,
        rtol=1e-5,
    )
    torch.testing.assert_close(
        logprob.grad.flatten().double(),
        torch.tensor(expected_grad, dtype=torch.float64),
        atol=1e-5,
        rtol=1e-5,
    )


def test_kl_penalty_rejects_unknown_names_and_shape_mismatch():
    with pytest.raises(ValueError, match=r"unknown kl_penalty 'full'; known: \['kl', 'k1'"):
        algos.kl_penalty(torch.zeros(2, 3), torch.zeros(2, 3), "full")
    with pytest.raises(ValueError, match=r"logprob shape \(2, 3\) and ref_logprob shape \(2, 4\)"):
        algos.kl_penalty(torch.zeros(2, 3), torch.zeros(2, 4), "kl")


def test_adaptive_controller_follows_the_formula_and_resumes():
    ctrl = algos.AdaptiveKLController(init_kl_coef=0.1, target_kl=0.05, horizon=1000)
    ctrl.update(current_kl=0.2, n_steps=64)  # error clipped to +0.2
    assert ctrl.value == pytest.approx(0.1 * (1 + 0.2 * 64 / 1000))
    ctrl.update(current_kl=0.045, n_steps=64)  # error -0.1
    expected = 0.1 * (1 + 0.2 * 64 / 1000) * (1 - 0.1 * 64 / 1000)
    assert ctrl.value == pytest.approx(expected)

    resumed = algos.AdaptiveKLController(init_kl_coef=0.1, target_kl=0.05, horizon=1000)
    resumed.load_state_dict(ctrl.state_dict())
    for c in (ctrl, resumed):
        c.update(current_kl=0.0, n_steps=10)
    assert resumed.value == ctrl.value
    with pytest.raises(ValueError, match="needs key 'value'"):
        resumed.load_state_dict({"coef": 1.0})


def test_fixed_controller_stays_fixed_and_factory_reads_the_config():
    fixed = algos.get_kl_controller(
        type("Cfg", (), dict(type="fixed", kl_coef=0.3, target_kl=0.1, horizon=10))
    )
    fixed.update(current_kl=5.0, n_steps=100)
    assert isinstance(fixed, algos.FixedKLController) and fixed.value == 0.3
    adaptive = algos.get_kl_controller(
        type("Cfg", (), dict(type="adaptive", kl_coef=0.3, target_kl=0.1, horizon=10))
    )
    assert isinstance(adaptive, algos.AdaptiveKLController)
    with pytest.raises(ValueError, match=r"algorithm.kl_ctrl.type='pid' is unknown"):
        algos.get_kl_controller(type("Cfg", (), dict(type="pid", kl_coef=0.3, target_kl=0.1, horizon=10)))
    with pytest.raises(ValueError, match="horizon must be > 0"):
        algos.AdaptiveKLController(0.1, 0.1, 0)


def rl_batch(seed: int = 0) -> DataProto:
    gen = torch.Generator().manual_seed(seed)
    mask = random_mask(5, 7, gen, empty_rows=(3,))
    logprob, ref_logprob = log_prob_pair(seed, (5, 7))
    return DataProto.from_dict(
        {
            "token_level_scores": torch.randn(5, 7, generator=gen) * mask,
            "old_log_probs": logprob,
            "ref_log_prob": ref_logprob,
            "response_mask": mask,
        },
        {"uid": np.arange(5)},
    )


@pytest.mark.parametrize("kind", ["kl", "low_var_kl", "k3+"])
def test_apply_kl_penalty_shapes_rewards_and_reports_the_kl(kind):
    data = rl_batch()
    b = data.batch
    ctrl = algos.AdaptiveKLController(init_kl_coef=0.2, target_kl=0.1, horizon=100)
    data, metrics = algos.apply_kl_penalty(data, ctrl, kl_penalty=kind)

    kld = [
        [ref.kl_value(a, r, kind) * m for a, r, m in zip(ar, rr, mr)]
        for ar, rr, mr in zip(
            ref.rows(b["old_log_probs"]), ref.rows(b["ref_log_prob"]), ref.rows(b["response_mask"])
        )
    ]
    expected = [
        [s - 0.2 * k for s, k in zip(sr, kr)] for sr, kr in zip(ref.rows(b["token_level_scores"]), kld)
    ]
    torch.testing.assert_close(
        b["token_level_rewards"].double(), torch.tensor(expected, dtype=torch.float64), atol=1e-5, rtol=1e-5
    )
    per_seq = [sum(kr) / (sum(mr) + 1e-8) for kr, mr in zip(kld, ref.rows(b["response_mask"]))]
    current_kl = sum(per_seq) / len(per_seq)  # the empty response counts as KL 0, as in verl
    assert metrics["actor/reward_kl_penalty"] == pytest.approx(current_kl, abs=1e-6)
    assert metrics["actor/reward_kl_penalty_coeff"] == 0.2
    error = float(np.clip(current_kl / 0.1 - 1, -0.2, 0.2))
    assert ctrl.value == pytest.approx(0.2 * (1 + error * 5 / 100), rel=1e-6)


def test_apply_kl_penalty_names_missing_fields():
    data = rl_batch()
    data.pop(batch_keys=["ref_log_prob"])
    with pytest.raises(ValueError, match=r"missing \['ref_log_prob'\] for apply_kl_penalty"):
        algos.apply_kl_penalty(data, algos.FixedKLController(0.1))


def test_rewards_from_scores_copies_the_scores():
    data = algos.rewards_from_scores(rl_batch())
    assert data.batch["token_level_rewards"] is data.batch["token_level_scores"]
    with pytest.raises(ValueError, match="token_level_scores"):
        algos.rewards_from_scores(DataProto.from_dict({"response_mask": torch.ones(2, 2)}))


@pytest.mark.parametrize("kind", algos.KL_PENALTIES)
def test_kl_penalty_matches_verl(verl_core_algos, kind):
    logprob, ref_logprob = log_prob_pair(1)
    ours_lp, theirs_lp = logprob.clone().requires_grad_(), logprob.clone().requires_grad_()
    ours = algos.kl_penalty(ours_lp, ref_logprob, kind)
    theirs = verl_core_algos.kl_penalty(theirs_lp, ref_logprob, kind)
    (ours * torch.arange(ours.numel()).view_as(ours)).sum().backward()
    (theirs * torch.arange(theirs.numel()).view_as(theirs)).sum().backward()
    torch.testing.assert_close(ours, theirs)
    torch.testing.assert_close(ours_lp.grad, theirs_lp.grad)


def test_adaptive_controller_matches_verl(verl_core_algos):
    ours = algos.AdaptiveKLController(0.05, 0.02, 500)
    theirs = verl_core_algos.AdaptiveKLController(0.05, 0.02, 500)
    for kl in (0.0, 0.01, 0.03, 1.0, math.pi / 100):
        ours.update(kl, 256)
        theirs.update(kl, 256)
        assert ours.value == pytest.approx(theirs.value, rel=1e-12)
