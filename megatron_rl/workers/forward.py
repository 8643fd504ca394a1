"""Per-response-token outputs of the model: log-probs (+ entropy) and values, and forward-only passes.

Log-probs come from the vocabulary-parallel logits through ``ops.log_probs_from_logits`` with
Megatron's TP group: only the N real response positions are selected ([N, V/tp]), and no rank
ever builds a full-vocabulary softmax. Padded vocabulary columns are excluded.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence

import torch

from megatron_rl.ops import check_token_ids, log_probs_from_logits
from megatron_rl.models.router_replay import ROUTED_EXPERTS, check_routed_experts, left_justify
from megatron_rl.models.vision_inputs import MULTI_MODAL_INPUTS, model_inputs
from megatron_rl.protocol import DataProto
from megatron_rl.workers.engine import MegatronEngine
from megatron_rl.workers.micro_batches import MicroBatchSpec, split_micro_batches
from megatron_rl.workers.packing import PackedMicroBatch, pack_micro_batch, real_token_counts, thd_size, to_thd
from megatron_rl.workers.shared_prompts import pack_shared_prompts

# (model output, micro-batch) -> {name: [b, R] tensor}
PerTokenFn = Callable[[torch.Tensor, PackedMicroBatch], dict[str, torch.Tensor]]


def pack_batch(
    engine: MegatronEngine, data: DataProto, spec: MicroBatchSpec, field_keys: Sequence[str], budget_name: str
) -> list[PackedMicroBatch]:
    """``data`` cut into packed micro-batches on the engine's device.

    The real response tokens (the log-probs' labels) are checked against the vocabulary here, once per
    batch (one host sync), so that no micro-batch's loss syncs to check them (``response_log_probs``).
    """
    keys = ("input_ids", "attention_mask", "responses", *field_keys)
    batch = {key: data.batch[key].to(engine.device) for key in dict.fromkeys(keys)}
    if engine.routing_replay is not None and ROUTED_EXPERTS in data.batch:  # replayed routing rides with its rows
        routed = data.batch[ROUTED_EXPERTS]
        moe = engine.hf_config.moe
        check_routed_experts(routed, batch["input_ids"], engine.config.num_layers, moe.topk, moe.num_experts,
                             engine.name)
        batch[ROUTED_EXPERTS] = left_justify(routed.to(engine.device), batch["attention_mask"])
        field_keys = (*field_keys, ROUTED_EXPERTS)
    responses = batch["responses"]
    check_token_ids(
        "batch['responses']", responses, engine.hf_config.vocab_size,
        mask=batch["attention_mask"][:, batch["input_ids"].shape[1] - responses.shape[1] :],
    )
    lengths = real_token_counts(batch)
    cp = engine.context_parallel  # (group, size, rank) or None: each rank keeps its share of every sequence
    cp_size = cp[1] if cp is not None else 1
    if cp_size > 1:  # a token budget is per GPU, as in verl: a micro-batch spread over CP ranks holds CP x as many
        spec = dataclasses.replace(spec, max_token_len=spec.max_token_len * cp_size)
        budget_name = f"{budget_name} x context_parallel_size {cp_size}"
    row_groups = split_micro_batches(lengths, spec, budget_name, packed=engine.packed_sequences)
    # One rectangle for all micro-batches where the schedule needs it (see MegatronEngine).
    # Sequence parallelism splits the sequence over TP ranks: widths are rounded up to a multiple of TP.
    multiple = engine.sequence_multiple

    def width(rows: Sequence[int]) -> int:
        longest = max(max((lengths[r] for r in rows), default=1), 1)
        return -(-longest // multiple) * multiple

    if engine.uniform_micro_batch_shape:
        uniform = (max(map(len, row_groups)), width(range(len(lengths))))
    shapes = [
        uniform if engine.uniform_micro_batch_shape else (None if multiple == 1 else (len(rows), width(rows)))
        for rows in row_groups
    ]
    if engine.share_prompts:
        shared = _pack_shared(batch, row_groups, tuple(field_keys), engine)
        # Micro-batches that cut prompt groups apart share little and are wider: keep the padded layout
        # when its rectangles compute fewer positions (one layout for the whole batch, as VPP needs).
        rectangles = [shape or (len(rows), width(rows)) for rows, shape in zip(row_groups, shapes)]
        if sum(mb.computed_tokens for mb in shared) < sum(count * cols for count, cols in rectangles):
            return shared
    packed = [
        pack_micro_batch(batch, torch.as_tensor(rows, device=engine.device), tuple(field_keys), shape)
        for rows, shape in zip(row_groups, shapes)
    ]
    if getattr(engine.hf_config, "vision", None) is not None:
        packed = [_with_images(engine, data, micro_batch) for micro_batch in packed]
    if engine.packed_sequences:  # THD: each micro-batch's real tokens end to end, no padding computed
        total = None
        if engine.uniform_micro_batch_shape:
            total = max(thd_size(torch.as_tensor([lengths[r] for r in rows]), multiple, cp_size)[1]
                        for rows in row_groups)
        packed = [to_thd(micro_batch, multiple, total, cp) for micro_batch in packed]
    return packed


def _with_images(engine: MegatronEngine, data: DataProto, micro_batch: PackedMicroBatch) -> PackedMicroBatch:
    """A vision-language model's micro-batch: its rows' images (verl's ``multi_modal_inputs`` column) and the
    mRoPE positions of its packed rows (real tokens first, in order: the positions of the original rows)."""
    column = data.non_tensor_batch.get(MULTI_MODAL_INPUTS)
    rows = [None] * len(micro_batch.rows) if column is None else [column[int(r)] for r in micro_batch.rows]
    positions, images = model_inputs(engine.hf_config, micro_batch.input_ids.cpu(), micro_batch.attention_mask.cpu(),
                                     rows + [None] * (micro_batch.input_ids.shape[0] - len(rows)))
    return dataclasses.replace(micro_batch, mrope_positions=positions.to(engine.device),
                               images={k: v.to(engine.device) for k, v in images.items()})


def _pack_shared(
    batch: dict[str, torch.Tensor], row_groups: Sequence[Sequence[int]], field_keys: tuple[str, ...],
    engine: MegatronEngine,
) -> list[PackedMicroBatch]:
    """One [prompt | responses...] sequence per prompt of each micro-batch (workers/shared_prompts.py)."""
    row_tensors = [torch.as_tensor(rows, device=engine.device) for rows in row_groups]
    packed = [pack_shared_prompts(batch, rows, field_keys, multiple=engine.sequence_multiple) for rows in row_tensors]
    if not engine.uniform_micro_batch_shape:
        return packed
    uniform = (max(mb.input_ids.shape[0] for mb in packed), max(mb.input_ids.shape[1] for mb in packed))
    return [pack_shared_prompts(batch, rows, field_keys, uniform) for rows in row_tensors]


def response_log_probs(
    engine: MegatronEngine,
    logits: torch.Tensor,
    micro_batch: PackedMicroBatch,
    temperature: float,
    with_entropy: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """[b, R] log-probs of the response tokens (and entropies) from [b, W, V/tp] logits.

    No host sync: the labels were checked once for the whole batch by ``pack_batch``."""
    result = log_probs_from_logits(
        micro_batch.select_predictors(logits),
        micro_batch.predicted_labels,
        tp_group=engine.tp_group,
        temperature=temperature,
        with_entropy=with_entropy,
        vocab_size=engine.hf_config.vocab_size,
        check_labels=False,
    )
    if with_entropy:
        log_probs, entropy = result
        return micro_batch.scatter(log_probs), micro_batch.scatter(entropy)
    return micro_batch.scatter(result), None


def response_values(values: torch.Tensor, micro_batch: PackedMicroBatch) -> torch.Tensor:
    """[b, R] values of the states before each response token, from the value head's [b, W, 1]."""
    return micro_batch.scatter(micro_batch.select_predictors(values).squeeze(-1).float())


def forward_per_token(
    engine: MegatronEngine,
    data: DataProto,
    spec: MicroBatchSpec,
    per_token: PerTokenFn,
    names: Sequence[str],
    budget_name: str,
    widths: Mapping[str, int] | None = None,
) -> dict[str, torch.Tensor]:
    """Forward-only pass over ``data``; returns {name: [B, R] fp32} on every rank of the pipeline
    ({name: [B, R, widths[name]]} for the names in ``widths``, e.g. a teacher's top-k).

    The last stage computes the values and broadcasts them along the pipeline, so any rank of a
    data-parallel group can answer (the controller collects from the last stage).
    """
    micro_batches = pack_batch(engine, data, spec, (), budget_name)

    def step(output: torch.Tensor, micro_batch: PackedMicroBatch):
        return output.new_zeros((), dtype=torch.float32), per_token(output, micro_batch)

    results = engine.run(micro_batches, step, forward_only=True)
    outputs = {}
    for name in names:
        shape = (len(data), data.batch["responses"].shape[1], *(() if name not in (widths or {}) else (widths[name],)))
        full = None
        if engine.is_last_stage:
            full = torch.zeros(shape, dtype=torch.float32, device=engine.device)
            for micro_batch, result in zip(micro_batches, results):
                full[micro_batch.rows] = result[name].float()
        outputs[name] = engine.broadcast_from_last_stage(full, shape, torch.float32).cpu()
    return outputs


def compute_log_probs(
    engine: MegatronEngine,
    data: DataProto,
    spec: MicroBatchSpec,
    temperature: float,
    with_entropy: bool,
    budget_name: str,
) -> dict[str, torch.Tensor]:
    """{"log_probs": [B, R], "entropy": [B, R] when asked} for the response tokens of ``data``."""

    def per_token(logits: torch.Tensor, micro_batch: PackedMicroBatch) -> dict[str, torch.Tensor]:
        log_probs, entropy = response_log_probs(engine, logits, micro_batch, temperature, with_entropy)
        return {"log_probs": log_probs} | ({"entropy": entropy} if with_entropy else {})

    names = ("log_probs", "entropy") if with_entropy else ("log_probs",)
    return forward_per_token(engine, data, spec, per_token, names, budget_name)
