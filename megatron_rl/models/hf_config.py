"""Read an HF config.json into the facts a Megatron GPT needs, rejecting what we cannot represent."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from megatron_rl.config.access import plain
from megatron_rl.models.mla import MLASpec, parse_mla_config
from megatron_rl.models.moe import MoESpec, parse_moe_config
from megatron_rl.models.mtp import MTPSpec, parse_mtp_config
from megatron_rl.models.unbuilt import UNBUILT_ARCHITECTURES
from megatron_rl.models.vision import VISION_LANGUAGE_ARCHITECTURES, VisionSpec, split_vision_language

# Architecture -> model_type. All share the Llama block: RMSNorm, SwiGLU MLP, RoPE, GQA; the MoE families
# (Qwen2-MoE: Qwen2's attention, Qwen3-MoE: Qwen3's, Mixtral: Mistral's) replace the MLP of their MoE layers
# by routed SwiGLU experts, Qwen2-MoE's plus a gated shared expert (models/moe.py). DeepSeek-V3 (also R1, Kimi-K2,
# Moonlight) replaces the attention by multi-latent attention (models/mla.py) and routes with sigmoid scores,
# an expert bias and expert groups, plus ungated shared experts; its first layers are dense (models/moe.py).
# GLM-4.5 (and -Air) is GQA attention (q/k/v bias, optional q/k norms, RoPE on the first part of each head) with
# DeepSeek-V3's MoE. MiMo is Qwen2's block plus multi-token-prediction layers (models/mtp.py), which DeepSeek-V3 and
# GLM-4.5 checkpoints carry too. Hy3 is Qwen3's attention (q/k norms) with DeepSeek-V3's sigmoid routing (no groups).
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "MistralForCausalLM": "mistral",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "MixtralForCausalLM": "mixtral",
    "DeepseekV3ForCausalLM": "deepseek_v3",
    "Glm4MoeForCausalLM": "glm4_moe",
    "MiMoForCausalLM": "mimo",
    "HYV3ForCausalLM": "hy_v3",
}
# Families whose attention_bias puts a bias on q/k/v only (o_proj has none): Megatron's add_qkv_bias.
_QKV_BIAS_TYPES = ("qwen2", "qwen2_moe", "glm4_moe", "mimo")
# Megatron's llama3 RoPE scaling hard-codes these; configs with other values are refused.
_MEGATRON_LLAMA3_ROPE = {
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


class UnsupportedModelError(ValueError):
    """The HF config asks for something the Megatron GPT built here cannot reproduce exactly."""


@dataclass(frozen=True)
class RopeScaling:
    kind: str  # "linear" or "llama3"
    factor: float


@dataclass(frozen=True)
class HFModelConfig:
    """The architecture facts of one HF causal LM, normalised across transformers 4.x / 5.x."""

    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None
    qkv_bias: bool
    qk_norm: bool
    tie_word_embeddings: bool
    sliding_window: int | None
    max_position_embeddings: int
    source: str  # where the config came from, for error messages
    raw: dict[str, Any] = field(repr=False, compare=False)  # the config.json dict, written back on export
    moe: MoESpec | None = None  # the routed experts of every layer; None for dense models
    # <Family>ForSequenceClassification (a reward model): its score head has no bias.
    sequence_classifier: bool = False
    mla: MLASpec | None = None  # multi-latent attention (DeepSeek-V3); None = GPT attention (q/k/v)
    # share of each head's dims RoPE rotates (the first ones, rotate_half layout): GLM-4.5's partial_rotary_factor
    rotary_percent: float = 1.0
    # the checkpoint's multi-token-prediction layers (num_nextn_predict_layers); ``mtp``: those the model builds
    # (model.mtp.enable: models/mtp.py with_mtp), None = skipped on load
    checkpoint_mtp: MTPSpec | None = None
    mtp: MTPSpec | None = None
    # a vision-language checkpoint's vision tower and mRoPE (models/vision.py); the fields above describe its
    # language model, ``architecture`` and ``raw`` the whole checkpoint
    vision: VisionSpec | None = None

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim


def _rope(hf_config: dict[str, Any], where: str) -> tuple[float, RopeScaling | None]:
    # transformers 5 writes rope_parameters; 4.x wrote rope_theta + rope_scaling.
    params = hf_config.get("rope_parameters") or {}
    scaling = hf_config.get("rope_scaling") or {}
    theta = params.get("rope_theta", hf_config.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    merged = {**scaling, **params}
    if rope_type == "default":
        return float(theta), None
    if rope_type == "linear":
        return float(theta), RopeScaling("linear", float(merged["factor"]))
    if rope_type == "llama3":
        for key, expected in _MEGATRON_LLAMA3_ROPE.items():
            if float(merged.get(key, expected)) != expected:
                raise UnsupportedModelError(
                    f"{where}: llama3 rope scaling with {key}={merged[key]} is not supported "
                    f"(Megatron-Core fixes {key}={expected})"
                )
        return float(theta), RopeScaling("llama3", float(merged["factor"]))
    raise UnsupportedModelError(
        f"{where}: rope type {rope_type!r} is not supported; supported: default, linear, llama3"
    )


def _rotary_percent(
    hf_config: dict[str, Any], model_type: str, head_dim: int, scaling: RopeScaling | None, where: str
) -> float:
    """GLM-4.5's partial_rotary_factor (transformers 5: in rope_parameters) as Megatron's rotary_percent. Both rotate
    the first int(head_dim * factor) dims of each head in the rotate_half layout (transformers' Glm4Moe
    apply_rotary_pos_emb; Megatron's rope_utils._apply_rotary_pos_emb_bshd with rotary_interleaved=False) with
    inv_freq = theta^(-2i / that dim). The other families' attention rotates whole heads."""
    if model_type != "glm4_moe":
        return 1.0
    params = hf_config.get("rope_parameters") or {}
    factor = float(params.get("partial_rotary_factor", hf_config.get("partial_rotary_factor", 0.5)))
    rotary_dim = int(head_dim * factor)
    _reject(
        not 0.0 < factor <= 1.0 or rotary_dim % 2,
        where,
        f"partial_rotary_factor={factor} gives {rotary_dim} rotary dims of head_dim={head_dim}; "
        "only a positive even number is supported",
    )
    # transformers' scaled RoPE types compute their frequencies over that dim too, Megatron's llama3 / linear
    # scaling were not checked against them with a partial rotation
    if scaling is not None and factor < 1.0:
        raise UnsupportedModelError(
            f"{where}: rope type {scaling.kind!r} with partial_rotary_factor={factor} is not supported"
        )
    return factor


def _qkv_bias(hf_config: dict[str, Any], model_type: str) -> bool:
    """Whether q/k/v have a bias (Megatron's add_qkv_bias)."""
    if model_type == "qwen2_moe":
        return bool(hf_config.get("qkv_bias", True))
    if model_type == "glm4_moe":
        return bool(hf_config.get("attention_bias", False))
    return model_type in ("qwen2", "mimo")


def _qk_norm(hf_config: dict[str, Any], model_type: str) -> bool:
    """Whether q and k are RMS-normalised per head before RoPE (Megatron's qk_layernorm)."""
    return model_type in ("qwen3", "qwen3_moe", "hy_v3") or (
        model_type == "glm4_moe" and bool(hf_config.get("use_qk_norm")))


def _reject(cond: bool, where: str, message: str) -> None:
    if cond:
        raise UnsupportedModelError(f"{where}: {message}")


def causal_lm_architecture(hf_config: dict[str, Any], source: str) -> str:
    """The supported causal-LM architecture the config declares. A saved critic is
    <Family>ForTokenClassification, a reward model <Family>ForSequenceClassification: same backbone, read as
    its causal-LM family."""
    architectures = [
        a.replace("ForTokenClassification", "ForCausalLM").replace("ForSequenceClassification", "ForCausalLM")
        for a in hf_config.get("architectures") or []
    ]
    supported = ", ".join([*SUPPORTED_ARCHITECTURES, *VISION_LANGUAGE_ARCHITECTURES])
    arch = next((a for a in architectures if a in SUPPORTED_ARCHITECTURES), None)
    refused = next((a for a in architectures if a in UNBUILT_ARCHITECTURES), None)
    if arch is None and refused is not None:
        raise UnsupportedModelError(
            f"{source}: architecture {refused} is not supported: {UNBUILT_ARCHITECTURES[refused]}; "
            f"supported: {supported}"
        )
    if arch is None:
        declared = hf_config.get("architectures") or hf_config.get("model_type")
        raise UnsupportedModelError(
            f"{source}: unsupported architecture {declared!r}; "
            f"supported: {supported} (and their ForTokenClassification critics and "
            "ForSequenceClassification reward models)"
        )
    return arch


def _check_block(hf_config: dict[str, Any], model_type: str, source: str) -> None:
    """Refuse the activation, biases and attention layouts the Llama block built here cannot express."""
    _reject(
        hf_config.get("hidden_act", "silu") != "silu",
        source,
        f"hidden_act={hf_config.get('hidden_act')!r}, only 'silu' (SwiGLU) is supported",
    )
    _reject(bool(hf_config.get("mlp_bias", False)), source, "mlp_bias=true is not supported")
    # Qwen2 always has q/k/v bias and no o_proj bias, Qwen2-MoE has them when qkv_bias (default true), GLM-4.5 when
    # attention_bias. For the others attention_bias adds an o_proj bias too, which Megatron can only express
    # together with MLP biases.
    attention_bias = bool(hf_config.get("attention_bias", False))
    _reject(
        model_type not in _QKV_BIAS_TYPES and attention_bias,
        source,
        "attention_bias=true (o_proj bias) is not supported",
    )
    _reject(
        bool(hf_config.get("use_sliding_window", False)),
        source,
        "use_sliding_window=true (per-layer windows) is not supported",
    )
    layer_types = set(hf_config.get("layer_types") or ["full_attention"])
    _reject(
        model_type not in ("mistral", "mixtral") and layer_types != {"full_attention"},
        source,
        f"layer_types {sorted(layer_types)} are not supported",
    )
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
        _reject(key not in hf_config, source, f"missing required field {key!r}")


def _is_reward_model(hf_config: dict[str, Any], source: str) -> bool:
    """Whether this is a <Family>ForSequenceClassification, which must have one label (a scalar score)."""
    declared = hf_config.get("architectures") or []
    sequence_classifier = any(a.endswith("ForSequenceClassification") for a in declared)
    # transformers' default without id2label is two labels.
    id2label = hf_config.get("id2label")
    num_labels = len(id2label) if id2label else int(hf_config.get("num_labels", 2))
    _reject(
        sequence_classifier and num_labels != 1,
        source,
        f"a reward model needs one label (a scalar score), this ForSequenceClassification has "
        f"num_labels={num_labels} (id2label)",
    )
    return sequence_classifier


def parse_hf_config(hf_config: dict[str, Any], source: str = "<config dict>") -> HFModelConfig:
    """Validate a config.json dict and normalise it; every refusal says which field and value. A vision-language
    checkpoint is read as its language model plus ``vision`` (models/vision.py)."""
    architecture = next((a for a in hf_config.get("architectures") or [] if a in VISION_LANGUAGE_ARCHITECTURES), None)
    if architecture is not None:
        text, vision = split_vision_language(hf_config, architecture, source)
        language = parse_hf_config(text, source)
        return replace(language, architecture=architecture, raw=dict(hf_config), vision=vision)
    arch = causal_lm_architecture(hf_config, source)
    model_type = SUPPORTED_ARCHITECTURES[arch]
    _check_block(hf_config, model_type, source)
    qkv_bias = _qkv_bias(hf_config, model_type)
    heads = int(hf_config["num_attention_heads"])
    kv_heads = int(hf_config.get("num_key_value_heads") or heads)
    _reject(
        heads % kv_heads != 0,
        source,
        f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}",
    )
    sequence_classifier = _is_reward_model(hf_config, source)
    head_dim = int(hf_config.get("head_dim") or int(hf_config["hidden_size"]) // heads)
    mla, mla_theta = parse_mla_config(hf_config, model_type, source)
    # MLA reads its own RoPE (YaRN) into the MLASpec
    theta, scaling = (mla_theta, None) if mla is not None else _rope(hf_config, source)
    moe = parse_moe_config(hf_config, model_type, source)
    moe_last_layer = moe is not None and moe.is_moe_layer(int(hf_config["num_hidden_layers"]) - 1)
    return HFModelConfig(
        architecture=arch,
        model_type=model_type,
        vocab_size=int(hf_config["vocab_size"]),
        hidden_size=int(hf_config["hidden_size"]),
        intermediate_size=int(hf_config["intermediate_size"]),
        num_layers=int(hf_config["num_hidden_layers"]),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(hf_config.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        qkv_bias=qkv_bias,
        qk_norm=_qk_norm(hf_config, model_type),
        tie_word_embeddings=bool(hf_config.get("tie_word_embeddings", False)),
        sliding_window=hf_config.get("sliding_window") if model_type in ("mistral", "mixtral") else None,
        max_position_embeddings=int(hf_config.get("max_position_embeddings", 4096)),
        source=source,
        raw=dict(hf_config),
        moe=moe,
        sequence_classifier=sequence_classifier,
        mla=mla,
        rotary_percent=_rotary_percent(hf_config, model_type, head_dim, scaling, source),
        checkpoint_mtp=parse_mtp_config(hf_config, model_type, moe_last_layer),
    )


def plain_overrides(override_config: Mapping[str, Any] | None) -> dict[str, Any]:
    return dict(plain(override_config)) if override_config else {}


def apply_override_config(raw: dict[str, Any], override_config: Mapping[str, Any] | None) -> dict[str, Any]:
    """config.json fields with ``actor_rollout_ref.model.override_config`` on top (verl's key): a
    shallow update, as transformers' ``PretrainedConfig.update`` does. The planner, the Megatron
    builder and the rollout engines all read the model through this."""
    return {**raw, **plain_overrides(override_config)}


def load_hf_config_dict(
    model_dir: str | Path, override_config: Mapping[str, Any] | None = None
) -> tuple[dict[str, Any], str]:
    """(``<model_dir>/config.json`` with the overrides applied, a source string for messages)."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"no config.json in HF model directory {model_dir}")
    with open(path) as f:
        raw = json.load(f)
    overrides = plain_overrides(override_config)
    source = str(path) + (f" + override_config {sorted(overrides)}" if overrides else "")
    return apply_override_config(raw, overrides), source


def load_hf_config(model_dir: str | Path, override_config: Mapping[str, Any] | None = None) -> HFModelConfig:
    """Read and validate ``<model_dir>/config.json``, with ``override_config`` fields on top."""
    raw, source = load_hf_config_dict(model_dir, override_config)
    return parse_hf_config(raw, source=source)


def needs_rebuilt_config(model_dir: Any) -> bool:
    """Whether transformers cannot read ``model_dir``'s config.json by itself (MiMo: ``load_pretrained_config``);
    False for what is not a directory path (a config object the engine builds from)."""
    if not isinstance(model_dir, (str, os.PathLike)):
        return False
    path = Path(model_dir) / "config.json"
    return path.is_file() and json.loads(path.read_text()).get("model_type") == "mimo"


def load_pretrained_config(model_dir: str | Path, override_config: Mapping[str, Any] | None = None):
    """transformers' ``PretrainedConfig`` of ``model_dir`` with ``override_config`` applied: what the HF
    rollout engine builds from, so it computes the same model as the Megatron side."""
    from transformers import AutoConfig

    raw = json.loads((Path(model_dir) / "config.json").read_text())
    if raw.get("model_type") == "mimo":
        # transformers has no MiMo: its main model is Qwen2's (the MTP layers are not served, models/mtp.py)
        fields = {k: v for k, v in raw.items() if k not in ("architectures", "model_type", "auto_map")}
        config = AutoConfig.for_model("qwen2", **fields)
        config.architectures = ["Qwen2ForCausalLM"]
    else:
        config = AutoConfig.from_pretrained(str(model_dir))
    overrides = plain_overrides(override_config)
    if overrides:
        config.update(overrides)
    return config
