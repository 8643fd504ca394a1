"""A DPO run's config, checked before anything starts (``python -m megatron_rl.dpo``; docs/dpo.md).

The SFT run's checks (plan/validate.py ``validate_sft``: model, data, truncation, launcher, the batch's data-parallel
split) and the ``dpo:`` section's (config/preference_schema.py), each refusal a ConfigError naming the key.
"""
from __future__ import annotations

import dataclasses
import math

import torch
from omegaconf import DictConfig

from megatron_rl.algos.preference import compute_preference_loss
from megatron_rl.config.access import replace_path
from megatron_rl.config.errors import ConfigError, require as _require
from megatron_rl.config.loader import checked_typed_config
from megatron_rl.config.lora import lora_enabled
from megatron_rl.config.preference_schema import PreferenceLoss, PreferenceReference, loss_kwargs
from megatron_rl.config.schema import PPOTrainerConfig
from megatron_rl.plan.validate import DerivedSizes, validate_sft

__all__ = ["validate_dpo"]


def validate_dpo(cfg: DictConfig | PPOTrainerConfig) -> DerivedSizes:
    """The SFT checks and the ``dpo.*`` keys'; the sizes of a step of ``data.train_batch_size`` pairs (2 rows each)."""
    cfg = checked_typed_config(cfg)
    dpo, data = cfg.dpo, cfg.data
    rows = 2 * data.train_batch_size  # each pair is two rows: the micro-batches and data-parallel shards count rows
    try:
        sizes = validate_sft(replace_path(cfg, "data.train_batch_size", rows))
    except ConfigError as err:
        raise ConfigError(f"{err} (a DPO step of data.train_batch_size={data.train_batch_size} pairs trains {rows} "
                          "rows: each pair's chosen and rejected sides)") from None
    _require(math.isfinite(dpo.beta) and dpo.beta > 0, f"dpo.beta={dpo.beta} must be > 0 (the implicit reward's scale)")
    _require(0.0 <= dpo.label_smoothing < 0.5, f"dpo.label_smoothing={dpo.label_smoothing} must be in [0, 0.5)")
    _require(dpo.label_smoothing == 0.0 or dpo.loss_type != PreferenceLoss.ipo,
             f"dpo.label_smoothing={dpo.label_smoothing} applies to dpo.loss_type=sigmoid and simpo, not ipo")
    _require(math.isfinite(dpo.simpo_gamma), f"dpo.simpo_gamma={dpo.simpo_gamma} must be a finite number")
    _require(dpo.reference != PreferenceReference.adapters_off or lora_enabled(cfg.actor_rollout_ref.model.lora),
             "dpo.reference=adapters_off takes the actor with its LoRA adapters off as the reference, but "
             "actor_rollout_ref.model.lora is off (rank 0): use dpo.reference=frozen (or auto)")
    keys = {"data.prompt_key": data.prompt_key, "dpo.chosen_key": dpo.chosen_key, "dpo.rejected_key": dpo.rejected_key}
    for key, value in keys.items():
        _require(bool(value), f"{key} is empty: it names the preference rows' column")
    _require(len(set(keys.values())) == 3, f"data.prompt_key, dpo.chosen_key and dpo.rejected_key must name three "
             f"different columns, got {list(keys.values())}")
    try:  # the loss's own rules on its parameters (algos/preference.py): one rule, two callers
        zero = torch.zeros(1)
        compute_preference_loss(zero, zero, zero, zero, **loss_kwargs(dpo))
    except ValueError as err:
        raise ConfigError(f"dpo: {err}") from None
    return dataclasses.replace(sizes, prompts_per_step=data.train_batch_size)

