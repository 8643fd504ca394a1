"""verl's video rows: frames and metadata as qwen_vl_utils gives them, the torchvision-free video processor against
transformers' layout, the processors' own video tokens (Qwen2.5-VL's second_per_grid_ts, Qwen3-VL's timestamps), the
dataset's columns, and bad videos refused naming the row and the column."""

from __future__ import annotations

import io
from pathlib import Path

import cv2
import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoImageProcessor
from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor
from transformers.video_utils import VideoMetadata

from megatron_rl.config.schema import DataConfig
from megatron_rl.data import MalformedRowError, RLDataset, collate_to_dataproto, load_tokenizer
from megatron_rl.data.multimodal import VisionEncoder, build_messages, load_processor
from megatron_rl.data.video import VideoProblem, load_video
from megatron_rl.data.video_processor import QwenVideoProcessor
from megatron_rl.data.vision_checkpoint import build_tiny_vl_checkpoint

from data_rows import user_row, write_parquet

# the timestamps' characters too, so that Qwen3-VL's "<0.2 seconds>" decodes as text
TEXTS = ["How many squares are in the picture? Answer with a single digit.", "left right 0 1 2 3 4",
         "<0.2 seconds> <1.2 seconds> <2.5 seconds> 5 6 7 8 9"]
PATCH = {"qwen2_5_vl": 14, "qwen3_vl": 16}
MERGE = 2


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen3_vl"])
def family(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {name: build_tiny_vl_checkpoint(tmp_path_factory.mktemp(name), TEXTS, family=name) for name in PATCH}


def textured(width: int, height: int, seed: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8))


def png(image: Image.Image) -> bytes:
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def frames_item(count: int, side: int, **options) -> dict:
    """A video as a frame list of ``count`` textured PNGs, kept at ``side`` x ``side`` pixels."""
    frames = [{"bytes": png(textured(side, side, seed))} for seed in range(count)]
    return {"video": frames, "min_pixels": side * side, "max_pixels": side * side, **options}


def write_clip(path: Path, frames: int = 20, fps: float = 10.0) -> Path:
    """An MJPG .avi whose frame i is a flat colour with red = 12 * i (OpenCV writes BGR)."""
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"MJPG"), fps, (64, 48))
    for i in range(frames):
        frame = np.zeros((48, 64, 3), np.uint8)
        frame[..., 2], frame[..., 1] = 12 * i, 100
        writer.write(frame)
    writer.release()
    return path


def video_row(content: str, videos: list, **extra) -> dict:
    return {**user_row(content, data_source="synthetic/shapes"), "videos": videos, **extra}


def unpadded(item: dict) -> list[int]:
    return item["input_ids"][item["attention_mask"].bool()].tolist()


# ---------------------------------------------------------------------------------------------- the processor

def test_two_equal_frames_give_the_image_processors_pixels(checkpoints, family):
    """The image processor broadcasts an image over the temporal patch: a still video of it is the same input."""
    side = PATCH[family] * MERGE * 2
    image = textured(side, side, seed=3)
    video = torch.from_numpy(np.array(image)).permute(2, 0, 1)[None].repeat(2, 1, 1, 1)
    stand_in = load_processor(checkpoints[family]).video_processor
    out = stand_in(videos=[video], do_sample_frames=False, return_tensors="pt")
    expected = AutoImageProcessor.from_pretrained(checkpoints[family], local_files_only=True)(image,
                                                                                             return_tensors="pt")
    assert out["video_grid_thw"].tolist() == expected["image_grid_thw"].tolist() == [[1, 4, 4]]
    assert out["pixel_values_videos"].shape == expected["pixel_values"].shape
    assert torch.allclose(out["pixel_values_videos"], expected["pixel_values"], atol=1e-5, rtol=0)


