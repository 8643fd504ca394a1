"""KL estimators between the policy and the reference, and the controllers of the KL coefficient."""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np
import torch

_BASE_ESTIMATORS = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")
# "<name>+": the value of <name> with the gradient of k2, which is the unbiased KL gradient.
KL_PENALTIES: tuple[str, ...] = _BASE_ESTIMATORS + tuple(f"{name}+" for name in _BASE_ESTIMATORS)


def kl_penalty(logprob: torch.Tensor, ref_logprob: torch.Tensor, kl_penalty: str) -> torch.Tensor:
    """Per-token KL estimate (Schulman's k1/k2/k3, http://joschu.net/blog/kl-approx.html).

    kl/k1: logp - ref;  abs: |logp - ref|;  mse/k2: 0.5 (logp - ref)^2;
    low_var_kl/k3: with d = clamp(ref - logp, -20, 20), clamp(exp(d) - d - 1, -10, 10).
    A "+" suffix keeps the value and takes the gradient from k2 (straight-through).
    """
    if kl_penalty not in KL_PENALTIES:
        raise ValueError(f"unknown kl_penalty {kl_penalty!r}; known: {list(KL_PENALTIES)}")
    if logprob.shape != ref_logprob.shape:
        raise ValueError(
            f"logprob shape {tuple(logprob.shape)} and ref_logprob shape {tuple(ref_logprob.shape)} "
            "must be equal"
        )
    straight_through = kl_penalty.endswith("+")
    value = _kl_value(logprob, ref_logprob, kl_penalty.rstrip("+"))
    if not straight_through:
        return value
    k2 = 0.5 * (logprob - ref_logprob).square()
    return k2 - k2.detach() + value.detach()


def _kl_value(logprob: torch.Tensor, ref_logprob: torch.Tensor, name: str) -> torch.Tensor:
    if name in ("kl", "k1"):
        return logprob - ref_logprob
    if name == "abs":
        return (logprob - ref_logprob).abs()
    if name in ("mse", "k2"):
        return 0.5 * (logprob - ref_logprob).square()
    log_ratio = torch.clamp(ref_logprob - logprob, min=-20, max=20)  # low_var_kl / k3
    return torch.clamp(log_ratio.exp() - log_ratio - 1, min=-10, max=10)


class KLController:
    """Holds the KL coefficient ``value``; ``state_dict`` / ``load_state_dict`` carry it across a resume."""

    def __init__(self, kl_coef: float) -> None:
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        raise NotImplementedError

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if "value" not in state:
            raise ValueError(f"KL controller state needs key 'value', got keys {sorted(state)}")
        self.value = float(state["value"])


class FixedKLController(KLController):
    """A constant KL coefficient."""

    def update(self, current_kl: float, n_steps: int) -> None:
        """Nothing to adapt."""


class AdaptiveKLController(KLController):
    """The coefficient follows the measured KL towards ``target_kl`` (Ziegler et al. 2019,
    https://arxiv.org/abs/1909.08593): value *= 1 + clip(kl/target - 1, -0.2, 0.2) * n_steps / horizon.

    ``state_dict`` carries the evolving coefficient; target and horizon come from the config, so a
    resumed run may change them.
    """

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int) -> None:
        if not target_kl > 0:
            raise ValueError(f"algorithm.kl_ctrl.target_kl must be > 0, got {target_kl}")
        if not horizon > 0:
            raise ValueError(f"algorithm.kl_ctrl.horizon must be > 0, got {horizon}")
        super().__init__(init_kl_coef)
        self.target = float(target_kl)
        self.horizon = horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        proportional_error = float(np.clip(current_kl / self.target - 1, -0.2, 0.2))
        self.value *= 1 + proportional_error * n_steps / self.horizon


def get_kl_controller(kl_ctrl: Any) -> KLController:
    """Build the controller from ``algorithm.kl_ctrl`` (fields type, kl_coef, target_kl, horizon)."""
    if kl_ctrl.type == "fixed":
        return FixedKLController(kl_coef=kl_ctrl.kl_coef)
    if kl_ctrl.type == "adaptive":
        return AdaptiveKLController(
            init_kl_coef=kl_ctrl.kl_coef, target_kl=kl_ctrl.target_kl, horizon=kl_ctrl.horizon
        )
    raise ValueError(f"algorithm.kl_ctrl.type={kl_ctrl.type!r} is unknown; known: ['fixed', 'adaptive']")
