"""verl's multimodal rows in RLDataset: image tokens as the processor expands them, pixels, and bad inputs refused."""

from __future__ import annotations

import io
import pickle
import struct
import zlib
from pathlib import Path

import pytest
import torch
from PIL import Image
from transformers import AutoImageProcessor, Qwen2_5_VLProcessor

from megatron_rl.config.schema import DataConfig
from megatron_rl.data import MalformedRowError, RLDataset, collate_to_dataproto, load_tokenizer
from megatron_rl.data.multimodal import ImageProblem, load_image, load_processor
from megatron_rl.data.vision_checkpoint import build_tiny_vl_checkpoint

from data_rows import user_row, write_jsonl, write_parquet

TEXTS = ["How many squares are in the picture? Answer with a single digit.", "left right 0 1 2 3 4"]


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_vl_checkpoint(tmp_path_factory.mktemp("vl"), TEXTS)


@pytest.fixture(scope="module")
def vl_tokenizer(vl_dir):
    return load_tokenizer(vl_dir)


def png(width: int, height: int, colour=(200, 30, 30)) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (width, height), colour).save(out, format="PNG")
    return out.getvalue()


def image_row(content: str, images: list, ground_truth: str = "1") -> dict:
    return {**user_row(content, data_source="synthetic/shapes", ground_truth=ground_truth), "images": images}


def unpadded(item: dict) -> list[int]:
    return item["input_ids"][item["attention_mask"].bool()].tolist()


