import logging

import pytest
import torch
from data_rows import user_row, write_jsonl, write_parquet

from megatron_rl.data import MalformedRowError, RLDataset


def prompt_ids(tokenizer, content: str) -> list[int]:
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
    )
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_row_is_chat_templated_and_left_padded(tokenizer, tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [user_row("copy: 38145", ground_truth="38145")])
    item = RLDataset(path, tokenizer, max_prompt_length=32)[0]
    expected = prompt_ids(tokenizer, "copy: 38145")
    n = len(expected)
    assert item["input_ids"].shape == item["attention_mask"].shape == item["position_ids"].shape == (32,)
    assert item["input_ids"][-n:].tolist() == expected
    assert item["input_ids"][:-n].eq(tokenizer.pad_token_id).all()
    assert item["attention_mask"].tolist() == [0] * (32 - n) + [1] * n
    assert item["position_ids"].tolist() == [0] * (32 - n) + list(range(n))
    assert tokenizer.decode(item["input_ids"][-n:]).endswith("copy: 38145<|im_end|>\n<|im_start|>assistant\n")
    assert item["raw_prompt"] == [{"role": "user", "content": "copy: 38145"}]
    assert item["data_source"] == "synthetic/copy"
    assert item["reward_model"]["ground_truth"] == "38145"
    assert item["extra_info"] == {"split": "train"} and item["index"] == 0


def test_overlong_prompts_are_filtered_and_counted(tokenizer, tmp_path, caplog):
    rows = [
        user_row("copy: 1"),
        user_row("copy: " + "7" * 40),
        user_row("copy: 22"),
        user_row("copy: " + "8" * 50),
    ]
    path = write_parquet(tmp_path / "d.parquet", rows)
    limit = len(prompt_ids(tokenizer, "copy: 22"))
    with caplog.at_level(logging.WARNING, logger="megatron_rl.data.dataset"):
        ds = RLDataset(path, tokenizer, max_prompt_length=limit)
    assert len(ds) == 2 and ds.num_overlong == 2
    assert [ds[i]["index"] for i in range(2)] == [0, 2]  # the row numbers of the kept rows
    assert "dropped 2 of 4 prompts longer than data.max_prompt_length" in caplog.text


@pytest.mark.parametrize("side", ["left", "right", "middle"])
def test_truncation_keeps_the_chosen_end(tokenizer, tmp_path, side):
    path = write_jsonl(tmp_path / "d.jsonl", [user_row("copy: " + "1234567890" * 3)])
    full = prompt_ids(tokenizer, "copy: " + "1234567890" * 3)
    ds = RLDataset(path, tokenizer, max_prompt_length=11, filter_overlong_prompts=False, truncation=side)
    kept = ds[0]["input_ids"].tolist()
    # verl's middle: the first max_prompt_length // 2 tokens and the last max_prompt_length - that
    assert kept == {"left": full[-11:], "right": full[:11], "middle": full[:5] + full[-6:]}[side]
    assert ds[0]["attention_mask"].all() and ds.num_overlong == 1


def test_truncation_error_names_the_row(tokenizer, tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [user_row("copy: 1"), user_row("copy: " + "9" * 30)])
    limit = len(prompt_ids(tokenizer, "copy: 1"))
    with pytest.raises(
        ValueError,
        match=rf"d\.jsonl line 2: prompt is \d+ tokens, longer than data.max_prompt_length={limit}",
    ):
        RLDataset(path, tokenizer, max_prompt_length=limit, filter_overlong_prompts=False, truncation="error")


BROKEN_ROWS = [
    ({"data_source": "x", "reward_model": {"ground_truth": "1"}}, "missing 'prompt'"),
    ({**user_row("a"), "prompt": "copy: 1"}, "'prompt' must be a non-empty list of chat messages"),
    (
        {**user_row("a"), "prompt": [{"role": "user", "content": 5}]},
        r"prompt\[0\].content must be a string, got int 5",
    ),
    (
        {**user_row("a"), "reward_model": {"style": "rule"}},
        "'reward_model' must be a dict with a 'ground_truth'",
    ),
    ({**user_row("a"), "data_source": None}, "'data_source' must be a non-empty string"),
    ({**user_row("a"), "extra_info": [1]}, "'extra_info' must be a dict"),
    ('{"prompt": [', "invalid JSON"),
    ("[1, 2]", "expected a JSON object, got list"),
]


