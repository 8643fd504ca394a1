"""Size arithmetic shared by the builder and planners; no Megatron import, so it loads instantly."""

from __future__ import annotations

from megatron_rl.models.hf_config import HFModelConfig
from megatron_rl.models.moe import check_expert_parallel_fit

DEFAULT_VOCAB_DIVISOR = 128


def padded_vocab_size(vocab_size: int, tp: int, divisible_by: int = DEFAULT_VOCAB_DIVISOR) -> int:
    """Megatron's padding: round the vocabulary up to a multiple of ``divisible_by * tp``."""
    multiple = divisible_by * tp
    return -(-vocab_size // multiple) * multiple


def stage_layer_counts(num_layers: int, pp: int, first: int | None = None, last: int | None = None) -> list[int]:
    """Layers on each pipeline stage as Megatron cuts them (TransformerConfig's num_layers_in_first/
    last_pipeline_stage, get_transformer_layer_offset): evenly over PP, or with ``first`` / ``last`` set, those on
    the first / last stage and the rest evenly over the stages between. ValueError naming the numbers when they do
    not divide."""
    if first is None and last is None:
        if num_layers % pp:
            raise ValueError(f"num_hidden_layers={num_layers} is not divisible by PP={pp}")
        return [num_layers // pp] * pp
    if pp < 2:
        raise ValueError(f"num_layers_in_first/last_pipeline_stage={first}/{last} need PP > 1, got PP={pp}")
    for name, value in (("first", first), ("last", last)):
        if value is not None and not 0 < value < num_layers:
            raise ValueError(f"num_layers_in_{name}_pipeline_stage={value} must lie in [1, {num_layers - 1}]")
    middle_stages = pp - (first is not None) - (last is not None)
    middle_layers = num_layers - (first or 0) - (last or 0)
    if middle_layers < 0 or (middle_stages == 0 and middle_layers) or (middle_stages and middle_layers % middle_stages):
        raise ValueError(f"num_layers_in_first/last_pipeline_stage={first}/{last} leave {middle_layers} of "
                         f"num_hidden_layers={num_layers} for the {middle_stages} stages between, which do not "
                         "split them evenly")
    per_middle = middle_layers // middle_stages if middle_stages else 0
    counts = [per_middle] * pp
    if first is not None:
        counts[0] = first
    if last is not None:
        counts[-1] = last
    return counts


def check_parallel_fit(
    hf: HFModelConfig, tp: int, pp: int, vpp: int | None, *, ep: int = 1, etp: int | None = None,
    first: int | None = None, last: int | None = None,
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
    if first is not None or last is not None:  # an uneven split (verl's 235B script): the stages Megatron cuts
        if vpp:
            raise ValueError(f"{where}: num_layers_in_first/last_pipeline_stage with a virtual pipeline (VPP={vpp}) "
                             "is not built here; drop virtual_pipeline_model_parallel_size or the uneven split")
        try:
            stage_layer_counts(hf.num_layers, pp, first, last)
        except ValueError as err:
            raise ValueError(f"{where}: {err}") from None
        return
    stages = pp * (vpp or 1)
    if hf.num_layers % stages:
        raise ValueError(
            f"{where}: num_hidden_layers={hf.num_layers} is not divisible by PP*VPP={pp}*{vpp or 1}={stages} (an "
            "uneven split: override_transformer_config.num_layers_in_first/last_pipeline_stage)"
        )
