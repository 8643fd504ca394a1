"""verl's SFT rows as token ids and a loss mask on the assistant's tokens (issue 55: the data side of SFT).

A row is a conversation: verl's multi-turn column (``messages_key``, default ``messages``: a list of ``{"role",
"content"}``, optionally with the row's ``tools`` for the template) or verl's single-turn pair (``prompt_key`` /
``response_key``: a user message and the assistant's answer). The whole conversation is rendered once by the
tokenizer's chat template and tokenized; the loss is on each assistant message's tokens: from the end of the
conversation before it, rendered with the generation prompt (``<|im_start|>assistant\\n`` is context, not
target), to the end of the conversation through it (its content and end-of-turn tokens: ``<|im_end|>\\n``).
That is verl's MultiTurnSFTDataset mask, found from renderings of the conversation's own prefixes rather than of
each message alone, so a template's default system prompt or per-turn headers need no special case.

A template that renders an earlier part of the conversation differently once later turns follow (e.g. one that
strips a past turn's reasoning) cannot be masked this way: the row is refused naming it, as verl refuses it unless
told to ignore the mismatch. So is a row with no assistant message, and one longer than ``max_length`` under
``truncation=error`` (``left`` / ``right`` cut it, as verl does).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from megatron_rl.data.rows import encoded_rows
from megatron_rl.protocol import DataProto

__all__ = ["SFTExample", "SFTDataset", "collate_sft", "conversation_of", "encode_conversation", "sft_batch",
           "truncated"]

TRUNCATIONS = ("error", "left", "right")


@dataclass(frozen=True)
class SFTExample:
    """One row: its tokens and the loss mask (1 on assistant tokens), both unpadded, and where it came from."""

    input_ids: list[int]
    loss_mask: list[int]
    location: str


def conversation_of(row: Mapping[str, Any], messages_key: str, prompt_key: str, response_key: str) -> list[dict]:
    """The row's messages: ``messages_key`` when the row has it, else the ``prompt_key`` / ``response_key`` pair."""
    if row.get(messages_key) is not None:  # (a parquet file holds null where a row lacks a column)
        messages = row[messages_key]
        if not isinstance(messages, Sequence) or isinstance(messages, str) or not all(
                isinstance(m, Mapping) and "role" in m and "content" in m for m in messages):
            raise ValueError(f"{messages_key!r} must be a list of {{'role', 'content'}} messages")
        return [dict(m) for m in messages]
    if row.get(prompt_key) is not None and row.get(response_key) is not None:
        return [{"role": "user", "content": str(row[prompt_key])},
                {"role": "assistant", "content": str(row[response_key])}]
    keys = sorted(k for k, v in row.items() if v is not None)
    raise ValueError(f"has neither {messages_key!r} (data.messages_key) nor both {prompt_key!r} / {response_key!r} "
                     f"(data.prompt_key / data.response_key); its keys: {keys}")


def _render(tokenizer: Any, messages: list[dict], tools: Any, generation: bool, kwargs: Mapping[str, Any]) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=generation,
                                         **kwargs)
    return list(tokenizer.encode(text, add_special_tokens=False))


def encode_conversation(tokenizer: Any, messages: list[dict], tools: Any = None,
                        template_kwargs: Mapping[str, Any] | None = None) -> tuple[list[int], list[int]]:
    """(token ids of the whole conversation, loss mask: 1 on each assistant message's tokens); ValueError when the
    conversation has no assistant message or the template renders a prefix of it otherwise than the whole."""
    kwargs = dict(template_kwargs or {})
    full = _render(tokenizer, messages, tools, False, kwargs)
    mask = [0] * len(full)
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if not turns:
        raise ValueError("has no assistant message: nothing to train on")
    for i in turns:
        start = _render(tokenizer, messages[:i], tools, True, kwargs) if i else []
        end = _render(tokenizer, messages[:i + 1], tools, False, kwargs)
        for name, prefix in (("the conversation before it, with the generation prompt", start),
                             ("the conversation through it", end)):
            if full[:len(prefix)] != prefix:
                raise ValueError(
                    f"message {i} (assistant): the chat template renders {name} otherwise than the same turns inside "
                    "the whole conversation (a template that rewrites earlier turns, e.g. strips their reasoning), "
                    "so its tokens cannot be masked; use a template that renders each turn the same")
        mask[len(start):len(end)] = [1] * (len(end) - len(start))
    return full, mask


