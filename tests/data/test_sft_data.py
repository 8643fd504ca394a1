"""SFT rows (megatron_rl/data/sft.py): the loss mask is 1 exactly on each assistant message's content and end-of-turn
tokens, checked against a hand computation from the rendered text's character spans (the tokenizer's offsets), for
multi-turn rows, verl's prompt/response pairs and a template with a default system prompt; rows the template cannot
mask, rows without an assistant turn and overlong rows are refused naming the file and row."""

from __future__ import annotations

import copy

import pytest
import torch

from megatron_rl.data import MalformedRowError
from megatron_rl.data.sft import SFTDataset, collate_sft, encode_conversation

from data_rows import write_jsonl, write_parquet

CONVERSATION = [
    {"role": "system", "content": "Copy the digits."},
    {"role": "user", "content": "Copy: 123"},
    {"role": "assistant", "content": "123"},
    {"role": "user", "content": "Copy: 4567"},
    {"role": "assistant", "content": "4567 done"},
]


def hand_mask(tokenizer, messages: list[dict]) -> tuple[list[int], list[int]]:
    """The rendered conversation's tokens, 1 on those whose characters lie in an assistant message's
    "<content><|im_end|>\\n" (ChatML: what follows "<|im_start|>assistant\\n")."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    spans, cursor = [], 0
    for message in messages:
        block = f"<|im_start|>{message['role']}\n{message['content']}<|im_end|>\n"
        at = text.index(block, cursor)
        if message["role"] == "assistant":
            head = len(f"<|im_start|>{message['role']}\n")
            spans.append((at + head, at + len(block)))
        cursor = at + len(block)
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    mask = [int(any(a <= start and end <= b for a, b in spans)) for start, end in encoded["offset_mapping"]]
    return list(encoded["input_ids"]), mask


def test_multi_turn_masks_equal_the_hand_computation(tokenizer):
    ids, mask = encode_conversation(tokenizer, CONVERSATION)
    assert (ids, mask) == hand_mask(tokenizer, CONVERSATION)
    assert tokenizer.decode([t for t, m in zip(ids, mask) if m]) == "123<|im_end|>\n4567 done<|im_end|>\n"
    assert sum(mask) < len(ids) and mask[0] == 0


def test_a_default_system_prompt_of_the_template_needs_no_special_case(tokenizer):
    """A Qwen-like template that adds a system message when the conversation has none: the prefixes carry it too."""
    qwen_like = copy.deepcopy(tokenizer)
    qwen_like.chat_template = (
        "{% if messages[0]['role'] != 'system' %}<|im_start|>system\nYou are helpful.<|im_end|>\n{% endif %}"
        + tokenizer.chat_template)
    messages = CONVERSATION[1:]
    ids, mask = encode_conversation(qwen_like, messages)
    expected = hand_mask(qwen_like, [{"role": "system", "content": "You are helpful."}, *messages])
    assert (ids, mask) == expected


def test_a_template_that_rewrites_earlier_turns_is_refused(tokenizer, tmp_path):
    stripping = copy.deepcopy(tokenizer)  # drops every assistant turn but the last (as reasoning-stripping ones do)
    stripping.chat_template = (
        "{% for message in messages %}{% if message['role'] != 'assistant' or loop.last %}"
        "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    path = write_jsonl(tmp_path / "sft.jsonl", [{"messages": CONVERSATION}])
    with pytest.raises(MalformedRowError, match=r"sft.jsonl line 1: message 2 \(assistant\): the chat template "
                                                 r"renders .* otherwise than the same turns inside the whole"):
        SFTDataset(path, stripping)


def test_prompt_response_pairs_and_parquet_rows(tokenizer, tmp_path):
    path = write_parquet(tmp_path / "sft.parquet", [{"prompt": "Copy: 12", "response": "12"},
                                                    {"question": "Copy: 9", "answer": "9"}])
    with pytest.raises(MalformedRowError, match=r"sft.parquet row 1: has neither 'messages' .* nor both 'prompt' / "
                                                 r"'response'"):
        SFTDataset(path, tokenizer)
    dataset = SFTDataset(write_parquet(tmp_path / "pairs.parquet", [{"question": "Copy: 9", "answer": "9"}]),
                         tokenizer, prompt_key="question", response_key="answer")
    messages = [{"role": "user", "content": "Copy: 9"}, {"role": "assistant", "content": "9"}]
    assert (dataset[0].input_ids, dataset[0].loss_mask) == hand_mask(tokenizer, messages)


@pytest.mark.parametrize("row, message", [
    ({"messages": [{"role": "user", "content": "hi"}]}, r"line 1: has no assistant message"),
    ({"messages": "hi"}, r"line 1: 'messages' must be a list of \{'role', 'content'\} messages"),
    ("not json", r"line 1: .*"),
])
def test_bad_rows_are_refused_naming_file_and_row(tokenizer, tmp_path, row, message):
    path = write_jsonl(tmp_path / "bad.jsonl", [row])
    with pytest.raises(MalformedRowError, match=rf"bad.jsonl {message}"):
        SFTDataset(path, tokenizer)


def test_truncation_error_left_right(tokenizer, tmp_path):
    path = write_jsonl(tmp_path / "long.jsonl", [{"messages": CONVERSATION}])
    ids, mask = encode_conversation(tokenizer, CONVERSATION)
    with pytest.raises(MalformedRowError, match=rf"long.jsonl line 1: {len(ids)} tokens, more than "
                                                 r"data.max_length=10 \(data.truncation=error"):
        SFTDataset(path, tokenizer, max_length=10)
    left = SFTDataset(path, tokenizer, max_length=10, truncation="left")[0]
    assert (left.input_ids, left.loss_mask) == (ids[-10:], mask[-10:])
    short = 3  # the first tokens are the system message's: no assistant token survives a right cut
    with pytest.raises(MalformedRowError, match=r"left no assistant token"):
        SFTDataset(path, tokenizer, max_length=short, truncation="right")
    with pytest.raises(ValueError, match=r"data.truncation='middle': one of \['error', 'left', 'right'\]"):
        SFTDataset(path, tokenizer, truncation="middle")


def test_collate_right_pads_with_masks_and_positions(tokenizer, tmp_path):
    path = write_jsonl(tmp_path / "two.jsonl", [{"messages": CONVERSATION}, {"messages": CONVERSATION[1:3]}])
    dataset = SFTDataset(path, tokenizer)
    batch = collate_sft([dataset[0], dataset[1]], tokenizer.pad_token_id)
    n0, n1 = len(dataset[0].input_ids), len(dataset[1].input_ids)
    assert batch["input_ids"].shape == (2, n0) and n1 < n0
    assert batch["attention_mask"].sum(-1).tolist() == [n0, n1]
    assert batch["loss_mask"][1, n1:].sum() == 0 and batch["loss_mask"][1, :n1].tolist() == dataset[1].loss_mask
    assert torch.equal(batch["position_ids"][1, :n1], torch.arange(n1))
