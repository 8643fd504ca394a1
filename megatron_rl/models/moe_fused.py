"""Per-expert checkpoint names -> slices of transformers 5's fused expert tensors (for the HF rollout engine).

Checkpoints (and ``export_hf_weights``) name each expert's tensors
(``model.layers.i.mlp.experts.e.gate_proj.weight``; Mixtral: ``block_sparse_moe.experts.e.w1/w3/w2``), but
transformers 5 holds a layer's experts as two fused parameters: ``model.layers.i.mlp.experts.gate_up_proj``
[E, 2F, H] (gate rows first, then up) and ``...experts.down_proj`` [E, H, F] (and calls Mixtral's
``block_sparse_moe`` ``mlp``). ``expert_slice`` maps a per-expert name to its view, so a weight update writes
straight into the fused tensors.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch

_EXPERT = re.compile(r"^model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight$")
_ROLE = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}


def expert_slice(
    targets: Mapping[str, torch.Tensor], name: str
) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """(view of the fused tensor that ``name`` fills, the fused tensor), or None when ``name`` is no per-expert
    name or the model has no fused experts for it. Mixtral's router (``block_sparse_moe.gate``) is
    ``mlp.gate`` in transformers 5: (that tensor, None)."""
    if ".block_sparse_moe.gate." in name:
        router = targets.get(name.replace(".block_sparse_moe.", ".mlp."))
        return None if router is None else (router, None)
    match = _EXPERT.match(name)
    if match is None or match.group(3) not in _ROLE:
        return None
    layer, expert, role = int(match.group(1)), int(match.group(2)), _ROLE[match.group(3)]
    prefix = f"model.layers.{layer}.mlp.experts."
    if role == "down":
        fused = targets.get(prefix + "down_proj")
        return None if fused is None or expert >= fused.shape[0] else (fused[expert], fused)
    fused = targets.get(prefix + "gate_up_proj")
    if fused is None or expert >= fused.shape[0]:
        return None
    half = fused.shape[1] // 2
    rows = slice(0, half) if role == "gate" else slice(half, 2 * half)
    return fused[expert, rows], fused


def slices_per_fused(fused: torch.Tensor, name_of_fused: str) -> int:
    """How many per-expert tensors fill ``fused``: 2 per expert for gate_up_proj, 1 for down_proj."""
    return fused.shape[0] * (2 if name_of_fused.endswith("gate_up_proj") else 1)