def truncated(ids: list[int], mask: list[int], max_length: int, truncation: str,
              prefix: str = "data.") -> tuple[list[int], list[int]]:
    """``ids`` and ``mask`` cut to ``max_length`` as ``truncation`` says (``left`` keeps the end, ``right`` the
    start); ValueError for a longer row under ``error``. ``prefix``: how the refusal names the keys (the SFT
    dataset's data.*; the preference dataset's own arguments)."""
    if len(ids) > max_length:
        if truncation == "error":
            raise ValueError(f"{len(ids)} tokens, more than {prefix}max_length={max_length} ({prefix}truncation=error; "
                             "left or right cut it)")
        keep = slice(-max_length, None) if truncation == "left" else slice(0, max_length)
        ids, mask = ids[keep], mask[keep]
    return ids, mask


class SFTDataset(torch.utils.data.Dataset):
    """verl's SFT files (parquet or jsonl) as ``SFTExample`` items, every row checked and encoded at build time."""

    def __init__(self, files: str | Path | Sequence[str | Path], tokenizer: Any, *, max_length: int = 1024,
                 truncation: str = "error", messages_key: str = "messages", prompt_key: str = "prompt",
                 response_key: str = "response", tools_key: str = "tools",
                 template_kwargs: Mapping[str, Any] | None = None) -> None:
        if truncation not in TRUNCATIONS:
            raise ValueError(f"data.truncation={truncation!r}: one of {list(TRUNCATIONS)}")
        if max_length < 2:
            raise ValueError(f"data.max_length={max_length}: at least 2 tokens")
        keys = (messages_key, prompt_key, response_key)
        self.examples: list[SFTExample] = encoded_rows(
            files, lambda location, row: self._encode(location, row, tokenizer, max_length, truncation, keys,
                                                      tools_key, template_kwargs), "SFT")

    @staticmethod
    def _encode(location: str, row: dict, tokenizer: Any, max_length: int, truncation: str,
                keys: tuple[str, str, str], tools_key: str, template_kwargs: Mapping[str, Any] | None) -> SFTExample:
        """One row as an example; ValueError saying what is wrong with it (``encoded_rows`` names the row)."""
        messages = conversation_of(row, *keys)
        ids, mask = encode_conversation(tokenizer, messages, row.get(tools_key), template_kwargs)
        ids, mask = truncated(ids, mask, max_length, truncation)
        if not any(mask):
            raise ValueError(f"truncation to data.max_length={max_length} ({truncation}) left no assistant token")
        return SFTExample(ids, mask, location)

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, index: int) -> SFTExample:
        return self.examples[index]


def collate_sft(examples: Sequence[SFTExample], pad_token_id: int) -> dict[str, torch.Tensor]:
    """Right-padded ``input_ids``, ``attention_mask``, ``position_ids`` and ``loss_mask`` [B, longest]."""
    width = max(len(e.input_ids) for e in examples)
    out = {"input_ids": torch.full((len(examples), width), pad_token_id, dtype=torch.long),
           "attention_mask": torch.zeros((len(examples), width), dtype=torch.long),
           "loss_mask": torch.zeros((len(examples), width), dtype=torch.long)}
    for row, example in enumerate(examples):
        n = len(example.input_ids)
        out["input_ids"][row, :n] = torch.as_tensor(example.input_ids)
        out["attention_mask"][row, :n] = 1
        out["loss_mask"][row, :n] = torch.as_tensor(example.loss_mask)
    out["position_ids"] = (out["attention_mask"].cumsum(-1) - 1).clamp(min=0)
    return out


def sft_batch(examples: Sequence[SFTExample], pad_token_id: int) -> DataProto:
    """The rows as the trainer's batch (workers/sft.py): the RL layout with the first token as the prompt and the
    rest as the response, ``response_mask`` the loss mask of those tokens (the first token is never a target: a
    conversation opens with the template's header). ``row_location`` names each row's file and row."""
    padded = collate_sft(examples, pad_token_id)
    out = DataProto.from_dict({
        "input_ids": padded["input_ids"], "attention_mask": padded["attention_mask"],
        "position_ids": padded["position_ids"], "responses": padded["input_ids"][:, 1:],
        "response_mask": padded["loss_mask"][:, 1:]})
    out.non_tensor_batch["row_location"] = np.array([e.location for e in examples], dtype=object)
    return out
