"""One micro-batch as the model sees it: padding removed, and where each response token's output is.

Prompts are left-padded and responses right-padded, so a [b, P+R] batch can be mostly padding.
``pack_micro_batch`` moves each row's real tokens to the left (keeping their order) and cuts the
rectangle at the longest row: the model computes ``b x max(real tokens)`` positions. The model's
RoPE follows token order and pads are masked, so the real tokens' outputs are unchanged.

Response token t of a row (original column P+t) is predicted by the output at the real token just
before it; ``token_rows``/``predictor_cols`` select those outputs as an [N, ...] tensor for the N
real response tokens, and ``scatter`` writes per-token results back into the [b, R] response layout.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from megatron_rl.distributed.context_parallel import local_pack_positions, sum_over_cp


@dataclass(frozen=True)
class ContextParallelShard:
    """This rank's share of a THD pack under context parallelism (distributed/context_parallel.py)."""

    group: Any  # the CP process group
    size: int
    rank: int
    local_of: torch.Tensor  # [T] local index of each global pack position on this rank, -1 on another rank's
    positions: torch.Tensor  # [T / CP] the global pack positions this rank holds, in local order

    def owned(self, positions: torch.Tensor) -> torch.Tensor:
        """[n] bool: which of these global pack positions this rank holds."""
        return self.local_of[positions] >= 0