@pytest.mark.parametrize("broken,problem", BROKEN_ROWS)
def test_malformed_row_is_skipped_with_file_and_line(tokenizer, tmp_path, broken, problem):
    path = write_jsonl(tmp_path / "d.jsonl", [user_row("copy: 1"), broken, user_row("copy: 2")])
    ds = RLDataset(path, tokenizer, max_prompt_length=32, on_malformed_row="skip")
    assert len(ds) == 2 and [ds[i]["index"] for i in range(2)] == [0, 2]
    assert len(ds.malformed) == 1
    assert ds.malformed[0].startswith(f"{path} line 2: ")
    with pytest.raises(MalformedRowError, match=rf"d\.jsonl line 2: {problem}"):
        RLDataset(path, tokenizer, max_prompt_length=32, on_malformed_row="error")


def test_malformed_parquet_row_names_the_row_number(tokenizer, tmp_path):
    rows = [user_row("copy: 1"), user_row("copy: 2"), {**user_row("copy: 3"), "reward_model": None}]
    path = write_parquet(tmp_path / "d.parquet", rows)
    with pytest.raises(MalformedRowError, match=r"d\.parquet row 2: 'reward_model' must be a dict"):
        RLDataset(path, tokenizer, max_prompt_length=32, on_malformed_row="error")


def test_files_concatenate_in_order_with_running_row_numbers(tokenizer, tmp_path):
    first = write_parquet(tmp_path / "a.parquet", [user_row("copy: 1"), user_row("copy: 2")])
    second = write_jsonl(tmp_path / "b.jsonl", [user_row("copy: 3"), {"broken": True}, user_row("copy: 5")])
    ds = RLDataset([first, second], tokenizer, max_prompt_length=32)
    assert [ds[i]["raw_prompt"][0]["content"] for i in range(len(ds))] == [
        "copy: 1",
        "copy: 2",
        "copy: 3",
        "copy: 5",
    ]
    assert [ds[i]["index"] for i in range(len(ds))] == [0, 1, 2, 4]


def test_no_usable_rows_is_an_error_with_counts(tokenizer, tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"broken": True}, user_row("copy: " + "1" * 40)])
    with pytest.raises(ValueError, match="2 rows read, 1 malformed, 1 longer than data.max_prompt_length=8"):
        RLDataset(path, tokenizer, max_prompt_length=8)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"truncation": "center"}, "data.truncation='center' is unknown"),
        ({"on_malformed_row": "ignore"}, "data.on_malformed_row='ignore' is unknown"),
        ({"max_prompt_length": 0}, "data.max_prompt_length must be a positive integer"),
    ],
)
def test_bad_settings_name_the_config_key(tokenizer, tmp_path, kwargs, message):
    path = write_jsonl(tmp_path / "d.jsonl", [user_row("copy: 1")])
    with pytest.raises(ValueError, match=message):
        RLDataset(path, tokenizer, **kwargs)


def test_unknown_file_type_and_missing_file(tokenizer, tmp_path):
    with pytest.raises(ValueError, match="expected .parquet or .jsonl"):
        RLDataset(write_jsonl(tmp_path / "d.csv", [user_row("copy: 1")]), tokenizer)
    with pytest.raises(FileNotFoundError, match="missing.parquet"):
        RLDataset(tmp_path / "missing.parquet", tokenizer)


def test_from_config_reads_the_data_section(tokenizer, tmp_path):
    from megatron_rl.config.schema import DataConfig

    path = write_jsonl(tmp_path / "d.jsonl", [user_row("copy: 1"), user_row("copy: " + "2" * 40)])
    cfg = DataConfig(max_prompt_length=16, filter_overlong_prompts=False, truncation="left")
    ds = RLDataset.from_config([str(path)], tokenizer, cfg)
    assert len(ds) == 2 and ds[1]["input_ids"].shape == (16,) and ds[1]["attention_mask"].all()
    assert isinstance(ds[0]["input_ids"], torch.Tensor) and ds[0]["input_ids"].dtype == torch.long
