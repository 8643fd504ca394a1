"""The policy's samples as token rows for the reward model (on the driver, before the RM is called).

- ``reward_model.model.input_tokenizer`` null (the RM shares the policy's tokenizer and chat template):
  each row is the sample's own real tokens, prompt and response up to its end.
- ``input_tokenizer`` set (verl's meaning: the policy's tokenizer, whose text the RM must re-read): the
  response is decoded with it (up to its last valid token, special tokens skipped), appended to the
  prompt's chat messages (``raw_prompt``) as the assistant turn, rendered with the RM tokenizer's own chat
  template and tokenized by it. The score is then the RM's score of that text, as if scored directly.

``reward_model.max_length`` bounds a row: longer rows keep their last ``max_length`` tokens (the score is
read at the last one), counted in ``reward/rm/truncated``.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from megatron_rl.protocol import DataProto
from megatron_rl.reward.manager import decode_responses


class RewardModelInputs:
    """Args:
    rm_tokenizer: the reward model's tokenizer (with its chat template), used when re-tokenizing.
    input_tokenizer: the policy's tokenizer to decode responses with; None: the rows keep the policy's tokens.
    max_length: at most this many tokens per RM row (None: no bound).
    """

    def __init__(
        self,
        rm_tokenizer: PreTrainedTokenizerBase,
        input_tokenizer: PreTrainedTokenizerBase | None = None,
        max_length: int | None = None,
    ) -> None:
        if max_length is not None and not (isinstance(max_length, int) and max_length >= 1):
            raise ValueError(f"reward_model.max_length must be a positive integer or null, got {max_length!r}")
        if input_tokenizer is not None and not rm_tokenizer.chat_template:
            raise ValueError(
                "reward_model.model.input_tokenizer is set (re-tokenize for the RM) but the RM tokenizer at "
                "reward_model.model.path has no chat template to render the conversation with"
            )
        self.rm_tokenizer = rm_tokenizer
        self.input_tokenizer = input_tokenizer
        self.max_length = max_length

    def __call__(self, data: DataProto) -> tuple[DataProto, dict[str, float]]:
        """RM rows (input_ids/attention_mask [B, L], right-padded) and ``reward/rm/truncated``."""
        rows = self.retokenized(data) if self.input_tokenizer is not None else self.policy_tokens(data)
        truncated = 0
        if self.max_length is not None:
            truncated = sum(len(row) > self.max_length for row in rows)
            rows = [row[-self.max_length :] for row in rows]
        return right_padded(rows, self.rm_tokenizer.pad_token_id or 0), {"reward/rm/truncated": float(truncated)}

    @staticmethod
    def policy_tokens(data: DataProto) -> list[list[int]]:
        data.require("input_ids", "attention_mask", where="reward model inputs")
        ids, mask = data.batch["input_ids"].cpu(), data.batch["attention_mask"].cpu().bool()
        return [row[keep].tolist() for row, keep in zip(ids, mask, strict=True)]

    def retokenized(self, data: DataProto) -> list[list[int]]:
        data.require("responses", "response_mask", "raw_prompt", where="reward model inputs (re-tokenized)")
        texts = decode_responses(self.input_tokenizer, data.batch["responses"], data.batch["response_mask"])
        return [
            self.tokenize_conversation(_messages(prompt, i), text)
            for i, (prompt, text) in enumerate(zip(data.non_tensor_batch["raw_prompt"], texts, strict=True))
        ]

    def tokenize_conversation(self, messages: list[dict[str, Any]], response: str) -> list[int]:
        """The RM's tokens of ``messages`` followed by ``response`` as the assistant's turn."""
        conversation = [*messages, {"role": "assistant", "content": response}]
        text = self.rm_tokenizer.apply_chat_template(conversation, tokenize=False)
        return self.rm_tokenizer(text, add_special_tokens=False)["input_ids"]


def _messages(prompt: Any, row: int) -> list[dict[str, Any]]:
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    messages = list(prompt)
    if not all(isinstance(m, dict) and "role" in m and "content" in m for m in messages):
        raise ValueError(
            f"reward model inputs: raw_prompt of row {row} must be chat messages ({{'role', 'content'}} dicts) "
            f"or a string, got {prompt!r:.80}"
        )
    return messages


def right_padded(rows: list[list[int]], pad_id: int) -> DataProto:
    """Token rows as one right-padded [B, max len] batch with its attention mask."""
    width = max((len(row) for row in rows), default=0)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(row, dtype=torch.long)
        mask[i, : len(row)] = 1
    return DataProto.from_dict({"input_ids": ids, "attention_mask": mask})
