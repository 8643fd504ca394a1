"""Stream full HF-named tensors out of TP/PP-sharded Megatron chunks, and save an HF directory.

``export_hf_weights`` is a collective over the model-parallel group: every rank must iterate it to the end,
in step. It is **shard-first and bucketed** (docs/rollout.md, "Weight export: shard first"):

1. Buckets. Every rank builds the same plan: the HF tensor groups in checkpoint order, cut into buckets of
   consecutive groups held by one pipeline stage, each bucket one flat byte buffer of this TP rank's shards
   (``bucket_bytes`` of full tensors, i.e. ``bucket_bytes / tp`` per rank; a larger group travels alone).
2. Pipeline: the owning stage's rank of TP rank t packs its shards (casting to ``dtype`` in the copy) and
   broadcasts the flat buffer over its pipeline group, so every rank receives only **its own TP rank's
   shards** of the stages it does not hold — one collective per bucket, never a full tensor across nodes.
3. Tensor parallel: one ``all_gather_into_tensor`` per bucket over the TP group (inside a node) gives every
   TP rank all shards of the bucket.
4. Conversion, once per tensor, only on ranks that materialise (``consumers``): the shards are written straight
   into a fresh HF-layout bucket (SGLang's flattened_bucket layout; q/k/v and gate/up split, vocabulary
   padding dropped), which is sealed (never written again) and yielded tensor by tensor as views of it.
   ``sync_weights`` hands a sealed bucket to the engine as is, without another copy.

Who takes part in what (``consumers``: the ranks that need full tensors; default every rank). A rank *needs
shards* when some rank of its TP group is a consumer. Pipeline step of a bucket in a pipeline group: the
receivers are the members, other than the owner, that need shards — none: nothing is sent; all: one
broadcast; some: point-to-point sends from the owner to each. TP step, on ranks that need shards: every TP
rank a consumer: all-gather; else one gather to each consumer. Non-consumers yield nothing. Colocated
engines: every rank consumes. Server mode: only global rank 0 (the sender) consumes, so only its TP group
gathers (to it) and only its pipeline groups send, point to point, to it.

Overlap: bucket k+1's pipeline transfer is started before bucket k is converted and its TP gather before
bucket k is yielded (asynchronous collectives), so they run while the consumer loads bucket k into the engine.
The yielded HF buckets are fresh per bucket and never rewritten, so a consumer may keep (or hand an engine) any
view; the internal transfer buffers (two slots each, reused) are never handed on. Peak extra memory per rank:
2 x (bucket_bytes / tp shard buffer + bucket_bytes gathered) for the export's lifetime + the HF bucket being
consumed (<= bucket_bytes), plus what the consumer still holds.

MoE experts (models/moe.py). Buckets never mix experts with other tensors, nor experts of two EP ranks. An
expert bucket first goes over the expert-parallel group of its stage: the EP rank that owns the experts packs
its ETP shards and broadcasts them to the other EP ranks of the stage (every rank of the stage takes part), so
each rank of the stage then holds the shard its own position needs; pipeline and TP steps follow as for dense
buckets. ETP is 1 or TP (sizes.check_parallel_fit): at ETP = TP the expert-TP group is the TP group (checked),
at ETP = 1 each rank holds whole experts and the TP step is skipped.

``export_hf_weights_tensorwise`` is the previous path (per tensor: TP all-gather on the owning stage, then
the full tensor broadcast over every pipeline group), kept as the baseline of the benchmark and the
traffic model's check.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from safetensors.torch import save_file

from megatron_rl.distributed.host_gather import HostGather, host_gather_for
from megatron_rl.bucket import DEFAULT_BUCKET_BYTES, WeightBucket
from megatron_rl.models.hf_checkpoint import INDEX_FILE, SINGLE_FILE
from megatron_rl.models.hf_config import HFModelConfig
from megatron_rl.models.layout import (
    Kind,
    ParamMapping,
    TensorGroup,
    chunk_mappings,
    hf_from_shards,
    hf_tensor_groups,
    is_value_model,
    unwrap,
)

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "generation_config.json",
)


@dataclass(frozen=True)
class ExportPlan:
    """What one export materialises where. ``consumers``: the global ranks that need full tensors (None: every
    rank; server mode: the sender alone). ``bucket_bytes``: full-tensor bytes per bucket. ``dtype``: what the
    weights are cast to before communication (None: the parameters' dtype)."""

    consumers: frozenset[int] | None = None
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    dtype: torch.dtype | None = None
    # the multi-token-prediction layers the model builds (models/mtp.py): in the HF export; the engines do not
    # draft with them (model.mtp.enable_rollout is refused), so the weight sync leaves them out
    with_mtp: bool = True

    def __post_init__(self) -> None:
        if self.bucket_bytes <= 0:
            raise ValueError(f"export bucket_bytes must be positive, got {self.bucket_bytes}")

def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _aligned(offset: int, alignment: int) -> int:
    return (offset + alignment - 1) // alignment * alignment


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


@dataclass(frozen=True)
class ShardSlot:
    """One Megatron parameter's TP shard in a bucket's flat per-rank buffer (same on every TP rank)."""

    group: TensorGroup
    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int  # bytes into the per-rank buffer
    nbytes: int


@dataclass(frozen=True)
class ExportBucket:
    stage: int  # pipeline rank that holds these parameters
    slots: tuple[ShardSlot, ...]
    shard_bytes: int  # per-rank flat buffer size
    ep_rank: int | None = None  # MoE experts under EP > 1: the EP rank that holds them (module docstring)
    expert: bool = False  # MoE expert tensors (split over ETP, not TP)


def plan_export_buckets(
    groups: list[TensorGroup],
    owner: dict[str, tuple[int, str, tuple[int, ...]]],
    tp: int,
    bucket_bytes: int,
    ep_owner: dict[str, int] | None = None,
) -> list[ExportBucket]:
    """Cut the HF tensor groups (checkpoint order) into buckets of one stage, <= ``bucket_bytes`` of gathered
    bytes (``tp`` x per-rank bytes) each; a group larger than that travels alone. ``owner``: group key ->
    (stage, dtype name, local shard shape); ``ep_owner``: MoE expert group key -> EP rank holding it (EP > 1).
    A bucket holds either MoE expert tensors of one EP rank or other tensors. Pure: the traffic model calls it."""
    ep_owner = ep_owner or {}
    buckets: list[ExportBucket] = []
    slots: list[ShardSlot] = []
    stage, used, holder = -1, 0, (None, False)
    for group in groups:
        if group.key not in owner:
            raise RuntimeError(f"no pipeline stage holds {group.key!r}; are all model chunks passed?")
        g_stage, dtype_name, shape = owner[group.key]
        g_holder = (ep_owner.get(group.key), group.expert is not None)
        dtype = getattr(torch, dtype_name)
        nbytes = _numel(shape) * dtype.itemsize
        offset = _aligned(used, dtype.itemsize)
        if slots and (g_stage != stage or g_holder != holder or (offset + nbytes) * tp > bucket_bytes):
            buckets.append(ExportBucket(stage, tuple(slots), used, *holder))
            slots, used, offset = [], 0, 0
        stage, holder = g_stage, g_holder
        slots.append(ShardSlot(group, tuple(shape), dtype, offset, nbytes))
        used = offset + nbytes
    if slots:
        buckets.append(ExportBucket(stage, tuple(slots), used, *holder))
    return buckets


def hf_bucket_specs(hf: HFModelConfig, bucket: ExportBucket) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """(HF name, full shape, dtype) of every tensor the bucket converts to."""
    return [(t.name, tuple(t.shape), slot.dtype) for slot in bucket.slots for t in slot.group.tensors]


def _write_hf(hf: HFModelConfig, group: TensorGroup, shards: list[torch.Tensor], dests: list[torch.Tensor]) -> None:
    """Write the full HF tensors of ``group`` from its TP shards straight into ``dests`` (one copy per byte)."""
    kind, tp = group.kind, len(shards)
    if kind is Kind.REPLICATED:
        dests[0].copy_(shards[0])
        return
    if kind is Kind.COLUMN:
        rows = shards[0].shape[0]
        for r, shard in enumerate(shards):
            dests[0][r * rows : (r + 1) * rows].copy_(shard)
        return
    if kind is Kind.ROW:
        cols = shards[0].shape[1]
        for r, shard in enumerate(shards):
            dests[0][:, r * cols : (r + 1) * cols].copy_(shard)
        return
    if kind is Kind.COLUMN_SWAPPED_INPUTS:  # Megatron's [embedding | hidden] inputs back to MiMo's [hidden | embedding]
        rows, half = shards[0].shape[0], shards[0].shape[1] // 2
        for r, shard in enumerate(shards):
            dests[0][r * rows : (r + 1) * rows, :half].copy_(shard[:, half:])
            dests[0][r * rows : (r + 1) * rows, half:].copy_(shard[:, :half])
        return
    if kind is Kind.VOCAB:
        rows, vocab = shards[0].shape[0], dests[0].shape[0]
        for r, shard in enumerate(shards):
            lo, hi = r * rows, min((r + 1) * rows, vocab)
            if hi > lo:
                dests[0][lo:hi].copy_(shard[: hi - lo])
        return
    if kind is Kind.GATE_UP:
        half = shards[0].shape[0] // 2
        for r, shard in enumerate(shards):
            dests[0][r * half : (r + 1) * half].copy_(shard[:half])
            dests[1][r * half : (r + 1) * half].copy_(shard[half:])
        return
    if kind is Kind.QKV:
        ng, hd = hf.num_key_value_heads, hf.head_dim
        q_rows = hf.num_attention_heads // ng * hd
        if ng % tp == 0:  # each shard holds whole query groups
            per = ng // tp
            q, k, v = (d.view(ng, -1, *d.shape[1:]) for d in dests)
            for r, shard in enumerate(shards):
                sq, sk, sv = shard.view(per, q_rows + 2 * hd, *shard.shape[1:]).split([q_rows, hd, hd], dim=1)
                q[r * per : (r + 1) * per].copy_(sq)
                k[r * per : (r + 1) * per].copy_(sk)
                v[r * per : (r + 1) * per].copy_(sv)
            return
        for dest, full in zip(dests, hf_from_shards(hf, group, shards)):  # TP > query groups: partial groups
            dest.copy_(full)
        return
    raise AssertionError(kind)


def _all_gather_flat():
    """torch >= 2.13 renamed all_gather_into_tensor to all_gather_single (the old name warns); looked up per call."""
    return getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class _Transfer:
    """The collectives of one bucket on this rank: pipeline step, then TP step (both may run asynchronously)."""

    def __init__(self, ctx: _ExportContext, bucket: ExportBucket, index: int) -> None:
        self.ctx, self.bucket, self.slot = ctx, bucket, index % 2
        self.shard: torch.Tensor | None = None
        self.gathered: torch.Tensor | None = None
        # the host's shared buffer slot, for buckets whose TP step goes through it (``_ExportContext.host_slot``)
        self._host_slot = ctx.host_slot(bucket)
        self._works: list = []

    def _pack(self, buffer: torch.Tensor) -> None:
        """This rank's shards of the bucket's parameters into its flat buffer."""
        for slot in self.bucket.slots:
            view = buffer[slot.offset : slot.offset + slot.nbytes].view(slot.dtype).view(slot.shape)
            view.copy_(self.ctx.local[slot.group.key].value())  # the cast to the export dtype is this copy

    def _expert_parallel_step(self) -> torch.Tensor | None:
        """An expert bucket under EP > 1, on its stage: the owning EP rank's shards, broadcast over the EP group
        (every rank of the stage takes part, whatever it consumes). None for other buckets and stages."""
        ctx, bucket = self.ctx, self.bucket
        if bucket.ep_rank is None or bucket.stage != ctx.pp_rank:
            return None
        buffer = ctx.staging("expert", self.slot, bucket.shard_bytes)
        if ctx.ep_rank == bucket.ep_rank:
            self._pack(buffer)
        dist.broadcast(buffer, group=ctx.ep_group, group_src=bucket.ep_rank)
        return buffer

    def start_pipeline(self) -> _Transfer:
        ctx, bucket = self.ctx, self.bucket
        expert_shard = self._expert_parallel_step()
        if ctx.host_wide:  # the owning stage writes the host's shared rows; every stage reads them (no broadcast)
            if bucket.stage == ctx.pp_rank:
                self._pack(ctx.host_gather.row(self._host_slot, bucket.shard_bytes))
            return self
        receivers = [s for s in range(ctx.pp_size) if s != bucket.stage and ctx.needs_shards[s]]
        if bucket.stage == ctx.pp_rank:
            if not receivers and not ctx.needs_shards[ctx.pp_rank]:
                return self
        elif ctx.pp_rank not in receivers:
            return self
        shard = ctx.shard_buffer(self.slot, self._host_slot, bucket.shard_bytes)
        if expert_shard is not None:
            shard.copy_(expert_shard)
        elif bucket.stage == ctx.pp_rank:
            self._pack(shard)
        self.shard = shard
        if not receivers:
            return self
        if len(receivers) == ctx.pp_size - 1:
            self._works.append(
                dist.broadcast(shard, group=ctx.pp_group, group_src=bucket.stage, async_op=True)
            )
        elif bucket.stage == ctx.pp_rank:
            self._works += [dist.isend(shard, dst=ctx.pp_ranks[s], group=ctx.pp_group) for s in receivers]
        else:
            self._works.append(dist.irecv(shard, src=ctx.pp_ranks[bucket.stage], group=ctx.pp_group))
        return self

    def _wait(self) -> None:
        for work in self._works:
            work.wait()
        self._works = []

    def start_tensor_parallel(self) -> _Transfer:
        self._wait()
        ctx = self.ctx
        if ctx.host_wide:  # every rank of the model-parallel group, consumer or not, enters each bucket's barrier
            self._works.append(ctx.host_gather.publish())
            return self
        if not ctx.needs_shards[ctx.pp_rank]:
            self.shard = None
            return self
        assert self.shard is not None
        if ctx.split_of(self.bucket) == 1:
            self.gathered = self.shard if ctx.is_consumer else None
            return self
        consumers = ctx.tp_consumers
        if self._host_slot is not None:
            # the shard already sits in this rank's row of the host's shared buffer (packed or received there)
            self._works.append(ctx.host_gather.publish())
        elif len(consumers) == ctx.tp_size:
            self.gathered = ctx.staging("gathered", self.slot, ctx.tp_size * self.bucket.shard_bytes)
            self._works.append(
                _all_gather_flat()(self.gathered, self.shard, group=ctx.tp_group, async_op=True)
            )
        else:
            for dst in consumers:
                out = None
                if dst == ctx.rank:
                    self.gathered = ctx.staging("gathered", self.slot, ctx.tp_size * self.bucket.shard_bytes)
                    out = list(self.gathered.view(ctx.tp_size, -1))
                self._works.append(
                    dist.gather(self.shard, out, dst=dst, group=ctx.tp_group, async_op=True)
                )
        return self

    def finish(self) -> torch.Tensor | None:
        """The gathered shards ([split x shard_bytes] uint8, one row per rank) on a consumer, else None."""
        self._wait()
        self.shard = None
        if self._host_slot is not None and self.ctx.is_consumer:
            self.gathered = self.ctx.host_gather.gathered(self._host_slot, self.bucket.shard_bytes)
        gathered, self.gathered = self.gathered, None
        return gathered


@dataclass
class _ExportContext:
    hf: HFModelConfig
    local: dict[str, ParamMapping]
    device: torch.device
    rank: int
    pp_group: object
    pp_rank: int
    pp_size: int
    pp_ranks: list[int]
    tp_group: object
    tp_size: int
    is_consumer: bool
    tp_consumers: list[int]  # global ranks of this TP group that consume
    needs_shards: list[bool]  # per pipeline rank of this pipeline group
    # MoE: the expert-parallel group of this rank, its rank in it, the expert-TP size, expert key -> EP rank
    ep_group: object = None
    ep_rank: int = 0
    etp_size: int = 1
    ep_owner: dict | None = None
    host_gather: HostGather | None = None  # CPU ranks of one host: the TP step through shared memory
    _staging: dict | None = None
    _host_buckets: int = 0  # buckets given a slot of the shared buffer so far

    @property
    def host_wide(self) -> bool:
        """The shared buffer spans the model-parallel group (PP > 1 without EP: ``_take_host_buffer``), so it is
        the pipeline step too."""
        return self.host_gather is not None and self.pp_size > 1 and self.ep_owner is None

    def host_slot(self, bucket: ExportBucket) -> int | None:
        """The shared buffer's slot for ``bucket`` when its TP step goes through it, else None; called once per
        bucket, in order. The slots alternate over these buckets only: a bucket without a TP step (experts at
        expert-TP 1) publishes no barrier, so it must not take a slot either, or a rank could write the row
        of the slot in use two buckets ago while another rank still reads it (host_gather's slot rule)."""
        if self.host_gather is None or (self.split_of(bucket) == 1 and not self.host_wide):
            return None
        self._host_buckets += 1
        return (self._host_buckets - 1) % 2

    def shard_buffer(self, slot: int, host_slot: int | None, nbytes: int) -> torch.Tensor:
        """Where this rank's TP shard of a bucket is packed or received: its row of the shared buffer when
        the TP step goes through the host's memory (no copy into the gather), else a staging buffer."""
        if host_slot is not None:
            return self.host_gather.row(host_slot, nbytes)
        return self.staging("shard", slot, nbytes)

    def split_of(self, bucket: ExportBucket) -> int:
        """How many ranks' shards make up the bucket's full tensors: TP, or for experts at ETP = 1 one."""
        return self.etp_size if bucket.expert else self.tp_size

    def staging(self, kind: str, slot: int, nbytes: int) -> torch.Tensor:
        """Internal transfer buffers, two slots per kind (bucket k uses slot k % 2), reused across buckets: bucket
        k+2's transfer starts only after bucket k was converted out of them, and they are never handed on (the
        consumer gets the fresh sealed HF bucket). Saves an allocation and its first touch per bucket."""
        if self._staging is None:
            self._staging = {}
        buffer = self._staging.get((kind, slot))
        if buffer is None or buffer.numel() < nbytes:
            buffer = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            self._staging[(kind, slot)] = buffer
        return buffer[:nbytes]


def _hf_bucket(ctx: _ExportContext, bucket: ExportBucket, gathered: torch.Tensor) -> WeightBucket:
    specs = hf_bucket_specs(ctx.hf, bucket)
    out = WeightBucket(WeightBucket.capacity_for([(shape, dtype) for _, shape, dtype in specs]), ctx.device)
    split = ctx.split_of(bucket)
    rows = gathered.view(split, bucket.shard_bytes) if gathered.dim() == 1 else gathered
    for slot in bucket.slots:
        shards = [rows[r, slot.offset : slot.offset + slot.nbytes].view(slot.dtype).view(slot.shape)
                  for r in range(split)]
        dests = [out.reserve(t.name, tuple(t.shape), slot.dtype) for t in slot.group.tensors]
        if slot.group.kind is Kind.REPLICATED:
            shards = shards[:1]
        _write_hf(ctx.hf, slot.group, shards, dests)
    return out.seal()


def _export_context(chunks, dtype, consumers) -> tuple[_ExportContext, dict, bool]:
    hf = chunks[0].hf_config
    local = {m.group.key: m for chunk in chunks for m in chunk_mappings(chunk) if m.export}
    pp_group = parallel_state.get_pipeline_model_parallel_group()
    tp_group = parallel_state.get_tensor_model_parallel_group()
    pp_size, pp_rank = dist.get_world_size(pp_group), dist.get_rank(pp_group)
    tp_ranks = dist.get_process_group_ranks(tp_group)
    rank = dist.get_rank()
    is_consumer = consumers is None or rank in consumers
    tp_consumers = [r for r in tp_ranks if consumers is None or r in consumers]
    holdings = {
        key: (str(dtype or m.param.dtype).removeprefix("torch."), tuple(m.param.shape)) for key, m in local.items()
    }
    holdings, ep_owner = _expert_holdings(holdings, local)
    # the EP owners of every stage's experts travel with the holdings: every rank must cut the same buckets
    mine = (holdings, bool(tp_consumers), ep_owner)
    if pp_size > 1:
        everyone: list = [None] * pp_size
        dist.all_gather_object(everyone, mine, group=pp_group)
    else:
        everyone = [mine]
    owner = {key: (stage, dt, shape)
             for stage, (held, *_) in enumerate(everyone) for key, (dt, shape) in held.items()}
    value_model = any("score.weight" in held for held, *_ in everyone)  # only the last stage has the head
    if ep_owner is not None:
        ep_owner = {key: ep for *_, stage_owner in everyone for key, ep in stage_owner.items()}
    ctx = _ExportContext(
        hf=hf, local=local, device=_device(), rank=rank, pp_group=pp_group, pp_rank=pp_rank, pp_size=pp_size,
        pp_ranks=dist.get_process_group_ranks(pp_group), tp_group=tp_group, tp_size=len(tp_ranks),
        is_consumer=is_consumer, tp_consumers=tp_consumers, needs_shards=[needs for _, needs, _ in everyone],
    )
    _add_expert_parallel(ctx, ep_owner)
    return ctx, owner, value_model


def _expert_holdings(holdings: dict, local: dict[str, ParamMapping]) -> tuple[dict, dict[str, int] | None]:
    """Under EP > 1 each rank holds only its experts: add the other EP ranks' (all-gather over the EP group),
    with the EP rank of each expert key. Without EP: unchanged, None."""
    group = parallel_state.get_expert_model_parallel_group(check_initialized=False)
    if group is None or dist.get_world_size(group) == 1:
        return holdings, None
    mine = {key: held for key, held in holdings.items() if local[key].group.expert is not None}
    everyone: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    ep_owner = {key: ep_rank for ep_rank, held in enumerate(everyone) for key in held}
    merged = dict(holdings)
    for held in everyone:
        merged.update(held)
    return merged, ep_owner


def _add_expert_parallel(ctx: _ExportContext, ep_owner: dict[str, int] | None) -> None:
    if ctx.hf.moe is None:
        return
    ctx.ep_group = parallel_state.get_expert_model_parallel_group()
    ctx.ep_rank = dist.get_rank(ctx.ep_group)
    ctx.etp_size = parallel_state.get_expert_tensor_parallel_world_size()
    ctx.ep_owner = ep_owner
    if 1 < ctx.etp_size:
        etp_ranks = dist.get_process_group_ranks(parallel_state.get_expert_tensor_parallel_group())
        if etp_ranks != dist.get_process_group_ranks(ctx.tp_group):
            raise RuntimeError(
                f"expert-TP group {etp_ranks} is not the TP group {dist.get_process_group_ranks(ctx.tp_group)}: "
                "the export gathers expert shards over the TP group"
            )


def _take_host_buffer(ctx: _ExportContext, shard_bytes: int) -> None:
    """Gloo ranks of one host move the bucket's shards through shared memory: at PP > 1 (no EP) one buffer over
    the model-parallel group with a row per TP rank, written by the owning stage (no pipeline broadcast);
    else the TP group's, for the TP step only. Where it cannot (NCCL, several hosts, no room), the collectives."""
    if ctx.pp_size > 1 and ctx.ep_owner is None:
        group = parallel_state.get_model_parallel_group()
        ctx.host_gather = host_gather_for(group, shard_bytes, rows=ctx.tp_size, row=dist.get_rank(ctx.tp_group))
    elif ctx.tp_size > 1 and ctx.needs_shards[ctx.pp_rank]:
        ctx.host_gather = host_gather_for(ctx.tp_group, shard_bytes)


def export_hf_buckets(model_chunks: list[torch.nn.Module], plan: ExportPlan = ExportPlan()) -> Iterator[WeightBucket]:
    """Yield sealed HF-layout ``WeightBucket``s (checkpoint order) on the plan's consumer ranks; a collective
    (module docstring) that every rank of the model-parallel group must iterate to the end."""
    chunks = [unwrap(c) for c in model_chunks]
    ctx, owner, value_model = _export_context(chunks, plan.dtype, plan.consumers)
    buckets = plan_export_buckets(
        hf_tensor_groups(ctx.hf, value_head=value_model, mtp=plan.with_mtp), owner, ctx.tp_size, plan.bucket_bytes,
        ctx.ep_owner
    )
    if not buckets:
        return
    _take_host_buffer(ctx, max(b.shard_bytes for b in buckets))
    try:
        pending = _Transfer(ctx, buckets[0], 0).start_pipeline().start_tensor_parallel()
        for k, bucket in enumerate(buckets):
            gathered = pending.finish()
            following = _Transfer(ctx, buckets[k + 1], k + 1).start_pipeline() if k + 1 < len(buckets) else None
            out = _hf_bucket(ctx, bucket, gathered) if gathered is not None else None
            del gathered
            if following is not None:
                pending = following.start_tensor_parallel()  # runs while the consumer loads ``out``
            if out is not None:
                yield out
    finally:
        if ctx.host_gather is not None:
            ctx.host_gather.release()


def export_hf_weights(
    model_chunks: list[torch.nn.Module],
    dtype: torch.dtype | None = None,
    *,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    consumers: Iterable[int] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, full_tensor)`` in HF checkpoint order on every consumer rank (default: every rank).

    ``dtype`` casts before communication (e.g. bf16 for rollout engines); default: parameter dtype.
    A value model yields ``score.weight``/``score.bias`` instead of ``lm_head.weight``; a tied model
    yields no ``lm_head.weight``. Tensors are views of sealed buckets on the current CUDA device (CPU
    without CUDA), never written again. Non-consumer ranks take part in the collectives and yield nothing.
    """
    plan = ExportPlan(None if consumers is None else frozenset(consumers), bucket_bytes, dtype)
    for bucket in export_hf_buckets(model_chunks, plan):
        yield from bucket.named_tensors()


# ---------------------------------------------------------------- the previous path (baseline)


def _gather_tp(tensor: torch.Tensor) -> list[torch.Tensor]:
    group = parallel_state.get_tensor_model_parallel_group()
    size = dist.get_world_size(group)
    if size == 1:
        return [tensor]
    shards = [torch.empty_like(tensor) for _ in range(size)]
    dist.all_gather(shards, tensor.contiguous(), group=group)
    return shards


def _full_tensors(hf: HFModelConfig, mapping: ParamMapping, dtype: torch.dtype | None) -> list[torch.Tensor]:
    local = mapping.value()
    if dtype is not None:
        local = local.to(dtype)
    shards = [local] if mapping.group.kind is Kind.REPLICATED else _gather_tp(local)
    return [t.contiguous() for t in hf_from_shards(hf, mapping.group, shards)]


def export_hf_weights_tensorwise(
    model_chunks: list[torch.nn.Module], dtype: torch.dtype | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """The previous export: per tensor, TP all-gather on the owning stage, then the FULL tensor broadcast over
    the pipeline group, so every rank receives every full tensor. Kept as the benchmark's baseline."""
    chunks = [unwrap(c) for c in model_chunks]
    hf = chunks[0].hf_config
    local = {m.group.key: m for chunk in chunks for m in chunk_mappings(chunk) if m.export}
    pp_group = parallel_state.get_pipeline_model_parallel_group()
    pp_size = dist.get_world_size(pp_group)
    pp_rank = dist.get_rank(pp_group)
    holdings = {key: str(dtype or m.param.dtype).removeprefix("torch.") for key, m in local.items()}
    everyone: list[dict[str, str]] = [{} for _ in range(pp_size)]
    if pp_size > 1:
        dist.all_gather_object(everyone, holdings, group=pp_group)
    else:
        everyone = [holdings]
    owner = {key: (rank, dt) for rank, held in enumerate(everyone) for key, dt in held.items()}
    device = _device()
    value_model = any("score.weight" in held for held in everyone)
    for group in hf_tensor_groups(hf, value_head=value_model):
        if group.key not in owner:
            raise RuntimeError(f"no pipeline stage holds {group.key!r}; are all model chunks passed?")
        src, dtype_name = owner[group.key]
        if src == pp_rank:
            tensors = _full_tensors(hf, local[group.key], dtype)
        else:
            tensors = [
                torch.empty(t.shape, dtype=getattr(torch, dtype_name), device=device) for t in group.tensors
            ]
        for spec, tensor in zip(group.tensors, tensors):
            if pp_size > 1:
                dist.broadcast(tensor, group=pp_group, group_src=src)
            yield spec.name, tensor


def _config_for_export(hf: HFModelConfig, value_model: bool, dtype: torch.dtype) -> dict:
    config = dict(hf.raw)
    config["dtype"] = str(dtype).removeprefix("torch.")
    config.pop("torch_dtype", None)
    # An FP8 block-scaled source (DeepSeek-V3) was dequantised on load; the saved weights are ``dtype``.
    config.pop("quantization_config", None)
    # A reward model stays <Family>ForSequenceClassification: its config.json already says so.
    if value_model and not hf.sequence_classifier:
        # Loadable as transformers' <Family>ForTokenClassification with one label: the critic.
        config["architectures"] = [hf.architecture.replace("ForCausalLM", "ForTokenClassification")]
        config["num_labels"] = 1
        config["id2label"], config["label2id"] = {"0": "LABEL_0"}, {"LABEL_0": 0}
    return config


def save_hf_checkpoint(
    model_chunks: list[torch.nn.Module],
    out_dir: str | Path,
    tokenizer_dir: str | Path | None = None,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int = 5 * 1024**3,
    progress: bool = False,
) -> None:
    """Write a complete HF model directory from the chunks (collective: call on every rank).

    Global rank 0 writes config.json, ``model.safetensors`` (or ``model-0000i-of-0000n.safetensors``
    + ``model.safetensors.index.json`` past ``max_shard_bytes``) and copies the tokenizer files found
    in ``tokenizer_dir``. Other ranks take part in the gathers only.
    """
    chunks = [unwrap(c) for c in model_chunks]
    hf = chunks[0].hf_config
    writer = dist.get_rank() == 0
    value_model = is_value_model(chunks)
    out = Path(out_dir)
    if writer:
        out.mkdir(parents=True, exist_ok=True)
    stream = export_hf_weights(chunks, dtype=dtype, consumers={0})  # only the writer materialises
    if progress and writer:
        from tqdm import tqdm

        total = sum(len(g.tensors) for g in hf_tensor_groups(hf, value_head=value_model))
        stream = tqdm(stream, total=total, desc=f"writing {out.name}", unit="tensor")

    pending: dict[str, torch.Tensor] = {}
    pending_bytes, total_bytes, saved_dtype = 0, 0, dtype
    written: list[list[str]] = []  # tensor names per shard file, in order
    for name, tensor in stream:
        if not writer:
            continue
        saved_dtype = saved_dtype or tensor.dtype
        size = tensor.numel() * tensor.element_size()
        if pending and pending_bytes + size > max_shard_bytes:
            written.append(_write_shard(out, pending, len(written)))
            pending_bytes = 0
        pending[name] = tensor.cpu()
        pending_bytes += size
        total_bytes += size
    if writer:
        written.append(_write_shard(out, pending, len(written)))
        _name_shards(out, written, total_bytes)
        with open(out / "config.json", "w") as f:
            json.dump(_config_for_export(hf, value_model, saved_dtype), f, indent=2)
        if tokenizer_dir is not None:
            for file in TOKENIZER_FILES:
                if (Path(tokenizer_dir) / file).is_file():
                    shutil.copy2(Path(tokenizer_dir) / file, out / file)
    dist.barrier()


def _temp_shard_name(index: int) -> str:
    return f"shard-{index:05d}.tmp.safetensors"


def _write_shard(out: Path, tensors: dict[str, torch.Tensor], index: int) -> list[str]:
    save_file(tensors, str(out / _temp_shard_name(index)), metadata={"format": "pt"})
    names = list(tensors)
    tensors.clear()
    return names


def _name_shards(out: Path, written: list[list[str]], total_bytes: int) -> None:
    """Give the shards HF's names (a single file is model.safetensors) and write the index."""
    if len(written) == 1:
        (out / _temp_shard_name(0)).replace(out / SINGLE_FILE)
        return
    weight_map = {}
    for i, names in enumerate(written):
        final = f"model-{i + 1:05d}-of-{len(written):05d}.safetensors"
        (out / _temp_shard_name(i)).replace(out / final)
        weight_map.update({name: final for name in names})
    with open(out / INDEX_FILE, "w") as f:
        json.dump({"metadata": {"total_size": total_bytes}, "weight_map": weight_map}, f, indent=2)
