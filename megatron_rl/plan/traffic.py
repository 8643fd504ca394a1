"""Byte-accurate traffic model of one weight sync (Megatron actor -> colocated rollout engines).

Two paths, both evaluated collective by collective over the real rank layout (Megatron's order
tp-cp-ep-dp-pp, rank r on node r // gpus_per_node), so the per-rank figures are exact, not estimates:

* ``tensorwise`` (the previous ``export_hf_weights``): per parameter, a TP all-gather of its shard on the stage
  that holds it, then every HF tensor of it, FULL, broadcast over every pipeline group.
* ``shard_first`` (today's ``export_hf_weights``): per bucket (one stage's consecutive parameters, at most
  ``bucket_bytes`` gathered), the owner broadcasts each TP rank's flat shard buffer over its pipeline group,
  then one all-gather of the bucket over the TP group; every rank converts the full tensors once.

Accounting (the same rule the CPU instrumented run counts with, tests/plan/test_weight_sync_traffic.py):
a broadcast sends n bytes from the root to each other member; an all-gather sends each member's n bytes to
every other member; a pair's bytes are inter-node when the two ranks' nodes differ, else intra-node (NVLink).
Bytes *received* per GPU do not depend on the collective's algorithm (ring, tree or direct), which is why the
time model uses them. Modelled time per GPU, serial (no overlap credited), worst GPU:

    t = inter_recv / inter_node_Bps + intra_recv / nvlink_Bps + copy_bytes / copy_Bps + collectives x latency

MoE (``ep`` / ``etp``): the export's buckets (``plan_export_buckets`` itself, so the cut is the export's) never
mix experts with other tensors nor two EP ranks' experts. An expert bucket is first broadcast by its owning EP
rank over each expert-parallel group of its stage (Megatron's expert order tp(ETP)-ep-dp-pp), then goes over the
pipeline groups like any bucket, then is all-gathered over the TP group only when ETP = TP > 1 (ETP = 1: whole
experts, no TP step). Only the shard-first path is modelled for MoE (the tensorwise baseline is dense-only).

``copy_bytes`` counts the local copies each path makes: shard_first = pack own shards + write every full tensor
once + the engine's load (full bytes / rollout TP), for MoE plus the copy of each expert bucket of the stage
from the EP broadcast's buffer into the shard buffer; tensorwise = re-layout of the owned full tensors + the copy
into the sync's bucket + the engine's load.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from megatron_rl.config.schema import PPOTrainerConfig
from megatron_rl.models.hf_config import HFModelConfig
from megatron_rl.models.layout import Kind, TensorGroup, hf_tensor_groups
from megatron_rl.models.vision_model import vision_tensor_shapes
from megatron_rl.models.sizes import padded_vocab_size, stage_layer_counts
from megatron_rl.plan.report import Plan
from megatron_rl.weights.export import plan_export_buckets

__all__ = ["Bandwidths", "SyncTraffic", "model_sync_traffic", "format_sync_traffic", "shard_groups"]

PATHS = ("tensorwise", "shard_first")


@dataclass(frozen=True)
class Bandwidths:
    inter_node_Bps: float = 50e9  # per GPU (one 400 Gb/s NIC per GPU)
    nvlink_Bps: float = 450e9  # NVLink all-gather bandwidth per GPU (H100 SXM)
    copy_Bps: float = 2.5e12  # device-to-device copy (H100 HBM3)
    latency_s: float = 20e-6  # per collective


@dataclass(frozen=True)
class _Group:
    stage: int
    kind: str  # replicated / split
    shard_bytes: int  # one TP rank's shard of the Megatron parameter
    hf_bytes: tuple[int, ...]  # its HF tensors, full, vocabulary padding stripped


@dataclass
class SyncTraffic:
    path: str
    tp: int
    pp: int
    dp: int
    gpus_per_node: int
    # per rank: {"inter_recv", "inter_send", "intra_recv", "intra_send", "collectives", "copy"} -> count
    per_rank: list[dict[str, int]] = field(default_factory=list)
    bandwidths: Bandwidths = field(default_factory=Bandwidths)
    ep: int = 1  # MoE: expert parallel and expert tensor parallel sizes
    etp: int = 1

    def worst(self, key: str) -> int:
        return max(r[key] for r in self.per_rank)

    def seconds_of(self, rank: int) -> float:
        r, bw = self.per_rank[rank], self.bandwidths
        return (r["inter_recv"] / bw.inter_node_Bps + r["intra_recv"] / bw.nvlink_Bps + r["copy"] / bw.copy_Bps
                + r["collectives"] * bw.latency_s)

    @property
    def seconds(self) -> float:
        return max(self.seconds_of(rank) for rank in range(len(self.per_rank)))


def layer_stages(hf: HFModelConfig, pp: int, stage_counts: Sequence[int] | None = None) -> list[int]:
    """The pipeline stage of each layer: ``stage_counts`` layers per stage (an uneven split), else even."""
    counts = list(stage_counts) if stage_counts is not None else stage_layer_counts(hf.num_layers, pp)
    return [stage for stage, count in enumerate(counts) for _ in range(count)]


def shard_groups(hf: HFModelConfig, tp: int, pp: int, dtype_bytes: int, value_head: bool = False,
                 stage_counts: Sequence[int] | None = None) -> list[_Group]:
    """The exported parameters in checkpoint order with their stage, shard and HF sizes (``stage_counts``
    layers per stage; None: even)."""
    stages = layer_stages(hf, pp, stage_counts)
    h, b = hf.hidden_size, dtype_bytes
    vocab_padded = padded_vocab_size(hf.vocab_size, tp)
    groups = [_Group(0, "split", vocab_padded // tp * h * b, (hf.vocab_size * h * b,))]
    # a vision-language model's vision tower: whole on every TP rank of the first stage, each tensor sent as it is
    groups += [_Group(0, "replicated", _numel(shape) * b, (_numel(shape) * b,)) for shape in _vision_shapes(hf)]
    for layer in range(hf.num_layers):
        groups += _dense_layer_groups(hf, stages[layer], tp, b)
    last = pp - 1
    groups.append(_Group(last, "replicated", h * b, (h * b,)))
    if value_head:
        groups += [_Group(last, "replicated", h * b, (h * b,)), _Group(last, "replicated", b, (b,))]
    elif not hf.tie_word_embeddings:
        groups.append(_Group(last, "split", vocab_padded // tp * h * b, (hf.vocab_size * h * b,)))
    for _ in range(hf.mtp.num_layers if hf.mtp is not None and not value_head else 0):  # on the last stage
        groups += [_Group(last, "replicated", h * b, (h * b,))] * 2  # enorm, hnorm
        groups.append(_Group(last, "split", 2 * h // tp * h * b, (2 * h * h * b,)))  # eh_proj
        groups += _dense_layer_groups(hf, last, tp, b)
        groups.append(_Group(last, "replicated", h * b, (h * b,)))  # final norm
    return groups


def _vision_shapes(hf: HFModelConfig) -> list[tuple[int, ...]]:
    """The vision tower's tensor shapes in checkpoint order (none for a text model)."""
    return [] if hf.vision is None else list(vision_tensor_shapes(hf.vision).values())


