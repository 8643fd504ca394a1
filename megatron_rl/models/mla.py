"""Multi-latent attention (MLA, DeepSeek-V3 / R1, Kimi-K2, Moonlight): the HF config's facts, how they map to
Megatron-Core 0.16.1's ``MLASelfAttention`` (``MLATransformerConfig``), and the HF tensors of one layer.

No Megatron import: hf_config and the planner read this module before any worker starts.

HF (transformers' ``DeepseekV3Attention``) per token x:
  q = q_b_proj(q_a_layernorm(q_a_proj(x)))      (or q_proj(x) when q_lora_rank is null)
      per head [qk_nope_head_dim | qk_rope_head_dim]
  c, k_rope = split(kv_a_proj_with_mqa(x), [kv_lora_rank, qk_rope_head_dim])   (the rope part is the LAST rows)
  k_nope, v = per head split(kv_b_proj(kv_a_layernorm(c)), [qk_nope_head_dim, v_head_dim])
  RoPE on the rope parts, the pairs interleaved (x0, x1), (x2, x3), ... (``rope_interleave``, default true)
Megatron's MLASelfAttention computes the same with the same row orders:
  linear_q_down_proj = q_a_proj, q_layernorm = q_a_layernorm, linear_q_up_proj = q_b_proj (linear_q_proj = q_proj),
  linear_kv_down_proj = kv_a_proj_with_mqa (split [kv_lora_rank, qk_pos_emb_head_dim]), kv_layernorm =
  kv_a_layernorm, linear_kv_up_proj = kv_b_proj (per head [qk_head_dim | v_head_dim]), linear_proj = o_proj.
  Its unfused RoPE de-interleaves the rope part before rotating (``multi_latent_attention`` in
  rope_utils._apply_rotary_pos_emb_bshd), which is transformers' ``apply_rotary_pos_emb_interleave``.
TP (local spec): every projection but o_proj is a ColumnParallelLinear (dim 0 split: the down projections are
gathered back inside MLA, the up projections split by head), o_proj a RowParallelLinear; the norms replicated.

YaRN (``rope_scaling`` / ``rope_parameters`` of type yarn): cos/sin are scaled by mscale(factor, mscale) /
mscale(factor, mscale_all_dim) and the softmax scale by mscale(factor, mscale_all_dim)^2 / sqrt(q_head_dim) in
both (transformers: ``yarn_apply_mscale``; Megatron: ``MultiLatentAttention.softmax_scale``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

MLA_MODEL_TYPES = ("deepseek_v3",)


@dataclass(frozen=True)
class YarnRope:
    factor: float
    original_max_position_embeddings: int
    beta_fast: float
    beta_slow: float
    mscale: float  # 1.0 / 0.0 when the HF config leaves mscale_all_dim unset (see parse_mla_config)
    mscale_all_dim: float


@dataclass(frozen=True)
class MLASpec:
    """The attention of an MLA model (same in every layer)."""

    q_lora_rank: int | None  # None: one q_proj, no query compression (Moonlight, V2-Lite)
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    yarn: YarnRope | None = None

    @property
    def q_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


def parse_mla_config(
    hf_config: dict[str, Any], model_type: str, source: str
) -> tuple[MLASpec | None, float]:
    """(the MLASpec, rope_theta) of an MLA family's config.json dict; (None, theta unread) for the others."""
    from megatron_rl.models.hf_config import UnsupportedModelError  # import cycle: hf_config imports this module

    if model_type not in MLA_MODEL_TYPES:
        return None, 0.0

    def refuse(message: str) -> None:
        raise UnsupportedModelError(f"{source}: {message}")

    for key in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
        if hf_config.get(key) is None:
            refuse(f"missing required field {key!r}")
    if hf_config.get("rope_interleave", True) is False:
        # Megatron's MLA always de-interleaves the rope part (rope_utils._apply_rotary_pos_emb_bshd)
        refuse("rope_interleave=false is not supported (Megatron-Core's MLA rotates interleaved pairs)")
    q_lora = hf_config.get("q_lora_rank")
    params = hf_config.get("rope_parameters") or {}
    scaling = hf_config.get("rope_scaling") or {}
    merged = {**scaling, **params}
    theta = float(merged.get("rope_theta", hf_config.get("rope_theta", 10000.0)))
    rope_type = merged.get("rope_type") or merged.get("type") or "default"
    yarn = None
    if rope_type == "yarn":
        yarn = _yarn(merged, hf_config, refuse)
    elif rope_type != "default":
        refuse(f"rope type {rope_type!r} is not supported for MLA; supported: default, yarn")
    spec = MLASpec(
        q_lora_rank=None if q_lora is None else int(q_lora),
        kv_lora_rank=int(hf_config["kv_lora_rank"]),
        qk_nope_head_dim=int(hf_config["qk_nope_head_dim"]),
        qk_rope_head_dim=int(hf_config["qk_rope_head_dim"]),
        v_head_dim=int(hf_config["v_head_dim"]),
        yarn=yarn,
    )
    return spec, theta


