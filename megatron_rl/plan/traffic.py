"""Byte-accurate traffic model of one weight sync (Megatron actor -> colocated rollout engines).

Two paths, both evaluated collective by collective over the real rank layout (Megatron's order
tp-cp-ep-dp-pp, rank r on node r // gpus_per_node), so the per-rank figures are exact, not estimates:

* ``tensorwise`` (the previous ``export_hf_weights``): per parameter, a TP all-gather of its shard on the stage
  that holds it, then every HF tensor of it, FULL, broadcast over every pipeline group.
* ``shard_first`` (today's ``export_hf_weights``): per bucket (one stage's consecutive parameters, at most
  ``bucket_bytes`` gathered), the owner broadcasts each TP rank's flat shard buffer over its pipeline group,
  then one all-gather of the bucket over the TP group; every rank converts the full tensors once.

Accounting (the same rule the CPU instrumented run counts with, tests/rollout/test_weight_sync_traffic.py):
a broadcast sends n bytes from the root to each other member; an all-gather sends each member's n bytes to
every other member; a pair's bytes are inter-node when the two ranks' nodes differ, else intra-node (NVLink).
Bytes *received* per GPU do not depend on the collective's algorithm (ring, tree or direct), which is why the
time model uses them. Modelled time per GPU, serial (no overlap credited), worst GPU:

    t = inter_recv / inter_node_Bps + intra_recv / nvlink_Bps + copy_bytes / copy_Bps + collectives x latency

``copy_bytes`` counts the local copies each path makes: shard_first = pack own shards + write every full tensor
once + the engine's load (full bytes / rollout TP); tensorwise = re-layout of the owned full tensors + the copy
into the sync's bucket + the engine's load.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from megatron_rl.models.hf_config import HFModelConfig
from megatron_rl.models.sizes import padded_vocab_size

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

    def worst(self, key: str) -> int:
        return max(r[key] for r in self.per_rank)

    def seconds_of(self, rank: int) -> float:
        r, bw = self.per_rank[rank], self.bandwidths
        return (r["inter_recv"] / bw.inter_node_Bps + r["intra_recv"] / bw.nvlink_Bps + r["copy"] / bw.copy_Bps
                + r["collectives"] * bw.latency_s)

    @property
    def seconds(self) -> float:
        return max(self.seconds_of(rank) for rank in range(len(self.per_rank)))


def shard_groups(hf: HFModelConfig, tp: int, pp: int, dtype_bytes: int, value_head: bool = False) -> list[_Group]:
    """The exported parameters in checkpoint order with their stage, shard and HF sizes (even layer split)."""
    if hf.num_layers % pp:
        raise ValueError(f"num_hidden_layers={hf.num_layers} is not divisible by PP={pp}")
    h, f, b = hf.hidden_size, hf.intermediate_size, dtype_bytes
    vocab_padded = padded_vocab_size(hf.vocab_size, tp)
    per_stage = hf.num_layers // pp
    groups = [_Group(0, "split", vocab_padded // tp * h * b, (hf.vocab_size * h * b,))]
    qkv_rows = hf.q_size + 2 * hf.kv_size
    for layer in range(hf.num_layers):
        s = layer // per_stage
        groups.append(_Group(s, "replicated", h * b, (h * b,)))
        groups.append(_Group(s, "split", qkv_rows // tp * h * b, (hf.q_size * h * b, hf.kv_size * h * b, hf.kv_size * h * b)))
        if hf.qkv_bias:
            groups.append(_Group(s, "split", qkv_rows // tp * b, (hf.q_size * b, hf.kv_size * b, hf.kv_size * b)))
        if hf.qk_norm:
            groups += [_Group(s, "replicated", hf.head_dim * b, (hf.head_dim * b,))] * 2
        groups.append(_Group(s, "split", h * hf.q_size // tp * b, (h * hf.q_size * b,)))
        groups.append(_Group(s, "replicated", h * b, (h * b,)))
        groups.append(_Group(s, "split", 2 * f // tp * h * b, (f * h * b, f * h * b)))
        groups.append(_Group(s, "split", h * f // tp * b, (h * f * b,)))
    last = pp - 1
    groups.append(_Group(last, "replicated", h * b, (h * b,)))
    if value_head:
        groups += [_Group(last, "replicated", h * b, (h * b,)), _Group(last, "replicated", b, (b,))]
    elif not hf.tie_word_embeddings:
        groups.append(_Group(last, "split", vocab_padded // tp * h * b, (hf.vocab_size * h * b,)))
    return groups


def _buckets(groups: list[_Group], tp: int, bucket_bytes: int) -> list[tuple[int, int]]:
    """(stage, per-rank bytes) of each bucket: the export's rule (one dtype, so no alignment padding)."""
    out: list[list[int]] = []
    for g in groups:
        if out and out[-1][0] == g.stage and (out[-1][1] + g.shard_bytes) * tp <= bucket_bytes:
            out[-1][1] += g.shard_bytes
        else:
            out.append([g.stage, g.shard_bytes])
    return [(s, n) for s, n in out]


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
) -> SyncTraffic:
    """Per-rank bytes (by link class), collectives and local copies of one sync, every rank feeding an engine."""
    if path not in PATHS:
        raise ValueError(f"path must be one of {PATHS}, got {path!r}")
    world = tp * pp * dp
    node = [r // gpus_per_node for r in range(world)]

    def rank(t: int, d: int, s: int) -> int:
        return t + tp * (d + dp * s)

    keys = ("inter_recv", "inter_send", "intra_recv", "intra_send", "collectives", "copy")
    per_rank = [dict.fromkeys(keys, 0) for _ in range(world)]

    def send(src: int, dst: int, n: int) -> None:
        cls = "inter" if node[src] != node[dst] else "intra"
        per_rank[src][f"{cls}_send"] += n
        per_rank[dst][f"{cls}_recv"] += n

    def broadcast(members: list[int], root: int, n: int) -> None:
        for m in members:
            per_rank[m]["collectives"] += 1
            if m != root:
                send(root, m, n)

    def all_gather(members: list[int], n: int) -> None:
        for i in members:
            per_rank[i]["collectives"] += 1
            for j in members:
                if i != j:
                    send(i, j, n)

    groups = shard_groups(hf, tp, pp, dtype_bytes, value_head)
    full = sum(sum(g.hf_bytes) for g in groups)
    engine_load = full // (rollout_tp or tp)
    pp_groups = [(t, d) for t in range(tp) for d in range(dp)]
    if path == "shard_first":
        for stage, n in _buckets(groups, tp, bucket_bytes):
            if pp > 1:
                for t, d in pp_groups:
                    broadcast([rank(t, d, s) for s in range(pp)], rank(t, d, stage), n)
            if tp > 1:
                for d in range(dp):
                    for s in range(pp):
                        all_gather([rank(t, d, s) for t in range(tp)], n)
        for r in range(world):
            s = r // (tp * dp)
            own = sum(g.shard_bytes for g in groups if g.stage == s)
            per_rank[r]["copy"] = own + full + engine_load
    else:
        for g in groups:
            if g.kind == "split" and tp > 1:
                for d in range(dp):
                    all_gather([rank(t, d, g.stage) for t in range(tp)], g.shard_bytes)
            if pp > 1:
                for n in g.hf_bytes:
                    for t, d in pp_groups:
                        broadcast([rank(t, d, s) for s in range(pp)], rank(t, d, g.stage), n)
        for r in range(world):
            s = r // (tp * dp)
            owned = sum(sum(g.hf_bytes) for g in groups if g.stage == s and g.kind == "split")
            per_rank[r]["copy"] = owned + full + engine_load
    return SyncTraffic(path, tp, pp, dp, gpus_per_node, per_rank, bandwidths or Bandwidths())


def format_sync_traffic(hf: HFModelConfig, tp: int, pp: int, dp: int, gpus_per_node: int, *, name: str = "",
                        dtype_bytes: int = 2, bucket_bytes: int = 512 << 20, rollout_tp: int | None = None,
                        bandwidths: Bandwidths | None = None) -> str:
    """The planner's weight-sync lines: both paths, worst GPU, at the stated bandwidths."""
    bw = bandwidths or Bandwidths()
    lines = [
        f"weight sync{(' ' + name) if name else ''} (TP {tp} x PP {pp} x DP {dp}, {gpus_per_node} GPUs per node, "
        f"{dtype_bytes}-byte weights, {bucket_bytes >> 20} MiB buckets; worst GPU; at {bw.inter_node_Bps / 1e9:g} GB/s "
        f"inter-node, {bw.nvlink_Bps / 1e9:g} GB/s NVLink, {bw.copy_Bps / 1e12:g} TB/s copy, "
        f"{bw.latency_s * 1e6:g} us per collective):"
    ]
    for path in PATHS:
        t = model_sync_traffic(hf, tp, pp, dp, gpus_per_node, path=path, dtype_bytes=dtype_bytes,
                               bucket_bytes=bucket_bytes, rollout_tp=rollout_tp, bandwidths=bw)
        label = "today (tensorwise)" if path == "tensorwise" else "shard-first"
        lines.append(
            f"  {label:<20} inter-node in {t.worst('inter_recv') / 1e9:7.2f} GB, NVLink in "
            f"{t.worst('intra_recv') / 1e9:7.2f} GB, copies {t.worst('copy') / 1e9:7.2f} GB, "
            f"{t.worst('collectives'):6d} collectives -> {t.seconds:6.2f} s"
        )
    return "\n".join(lines)


def plan_sync_traffic(cfg, plan) -> str:
    """The weight-sync lines of ``python -m megatron_rl.plan`` for a resolved config and its plan."""
    from omegaconf import OmegaConf

    rollout = cfg.actor_rollout_ref.rollout
    layout = plan.actor_layout
    dtype = str(OmegaConf.select(rollout, "dtype", default="auto"))
    dtype_bytes = 4 if dtype in ("float32", "fp32") else 2
    if rollout.mode != "colocated":
        return "weight sync: server mode (one sender per server group) is not modelled; see docs/rollout.md"
    return format_sync_traffic(
        plan.model, layout.tp, layout.pp, layout.dp * layout.cp, int(cfg.trainer.n_gpus_per_node),
        dtype_bytes=dtype_bytes, bucket_bytes=int(rollout.weight_sync.bucket_size_mb) << 20,
        rollout_tp=int(rollout.tensor_model_parallel_size),
    )
