"""RoPE at given positions for one forward of a Megatron GPTModel (multi-latent attention's per-layer tables too).

Megatron's GPTModel rotates token s of every row by position s (or restarts at each packed sequence);
``position_ids`` only feed learned absolute embeddings. Shared-prompt micro-batches
(workers/shared_prompts.py) need each response to continue its prompt's positions although it sits
further along the row, so for the length of one forward the model's ``RotaryEmbedding`` hands out its
table gathered at ``position_ids`` ([W, S, 1, D]: per row, which the unfused bshd RoPE broadcasts).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


def _rotaries(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The RoPE tables one forward of ``model`` reads: the GPTModel's, or multi-latent attention's (DeepSeek-V3),
    which every MLASelfAttention layer builds for itself (YaRN included)."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import YarnRotaryEmbedding
    from megatron.core.utils import get_attr_wrapped_model

    if getattr(get_attr_wrapped_model(model, "config"), "multi_latent_attention", False):
        return [m.rotary_pos_emb for m in model.modules()
                if type(getattr(m, "rotary_pos_emb", None)) in (RotaryEmbedding, YarnRotaryEmbedding)
                and hasattr(m, "linear_kv_down_proj")]
    rotary = get_attr_wrapped_model(model, "rotary_pos_emb")
    if type(rotary) is not RotaryEmbedding:  # YaRN / mRoPE tables of a GPT model are built differently
        kind = type(rotary).__name__ if rotary is not None else "no RoPE"
        raise ValueError(f"RoPE at given positions needs Megatron's RotaryEmbedding; this model has {kind}")
    return [rotary]


def check_rope_positions(model: torch.nn.Module) -> None:
    """Raises ValueError naming what the model has when ``rope_at_positions`` cannot serve it."""
    _rotaries(model)


def _at_positions(rotary: torch.nn.Module, position_ids: torch.Tensor):
    """``rotary``'s forward, its table gathered at ``position_ids`` ([W, S, 1, D]); YaRN's with its mscale."""

    def at_positions(max_seq_len: int, offset: int = 0, packed_seq: bool = False, cp_group=None):
        if packed_seq or offset or max_seq_len != position_ids.shape[1]:
            raise ValueError(f"rope_at_positions: positions {tuple(position_ids.shape)} were given for a "
                             f"forward of {max_seq_len} positions (offset {offset}, packed {packed_seq})")
        table = rotary.get_emb(int(position_ids.max()) + 1)  # [P, 1, 1, D] (YaRN: and its mscale)
        table, mscale = table if isinstance(table, tuple) else (table, None)
        gathered = table[:, 0, 0][position_ids.t()].unsqueeze(2)
        return gathered if mscale is None else (gathered, mscale)

    return at_positions


@contextlib.contextmanager
def rope_at_positions(model: torch.nn.Module, position_ids: torch.Tensor) -> Iterator[None]:
    """Inside: token s of row b of the next forward is rotated by position ``position_ids[b, s]``."""
    rotaries = _rotaries(model)
    for rotary in rotaries:
        rotary.forward = _at_positions(rotary, position_ids)  # an instance attribute: __call__ finds it first
    try:
        yield
    finally:
        for rotary in rotaries:
            del rotary.forward
