import json
import logging

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from megatron_rl.data.tokenizer import build_tiny_tokenizer, load_tokenizer


def test_tiny_tokenizer_is_a_loadable_hf_directory(tokenizer):
    path = tokenizer.name_or_path
    config = json.loads(open(f"{path}/tokenizer_config.json").read())
    assert "<|im_start|>" in config["chat_template"]  # in the config itself, for older transformers
    reloaded = AutoTokenizer.from_pretrained(path, local_files_only=True)
    assert len(reloaded) == len(tokenizer)
    assert reloaded.eos_token == "<|im_end|>" and reloaded.pad_token == "<|endoftext|>"
    assert reloaded.pad_token_id != reloaded.eos_token_id


@pytest.mark.parametrize("digits", ["0", "38145", "9990001", "12345678901234567890"])
def test_every_digit_is_one_token(tokenizer, digits):
    for text in (digits, f"copy: {digits}", f"#### {digits}."):
        pieces = tokenizer.convert_ids_to_tokens(tokenizer(text, add_special_tokens=False)["input_ids"])
        assert [p for p in pieces if any(c.isdigit() for c in p)] == list(digits)


def test_text_round_trips_through_the_tokenizer(tokenizer):
    text = "Ana has 12 apples. Ana gets 30 more.\n#### 42"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == text


def test_chat_template_is_chatml_with_generation_prompt(tokenizer):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "copy: 123"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == (
        "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\ncopy: 123<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert ids.count(tokenizer.convert_tokens_to_ids("<|im_start|>")) == 3  # special tokens stay whole


def test_unseen_characters_become_unk(tokenizer):
    ids = tokenizer("copy: 1Z", add_special_tokens=False)["input_ids"]
    assert tokenizer.unk_token_id in ids


def test_load_tokenizer_sets_a_missing_pad_token(tokenizer, tmp_path, caplog):
    no_pad = PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend_tokenizer, eos_token="<|im_end|>")
    no_pad.save_pretrained(tmp_path)
    assert AutoTokenizer.from_pretrained(tmp_path).pad_token is None
    with caplog.at_level(logging.INFO, logger="megatron_rl.data.tokenizer"):
        loaded = load_tokenizer(tmp_path)
    assert loaded.pad_token_id == loaded.eos_token_id == tokenizer.eos_token_id
    assert "no pad token" in caplog.text


def test_load_tokenizer_names_a_missing_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere"):
        load_tokenizer(tmp_path / "nowhere")


def test_build_tiny_tokenizer_needs_text(tmp_path):
    with pytest.raises(ValueError, match="at least one training text"):
        build_tiny_tokenizer(tmp_path, [])
