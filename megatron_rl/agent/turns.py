"""What the agent loop and the agent proxy share: one engine call for the next model turn of several token contexts,
and the record of a sample's tokens after its prompt.

Contexts are token ids (prompt + every earlier turn, never re-tokenized), left-padded into one batch. A turn's
tokens keep the weight version that sampled each of them: the server clients' per-token
``token_weight_versions`` (a partial rollout resumed after a weight swap mixes two), else the batch's
``weight_version``. Observation tokens (tool results, user messages) take the version of the turn before them; they
are out of the loss either way.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from megatron_rl.protocol import DataProto

__all__ = ["GenerateFn", "TokenRecord", "Turn", "generate_turns", "record_routing", "record_tensors"]

GenerateFn = Callable[[DataProto], DataProto]


@dataclass(frozen=True)
class Turn:
    """What the engine generated for one context: its tokens, their log-probs and weight versions (one per token;
    empty when the engine reports none)."""

    tokens: list[int]
    log_probs: list[float]
    versions: list[int]
    # with routing replay (R3): the experts the engine routed each token of context + turn through,
    # [len(context) + len(tokens), layers, k] (-1 on the last token, never fed back); None otherwise
    routed: torch.Tensor | None = None


def generate_turns(generate_fn: GenerateFn, contexts: Sequence[Sequence[int]], max_new_tokens: Sequence[int],
                   meta: Mapping[str, Any], pad_token_id: int) -> list[Turn]:
    """One ``generate_fn`` call; each context's turn cut to its own ``max_new_tokens`` (the call asks the largest)."""
    width = max(len(c) for c in contexts)
    ids = torch.full((len(contexts), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(contexts), width), dtype=torch.long)
    for row, context in enumerate(contexts):
        ids[row, width - len(context):] = torch.as_tensor(list(context), dtype=torch.long)
        mask[row, width - len(context):] = 1
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    out = generate_fn(DataProto.from_dict({"input_ids": ids, "attention_mask": mask, "position_ids": position_ids},
                                          meta_info={**meta, "response_length": max(max_new_tokens)}))
    responses = out.batch["responses"].cpu()
    lengths = out.batch["response_mask"].sum(-1).cpu().tolist()
    log_probs = out.batch["rollout_log_probs"].float().cpu()
    per_token = out.non_tensor_batch.get("token_weight_versions")
    version = out.meta_info.get("weight_version")
    routed = out.batch.get("routed_experts")
    turns = []
    for row, room in enumerate(max_new_tokens):
        n = min(int(lengths[row]), int(room))
        if per_token is not None:
            versions = [int(v) for v in per_token[row][:n]]
        else:
            versions = [int(version)] * n if version is not None else []
        row_routed = None
        if routed is not None:  # [context | turn] of the row; a turn cut short loses its last token's routing
            row_routed = routed[row, width - len(contexts[row]):width + n].clone()
            row_routed[-1] = -1
        turns.append(Turn(responses[row, :n].tolist(), log_probs[row, :n].tolist(), versions, row_routed))
    return turns


@dataclass(kw_only=True)
class TokenRecord:
    """A sample's tokens after its prompt, in order: model turns (mask 1, the engine's log-probs) and observations
    (mask 0, log-prob 0), each token's weight version (-1 before any is known)."""

    tokens: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    # R3: the last turn's routing, which covers the prompt and every token but the last (each turn's prefill
    # routes the whole context again, with the weights every earlier turn had: the synchronous trainer's)
    routed: torch.Tensor | None = None

    def add_turn(self, turn: Turn) -> None:
        if turn.routed is not None:
            self.routed = turn.routed
        self.tokens += turn.tokens
        self.mask += [1] * len(turn.tokens)
        self.log_probs += list(turn.log_probs)
        self.versions += list(turn.versions) if turn.versions else [self._last_version()] * len(turn.tokens)

    def add_observation(self, tokens: list[int]) -> None:
        self.tokens += tokens
        self.mask += [0] * len(tokens)
        self.log_probs += [0.0] * len(tokens)
        self.versions += [self._last_version()] * len(tokens)

    def _last_version(self) -> int:
        return self.versions[-1] if self.versions else -1


def record_tensors(records: Sequence[TokenRecord], budget: int, pad_token_id: int) -> dict[str, Any]:
    """The records right-padded to ``budget``: ``responses``, ``response_attention`` (1 on every recorded token),
    ``response_mask``, ``rollout_log_probs`` [B, budget]; ``token_weight_versions`` (an object array of int64 rows)
    and per-sample ``weight_version`` (its oldest model token's; -1 when unknown)."""
    b = len(records)
    out = {"responses": torch.full((b, budget), pad_token_id, dtype=torch.long),
           "response_attention": torch.zeros((b, budget), dtype=torch.long),
           "response_mask": torch.zeros((b, budget), dtype=torch.long),
           "rollout_log_probs": torch.zeros((b, budget), dtype=torch.float32)}
    versions = np.empty(b, dtype=object)
    oldest = np.full(b, -1, dtype=np.int64)
    for row, record in enumerate(records):
        n = len(record.tokens)
        out["responses"][row, :n] = torch.as_tensor(record.tokens, dtype=torch.long)
        out["response_attention"][row, :n] = 1
        out["response_mask"][row, :n] = torch.as_tensor(record.mask, dtype=torch.long)
        out["rollout_log_probs"][row, :n] = torch.as_tensor(record.log_probs, dtype=torch.float32)
        versions[row] = np.asarray(record.versions, dtype=np.int64)
        sampled = [v for v, m in zip(record.versions, record.mask) if m and v >= 0]
        oldest[row] = min(sampled) if sampled else -1
    out["token_weight_versions"], out["weight_version"] = versions, oldest
    return out


def record_routing(records: Sequence[TokenRecord], prompt_lengths: Sequence[int], prompt_width: int,
                   budget: int) -> torch.Tensor | None:
    """R3's ``routed_experts`` [B, prompt_width + budget, layers, k] of records laid out as [left-padded prompt |
    right-padded responses] (-1 on padding and unfed tokens); None when no record has routing."""
    routed = [r.routed for r in records]
    if all(r is None for r in routed):
        return None
    if any(r is None for r in routed):
        raise ValueError("routing replay: some samples' turns carry routed_experts and others none")
    shape = routed[0].shape[1:]
    out = torch.full((len(records), prompt_width + budget, *shape), -1, dtype=routed[0].dtype)
    for row, (record, length) in enumerate(zip(records, prompt_lengths)):
        covered = record.routed[: length + len(record.tokens)]
        out[row, prompt_width - length:prompt_width - length + len(covered)] = covered
    return out