def test_patch_layout_is_transformers(checkpoints):
    """Each row is one patch: channels x frames x pixels; rows run over merge windows row by row, then the patches
    of a window row by row; checked against a hand-built tensor and transformers' own patchify."""
    stand_in = load_processor(checkpoints["qwen2_5_vl"]).video_processor
    patch, side = 14, 56
    video = torch.stack([torch.from_numpy(np.array(textured(side, side, seed))).permute(2, 0, 1) for seed in (1, 2)])
    out = stand_in(videos=[video], do_sample_frames=False, return_tensors="pt")["pixel_values_videos"]
    mean, std = torch.tensor(stand_in.image_mean)[:, None, None], torch.tensor(stand_in.image_std)[:, None, None]
    x = (video.double() / 255 - mean.double()) / std.double()
    rows = []
    for wi in range(2):
        for wj in range(2):
            for mi in range(2):
                for mj in range(2):
                    i, j = (wi * 2 + mi) * patch, (wj * 2 + mj) * patch
                    rows.append(torch.cat([x[t, c, i:i + patch, j:j + patch].reshape(-1)
                                           for c in range(3) for t in range(2)]))
    assert torch.allclose(out.double(), torch.stack(rows), atol=1e-5)
    normalized = ((video.float() - mean * 255) / (std * 255))[None]
    theirs, *grid = Qwen3VLVideoProcessor.patchify(None, normalized, patch_size=patch, merge_size=2,
                                                   temporal_patch_size=2)
    assert torch.equal(out, theirs[0]) and grid == [1, 4, 4]


def test_odd_frame_counts_repeat_the_last_frame(checkpoints):
    stand_in = load_processor(checkpoints["qwen2_5_vl"]).video_processor
    frames = [torch.from_numpy(np.array(textured(28, 28, seed))).permute(2, 0, 1) for seed in range(3)]
    out = stand_in(videos=[torch.stack(frames)], do_sample_frames=False, return_tensors="pt")
    padded = stand_in(videos=[torch.stack([*frames, frames[-1]])], do_sample_frames=False, return_tensors="pt")
    assert out["video_grid_thw"].tolist() == [[2, 2, 2]]
    assert torch.equal(out["pixel_values_videos"], padded["pixel_values_videos"])
    # a frame list read as verl reads it is padded the same way, before the processor
    frames, metadata = load_video(frames_item(3, 28), patch_size=14)
    assert frames.shape == (4, 3, 28, 28) and torch.equal(frames[3], frames[2])
    assert metadata.frames_indices == [0, 1, 2, 3] and metadata.fps == 2.0


def test_listed_frames_of_other_sizes_are_resized_to_the_firsts():
    frames = [{"bytes": png(textured(56, 56, 1))}, {"bytes": png(textured(84, 28, 2))}, textured(30, 60, 3)]
    video, metadata = load_video({"video": frames, "min_pixels": 784, "max_pixels": 56 * 56}, patch_size=14)
    assert video.shape == (4, 3, 56, 56) and metadata.total_num_frames == 4
    assert torch.equal(video[0], torch.from_numpy(np.array(textured(56, 56, 1))).permute(2, 0, 1))


def test_the_video_processor_reads_the_checkpoints_settings(checkpoints, tmp_path):
    qwen3 = QwenVideoProcessor.from_pretrained(checkpoints["qwen3_vl"])
    assert (qwen3.rule, qwen3.patch_size, qwen3.do_sample_frames) == ("qwen3", 16, False)
    assert qwen3.size == {"shortest_edge": 2 * 32 * 32, "longest_edge": 8 * 16 * 32 * 32}
    # without a video file: the image processor's, read as transformers' Qwen2VLVideoProcessor reads it
    (tmp_path / "preprocessor_config.json").write_bytes(
        (checkpoints["qwen2_5_vl"] / "preprocessor_config.json").read_bytes())
    qwen2 = QwenVideoProcessor.from_pretrained(tmp_path)
    assert qwen2.rule == "qwen2" and qwen2.size == {"shortest_edge": 28 * 28, "longest_edge": 16 * 28 * 28}
    with pytest.raises(ValueError, match="does not sample frames"):
        qwen2(videos=[torch.zeros(2, 3, 28, 28, dtype=torch.uint8)], do_sample_frames=True)


# ---------------------------------------------------------------------------------------------- the processors' calls

