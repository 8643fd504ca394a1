"""RM token rows on the driver: the policy's own tokens, or the text re-tokenized with the RM's template."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from megatron_rl_testing.tiny_models import make_tiny_tokenizer
from megatron_rl.protocol import DataProto
from megatron_rl.reward.model.inputs import RewardModelInputs


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return AutoTokenizer.from_pretrained(make_tiny_tokenizer(tmp_path_factory.mktemp("tok")))


def batch(tokenizer, raw_prompt=None) -> DataProto:
    """Two samples: prompt "xy" + response "ab" EOS, prompt "xyz" + response "c" (no EOS)."""
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    enc = {text: tokenizer(text, add_special_tokens=False)["input_ids"] for text in ("xy", "xyz", "ab", "c")}
    ids = torch.tensor([[pad, *enc["xy"], *enc["ab"], eos], [*enc["xyz"], *enc["c"], pad, pad]])
    mask = (ids != pad).long()
    responses, response_mask = ids[:, 3:], mask[:, 3:]
    raw = np.empty(2, dtype=object)
    raw[:] = raw_prompt or [[{"role": "user", "content": "hi"}], "plain prompt"]
    return DataProto.from_dict({"input_ids": ids, "attention_mask": mask, "responses": responses,
                                "response_mask": response_mask}, {"raw_prompt": raw})


def test_same_tokenizer_keeps_each_rows_real_tokens(tokenizer):
    rows, metrics = RewardModelInputs(tokenizer)(batch(tokenizer))
    eos = tokenizer.eos_token_id
    assert rows.batch["input_ids"][0].tolist() == tokenizer("xyab", add_special_tokens=False)["input_ids"] + [eos]
    assert rows.batch["attention_mask"].sum(1).tolist() == [5, 4]
    assert metrics == {"reward/rm/truncated": 0.0}


def test_retokenized_rows_are_the_rm_templates_text(tokenizer):
    rows, _ = RewardModelInputs(tokenizer, tokenizer)(batch(tokenizer))
    first = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ab"}], tokenize=False)
    assert first == "<|user|>hi<|end|><|assistant|>ab<|end|>"  # EOS skipped, response text re-rendered
    got = rows.batch["input_ids"][0][rows.batch["attention_mask"][0].bool()].tolist()
    assert got == tokenizer(first, add_special_tokens=False)["input_ids"]
    second = rows.batch["input_ids"][1][rows.batch["attention_mask"][1].bool()].tolist()
    assert tokenizer.decode(second) == "<|user|>plain prompt<|end|><|assistant|>c<|end|>"


def test_max_length_keeps_the_end_and_counts(tokenizer):
    rows, metrics = RewardModelInputs(tokenizer, max_length=4)(batch(tokenizer))
    assert tokenizer.decode(rows.batch["input_ids"][0]) == "yab<|eos|>"
    assert metrics["reward/rm/truncated"] == 1.0


def test_bad_inputs_are_refused_by_name(tokenizer, tmp_path):
    with pytest.raises(ValueError, match="reward_model.max_length"):
        RewardModelInputs(tokenizer, max_length=0)
    bare = AutoTokenizer.from_pretrained(make_tiny_tokenizer(tmp_path / "bare"))
    bare.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        RewardModelInputs(bare, tokenizer)
    with pytest.raises(ValueError, match="raw_prompt of row 0"):
        RewardModelInputs(tokenizer, tokenizer)(batch(tokenizer, raw_prompt=[[{"text": "x"}], "y"]))
    no_raw = batch(tokenizer)
    no_raw.non_tensor_batch.pop("raw_prompt")
    with pytest.raises(Exception, match="raw_prompt"):
        RewardModelInputs(tokenizer, tokenizer)(no_raw)