def test_image_tokens_and_pixels_are_the_processors(tmp_path, vl_dir, vl_tokenizer):
    images = [{"bytes": png(60, 40)}, {"bytes": png(112, 84, (0, 0, 255))}]
    rows = [image_row("<image>left <image>right How many", images)]
    dataset = RLDataset(write_parquet(tmp_path / "mm.parquet", rows), vl_tokenizer, max_prompt_length=96)
    item = dataset[0]

    # independently: the image processor's grids, each image pad repeated grid_t*grid_h*grid_w / merge**2 times
    pil = [load_image(i) for i in images]
    expected = AutoImageProcessor.from_pretrained(vl_dir, local_files_only=True)(pil, return_tensors="pt")
    counts = (expected["image_grid_thw"].prod(-1) // 4).tolist()
    pads = ["<|vision_start|>" + "<|image_pad|>" * n + "<|vision_end|>" for n in counts]
    text = f"<|im_start|>user\n{pads[0]}left {pads[1]}right How many<|im_end|>\n<|im_start|>assistant\n"
    assert unpadded(item) == vl_tokenizer(text, add_special_tokens=False)["input_ids"]

    # and the processor class's own __call__ on the same messages gives the same tokens and pixels
    processor = load_processor(vl_dir)
    assert isinstance(processor, Qwen2_5_VLProcessor)
    own = processor(text=[processor.apply_chat_template(item["raw_prompt"], add_generation_prompt=True,
                                                        tokenize=False)], images=pil, return_tensors="pt")
    assert unpadded(item) == own["input_ids"][0].tolist()
    inputs = item["multi_modal_inputs"]
    assert torch.equal(inputs["pixel_values"], own["pixel_values"])
    assert torch.equal(inputs["image_grid_thw"], expected["image_grid_thw"])
    assert item["raw_prompt"][0]["content"] == [{"type": "image"}, {"type": "text", "text": "left "},
                                                {"type": "image"}, {"type": "text", "text": "right How many"}]


def test_multi_modal_inputs_agree_with_image_grid_thw(tmp_path, vl_tokenizer):
    rows = [image_row("<image>How many", [{"bytes": png(56, 112)}]), user_row("How many")]
    dataset = RLDataset(write_parquet(tmp_path / "mixed.parquet", rows), vl_tokenizer, max_prompt_length=48)
    item, text_item = dataset[0], dataset[1]
    grid = item["multi_modal_inputs"]["image_grid_thw"]
    pixels = item["multi_modal_inputs"]["pixel_values"]
    assert grid.dtype == torch.long and grid.shape == (1, 3)
    assert pixels.dtype == torch.float32 and pixels.shape == (int(grid.prod(-1).sum()), 3 * 2 * 14 * 14)
    image_pad = vl_tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert unpadded(item).count(image_pad) == int(grid.prod(-1).sum()) // 4
    [image] = item["multi_modal_data"]["image"]
    assert isinstance(image, Image.Image) and image.mode == "RGB" and image.size == (56, 112)
    assert item["position_ids"].shape == (48,)  # 1-D text positions; the model computes mRoPE itself
    # a row without images carries empty multimodal fields, so a mixed batch collates
    assert text_item["multi_modal_data"] == {} and text_item["multi_modal_inputs"] == {}
    batch = collate_to_dataproto([item, text_item])
    assert batch.batch["input_ids"].shape == (2, 48)
    assert batch.non_tensor_batch["multi_modal_inputs"][0]["image_grid_thw"].shape == (1, 3)


def test_text_only_rows_are_unchanged_with_a_vision_tokenizer(tmp_path, vl_tokenizer):
    path = write_jsonl(tmp_path / "text.jsonl", [user_row("How many"), user_row("left right")])
    item = RLDataset(path, vl_tokenizer, max_prompt_length=24)[0]
    assert "multi_modal_data" not in item and "multi_modal_inputs" not in item
    assert unpadded(item) == vl_tokenizer.apply_chat_template(
        [{"role": "user", "content": "How many"}], add_generation_prompt=True, tokenize=True, return_dict=False)


def test_image_paths_in_jsonl_rows(tmp_path, vl_tokenizer):
    (tmp_path / "a.png").write_bytes(png(40, 40))
    rows = [image_row("<image>How many", [str(tmp_path / "a.png")]),
            image_row("<image>How many", [{"image": f"file://{tmp_path / 'a.png'}"}])]
    dataset = RLDataset(write_jsonl(tmp_path / "paths.jsonl", rows), vl_tokenizer, max_prompt_length=48)
    assert len(dataset) == 2
    assert torch.equal(dataset[0]["multi_modal_inputs"]["pixel_values"],
                       dataset[1]["multi_modal_inputs"]["pixel_values"])


def _zero_width_png() -> bytes:
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", 0, 4, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b"")


@pytest.mark.parametrize(
    "images,content,problem",
    [
        ([{"bytes": b"not an image"}], "<image>How many", r"images\[0\] cannot be decoded \(12 bytes\)"),
        ([{"bytes": png(28, 28)}, {"bytes": _zero_width_png()}], "<image><image>How many",
         r"images\[1\] cannot be decoded"),
        ([{"image": "/no/such/picture.png"}], "<image>How many",
         r"images\[0\] file '/no/such/picture.png' does not exist"),
        (["/no/such/picture.png"], "<image>How many", r"images\[0\] file '/no/such/picture.png' does not exist"),
        ([{"path": "x.png"}], "<image>How many", r"images\[0\] has neither 'bytes' nor 'image'"),
        ([{"bytes": png(28, 28)}], "<image><image>How many",
         r"the prompt has 2 <image> placeholder\(s\) but the row has 1 image"),
        ([{"bytes": png(28, 28)}], "How many", r"the prompt has 0 <image> placeholder\(s\) but the row has 1 image"),
    ],
)
def test_bad_images_are_refused_naming_file_and_row(tmp_path, vl_tokenizer, images, content, problem):
    rows = [image_row(content, images), user_row("left")]  # pyarrow takes the columns from the first row
    path = write_parquet(tmp_path / "bad.parquet", rows)
    with pytest.raises(MalformedRowError, match=rf"bad\.parquet row 0: {problem}"):
        RLDataset(path, vl_tokenizer, max_prompt_length=64, on_malformed_row="error")
    skipped = RLDataset(path, vl_tokenizer, max_prompt_length=64, on_malformed_row="skip")
    assert len(skipped) == 1 and len(skipped.malformed) == 1 and "bad.parquet row 0: " in skipped.malformed[0]


def test_a_zero_sized_image_is_refused():
    with pytest.raises(ImageProblem, match=r"is empty \(0x4 pixels\)"):
        load_image(Image.new("RGB", (0, 4)))


def test_images_over_max_prompt_length_are_filtered_or_refused(tmp_path, vl_tokenizer):
    rows = [image_row("<image>How many", [{"bytes": png(28, 28)}]),
            image_row("<image>How many", [{"bytes": png(112, 112)}])]  # 16 image tokens
    path = write_parquet(tmp_path / "big.parquet", rows)
    dataset = RLDataset(path, vl_tokenizer, max_prompt_length=20)
    assert len(dataset) == 1 and dataset.num_overlong == 1
    with pytest.raises(ValueError, match=r"big\.parquet row 1: prompt with images is \d+ tokens .*never truncated"):
        RLDataset(path, vl_tokenizer, max_prompt_length=20, filter_overlong_prompts=False, truncation="left")


def test_images_for_a_text_only_model_are_refused(tmp_path, tokenizer):
    path = write_parquet(tmp_path / "mm.parquet", [image_row("<image>1", [{"bytes": png(28, 28)}])])
    with pytest.raises(ValueError, match=r"mm\.parquet row 0 has images \(column 'images', data\.image_key\) "
                                         r"but the model at .* has no vision"):
        RLDataset(path, tokenizer, max_prompt_length=64)


def test_from_config_reads_the_image_key_and_pixel_limits(tmp_path, vl_tokenizer):
    rows = [{**image_row("<image>How many", []), "pictures": [{"bytes": png(112, 112)}]}]
    path = str(write_parquet(tmp_path / "keyed.parquet", rows))
    assert DataConfig().image_key == "images" and DataConfig().mm_processor_kwargs == {}
    config = DataConfig(max_prompt_length=64, image_key="pictures")
    full = RLDataset.from_config([path], vl_tokenizer, config)[0]["multi_modal_inputs"]["image_grid_thw"]
    config.mm_processor_kwargs = {"max_pixels": 56 * 56}
    small = RLDataset.from_config([path], vl_tokenizer, config)[0]["multi_modal_inputs"]["image_grid_thw"]
    assert full.tolist() == [[1, 8, 8]] and small.tolist() == [[1, 4, 4]]


def test_per_image_pixel_limits_resize_as_verl(tmp_path, vl_tokenizer):
    rows = [image_row("<image>How many", [{"bytes": png(112, 112), "max_pixels": 56 * 56}])]
    item = RLDataset(write_parquet(tmp_path / "limits.parquet", rows), vl_tokenizer, max_prompt_length=64)[0]
    assert item["multi_modal_data"]["image"][0].size == (56, 56)
    assert item["multi_modal_inputs"]["image_grid_thw"].tolist() == [[1, 4, 4]]


def test_qwen3_vl_checkpoint_encodes_images(tmp_path):
    model_dir = build_tiny_vl_checkpoint(tmp_path / "q3", TEXTS, family="qwen3_vl")
    rows = [image_row("<image>How many", [{"bytes": png(64, 64)}])]
    path = write_parquet(tmp_path / "q3.parquet", rows)
    item = RLDataset(path, load_tokenizer(model_dir), max_prompt_length=48)[0]
    grid = item["multi_modal_inputs"]["image_grid_thw"]
    assert grid.tolist() == [[1, 4, 4]]  # patch 16: 64x64 pixels
    assert item["multi_modal_inputs"]["pixel_values"].shape == (16, 3 * 2 * 16 * 16)


def test_a_dataset_with_images_pickles_for_spawned_loader_workers(tmp_path, vl_tokenizer):
    rows = [image_row("<image>How many", [{"bytes": png(56, 56)}])]
    dataset = RLDataset(write_parquet(tmp_path / "p.parquet", rows), vl_tokenizer, max_prompt_length=48)
    copy = pickle.loads(pickle.dumps(dataset))
    pixels = dataset[0]["multi_modal_inputs"]["pixel_values"]
    assert torch.equal(copy[0]["multi_modal_inputs"]["pixel_values"], pixels)
