"""The ``dpo:`` section of the config: preference training (``python -m megatron_rl.dpo``; docs/dpo.md).

A top-level section, as NeMo-RL's ``dpo:``; the model, layout, optimizer, micro-batching, data and trainer keys
are the SFT run's (``actor_rollout_ref.*``, ``data.*``, ``trainer.*``). Its values are checked before start
(plan/validate_dpo.py ``validate_dpo``); the choices are closed (refused when the config is composed).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass


class PreferenceLoss(enum.StrEnum):
    """algos/preference.py ``compute_preference_loss``'s ``loss_type``."""

    sigmoid = "sigmoid"  # DPO: summed log-probs of each response
    ipo = "ipo"  # IPO on length-normalised (mean per token) log-probs, as TRL feeds it
    simpo = "simpo"  # SimPO: length-normalised, reference-free


class PreferenceReference(enum.StrEnum):
    """Where the reference policy's log-probs come from."""

    auto = "auto"  # the actor with its LoRA adapters off when LoRA is on, else a frozen copy of model.path
    frozen = "frozen"  # a frozen engine of actor_rollout_ref.model.path (the actor's layout: actor_rollout_ref.ref)
    adapters_off = "adapters_off"  # the actor itself with its LoRA adapters switched off (needs LoRA)


@dataclass
class DPOConfig:
    beta: float = 0.1  # the implicit reward's scale (TRL's beta)
    loss_type: PreferenceLoss = PreferenceLoss.sigmoid
    label_smoothing: float = 0.0  # conservative DPO (sigmoid and simpo only), in [0, 0.5)
    simpo_gamma: float = 0.5  # SimPO's target margin (simpo only)
    reference: PreferenceReference = PreferenceReference.auto  # ignored by simpo (reference-free: none is built)
    # the rows' columns (TRL's / verl's names): the prompt is data.prompt_key (a string or chat messages)
    chosen_key: str = "chosen"  # a string (the assistant's answer) or a list of messages
    rejected_key: str = "rejected"


def length_normalised(loss_type: str) -> bool:
    """Whether a response's log-prob is the mean of its tokens' (ipo, simpo) rather than their sum (sigmoid)."""
    return str(loss_type) in (PreferenceLoss.ipo, PreferenceLoss.simpo)


def reference_free(loss_type: str) -> bool:
    return str(loss_type) == PreferenceLoss.simpo


def loss_kwargs(dpo: DPOConfig) -> dict[str, float | str]:
    """The section as algos/preference.py ``compute_preference_loss``'s keyword arguments."""
    return {"loss_type": str(dpo.loss_type), "beta": dpo.beta, "label_smoothing": dpo.label_smoothing,
            "simpo_gamma": dpo.simpo_gamma}