def test_qwen2_5_vl_gives_second_per_grid_ts_and_one_pad_per_merged_patch(checkpoints):
    processor = load_processor(checkpoints["qwen2_5_vl"])
    frames, metadata = load_video(frames_item(4, 56, sample_fps=4.0), patch_size=14)
    text = processor.apply_chat_template(build_messages([{"role": "user", "content": "<video>How many"}], 0, 1),
                                         add_generation_prompt=True, tokenize=False)
    out = processor(text=[text], videos=[frames], video_metadata=[metadata], do_sample_frames=False,
                    return_tensors="pt")
    t, h, w = out["video_grid_thw"][0].tolist()
    assert (t, h, w) == (2, 4, 4)
    assert out["second_per_grid_ts"].tolist() == [2 / 4.0]  # temporal_patch_size / fps
    pad = processor.tokenizer.convert_tokens_to_ids("<|video_pad|>")
    assert out["input_ids"][0].tolist().count(pad) == t * h * w // MERGE**2


def test_qwen3_vl_writes_each_temporal_patchs_timestamp(checkpoints):
    processor = load_processor(checkpoints["qwen3_vl"])
    image = textured(64, 64, seed=9)
    frames, metadata = load_video(frames_item(4, 64), patch_size=16)  # 2 frames a second: 0, 0.5, 1, 1.5 s
    text = processor.apply_chat_template(
        build_messages([{"role": "user", "content": "<image>left <video>right"}], 1, 1),
        add_generation_prompt=True, tokenize=False)
    out = processor(text=[text], images=[image], videos=[frames], video_metadata=[metadata], do_sample_frames=False,
                    return_tensors="pt")
    assert "second_per_grid_ts" not in out
    t, h, w = out["video_grid_thw"][0].tolist()
    decoded = processor.tokenizer.decode(out["input_ids"][0])
    block = "<|vision_start|>" + "<|video_pad|>" * (h * w // MERGE**2) + "<|vision_end|>"
    # each temporal patch: its frames' mean time, then its own vision block; transformers keeps the template's pair
    assert f"<|vision_start|><0.2 seconds>{block}<1.2 seconds>{block}<|vision_end|>right" in decoded
    assert t == 2 and decoded.count("<|vision_start|>") == 1 + (t + 1)  # the image's, the video's pair, one a patch
    assert torch.equal(out["image_grid_thw"], torch.tensor([[1, 4, 4]]))


def test_a_video_file_is_sampled_at_two_frames_a_second(tmp_path):
    path = write_clip(tmp_path / "clip.avi")  # 20 frames at 10 fps: 2 s
    frames, metadata = load_video({"video": str(path), "min_pixels": 28 * 28, "max_pixels": 56 * 56}, patch_size=14)
    assert metadata.frames_indices == [0, 6, 13, 19]  # linspace(0, 19, 4).round(): 4 frames, min_frames
    assert (metadata.total_num_frames, metadata.fps, metadata.video_backend) == (20, 10.0, "opencv")
    assert metadata.sampled_fps == 2.0
    assert frames.dtype == torch.uint8 and frames.shape == (4, 3, 56, 56)  # 48x64 -> multiples of 28
    red = frames[:, 0].float().mean((1, 2))
    assert torch.allclose(red, torch.tensor([0.0, 72, 156, 228]), atol=4)  # the sampled frames' own colours
    for options, indices in (({"nframes": 6}, [0, 4, 8, 11, 15, 19]), ({"fps": 4, "max_frames": 6},
                                                                      [0, 4, 8, 11, 15, 19]),
                             ({"fps": 5}, [0, 2, 4, 6, 8, 11, 13, 15, 17, 19])):
        assert load_video({"video": f"file://{path}", **options}, patch_size=14)[1].frames_indices == indices


def test_a_file_that_decodes_fewer_frames_than_it_counts_is_sampled_from_those(tmp_path):
    whole = write_clip(tmp_path / "clip.avi").read_bytes()
    cut = tmp_path / "cut.avi"
    cut.write_bytes(whole[: int(len(whole) * 0.9)])  # the container still says 20 frames
    capture = cv2.VideoCapture(str(cut))
    decodable = 0
    while capture.grab():
        decodable += 1
    capture.release()
    assert 2 <= decodable < 20
    frames, metadata = load_video({"video": str(cut), "nframes": 2}, patch_size=14)
    assert metadata.total_num_frames == decodable and metadata.frames_indices == [0, decodable - 1]
    assert len(frames) == 2


# ---------------------------------------------------------------------------------------------- the dataset

def test_video_rows_carry_frames_metadata_and_the_processors_inputs(tmp_path, checkpoints, family):
    side = PATCH[family] * MERGE * 2
    rows = [video_row("<video>How many", [frames_item(4, side)]), user_row("left")]
    tokenizer = load_tokenizer(checkpoints[family])
    dataset = RLDataset(write_parquet(tmp_path / "v.parquet", rows), tokenizer, max_prompt_length=96)
    item, text_item = dataset[0], dataset[1]
    [(frames, metadata)] = item["multi_modal_data"]["video"]
    assert "image" not in item["multi_modal_data"]
    assert frames.dtype == torch.uint8 and frames.shape == (4, 3, side, side)
    assert isinstance(metadata, VideoMetadata) and metadata.frames_indices == [0, 1, 2, 3]
    inputs = item["multi_modal_inputs"]
    assert inputs["video_grid_thw"].tolist() == [[2, 4, 4]]
    assert inputs["pixel_values_videos"].shape == (32, 3 * 2 * PATCH[family] ** 2)
    assert ("second_per_grid_ts" in inputs) == (family == "qwen2_5_vl")
    if family == "qwen2_5_vl":
        assert inputs["second_per_grid_ts"].dtype == torch.float32 and inputs["second_per_grid_ts"].tolist() == [1.0]
    assert unpadded(item).count(tokenizer.convert_tokens_to_ids("<|video_pad|>")) == 32 // MERGE**2
    assert item["raw_prompt"][0]["content"] == [{"type": "video"}, {"type": "text", "text": "How many"}]
    assert text_item["multi_modal_data"] == {} and text_item["multi_modal_inputs"] == {}
    batch = collate_to_dataproto([item, text_item])
    assert batch.non_tensor_batch["multi_modal_inputs"][0]["video_grid_thw"].shape == (1, 3)


def test_a_row_with_images_and_videos_is_the_processors_own_encoding(tmp_path, checkpoints):
    image = {"bytes": png(textured(56, 28, seed=5))}
    clip = write_clip(tmp_path / "clip.avi")
    rows = [video_row("<image>left <video>right", [{"video": str(clip), "min_pixels": 784, "max_pixels": 3136}],
                      images=[image])]
    tokenizer = load_tokenizer(checkpoints["qwen2_5_vl"])
    item = RLDataset(write_parquet(tmp_path / "both.parquet", rows), tokenizer, max_prompt_length=96)[0]
    assert set(item["multi_modal_data"]) == {"image", "video"}
    assert set(item["multi_modal_inputs"]) == {"pixel_values", "image_grid_thw", "pixel_values_videos",
                                              "video_grid_thw", "second_per_grid_ts"}
    encoder = VisionEncoder(load_processor(checkpoints["qwen2_5_vl"]))
    text = encoder.render(item["raw_prompt"])
    own = encoder.encode(text, encoder.load_images([image]), item["multi_modal_data"]["video"])
    assert unpadded(item) == own["input_ids"]
    for key in ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw", "second_per_grid_ts"):
        assert torch.equal(item["multi_modal_inputs"][key], own[key])
    assert item["multi_modal_data"]["video"][0][1].frames_indices == [0, 6, 13, 19]


def test_from_config_reads_the_video_key(tmp_path, checkpoints):
    rows = [{**video_row("<video>How many", []), "clips": [frames_item(2, 28)]}]
    path = str(write_parquet(tmp_path / "keyed.parquet", rows))
    assert DataConfig().video_key == "videos"
    item = RLDataset.from_config([path], load_tokenizer(checkpoints["qwen2_5_vl"]),
                                 DataConfig(max_prompt_length=64, video_key="clips"))[0]
    assert item["multi_modal_inputs"]["video_grid_thw"].tolist() == [[1, 2, 2]]
    # data.mm_processor_kwargs' pixel limits are the images' (a video processor's size means other things)
    rows = [{**video_row("<image><video>How many", [frames_item(2, 56)]),
             "images": [{"bytes": png(textured(56, 56, 4))}]}]
    config = DataConfig(max_prompt_length=64, mm_processor_kwargs={"max_pixels": 28 * 28})
    inputs = RLDataset.from_config([str(write_parquet(tmp_path / "limits.parquet", rows))],
                                   load_tokenizer(checkpoints["qwen2_5_vl"]), config)[0]["multi_modal_inputs"]
    assert inputs["image_grid_thw"].tolist() == [[1, 2, 2]] and inputs["video_grid_thw"].tolist() == [[1, 4, 4]]


def _bad_rows(tmp_path: Path) -> dict[str, tuple[dict, str]]:
    (tmp_path / "junk.avi").write_bytes(b"not a video" * 20)
    one = write_clip(tmp_path / "one.avi", frames=1)
    return {
        "missing file": (video_row("<video>1", ["/no/such/clip.avi"]),
                         r"videos\[0\] file '/no/such/clip.avi' does not exist"),
        "undecodable": (video_row("<video>1", [str(tmp_path / "junk.avi")]),
                        r"videos\[0\] cannot be decoded \('.*junk\.avi'\): OpenCV cannot open it"),
        "one frame": (video_row("<video>1", [str(one)]), r"videos\[0\] has 1 frame\(s\): too few"),
        "empty frame list": (video_row("<video>1", [[]]), r"videos\[0\] has no frames"),
        "bad frame": (video_row("<video>1", [[{"bytes": b"junk"}]]), r"videos\[0\] frame 0 cannot be decoded"),
        "no video key": (video_row("<video>1", [{"frames": ["a.png"]}]), r"videos\[0\] has no 'video'"),
        "placeholder without video": (video_row("<video>1", []),
                                      r"the prompt has 1 <video> placeholder\(s\) but the row has 0 video\(s\); .* "
                                      r"\(columns 'images' / 'videos': data\.image_key / data\.video_key\)"),
        "placeholder without image": (video_row("<image>1", [], images=[]),
                                      r"the prompt has 1 <image> placeholder\(s\) but the row has 0 image\(s\)"),
        "video without placeholder": (video_row("1", [frames_item(2, 28)]),
                                      r"the prompt has 0 <video> placeholder\(s\) but the row has 1 video\(s\)"),
    }


@pytest.mark.parametrize("case", ["missing file", "undecodable", "one frame", "empty frame list", "bad frame",
                                  "no video key", "placeholder without video", "placeholder without image",
                                  "video without placeholder"])
def test_bad_videos_are_refused_naming_file_row_and_column(tmp_path, checkpoints, case):
    row, problem = _bad_rows(tmp_path)[case]
    path = write_parquet(tmp_path / "bad.parquet", [row, user_row("left")])
    tokenizer = load_tokenizer(checkpoints["qwen2_5_vl"])
    with pytest.raises(MalformedRowError, match=rf"bad\.parquet row 0: {problem}"):
        RLDataset(path, tokenizer, max_prompt_length=64, on_malformed_row="error")
    skipped = RLDataset(path, tokenizer, max_prompt_length=64, on_malformed_row="skip")
    assert len(skipped) == 1 and "bad.parquet row 0: " in skipped.malformed[0]


def test_videos_for_a_text_only_model_are_refused(tmp_path, tokenizer):
    path = write_parquet(tmp_path / "v.parquet", [video_row("<video>1", [frames_item(2, 28)])])
    with pytest.raises(ValueError, match=r"v\.parquet row 0 has videos \(column 'videos', data\.video_key\) but the "
                                         r"model at .* has no vision"):
        RLDataset(path, tokenizer, max_prompt_length=64)


def test_a_processor_without_videos_refuses_them(checkpoints):
    processor = load_processor(checkpoints["qwen2_5_vl"])
    encoder = VisionEncoder(processor)
    videos = encoder.load_videos([frames_item(2, 28)])
    processor.video_processor = None
    with pytest.raises(VideoProblem, match=r"takes no videos \('videos', data\.video_key\)"):
        encoder.encode("<|vision_start|><|video_pad|><|vision_end|>", [], videos)