@dataclass
class PackedMicroBatch:
    rows: torch.Tensor  # [b] indices of these rows in the role's batch
    input_ids: torch.Tensor  # [b', W] real tokens first; b' >= b when padded with empty rows
    attention_mask: torch.Tensor  # [b', W] bool, True = real token
    token_rows: torch.Tensor  # [N] micro-batch row of each real response token
    token_cols: torch.Tensor  # [N] its response column t (0..R-1)
    predictor_cols: torch.Tensor  # [N] packed column whose output predicts it
    labels: torch.Tensor  # [N] the response token ids
    response_len: int
    fields: dict[str, torch.Tensor] = field(default_factory=dict)  # [b, R] inputs of the loss
    # THD (to_thd): the rows' real tokens end to end in one [1, T] row; cu_seqlens [n + 1] int32 (a
    # trailing pad sequence when T was rounded up); thd_index [N]: the packed position predicting each
    # response token. None for the padded [b, W] layout.
    cu_seqlens: torch.Tensor | None = None
    thd_index: torch.Tensor | None = None
    # Shared prompts (workers/shared_prompts.py): one [prompt | responses...] sequence per prompt group in
    # each of the S rows of input_ids. predictor_rows [N]: the sequence holding each response token's
    # predictor; shared_positions [S, W]: RoPE positions; shared_segments [S, W]: what each column is
    # (models.attention.shared_prompt_mask). None in the other layouts.
    predictor_rows: torch.Tensor | None = None
    shared_positions: torch.Tensor | None = None
    shared_segments: torch.Tensor | None = None
    # THD only: the global pack position of each row's last real token (what a reward model scores), and
    # under context parallelism this rank's share: input_ids holds its T / CP tokens, cu_seqlens and
    # thd_index stay global (each sequence padded at its end to a multiple of 2 x CP).
    last_index: torch.Tensor | None = None
    cp: ContextParallelShard | None = None
    # THD only: [1, T] (under CP this rank's [1, T / CP]) True at the pack's pad positions (the CP / TP rounding of
    # each sequence, the trailing pad sequence), which an MoE router must not count (``padding``)
    thd_padding: torch.Tensor | None = None
    # A vision-language model's (padded layout only, workers/forward.py): mRoPE positions [3, b', W] and the rows'
    # images (pixel_values, image_grid_thw) in row order, passed to the model's forward
    mrope_positions: torch.Tensor | None = None
    images: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def is_thd(self) -> bool:
        return self.cu_seqlens is not None

    @property
    def is_shared(self) -> bool:
        return self.shared_segments is not None

    @property
    def computed_tokens(self) -> int:
        """Positions the model computes for this micro-batch (the padded rectangle, or the pack)."""
        return int(self.input_ids.numel())

    @property
    def num_rows(self) -> int:
        return len(self.rows)

    @property
    def position_ids(self) -> torch.Tensor:
        """Positions of the packed tokens: 0.. per row (= cumsum(attention_mask) - 1 of the original);
        0.. per sequence in the THD layout; each response continuing its prompt with shared prompts; mRoPE's
        [3, b', W] for a vision-language model."""
        if self.mrope_positions is not None:
            return self.mrope_positions
        if self.is_shared:
            return self.shared_positions
        if self.is_thd:
            lengths = (self.cu_seqlens[1:] - self.cu_seqlens[:-1]).long()
            starts = torch.repeat_interleave(self.cu_seqlens[:-1].long(), lengths)
            positions = torch.arange(int(self.cu_seqlens[-1]), device=self.input_ids.device) - starts
            return (positions if self.cp is None else positions[self.cp.positions])[None, :]
        return torch.arange(self.input_ids.shape[1], device=self.input_ids.device).expand_as(self.input_ids)

    def packed_seq_params(self):
        """Megatron's PackedSeqParams (qkv_format thd) of a THD micro-batch, else None."""
        if not self.is_thd:
            return None
        from megatron.core import parallel_state
        from megatron.core.packed_seq_params import PackedSeqParams

        lengths = self.cu_seqlens[1:] - self.cu_seqlens[:-1]
        longest = int(lengths.max()) if len(lengths) else 0
        return PackedSeqParams(
            qkv_format="thd", cu_seqlens_q=self.cu_seqlens, cu_seqlens_kv=self.cu_seqlens,
            max_seqlen_q=longest, max_seqlen_kv=longest, cp_group=parallel_state.get_context_parallel_group(),
        )

    @property
    def owned_tokens(self) -> torch.Tensor | None:
        """[N] bool: the response tokens predicted on this CP rank (None without context parallelism)."""
        return None if self.cp is None else self.cp.owned(self.thd_index)

    @property
    def predicted_labels(self) -> torch.Tensor:
        """The labels of the response tokens ``select_predictors`` returns outputs for."""
        owned = self.owned_tokens
        return self.labels if owned is None else self.labels[owned]

    def select_predictors(self, output: torch.Tensor) -> torch.Tensor:
        """[b', W, ...] model output ([1, T, ...] for THD) -> [N, ...] at the positions that predict the
        response tokens (under context parallelism: [n, ...], the n tokens predicted on this rank)."""
        if self.is_thd:
            if self.cp is not None:
                return output[0, self.cp.local_of[self.thd_index[self.owned_tokens]]]
            return output[0, self.thd_index]
        if self.is_shared:
            return output[self.predictor_rows, self.predictor_cols]
        return output[self.token_rows, self.predictor_cols]

    @property
    def padding(self) -> torch.Tensor | None:
        """[b', W] ([1, T] THD) bool, True at positions that hold no token: what Megatron's MoE router leaves out of
        its load-balancing and z losses and its expert-bias counts (``padding_mask``). None with shared prompts,
        whose rows have no padding of their own to leave out."""
        if self.is_thd:
            return self.thd_padding
        return None if self.is_shared else ~self.attention_mask.bool()

    def attention_blocked(self) -> torch.Tensor:
        """The [b', 1, W, W] bool mask (True = blocked) of the padded and shared-prompt layouts."""
        # megatron-core (models/attention.py imports it): packing itself loads without it (workers/__init__.py)
        from megatron_rl.models.attention import causal_padding_mask, shared_prompt_mask

        if self.is_shared:
            return shared_prompt_mask(self.shared_segments)
        return causal_padding_mask(self.attention_mask)

    def scatter(self, per_token: torch.Tensor) -> torch.Tensor:
        """[N, ...] per-token values (those of ``select_predictors``) -> [b, R, ...], 0 where the response is
        padding (differentiable). Under context parallelism every CP rank gets the whole [b, R, ...]."""
        out = per_token.new_zeros(self.num_rows, self.response_len, *per_token.shape[1:])
        owned = self.owned_tokens
        if owned is None:
            return out.index_put((self.token_rows, self.token_cols), per_token)
        out = out.index_put((self.token_rows[owned], self.token_cols[owned]), per_token)
        return sum_over_cp(out, self.cp.group)

    def take(self, output: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """A THD pack's output at global pack ``positions``: [1, T, ...] -> [n, ...] (differentiable; under
        context parallelism each rank reads the positions it holds and every rank gets all n)."""
        if self.cp is None:
            return output[0, positions]
        local = self.cp.local_of[positions]
        owned = (local >= 0).reshape(-1, *([1] * (output.dim() - 2)))
        return sum_over_cp(torch.where(owned, output[0, local.clamp(min=0)], 0.0), self.cp.group)


def pack_micro_batch(
    batch: dict[str, torch.Tensor],
    rows: torch.Tensor,
    field_keys: tuple[str, ...] = (),
    shape: tuple[int, int] | None = None,
) -> PackedMicroBatch:
    """Pack ``rows`` of ``batch`` (input_ids, attention_mask, responses; see batch_checks.py).

    ``field_keys`` name the [B, R] tensors to carry along (sliced to these rows) for the loss.
    ``shape`` = (rows, width) fixes the packed rectangle instead of (len(rows), longest row): extra
    rows are empty (all padding, no response token, so they add nothing to any output or loss).
    """
    ids = batch["input_ids"][rows]
    real = batch["attention_mask"][rows].bool()
    responses = batch["responses"][rows]
    seq_len, response_len = ids.shape[1], responses.shape[1]
    prompt_len = seq_len - response_len

    longest = max(int(real.sum(dim=1).max()), 1)
    num_rows, width = shape if shape is not None else (len(rows), longest)
    if width < longest or num_rows < len(rows):
        raise ValueError(
            f"pack_micro_batch: shape {shape} cannot hold {len(rows)} rows of up to {longest} real tokens"
        )
    # Stable sort on "is padding" puts each row's real tokens first, in their original order.
    order = torch.sort((~real).to(torch.int8), dim=1, stable=True).indices[:, :width]
    packed_real = torch.zeros(num_rows, width, dtype=torch.bool, device=ids.device)
    packed_real[: len(rows), : order.shape[1]] = real.gather(1, order)
    packed_ids = torch.zeros(num_rows, width, dtype=ids.dtype, device=ids.device)
    packed_ids[: len(rows), : order.shape[1]] = ids.gather(1, order)

    # The packed column of original column c is (real tokens up to and including c) - 1.
    packed_col = real.long().cumsum(dim=1) - 1
    response_real = real[:, prompt_len:]
    token_rows, token_cols = response_real.nonzero(as_tuple=True)
    predictor_cols = packed_col[:, prompt_len:][token_rows, token_cols] - 1
    return PackedMicroBatch(
        rows=rows,
        input_ids=packed_ids.masked_fill(~packed_real, 0),
        attention_mask=packed_real,
        token_rows=token_rows,
        token_cols=token_cols,
        predictor_cols=predictor_cols,
        labels=responses[token_rows, token_cols],
        response_len=response_len,
        fields={key: batch[key][rows] for key in field_keys},
    )


def real_token_counts(batch: dict[str, torch.Tensor]) -> list[int]:
    """Real tokens per row: the length that packing leaves and the token budget counts."""
    return batch["attention_mask"].bool().sum(dim=1).tolist()


def thd_size(lengths: torch.Tensor, multiple: int = 1, cp_size: int = 1) -> tuple[torch.Tensor, int]:
    """Each sequence's length in a THD pack and the pack's length before any ``total``: under context
    parallelism every sequence is padded at its end to a multiple of 2 x CP x ``multiple`` (equal chunks,
    each a multiple of TP under sequence parallelism); the pack is rounded up to that same unit."""
    unit = multiple * (2 * cp_size if cp_size > 1 else 1)
    padded = -(-lengths // unit) * unit if cp_size > 1 else lengths
    return padded, -(-max(int(padded.sum()), 1) // unit) * unit


def to_thd(
    micro_batch: PackedMicroBatch, multiple: int = 1, total: int | None = None,
    cp: tuple[Any, int, int] | None = None,
) -> PackedMicroBatch:
    """The same micro-batch as packed sequences (THD): each row's real tokens one after the other in a
    single [1, T] row, ``cu_seqlens`` marking where each sequence starts. No position is padding except
    a trailing pad sequence when T is rounded up to ``multiple`` (sequence parallelism splits T over TP)
    or to ``total`` (one shape for every micro-batch, as the interleaved schedule needs).

    ``cp`` = (group, size, rank) with size > 1: context parallelism. Each sequence is padded at its end to
    a multiple of 2 x CP x ``multiple`` and this rank keeps its two chunks of each (ContextParallelShard)."""
    cp_group, cp_size, cp_rank = cp if cp is not None else (None, 1, 0)
    real = micro_batch.attention_mask.bool()
    lengths = real.sum(dim=1)
    padded, size = thd_size(lengths, multiple, cp_size)
    if total is not None and total < int(padded.sum()):
        raise ValueError(f"to_thd: a total of {total} positions cannot hold {int(padded.sum())} tokens")
    size = max(size, total or 0)
    device = micro_batch.input_ids.device
    starts = torch.cumsum(padded, 0) - padded
    ids = torch.zeros(1, size, dtype=micro_batch.input_ids.dtype, device=device)
    row, col = real.nonzero(as_tuple=True)  # row-major: row 0's tokens, then row 1's, ...
    ids[0, starts[row] + col] = micro_batch.input_ids[real]
    padding = torch.ones(1, size, dtype=torch.bool, device=device)
    padding[0, starts[row] + col] = False
    bounds = [0] + torch.cumsum(padded, 0).tolist()
    if size > bounds[-1]:
        bounds.append(size)  # the pad sequence: attends only to itself, predicts nothing
    cu_seqlens = torch.tensor(bounds, dtype=torch.int32, device=device)
    # Keep only non-empty sequences' boundaries (rows added as padding have no tokens).
    cu_seqlens = torch.unique_consecutive(cu_seqlens)
    num_rows = micro_batch.num_rows
    shard = None
    if cp_size > 1:
        positions = local_pack_positions(cu_seqlens, cp_size, cp_rank)
        local_of = torch.full((size,), -1, dtype=torch.long, device=device)
        local_of[positions] = torch.arange(len(positions), device=device)
        shard = ContextParallelShard(cp_group, cp_size, cp_rank, local_of, positions)
        ids, padding = ids[:, positions], padding[:, positions]
    return PackedMicroBatch(
        rows=micro_batch.rows,
        input_ids=ids,
        attention_mask=torch.ones_like(ids, dtype=torch.bool),
        token_rows=micro_batch.token_rows,
        token_cols=micro_batch.token_cols,
        predictor_cols=micro_batch.predictor_cols,
        labels=micro_batch.labels,
        response_len=micro_batch.response_len,
        fields=micro_batch.fields,
        cu_seqlens=cu_seqlens,
        thd_index=starts[micro_batch.token_rows] + micro_batch.predictor_cols,
        last_index=starts[:num_rows] + lengths[:num_rows] - 1,
        cp=shard,
        thd_padding=padding,
    )
