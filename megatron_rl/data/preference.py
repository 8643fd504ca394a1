"""Preference rows (verl / TRL / NeMo-RL style) as pairs of SFT examples (issue 55: the data side of DPO).

A row holds a prompt (``prompt_key``: a string, the user's message, or a list of chat messages) and two answers,
``chosen_key`` and ``rejected_key`` (each a string, the assistant's answer, or a list of messages: the assistant
turn(s) that follow the prompt). Each side is the conversation prompt + answer, encoded as an SFT row (data/sft.py
``encode_conversation``); its loss mask is on the answer's assistant tokens only (an assistant turn inside a
multi-turn prompt is context). A batch holds 2B rows in ``sft_batch``'s layout, the chosen then the rejected side of
each pair, with ``pair_index`` (the pair's place in the batch) and ``chosen`` (1 on the chosen side).

A row is refused naming its file and row when a side is missing or not text/messages, when an answer has no
assistant message, when a side is longer than ``max_length`` under ``truncation=error``, or when truncation left a
side no answer token. Identical chosen and rejected answers are allowed (their loss gradient is 0).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from megatron_rl.data.rows import encoded_rows
from megatron_rl.data.sft import TRUNCATIONS, SFTExample, encode_conversation, sft_batch, truncated
from megatron_rl.protocol import DataProto

__all__ = ["PreferencePair", "PreferenceDataset", "encode_side", "preference_batch"]


@dataclass(frozen=True)
class PreferencePair:
    chosen: SFTExample
    rejected: SFTExample
    location: str


def _messages(value: Any, role: str, what: str) -> list[dict]:
    """A string as one ``role`` message, or a list of {role, content} messages as they are."""
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    if (isinstance(value, Sequence) and value and all(isinstance(m, Mapping) and "role" in m and "content" in m
                                                      for m in value)):
        return [dict(m) for m in value]
    raise ValueError(f"{what} must be a string or a non-empty list of {{'role', 'content'}} messages, "
                     f"got {type(value).__name__}")


def encode_side(tokenizer: Any, prompt: list[dict], answer: list[dict], max_length: int, truncation: str,
                tools: Any = None) -> tuple[list[int], list[int]]:
    """(token ids of prompt + answer, loss mask on the answer's assistant tokens), truncated to ``max_length``;
    ValueError when the answer has no assistant message, is too long (truncation=error) or loses every token."""
    if not any(m["role"] == "assistant" for m in answer):
        raise ValueError("has no assistant message: nothing to prefer")
    ids, mask = encode_conversation(tokenizer, prompt + answer, tools)
    # the prompt's own assistant turns are context: the answer starts after the prompt rendered with the generation
    # prompt (encode_conversation checked that this rendering is a prefix of the whole conversation)
    text = tokenizer.apply_chat_template(prompt, tools=tools, tokenize=False, add_generation_prompt=True)
    start = len(tokenizer.encode(text, add_special_tokens=False))
    mask = [0] * start + mask[start:]
    ids, mask = truncated(ids, mask, max_length, truncation, prefix="")
    if not any(mask[1:]):  # the first token is never a target (sft_batch)
        raise ValueError(f"truncation to max_length={max_length} ({truncation}) left no answer token")
    return ids, mask


class PreferenceDataset(torch.utils.data.Dataset):
    """Preference files (parquet or jsonl) as ``PreferencePair`` items, every row checked and encoded at build time.
    ``max_length`` and ``truncation`` apply to each side (prompt + answer) alone."""

    def __init__(self, files: str | Path | Sequence[str | Path], tokenizer: Any, *, max_length: int = 1024,
                 truncation: str = "error", prompt_key: str = "prompt", chosen_key: str = "chosen",
                 rejected_key: str = "rejected", tools_key: str = "tools") -> None:
        if truncation not in TRUNCATIONS:
            raise ValueError(f"truncation={truncation!r}: one of {list(TRUNCATIONS)}")
        keys = (prompt_key, chosen_key, rejected_key)
        self.pairs: list[PreferencePair] = encoded_rows(
            files, lambda location, row: self._encode(location, row, tokenizer, max_length, truncation, keys,
                                                      tools_key), "preference")

    @staticmethod
    def _encode(location: str, row: dict, tokenizer: Any, max_length: int, truncation: str,
                keys: tuple[str, str, str], tools_key: str) -> PreferencePair:
        missing = [key for key in keys if row.get(key) is None]  # (a parquet file holds null where a row lacks one)
        if missing:
            present = sorted(k for k, v in row.items() if v is not None)
            raise ValueError(f"has no {' / '.join(map(repr, missing))} column (a preference row holds the prompt, "
                             f"the chosen and the rejected answer: {list(keys)}); its keys: {present}")
        prompt = _messages(row[keys[0]], "user", repr(keys[0]))
        sides = []
        for key in keys[1:]:
            try:
                answer = _messages(row[key], "assistant", "the answer")
                sides.append(SFTExample(*encode_side(tokenizer, prompt, answer, max_length, truncation,
                                                     row.get(tools_key)), location))
            except ValueError as err:
                raise ValueError(f"{key!r}: {err}") from None
        return PreferencePair(sides[0], sides[1], location)

    def __len__(self) -> int:
        return len(self.pairs)

    def __getitem__(self, index: int) -> PreferencePair:
        return self.pairs[index]


def preference_batch(pairs: Sequence[PreferencePair], pad_token_id: int) -> DataProto:
    """2B rows in ``sft_batch``'s layout: pair i's chosen side at row 2i, its rejected side at 2i + 1, with
    ``pair_index`` [2B] (i) and ``chosen`` [2B] (1 for the chosen side)."""
    out = sft_batch([side for pair in pairs for side in (pair.chosen, pair.rejected)], pad_token_id)
    out.batch["pair_index"] = torch.arange(len(pairs)).repeat_interleave(2)
    out.batch["chosen"] = torch.tensor([1, 0] * len(pairs))
    return out


def synthetic_pairs(rows: Sequence[Mapping[str, Any]], seed: int = 0) -> list[dict[str, Any]]:
    """Preference rows from data/tasks rows: the prompt, the right answer as ``chosen`` and the answer with one
    character changed (a digit to another digit) as ``rejected``: the tiny preset's data (docs/dpo.md)."""
    import random  # only this helper draws

    rng, out = random.Random(seed), []
    for row in rows:
        answer = str(row["extra_info"].get("answer", row["reward_model"]["ground_truth"]))
        at = rng.randrange(len(answer))
        old = answer[at]
        new = rng.choice([d for d in "0123456789" if d != old]) if old.isdigit() else "0"
        out.append({"prompt": list(row["prompt"]), "chosen": answer, "rejected": answer[:at] + new + answer[at + 1:]})
    return out
