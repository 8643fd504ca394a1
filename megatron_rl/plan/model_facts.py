"""The architecture the planner sizes: the model's own config.json, else ``plan.architecture`` in the config."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from megatron_rl.config import ConfigError
from megatron_rl.config.access import is_unset, plain
from megatron_rl.config.schema import ModelConfig, PPOTrainerConfig
from megatron_rl.models.hf_config import (
    HFModelConfig,
    UnsupportedModelError,
    apply_override_config,
    parse_hf_config,
)
from megatron_rl.models.mtp import check_drafting, with_mtp
from megatron_rl.plan.distillation import teacher_path

# the model sections a planner reads, by the key its messages name
TEACHER = "distillation.teacher_models"  # the one teacher of on-policy distillation (plan/distillation.py)
MODEL_SECTIONS = {"actor_rollout_ref.model": lambda cfg: cfg.actor_rollout_ref.model,
                  "critic.model": lambda cfg: cfg.critic.model,
                  TEACHER: lambda cfg: ModelConfig(path=teacher_path(cfg))}


def _config_json(model: ModelConfig) -> Path | None:
    if is_unset(model, "path"):
        return None
    path = Path(model.path).expanduser() / "config.json"
    return path if path.is_file() else None


def load_model_facts(cfg: PPOTrainerConfig, model_key: str = "actor_rollout_ref.model") -> HFModelConfig:
    """Read ``<model_key>.path/config.json`` when it exists (the truth), else the HF-style facts in
    ``plan.architecture`` (for planning on a machine without the weights); apply
    ``<model_key>.override_config`` on top, as the model builder does."""
    model = MODEL_SECTIONS[model_key](cfg)
    config_json = _config_json(model)
    if config_json is not None:
        with open(config_json) as f:
            raw: dict[str, Any] = json.load(f)
        source = str(config_json)
    else:
        architecture = cfg.plan.architecture
        if not architecture and is_unset(model, "path"):
            unset = [model_key + ".path"] + ([] if not is_unset(cfg.data, "train_files") and cfg.data.train_files
                                             else ["data.train_files"])
            raise ConfigError(
                f"{' and '.join(unset)} {'are' if len(unset) > 1 else 'is'} not set: name the model (an HF directory "
                f"with config.json) and the data (the launchers: MODEL_PATH=... DATA_DIR=...; by hand: "
                f"{model_key}.path=... data.train_files=[...]); to plan on a machine without the weights, set "
                f"plan.architecture to the model's config.json fields instead")
        if not architecture:
            path = None if is_unset(model, "path") else model.path
            raise ConfigError(
                f"the planner needs the model's architecture: {model_key}.path={path!r} has no "
                f"config.json and plan.architecture is empty; set plan.architecture to the config.json fields "
                f"(architectures, hidden_size, num_hidden_layers, num_attention_heads, num_key_value_heads, "
                f"intermediate_size, vocab_size, tie_word_embeddings)")
        raw = plain(architecture)
        source = "plan.architecture"
    raw = apply_override_config(raw, model.override_config)  # what load_hf_config does for the builder
    try:
        facts = parse_hf_config(raw, source=source)
        if model_key == "actor_rollout_ref.model":  # the actor builds the MTP layers model.mtp.enable asks for
            mtp = cfg.actor_rollout_ref.model.mtp
            facts = with_mtp(facts, mtp.enable)
            if mtp.enable_rollout:  # and the engines draft with them
                check_drafting(facts, mtp.num_speculative_tokens, "actor_rollout_ref.model.mtp.num_speculative_tokens")
        return facts
    except UnsupportedModelError as err:
        raise ConfigError(str(err)) from err
