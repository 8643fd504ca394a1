"""Preference losses (issue 55 item 3, losses only): DPO (sigmoid, with label smoothing), IPO and SimPO equal
hand-written formulas in values and gradients, TRL's metric names, bad inputs refused, and a few SGD steps
of DPO on synthetic pairs raise the implicit reward margin of a tiny policy."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_rl.algos import preference as pref

PC = [-4.0, -7.5, -2.0, -10.0]  # policy chosen / rejected, reference chosen / rejected
PR = [-5.0, -6.0, -9.0, -10.5]
RC = [-4.5, -7.0, -3.0, -9.0]
RR = [-4.0, -6.5, -8.0, -12.0]


def sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


def hand(loss_type: str, beta: float, eps: float = 0.0, gamma: float = 0.5):
    """Per-pair loss and d loss_i / d h_i (h: the policy log-ratio difference, minus the reference's except
    for simpo), written out from the papers' formulas."""
    out = []
    for pc, pr, rc, rr in zip(PC, PR, RC, RR):
        h = (pc - pr) - (0.0 if loss_type == "simpo" else rc - rr)
        if loss_type == "ipo":
            out.append(((h - 1 / (2 * beta)) ** 2, 2 * (h - 1 / (2 * beta))))
            continue
        z = beta * h - (gamma if loss_type == "simpo" else 0.0)
        loss = -(1 - eps) * math.log(sigmoid(z)) - eps * math.log(sigmoid(-z))
        out.append((loss, beta * (-(1 - eps) * sigmoid(-z) + eps * sigmoid(z))))
    return out


def run(loss_type: str, **kw):
    chosen, rejected = torch.tensor(PC, requires_grad=True), torch.tensor(PR, requires_grad=True)
    ref_c, ref_r = torch.tensor(RC, requires_grad=True), torch.tensor(RR, requires_grad=True)
    loss, metrics = pref.compute_preference_loss(chosen, rejected, ref_c, ref_r, loss_type=loss_type, **kw)
    loss.backward()
    return loss, metrics, chosen.grad, rejected.grad, ref_c.grad


@pytest.mark.parametrize("loss_type,kw", [
    ("sigmoid", dict(beta=0.1)),
    ("sigmoid", dict(beta=0.5, label_smoothing=0.1)),
    ("ipo", dict(beta=0.1)),
    ("ipo", dict(beta=2.0)),
    ("simpo", dict(beta=2.0, simpo_gamma=1.0)),
    ("simpo", dict(beta=2.0, simpo_gamma=0.5, label_smoothing=0.2)),
])
def test_losses_and_gradients_equal_the_formulas(loss_type, kw):
    loss, metrics, grad_c, grad_r, grad_ref = run(loss_type, **kw)
    expected = hand(loss_type, kw["beta"], kw.get("label_smoothing", 0.0), kw.get("simpo_gamma", 0.5))
    n = len(PC)
    assert loss.item() == pytest.approx(sum(v for v, _ in expected) / n, rel=1e-6)
    dh = torch.tensor([d for _, d in expected]) / n
    torch.testing.assert_close(grad_c, dh)
    torch.testing.assert_close(grad_r, -dh)
    assert grad_ref is None  # the reference is frozen: no gradient reaches it
    beta = kw["beta"]
    ref_c, ref_r = (0.0,) * n, (0.0,) * n
    if loss_type != "simpo":
        ref_c, ref_r = RC, RR
    chosen = [beta * (p - r) for p, r in zip(PC, ref_c)]
    rejected = [beta * (p - r) for p, r in zip(PR, ref_r)]
    assert metrics == pytest.approx({
        "rewards/chosen": sum(chosen) / n,
        "rewards/rejected": sum(rejected) / n,
        "rewards/margins": (sum(chosen) - sum(rejected)) / n,
        "rewards/accuracies": sum(c > r for c, r in zip(chosen, rejected)) / n,
    })


def test_dpo_is_minus_log_sigmoid_of_the_implicit_reward_margin():
    loss, metrics, *_ = run("sigmoid", beta=0.1)
    margins = [0.1 * ((pc - rc) - (pr - rr)) for pc, pr, rc, rr in zip(PC, PR, RC, RR)]
    assert metrics["rewards/margins"] == pytest.approx(sum(margins) / 4)
    assert loss.item() == pytest.approx(sum(-math.log(sigmoid(m)) for m in margins) / 4, rel=1e-6)


