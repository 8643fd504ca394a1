"""Rank jobs of test_glm4_moe.py (importable by spawned ranks): logits and export of tiny GLM-4.5 models at several
(TP, PP, EP) layouts."""

from __future__ import annotations

from typing import Any

# the layouts and the gradient comparison are DeepSeek-V3's (the same MoE block, GQA attention for MLA)
from deepseek_v3_jobs import GRAD_LAYER, layer_grads, layout_checks  # noqa: F401


def glm4_moe_checks(dirs: dict[str, str], layouts: list[tuple[int, int, int, int | None]]) -> dict[str, Any]:
    """``layout_checks``, and at the first layout how many dims each head's RoPE rotates (Megatron's frequency
    table, doubled)."""
    def first_layout(name: str, chunks: list, out: dict[str, Any]) -> None:
        out.setdefault("rotary_dims", {})[name] = 2 * chunks[0].rotary_pos_emb.inv_freq.numel()

    return layout_checks(dirs, layouts, first_layout)
