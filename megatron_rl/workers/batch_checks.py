"""Check a role's input batch before any model work, so a bad field fails with its name and shape.

Layout (verl's): ``input_ids``/``attention_mask``/``position_ids`` are [B, P+R] with the prompt
left-padded and the response right-padded; ``responses`` is [B, R] and equals the last R columns of
``input_ids``; every per-response-token field (``response_mask``, ``old_log_probs``, ``advantages``,
...) is [B, R].
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from megatron_rl.protocol import DataProto

SEQUENCE_KEYS = ("input_ids", "attention_mask", "position_ids")
RESPONSE_KEYS = (
    "responses",
    "response_mask",
    "old_log_probs",
    "ref_log_prob",
    "rollout_log_probs",
    "advantages",
    "returns",
    "values",
)


@dataclass(frozen=True)
class BatchShape:
    batch_size: int
    seq_len: int  # P + R
    response_len: int  # R


def _rows(mask: torch.Tensor, limit: int = 5) -> list[int]:
    return mask.nonzero().flatten()[:limit].tolist()


def check_batch(data: DataProto, required: Iterable[str], where: str) -> BatchShape:
    """Validate ``data`` for ``where`` (e.g. ``"update_actor"``); return its shape or raise ValueError.

    Checks: input_ids, attention_mask, responses and every ``required`` field are present;
    sequence fields are [B, P+R] like ``input_ids``;
    response fields are [B, R] like ``responses``; ``responses`` are the last R columns of
    ``input_ids``; ``response_mask`` only marks real tokens; every row with a real response token
    has a real prompt token before it; ``position_ids`` count the real tokens (the model's RoPE
    uses the token order, so other positions would be silently ignored).
    """
    required = ("input_ids", "attention_mask", "responses", *required)
    data.require(*dict.fromkeys(required), where=where)
    batch = data.batch
    for key in ("input_ids", "responses"):
        if key in batch and batch[key].dim() != 2:
            raise ValueError(
                f"{where}: batch[{key!r}] must be 2-D [batch, tokens], got shape {tuple(batch[key].shape)}"
            )
    ids, responses = batch["input_ids"], batch["responses"]
    size, seq_len = ids.shape
    response_len = responses.shape[1]
    if response_len >= seq_len:
        raise ValueError(
            f"{where}: responses has {response_len} columns but input_ids only {seq_len}; "
            "input_ids must be the prompt followed by the response"
        )
    for key in SEQUENCE_KEYS:
        if key in batch and tuple(batch[key].shape) != (size, seq_len):
            raise ValueError(
                f"{where}: batch[{key!r}] has shape {tuple(batch[key].shape)}, "
                f"expected {(size, seq_len)} like input_ids"
            )
    for key in RESPONSE_KEYS:
        if key in batch and tuple(batch[key].shape) != (size, response_len):
            raise ValueError(
                f"{where}: batch[{key!r}] has shape {tuple(batch[key].shape)}, "
                f"expected {(size, response_len)} (batch, response length) like responses"
            )
    mismatch = (ids[:, seq_len - response_len :] != responses).any(dim=1)
    if mismatch.any():
        raise ValueError(
            f"{where}: batch['responses'] differs from the last {response_len} columns of batch['input_ids'] "
            f"in rows {_rows(mismatch)}"
        )
    real = batch["attention_mask"].bool()
    if "response_mask" in batch:
        outside = (batch["response_mask"].bool() & ~real[:, seq_len - response_len :]).any(dim=1)
        if outside.any():
            raise ValueError(
                f"{where}: batch['response_mask'] is 1 where batch['attention_mask'] is 0 (padding) "
                f"in rows {_rows(outside)}"
            )
    has_response = real[:, seq_len - response_len :].any(dim=1)
    no_prompt = has_response & ~real[:, : seq_len - response_len].any(dim=1)
    if no_prompt.any():
        raise ValueError(
            f"{where}: rows {_rows(no_prompt)} have response tokens but no prompt token in attention_mask; "
            "the first response token needs a token before it to be predicted from"
        )
    if "position_ids" in batch:
        expected = (real.long().cumsum(dim=1) - 1).clamp(min=0)
        wrong = ((batch["position_ids"] != expected) & real).any(dim=1)
        if wrong.any():
            raise ValueError(
                f"{where}: batch['position_ids'] must count the real tokens (cumsum(attention_mask) - 1); "
                f"rows {_rows(wrong)} differ (custom positions are not supported: the model's RoPE "
                "follows token order)"
            )
    return BatchShape(size, seq_len, response_len)


def read_temperature(data: DataProto, where: str) -> float:
    """The sampling temperature the responses were generated with (``meta_info['temperature']``).

    Required rather than defaulted: log-probs at the wrong temperature are silently wrong.
    """
    if "temperature" not in data.meta_info:
        raise ValueError(
            f"{where}: meta_info['temperature'] is missing; set it to the rollout's sampling temperature "
            f"(meta_info has {sorted(data.meta_info)})"
        )
    temperature = data.meta_info["temperature"]
    if not isinstance(temperature, (int, float)) or not temperature > 0:
        raise ValueError(f"{where}: meta_info['temperature'] must be a number > 0, got {temperature!r}")
    return float(temperature)
