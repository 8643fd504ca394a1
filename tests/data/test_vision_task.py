"""The ``shapes`` and ``shape_colour`` vision tasks: rows in verl's multimodal format, their scorer, and the CLI's tiny
VL checkpoint."""

from __future__ import annotations

import io

import numpy as np
import pyarrow.parquet as pq
import pytest
from PIL import Image

from megatron_rl.data import RLDataset, load_tokenizer
from megatron_rl.data.tasks import VISION_TASKS, make_rows
from megatron_rl.data.tasks.__main__ import main
from megatron_rl.data.tasks.shapes import COLOUR_NAMES, IMAGE_SIZE
from megatron_rl.reward import get_scorer


def coloured_quarters(png: bytes) -> int:
    pixels = np.asarray(Image.open(io.BytesIO(png)).convert("RGB"))
    half = IMAGE_SIZE // 2
    quarters = [pixels[r:r + half, c:c + half] for r in (0, half) for c in (0, half)]
    return sum(int((q != 255).any()) for q in quarters)


def test_rows_hold_one_png_whose_squares_are_the_answer():
    rows = make_rows("shapes", 40, seed=3, split="train")
    assert "shapes" in VISION_TASKS
    assert {row["reward_model"]["ground_truth"] for row in rows} == {"1", "2", "3", "4"}
    for row in rows:
        [image] = row["images"]
        assert Image.open(io.BytesIO(image["bytes"])).size == (IMAGE_SIZE, IMAGE_SIZE)
        assert coloured_quarters(image["bytes"]) == int(row["reward_model"]["ground_truth"])
        assert row["prompt"][0]["content"].count("<image>") == 1
        assert row["data_source"] == "synthetic/shapes"


def test_colour_rows_hold_one_square_of_the_answers_colour():
    rows = make_rows("shape_colour", 40, seed=3, split="val")
    assert "shape_colour" in VISION_TASKS
    assert {row["reward_model"]["ground_truth"] for row in rows} == set(COLOUR_NAMES)
    for row in rows:
        [image] = row["images"]
        pixels = np.asarray(Image.open(io.BytesIO(image["bytes"])).convert("RGB")).reshape(-1, 3)
        assert pixels.shape[0] == (IMAGE_SIZE // 2) ** 2  # one merged patch: one image token
        colours = {tuple(p) for p in pixels} - {(255, 255, 255)}
        assert colours == {COLOUR_NAMES[row["reward_model"]["ground_truth"]][1]}
        assert row["data_source"] == "synthetic/shape_colour" and row["prompt"][0]["content"].startswith("<image>")


@pytest.mark.parametrize(
    "response,score",
    [("3", 1.0), (" 3\n", 1.0), ("\\boxed{3}", 1.0), ("so \\boxed{2} no \\boxed{3}", 1.0),
     ("2", 0.0), ("33", 0.0), ("", 0.0), ("\\boxed{4}", 0.0), ("three", 0.0)],
)
def test_scorer_gives_one_for_the_right_count_only(response, score):
    scorer = get_scorer("synthetic/shapes")
    result = scorer.fn(data_source="synthetic/shapes", solution_str=response, ground_truth="3", extra_info={})
    assert result["score"] == score and result["acc"] == score


def test_cli_writes_the_task_and_a_vl_checkpoint_the_dataset_reads(tmp_path):
    main(["shapes", "--out", str(tmp_path), "--train", "6", "--val", "3", "--vl-checkpoint"])
    assert pq.read_metadata(tmp_path / "train.parquet").num_rows == 6
    tokenizer = load_tokenizer(tmp_path / "model")
    dataset = RLDataset(tmp_path / "val.parquet", tokenizer, max_prompt_length=48)
    assert len(dataset) == 3
    for item in (dataset[i] for i in range(3)):
        ids = item["input_ids"][item["attention_mask"].bool()].tolist()
        assert tokenizer.unk_token_id not in ids
        assert item["multi_modal_inputs"]["image_grid_thw"].tolist() == [[1, 4, 4]]  # 56x56: 2x2 merged patches
        assert ids.count(tokenizer.convert_tokens_to_ids("<|image_pad|>")) == 4


def test_cli_refuses_a_text_tokenizer_for_a_vision_task(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["shapes", "--out", str(tmp_path), "--tokenizer"])
    err = capsys.readouterr().err
    assert "shapes has images" in err and "--vl-checkpoint" in err
    assert not (tmp_path / "train.parquet").exists()