def test_sequence_log_probs_sum_or_average_the_masked_tokens():
    token_lp = torch.tensor([[-1.0, -2.0, float("nan")], [-0.5, -0.5, -0.5], [0.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [0, 0, 0]])
    torch.testing.assert_close(pref.sequence_log_probs(token_lp, mask), torch.tensor([-3.0, -1.5, 0.0]))
    torch.testing.assert_close(pref.sequence_log_probs(token_lp, mask, average=True), torch.tensor([-1.5, -0.5, 0.0]))


def test_bad_inputs_are_refused():
    c = torch.tensor(PC)
    with pytest.raises(ValueError, match=r"policy_chosen_logps \(4,\), policy_rejected_logps \(3,\)"):
        pref.compute_preference_loss(c, c[:3], c, c)
    with pytest.raises(ValueError, match=r"reference_rejected_logps \(4, 1\)"):
        pref.compute_preference_loss(c, c, c, c[:, None])
    with pytest.raises(ValueError, match=r"unknown preference loss_type 'kto'.*sigmoid"):
        pref.compute_preference_loss(c, c, c, c, loss_type="kto")
    with pytest.raises(ValueError, match="needs reference_chosen_logps and reference_rejected_logps"):
        pref.compute_preference_loss(c, c, loss_type="ipo")
    with pytest.raises(ValueError, match="beta must be > 0"):
        pref.compute_preference_loss(c, c, c, c, beta=0.0)
    with pytest.raises(ValueError, match="label_smoothing"):
        pref.compute_preference_loss(c, c, c, c, label_smoothing=0.5)
    with pytest.raises(ValueError, match="no pairs"):
        pref.compute_preference_loss(c[:0], c[:0], c[:0], c[:0])
    with pytest.raises(TypeError, match="policy_rejected_logps must be a torch.Tensor"):
        pref.compute_preference_loss(c, PR, c, c)
    with pytest.raises(ValueError, match=r"token_log_probs \(2, 3\), response_mask \(2, 4\)"):
        pref.sequence_log_probs(torch.zeros(2, 3), torch.ones(2, 4))
    # simpo is reference-free: references are neither needed nor read
    loss, _ = pref.compute_preference_loss(c, c - 1, loss_type="simpo", beta=2.0)
    assert loss.item() == pytest.approx(-math.log(sigmoid(2.0 - 0.5)), rel=1e-6)


# ---------------------------------------------------------------- a tiny policy learns the preference

P, T, V = 16, 5, 8


def synthetic_pairs(seed: int = 0):
    """Chosen responses use tokens 0-3, rejected ones 4-7; both right-padded to random lengths."""
    gen = torch.Generator().manual_seed(seed)
    chosen = torch.randint(0, 4, (P, T), generator=gen)
    rejected = torch.randint(4, 8, (P, T), generator=gen)
    lengths = torch.randint(2, T + 1, (2, P), generator=gen)
    masks = (torch.arange(T) < lengths[..., None]).float()
    return chosen, rejected, masks[0], masks[1]


def token_log_probs(theta: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """A position-wise unigram policy: log softmax(theta[t])[token_t]."""
    return torch.log_softmax(theta, dim=-1).expand(tokens.shape[0], T, V).gather(-1, tokens[..., None])[..., 0]


@pytest.mark.parametrize("loss_type,kw,average", [
    ("sigmoid", dict(beta=0.1), False),
    ("ipo", dict(beta=0.5), True),
    ("simpo", dict(beta=2.0, simpo_gamma=0.5), True),
])
def test_sgd_on_the_loss_raises_the_implicit_reward_margin(loss_type, kw, average):
    chosen, rejected, mask_c, mask_r = synthetic_pairs()
    theta = (0.1 * torch.randn(T, V, generator=torch.Generator().manual_seed(1))).requires_grad_()
    reference = theta.detach().clone()
    ref_c = pref.sequence_log_probs(token_log_probs(reference, chosen), mask_c, average)
    ref_r = pref.sequence_log_probs(token_log_probs(reference, rejected), mask_r, average)
    opt = torch.optim.SGD([theta], lr=1.0)
    history = []
    for _ in range(15):
        pol_c = pref.sequence_log_probs(token_log_probs(theta, chosen), mask_c, average)
        pol_r = pref.sequence_log_probs(token_log_probs(theta, rejected), mask_r, average)
        loss, metrics = pref.compute_preference_loss(pol_c, pol_r, ref_c, ref_r, loss_type=loss_type, **kw)
        history.append((loss.item(), metrics))
        opt.zero_grad()
        loss.backward()
        opt.step()
    margins = [m["rewards/margins"] for _, m in history]
    assert margins[-1] > margins[0] + 0.1
    assert all(b >= a - 1e-6 for a, b in zip(margins, margins[1:]))
    assert history[-1][0] < history[0][0]
    assert history[-1][1]["rewards/accuracies"] == 1.0
    if loss_type != "simpo":  # at the start the policy is the reference: no implicit reward yet
        assert margins[0] == pytest.approx(0.0, abs=1e-6)