def _yarn(rope: dict[str, Any], hf_config: dict[str, Any], refuse) -> YarnRope:
    """transformers' ``_compute_yarn_parameters`` as Megatron's YarnRotaryEmbedding can express it."""
    if rope.get("attention_factor") is not None:
        refuse("yarn attention_factor is not supported (Megatron derives it from mscale / mscale_all_dim)")
    if rope.get("truncate", True) is False:
        refuse("yarn truncate=false is not supported (Megatron rounds the correction range to integers)")
    original = int(rope.get("original_max_position_embeddings") or hf_config.get("max_position_embeddings", 4096))
    factor = rope.get("factor")
    factor = float(factor) if factor is not None else hf_config["max_position_embeddings"] / original
    mscale, mscale_all_dim = rope.get("mscale"), rope.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        scales = (float(mscale), float(mscale_all_dim))
    elif mscale_all_dim:
        # transformers: cos/sin x mscale(factor) and softmax x mscale(factor, mscale_all_dim)^2; Megatron ties the
        # two through one mscale_all_dim.
        refuse(f"yarn mscale={mscale!r} with mscale_all_dim={mscale_all_dim} is not supported")
    else:
        # transformers: cos/sin x mscale(factor), softmax unscaled == Megatron's mscale=1, mscale_all_dim=0
        scales = (1.0, 0.0)
    return YarnRope(
        factor=factor,
        original_max_position_embeddings=original,
        beta_fast=float(rope.get("beta_fast") or 32.0),
        beta_slow=float(rope.get("beta_slow") or 1.0),
        mscale=scales[0],
        mscale_all_dim=scales[1],
    )


def mla_transformer_kwargs(mla: MLASpec, rope_theta: float) -> dict[str, Any]:
    """MLATransformerConfig fields for ``mla``."""
    kwargs: dict[str, Any] = dict(
        multi_latent_attention=True,
        q_lora_rank=mla.q_lora_rank,
        kv_lora_rank=mla.kv_lora_rank,
        qk_head_dim=mla.qk_nope_head_dim,  # Megatron's qk_head_dim is the part without RoPE
        qk_pos_emb_head_dim=mla.qk_rope_head_dim,
        v_head_dim=mla.v_head_dim,
        kv_channels=mla.q_head_dim,
        rotary_base=rope_theta,
        # the TE/Triton fused MLA RoPE kernels are CUDA-only; the unfused path is exact everywhere
        apply_rope_fusion=False,
        rotary_interleaved=False,  # MLA de-interleaves itself; True would rotate the pairs a second way
    )
    if mla.yarn is None:
        kwargs.update(rope_type="rope", rotary_scaling_factor=1.0, mscale=1.0, mscale_all_dim=0.0)
    else:
        y = mla.yarn
        kwargs.update(
            rope_type="yarn",
            rotary_scaling_factor=y.factor,
            original_max_position_embeddings=y.original_max_position_embeddings,
            beta_fast=y.beta_fast,
            beta_slow=y.beta_slow,
            mscale=y.mscale,
            mscale_all_dim=y.mscale_all_dim,
        )
    return kwargs


# TransformerConfig fields mla_transformer_kwargs sets from the HF config (not overridable).
MLA_DERIVED_FIELDS = (
    "multi_latent_attention", "q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim",
    "rope_type", "rotary_base", "rotary_scaling_factor", "original_max_position_embeddings", "beta_fast",
    "beta_slow", "mscale", "mscale_all_dim", "rotary_interleaved",
)


def mla_attention_tensors(
    mla: MLASpec, layer: int, hidden: int, heads: int
) -> list[tuple[str, str, tuple[int, ...], str]]:
    """(role, HF name, shape, TP split: "column" / "row" / "replicated") of layer ``layer``'s attention, in
    HF's module order. The down projections are whole on every TP rank, on TE's spec (TELinear, duplicated) and on
    the local one (models/mla_layers.py)."""
    p = f"model.layers.{layer}.self_attn."
    q_rows = heads * mla.q_head_dim
    tensors = []
    if mla.q_lora_rank is None:
        tensors.append(("q_proj", f"{p}q_proj.weight", (q_rows, hidden), "column"))
    else:
        r = mla.q_lora_rank
        tensors += [
            ("q_down", f"{p}q_a_proj.weight", (r, hidden), "replicated"),
            ("q_norm", f"{p}q_a_layernorm.weight", (r,), "replicated"),
            ("q_up", f"{p}q_b_proj.weight", (q_rows, r), "column"),
        ]
    c = mla.kv_lora_rank
    tensors += [
        ("kv_down", f"{p}kv_a_proj_with_mqa.weight", (c + mla.qk_rope_head_dim, hidden), "replicated"),
        ("kv_norm", f"{p}kv_a_layernorm.weight", (c,), "replicated"),
        ("kv_up", f"{p}kv_b_proj.weight", (heads * (mla.qk_nope_head_dim + mla.v_head_dim), c), "column"),
        ("o_proj", f"{p}o_proj.weight", (hidden, heads * mla.v_head_dim), "row"),
    ]
    return tensors
