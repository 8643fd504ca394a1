import re

import pyarrow.parquet as pq
import pytest

from megatron_rl.data import RLDataset, load_tokenizer
from megatron_rl.data.rows import check_row
from megatron_rl.data.tasks import TASKS, make_rows
from megatron_rl.data.tasks.__main__ import main


@pytest.mark.parametrize("task", sorted(TASKS))
def test_rows_are_valid_verl_rows_and_seeded(task):
    rows = make_rows(task, 20, seed=5, split="train")
    assert all(check_row(row, "prompt") is None for row in rows)
    source = "copy" if re.fullmatch(r"copy\d", task) else task  # copyN: copy with N digits, the copy scorer
    assert {row["data_source"] for row in rows} == {f"synthetic/{source}"}
    assert make_rows(task, 20, seed=5, split="train") == rows
    assert make_rows(task, 20, seed=6, split="train") != rows
    assert make_rows(task, 20, seed=5, split="val") != rows


@pytest.mark.parametrize(
    "task,transform",
    [("copy", lambda d: d), ("reverse", lambda d: d[::-1]), ("sort", lambda d: "".join(sorted(d)))],
)
def test_digit_answers_are_the_transformed_digits(task, transform):
    for row in make_rows(task, 50, seed=0, split="train"):
        digits = row["extra_info"]["digits"]
        assert 3 <= len(digits) <= 5 and digits.isdigit()
        assert row["prompt"][0]["content"] == f"{task}: {digits}"
        assert row["reward_model"]["ground_truth"] == transform(digits)


@pytest.mark.parametrize("length", [1, 2, 3])
def test_fixed_length_copies(length):
    rows = make_rows(f"copy{length}", 50, seed=0, split="train")
    assert {len(row["extra_info"]["digits"]) for row in rows} == {length}
    assert all(row["reward_model"]["ground_truth"] == row["extra_info"]["digits"] for row in rows)


def test_arithmetic_solutions_compute_the_ground_truth():
    for row in make_rows("arith", 200, seed=0, split="train"):
        answer = row["extra_info"]["answer"]
        assert answer.endswith(f"\n#### {row['reward_model']['ground_truth']}")
        assert int(row["reward_model"]["ground_truth"]) >= 0
        for lhs, rhs in re.findall(r"(\d+(?: [-+*] \d+)+) = (\d+)", answer):
            assert eval(lhs) == int(rhs)  # every step of the worked solution is right
        assert '"####"' in row["prompt"][0]["content"]


def test_cli_writes_parquet_and_a_tokenizer_the_dataset_reads(tmp_path):
    main(["copy", "--out", str(tmp_path), "--train", "30", "--val", "7", "--seed", "1", "--tokenizer"])
    assert pq.read_metadata(tmp_path / "train.parquet").num_rows == 30
    assert pq.read_metadata(tmp_path / "val.parquet").num_rows == 7
    tokenizer = load_tokenizer(tmp_path / "tokenizer")
    dataset = RLDataset(tmp_path / "val.parquet", tokenizer, max_prompt_length=24)
    assert len(dataset) == 7 and dataset.malformed == [] and dataset.num_overlong == 0
    assert tokenizer.unk_token_id not in dataset[0]["input_ids"].tolist()


def test_cli_rejects_an_unknown_task(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["divide", "--out", str(tmp_path)])
    assert "invalid choice: 'divide'" in capsys.readouterr().err