def _dense_layer_groups(hf: HFModelConfig, s: int, tp: int, b: int) -> list[_Group]:
    """One dense decoder layer's groups on stage ``s``: norms, q/k/v (and bias, q/k norms), o_proj, gate/up, down."""
    h, f = hf.hidden_size, hf.intermediate_size
    qkv_rows = hf.q_size + 2 * hf.kv_size
    groups = [_Group(s, "replicated", h * b, (h * b,)),
              _Group(s, "split", qkv_rows // tp * h * b, (hf.q_size * h * b, hf.kv_size * h * b, hf.kv_size * h * b))]
    if hf.qkv_bias:
        groups.append(_Group(s, "split", qkv_rows // tp * b, (hf.q_size * b, hf.kv_size * b, hf.kv_size * b)))
    if hf.qk_norm:
        groups += [_Group(s, "replicated", hf.head_dim * b, (hf.head_dim * b,))] * 2
    groups.append(_Group(s, "split", h * hf.q_size // tp * b, (h * hf.q_size * b,)))
    groups.append(_Group(s, "replicated", h * b, (h * b,)))
    groups.append(_Group(s, "split", 2 * f // tp * h * b, (f * h * b, f * h * b)))
    groups.append(_Group(s, "split", h * f // tp * b, (h * f * b,)))
    return groups


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _buckets(groups: list[_Group], tp: int, bucket_bytes: int) -> list[tuple[int, int]]:
    """(stage, per-rank bytes) of each bucket: the export's rule (one dtype, so no alignment padding)."""
    out: list[list[int]] = []
    for g in groups:
        if out and out[-1][0] == g.stage and (out[-1][1] + g.shard_bytes) * tp <= bucket_bytes:
            out[-1][1] += g.shard_bytes
        else:
            out.append([g.stage, g.shard_bytes])
    return [(s, n) for s, n in out]


def _stage_of(group: TensorGroup, stages: list[int], pp: int) -> int:
    """The pipeline stage holding ``group`` (``stages``: each layer's; embedding first, final norm and head
    last)."""
    layer = re.match(r"model\.(?:language_model\.)?layers\.(\d+)\.", group.key)  # Qwen3-VL: model.language_model.
    if layer and int(layer.group(1)) < len(stages):
        return stages[int(layer.group(1))]
    # the embedding and a vision tower are first; the final norm, the head and the MTP layers (DeepSeek's numbered
    # past the model's layers) last
    vision = group.key.startswith(("visual.", "model.visual."))  # models/vision.py's checkpoint prefixes
    embedding = group.key in ("model.embed_tokens.weight", "model.language_model.embed_tokens.weight")
    return 0 if embedding or vision else pp - 1


def _shard_shape(hf: HFModelConfig, group: TensorGroup, split: int, tp: int) -> tuple[int, ...]:
    """Local shape of ``group``'s Megatron parameter split ``split`` ways (the vocabulary padded for ``tp``)."""
    shape = group.tensors[0].shape
    if group.kind is Kind.REPLICATED:
        return shape
    if group.kind is Kind.VOCAB:
        return (padded_vocab_size(hf.vocab_size, tp) // split, *shape[1:])
    if group.kind is Kind.ROW:
        return (shape[0], shape[1] // split)
    return (sum(t.shape[0] for t in group.tensors) // split, *shape[1:])  # QKV, GATE_UP: stacked rows


def moe_export_buckets(hf: HFModelConfig, tp: int, pp: int, ep: int, etp: int, dtype_bytes: int,
                       bucket_bytes: int, value_head: bool = False, stage_counts: Sequence[int] | None = None):
    """The export's buckets of an MoE model at this layout (``plan_export_buckets`` on the HF groups, experts
    split over ETP and owned by EP rank ``expert // (num_experts / EP)``), as every rank plans them."""
    stages = layer_stages(hf, pp, stage_counts)
    dtype = {2: "bfloat16", 4: "float32"}[dtype_bytes]
    groups = hf_tensor_groups(hf, value_head)
    owner = {g.key: (_stage_of(g, stages, pp), dtype, _shard_shape(hf, g, tp if g.expert is None else etp, tp))
             for g in groups}
    per_rank = hf.moe.num_experts // ep
    ep_owner = {g.key: g.expert // per_rank for g in groups if g.expert is not None} if ep > 1 else None
    return plan_export_buckets(groups, owner, tp, bucket_bytes, ep_owner)


class _Ledger:
    """Per-rank bytes (by link class), collectives and copies of one sync, counted collective by collective over
    the rank layout (Megatron's order tp-cp-ep-dp-pp, rank r on node r // gpus_per_node)."""

    KEYS = ("inter_recv", "inter_send", "intra_recv", "intra_send", "collectives", "copy")

    def __init__(self, tp: int, pp: int, dp: int, gpus_per_node: int) -> None:
        self.tp, self.pp, self.dp = tp, pp, dp
        world = tp * pp * dp
        self.node = [r // gpus_per_node for r in range(world)]
        self.per_rank = [dict.fromkeys(self.KEYS, 0) for _ in range(world)]
        self.pp_groups = [(t, d) for t in range(tp) for d in range(dp)]

    def rank(self, t: int, d: int, s: int) -> int:
        return t + self.tp * (d + self.dp * s)

    def send(self, src: int, dst: int, n: int) -> None:
        cls = "inter" if self.node[src] != self.node[dst] else "intra"
        self.per_rank[src][f"{cls}_send"] += n
        self.per_rank[dst][f"{cls}_recv"] += n

    def broadcast(self, members: list[int], root: int, n: int) -> None:
        for m in members:
            self.per_rank[m]["collectives"] += 1
            if m != root:
                self.send(root, m, n)

    def all_gather(self, members: list[int], n: int) -> None:
        for i in members:
            self.per_rank[i]["collectives"] += 1
            for j in members:
                if i != j:
                    self.send(i, j, n)

    def pipeline_and_tensor_steps(self, stage: int, n: int, split: int) -> None:
        """A bucket's shard broadcast from its stage over every pipeline group, then all-gathered over TP."""
        tp, pp, dp = self.tp, self.pp, self.dp
        if pp > 1:
            for t, d in self.pp_groups:
                self.broadcast([self.rank(t, d, s) for s in range(pp)], self.rank(t, d, stage), n)
        if split > 1:
            for d in range(dp):
                for s in range(pp):
                    self.all_gather([self.rank(t, d, s) for t in range(tp)], n)


def _count_moe(ledger: _Ledger, hf: HFModelConfig, ep: int, etp: int, dtype_bytes: int, bucket_bytes: int,
               rollout_tp: int | None, value_head: bool, stage_counts: Sequence[int] | None = None) -> None:
    """Shard-first of an MoE model: expert buckets first go from their EP rank to the stage's other EP ranks."""
    tp, pp, dp = ledger.tp, ledger.pp, ledger.dp
    buckets = moe_export_buckets(hf, tp, pp, ep, etp, dtype_bytes, bucket_bytes, value_head, stage_counts)
    stage_size, edp = tp * dp, tp * dp // (ep * etp)

    def expert_rank(et: int, e: int, d: int, s: int) -> int:  # Megatron's expert order tp-ep-dp-pp
        return et + etp * (e + ep * (d + edp * s))

    for b in buckets:
        if b.ep_rank is not None:  # the owning EP rank's shards to the other EP ranks of the stage
            for et in range(etp):
                for d in range(edp):
                    members = [expert_rank(et, e, d, b.stage) for e in range(ep)]
                    ledger.broadcast(members, members[b.ep_rank], b.shard_bytes)
        ledger.pipeline_and_tensor_steps(b.stage, b.shard_bytes, etp if b.expert else tp)
    full = sum(_numel(t.shape) for g in hf_tensor_groups(hf, value_head) for t in g.tensors) * dtype_bytes
    for r, counts in enumerate(ledger.per_rank):
        s, ep_rank = r // stage_size, (r % stage_size) // etp % ep
        mine = [b for b in buckets if b.stage == s]
        packed = sum(b.shard_bytes for b in mine if b.ep_rank in (None, ep_rank))
        received = sum(b.shard_bytes for b in mine if b.ep_rank is not None)  # EP buffer -> shard buffer
        counts["copy"] = packed + received + full + full // (rollout_tp or tp)


def _count_shard_first(ledger: _Ledger, groups: list[_Group], bucket_bytes: int, full: int, engine_load: int) -> None:
    tp, dp = ledger.tp, ledger.dp
    for stage, n in _buckets(groups, tp, bucket_bytes):
        ledger.pipeline_and_tensor_steps(stage, n, tp)
    for r, counts in enumerate(ledger.per_rank):
        s = r // (tp * dp)
        own = sum(g.shard_bytes for g in groups if g.stage == s)
        counts["copy"] = own + full + engine_load


def _count_tensorwise(ledger: _Ledger, groups: list[_Group], full: int, engine_load: int) -> None:
    tp, pp, dp = ledger.tp, ledger.pp, ledger.dp
    for g in groups:
        if g.kind == "split" and tp > 1:
            for d in range(dp):
                ledger.all_gather([ledger.rank(t, d, g.stage) for t in range(tp)], g.shard_bytes)
        if pp > 1:
            for n in g.hf_bytes:
                for t, d in ledger.pp_groups:
                    ledger.broadcast([ledger.rank(t, d, s) for s in range(pp)], ledger.rank(t, d, g.stage), n)
    for r, counts in enumerate(ledger.per_rank):
        s = r // (tp * dp)
        owned = sum(sum(g.hf_bytes) for g in groups if g.stage == s and g.kind == "split")
        counts["copy"] = owned + full + engine_load


def model_sync_traffic(
    hf: HFModelConfig,
    tp: int,
    pp: int,
    dp: int,
    gpus_per_node: int,
    *,
    path: str,
    dtype_bytes: int = 2,
    bucket_bytes: int = 512 << 20,
    rollout_tp: int | None = None,
    value_head: bool = False,
    bandwidths: Bandwidths | None = None,
    ep: int = 1,
    etp: int | None = None,
    stage_counts: Sequence[int] | None = None,
) -> SyncTraffic:
    """Per-rank bytes (by link class), collectives and local copies of one sync, every rank feeding an engine.
    ``ep`` / ``etp`` (MoE models; ``etp`` None = TP): expert parallel and expert tensor parallel sizes;
    ``stage_counts``: layers per pipeline stage of an uneven split (None: even)."""
    if path not in PATHS:
        raise ValueError(f"path must be one of {PATHS}, got {path!r}")
    etp = tp if etp is None else etp
    if hf.moe is None and (ep, etp) != (1, tp):
        raise ValueError(f"EP={ep} / ETP={etp} need an MoE model")
    if hf.moe is not None and path != "shard_first":
        raise ValueError("the tensorwise export is modelled for dense models only; MoE: path='shard_first'")
    if (tp * dp) % (ep * etp):
        raise ValueError(f"TP x DP = {tp * dp} ranks per stage is not divisible by EP x ETP = {ep * etp}")
    ledger = _Ledger(tp, pp, dp, gpus_per_node)
    if hf.moe is not None:
        _count_moe(ledger, hf, ep, etp, dtype_bytes, bucket_bytes, rollout_tp, value_head, stage_counts)
        return SyncTraffic(path, tp, pp, dp, gpus_per_node, ledger.per_rank, bandwidths or Bandwidths(), ep, etp)
    groups = shard_groups(hf, tp, pp, dtype_bytes, value_head, stage_counts)
    full = sum(sum(g.hf_bytes) for g in groups)
    engine_load = full // (rollout_tp or tp)
    if path == "shard_first":
        _count_shard_first(ledger, groups, bucket_bytes, full, engine_load)
    else:
        _count_tensorwise(ledger, groups, full, engine_load)
    return SyncTraffic(path, tp, pp, dp, gpus_per_node, ledger.per_rank, bandwidths or Bandwidths())


def format_sync_traffic(hf: HFModelConfig, tp: int, pp: int, dp: int, gpus_per_node: int, *, name: str = "",
                        dtype_bytes: int = 2, bucket_bytes: int = 512 << 20, rollout_tp: int | None = None,
                        bandwidths: Bandwidths | None = None, ep: int = 1, etp: int | None = None,
                        stage_counts: Sequence[int] | None = None) -> str:
    """The planner's weight-sync lines: both paths (MoE: shard-first only), worst GPU, at the stated bandwidths."""
    bw = bandwidths or Bandwidths()
    experts = f" x EP {ep} x ETP {tp if etp is None else etp}" if hf.moe is not None else ""
    lines = [
        f"weight sync{(' ' + name) if name else ''} (TP {tp} x PP {pp} x DP {dp}{experts}, {gpus_per_node} GPUs per node, "
        f"{dtype_bytes}-byte weights, {bucket_bytes >> 20} MiB buckets; worst GPU; at {bw.inter_node_Bps / 1e9:g} GB/s "
        f"inter-node, {bw.nvlink_Bps / 1e9:g} GB/s NVLink, {bw.copy_Bps / 1e12:g} TB/s copy, "
        f"{bw.latency_s * 1e6:g} us per collective):"
    ]
    for path in PATHS if hf.moe is None else ("shard_first",):
        t = model_sync_traffic(hf, tp, pp, dp, gpus_per_node, path=path, dtype_bytes=dtype_bytes,
                               bucket_bytes=bucket_bytes, rollout_tp=rollout_tp, bandwidths=bw, ep=ep, etp=etp,
                               stage_counts=stage_counts)
        label = "today (tensorwise)" if path == "tensorwise" else "shard-first"
        lines.append(
            f"  {label:<20} inter-node in {t.worst('inter_recv') / 1e9:7.2f} GB, NVLink in "
            f"{t.worst('intra_recv') / 1e9:7.2f} GB, copies {t.worst('copy') / 1e9:7.2f} GB, "
            f"{t.worst('collectives'):6d} collectives -> {t.seconds:6.2f} s"
        )
    return "\n".join(lines)


def plan_sync_traffic(cfg: PPOTrainerConfig, plan: Plan) -> str:
    """The weight-sync lines of ``python -m megatron_rl.plan`` for a resolved config and its plan."""
    rollout = cfg.actor_rollout_ref.rollout
    layout = plan.actor_layout
    dtype = str(rollout.dtype)
    dtype_bytes = 4 if dtype in ("float32", "fp32") else 2
    if rollout.mode != "colocated":
        return "weight sync: server mode (one sender per server group) is not modelled; see docs/rollout.md"
    # the MTP layers travel only to engines that draft with them (weights/replica.py export_plan)
    model = plan.model if cfg.actor_rollout_ref.model.mtp.enable_rollout else replace(plan.model, mtp=None)
    return format_sync_traffic(
        model, layout.tp, layout.pp, layout.dp * layout.cp, int(cfg.trainer.n_gpus_per_node),
        dtype_bytes=dtype_bytes, bucket_bytes=int(rollout.weight_sync.bucket_size_mb) << 20,
        rollout_tp=int(rollout.tensor_model_parallel_size), ep=layout.ep, etp=layout.etp,
        stage_counts=stage_layer_counts(plan.model.num_layers, layout.pp, layout.first_stage_layers,
                                        layout.last_stage_layers),
    )
