"""Size arithmetic shared by the builder and planners; no Megatron import, so it loads instantly."""

from __future__ import annotations

from megatron_rl.models.hf_config import HFModelConfig
from megatron_rl.models.moe import check_expert_parallel_fit

DEFAULT_VOCAB_DIVISOR = 128


def padded_vocab_size(vocab_size: int, tp: int, divisible_by: int = DEFAULT_VOCAB_DIVISOR) -> int:
    """Megatron's padding: round the vocabulary up to a multiple of ``divisible_by * tp``."""
    multiple = divisible_by * tp
    return -(-vocab_size // multiple) * multiple


def check_parallel_fit(
    hf: HFModelConfig, tp: int, pp: int, vpp: int | None, *, ep: int = 1, etp: int | None = None
) -> None:
    """Refuse TP/PP (and for MoE models EP/ETP, ETP defaulting to TP) sizes that do not split this model
    evenly, naming the numbers."""
    where = hf.source
    heads, groups = hf.num_attention_heads, hf.num_key_value_heads
    if heads % tp:
        raise ValueError(f"{where}: num_attention_heads={heads} is not divisible by TP={tp}")
    if hf.moe is not None:
        check_expert_parallel_fit(hf.moe, tp, ep, tp if etp is None else etp, where)
    elif ep != 1:
        raise ValueError(f"{where}: expert_model_parallel_size={ep} needs an MoE model; {hf.architecture} is dense")
    elif hf.intermediate_size % tp:
        raise ValueError(f"{where}: intermediate_size={hf.intermediate_size} is not divisible by TP={tp}")
    if groups % tp and tp % groups:
        raise ValueError(f"{where}: num_key_value_heads={groups} must be a multiple or a divisor of TP={tp}")
    if tp > groups and ((heads // groups + 2) * hf.head_dim) % (tp // groups):
        raise ValueError(
            f"{where}: TP={tp} > num_key_value_heads={groups} splits each query group's "
            f"{(heads // groups + 2) * hf.head_dim} q/k/v rows over {tp // groups} ranks, which does not divide"
        )
    stages = pp * (vpp or 1)
    if hf.num_layers % stages:
        raise ValueError(
            f"{where}: num_hidden_layers={hf.num_layers} is not divisible by PP*VPP={pp}*{vpp or 1}={stages}"
        )
