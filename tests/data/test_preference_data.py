"""Preference rows (megatron_rl/data/preference.py): each side is the SFT encoding of prompt + answer with the loss mask
on the answer's assistant tokens only (a multi-turn prompt's assistant turn is context); the batch holds 2B rows, pair
i's chosen then rejected side, with pair_index and chosen; bad rows are refused naming the file and row."""

from __future__ import annotations

import pytest
import torch

from megatron_rl.data import MalformedRowError
from megatron_rl.data.preference import PreferenceDataset, preference_batch, synthetic_pairs
from megatron_rl.data.sft import encode_conversation
from megatron_rl.data.tasks import make_rows

from data_rows import write_jsonl, write_parquet

PROMPT = [{"role": "user", "content": "copy: 12"}, {"role": "assistant", "content": "12"},
          {"role": "user", "content": "copy: 345"}]


def answer_tokens(tokenizer, ids: list[int], mask: list[int]) -> str:
    return tokenizer.decode([t for t, m in zip(ids, mask) if m])


def test_each_side_is_prompt_plus_answer_masked_on_the_answer_only(tokenizer, tmp_path):
    path = write_jsonl(tmp_path / "pairs.jsonl", [
        {"prompt": PROMPT, "chosen": "345", "rejected": [{"role": "assistant", "content": "354"}]},
        {"prompt": "copy: 7", "chosen": "7", "rejected": "7"},  # identical sides: allowed
    ])
    data = PreferenceDataset(path, tokenizer)
    first = data[0]
    ids, sft_mask = encode_conversation(tokenizer, PROMPT + [{"role": "assistant", "content": "345"}])
    assert first.chosen.input_ids == ids
    assert answer_tokens(tokenizer, ids, sft_mask) == "12<|im_end|>\n345<|im_end|>\n"  # SFT masks both turns
    assert answer_tokens(tokenizer, ids, first.chosen.loss_mask) == "345<|im_end|>\n"  # DPO: the answer only
    assert answer_tokens(tokenizer, first.rejected.input_ids, first.rejected.loss_mask) == "354<|im_end|>\n"
    assert data[1].chosen == data[1].rejected and data[1].location.endswith("pairs.jsonl line 2")


def test_the_batch_holds_chosen_then_rejected_of_each_pair(tokenizer, tmp_path):
    rows = synthetic_pairs(make_rows("copy1", 3, 0, "train"))
    assert all(r["chosen"] != r["rejected"] and len(r["rejected"]) == 1 for r in rows)
    data = PreferenceDataset(write_parquet(tmp_path / "pairs.parquet", rows), tokenizer)
    batch = preference_batch([data[i] for i in range(3)], pad_token_id=tokenizer.pad_token_id)
    assert len(batch) == 6
    assert batch.batch["pair_index"].tolist() == [0, 0, 1, 1, 2, 2]
    assert batch.batch["chosen"].tolist() == [1, 0, 1, 0, 1, 0]
    for i in range(3):
        for row, side in ((2 * i, data[i].chosen), (2 * i + 1, data[i].rejected)):
            n = len(side.input_ids)
            assert batch.batch["input_ids"][row, :n].tolist() == side.input_ids
            assert batch.batch["response_mask"][row, : n - 1].tolist() == side.loss_mask[1:]
    assert torch.equal(batch.batch["responses"], batch.batch["input_ids"][:, 1:])


@pytest.mark.parametrize("row, message", [
    ({"prompt": "copy: 1", "chosen": "1"}, r"line 1: has no 'rejected' column .*its keys: \['chosen', 'prompt'\]"),
    ({"chosen": "1", "rejected": "2"}, r"line 1: has no 'prompt' column"),
    ({"prompt": "copy: 1", "chosen": 1, "rejected": "2"},
     r"line 1: 'chosen': the answer must be a string or a non-empty list"),
    ({"prompt": "copy: 1", "chosen": [{"role": "user", "content": "1"}], "rejected": "2"},
     r"line 1: 'chosen': has no assistant message"),
    ({"prompt": "copy: 1", "chosen": "1", "rejected": "2" * 40}, r"line 1: 'rejected': \d+ tokens, more than "
                                                                  r"max_length=24"),
])
def test_bad_rows_are_refused_naming_the_file_and_row(tokenizer, tmp_path, row, message):
    path = write_jsonl(tmp_path / "bad.jsonl", [row])
    with pytest.raises(MalformedRowError, match=f"bad.jsonl {message}"):
        PreferenceDataset(path, tokenizer, max_length=24)


def test_truncation_that_leaves_no_answer_token_is_refused(tokenizer, tmp_path):
    path = write_jsonl(tmp_path / "long.jsonl", [{"prompt": "copy: 1", "chosen": "1", "rejected": "2"},
                                                 {"prompt": "copy: " + "9" * 30, "chosen": "1", "rejected": "2"}])
    with pytest.raises(MalformedRowError, match=r"long.jsonl line 2: 'chosen': truncation to max_length=30 \(right\) "
                                                 r"left no answer token"):
        PreferenceDataset(path, tokenizer, max_length=30, truncation="right")
    kept = PreferenceDataset(path, tokenizer, max_length=30, truncation="left")  # the answer survives a left cut
    assert len(kept[1].chosen.input_ids) == 30 and sum(kept[1].chosen.loss_mask) >= 1
