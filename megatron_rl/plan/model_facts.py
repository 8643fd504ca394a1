"""The architecture the planner sizes: the model's own config.json, else ``plan.architecture`` in the config."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from megatron_rl.config import ConfigError
from megatron_rl.models.hf_config import (
    HFModelConfig,
    UnsupportedModelError,
    apply_override_config,
    parse_hf_config,
)


def _config_json(model: DictConfig) -> Path | None:
    if OmegaConf.is_missing(model, "path"):
        return None
    path = Path(model.path).expanduser() / "config.json"
    return path if path.is_file() else None


def load_model_facts(cfg: DictConfig, model_key: str = "actor_rollout_ref.model") -> HFModelConfig:
    """Read ``<model_key>.path/config.json`` when it exists (the truth), else the HF-style facts in
    ``plan.architecture`` (for planning on a machine without the weights); apply
    ``<model_key>.override_config`` on top, as the model builder does."""
    model = OmegaConf.select(cfg, model_key)
    config_json = _config_json(model)
    if config_json is not None:
        with open(config_json) as f:
            raw: dict[str, Any] = json.load(f)
        source = str(config_json)
    else:
        architecture = OmegaConf.select(cfg, "plan.architecture")
        if not architecture and OmegaConf.is_missing(model, "path"):
            unset = [model_key + ".path"] + (["data.train_files"] if not OmegaConf.select(
                cfg, "data.train_files", throw_on_missing=False, default=None) else [])
            raise ConfigError(
                f"{' and '.join(unset)} {'are' if len(unset) > 1 else 'is'} not set: name the model (an HF directory "
                f"with config.json) and the data (the launchers: MODEL_PATH=... DATA_DIR=...; by hand: "
                f"{model_key}.path=... data.train_files=[...]); to plan on a machine without the weights, set "
                f"plan.architecture to the model's config.json fields instead")
        if not architecture:
            path = OmegaConf.select(model, "path", throw_on_missing=False)
            raise ConfigError(
                f"the planner needs the model's architecture: {model_key}.path={path!r} has no "
                f"config.json and plan.architecture is empty; set plan.architecture to the config.json fields "
                f"(architectures, hidden_size, num_hidden_layers, num_attention_heads, num_key_value_heads, "
                f"intermediate_size, vocab_size, tie_word_embeddings)")
        raw = OmegaConf.to_container(architecture, resolve=True)
        source = "plan.architecture"
    raw = apply_override_config(raw, model.override_config)  # what load_hf_config does for the builder
    try:
        return parse_hf_config(raw, source=source)
    except UnsupportedModelError as err:
        raise ConfigError(str(err)) from err
