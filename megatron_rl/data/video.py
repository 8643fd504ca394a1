"""verl's video items -> frames and their metadata, as verl's ``process_video`` (qwen_vl_utils' ``fetch_video``) gives
them, without torchvision or decord: video files are decoded with OpenCV.

A row's videos (column ``data.video_key``, verl's default ``videos``) are a list whose items are

- a list of frames, each an image item as for images (``{"bytes": ...}``, a path, a PIL image), taken as given: the
  last frame is repeated to an even count; their timing is ``sample_fps`` (qwen_vl_utils' key, default 2);
- a path to a video file (``file://`` allowed), sampled at 2 frames per second;
- a dict ``{"video": <list of frames | path>, ...}`` with qwen_vl_utils' options: ``fps`` (default 2) or ``nframes``,
  ``min_frames`` / ``max_frames`` (4 / 768), ``min_pixels`` / ``max_pixels`` / ``total_pixels`` (of a frame; of the
  whole video), ``resized_height`` / ``resized_width``.

A file's frames are sampled at evenly spaced indices (``linspace(0, total - 1, n).round()``), ``n`` a multiple of 2
(FRAME_FACTOR). All frames of a video are resized to one size: ``smart_resize`` at factor ``patch_size * 2`` within
the video's pixel limits (128 .. 768 merged patches a frame by default, less when ``total_pixels`` is shared by
many frames). The metadata is transformers' ``VideoMetadata``: the processors read ``fps`` and ``frames_indices``
(Qwen3-VL's ``<t seconds>`` timestamps) and ``sampled_fps`` (Qwen2.5-VL's ``second_per_grid_ts``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import cv2
import numpy as np
import torch
from PIL import Image
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize
from transformers.video_utils import VideoMetadata

from megatron_rl.data.pixels import SPATIAL_MERGE, ImageProblem, open_item, option, to_rgb

__all__ = ["FRAME_FACTOR", "VIDEO_PLACEHOLDER", "VideoProblem", "load_video", "sample_indices"]

VIDEO_PLACEHOLDER = "<video>"
FRAME_FACTOR = 2  # qwen_vl_utils: frame counts are multiples of 2 (the temporal patch)
_FPS, _MIN_FRAMES, _MAX_FRAMES = 2.0, 4, 768
_MIN_TOKENS, _MAX_TOKENS = 128, 768  # merged patches a frame (qwen_vl_utils' VIDEO_MIN/MAX_TOKEN_NUM)
_MODEL_SEQ_LEN = 128000  # qwen_vl_utils' default total_pixels: 90% of this many tokens' pixels
_IMAGE_MIN_TOKENS, _IMAGE_MAX_TOKENS = 4, 16384  # a listed frame is first sized as an image (fetch_image)
_UNSUPPORTED = ("video_start", "video_end")


class VideoProblem(ImageProblem):
    """What is wrong with a row's videos (a short phrase; the dataset adds the file, the row and the column)."""


def load_video(item: Any, patch_size: int = 14) -> tuple[torch.Tensor, VideoMetadata]:
    """One item of a row's video list -> (frames uint8 [T, 3, H, W], metadata), as verl's ``process_video``."""
    if isinstance(item, Mapping):
        if item.get("video") is None:
            raise VideoProblem(f"has no 'video' (keys: {sorted(item)}); a video dict is {{'video': <frames | path>}}")
        source, options = item["video"], item
    else:
        source, options = item, {}
    if given := [key for key in _UNSUPPORTED if option(options, key) is not None]:
        raise VideoProblem(f"sets {given}: clips of a video are not read here; cut the file or list its frames")
    factor = patch_size * SPATIAL_MERGE
    if isinstance(source, (str, Path)):
        frames, metadata = _read_file(source, options)
        height, width = frames[0].shape[:2]
    elif isinstance(source, (list, tuple)):
        frames, metadata = _frame_list(list(source), options)
        height, width = smart_resize(
            *frames[0].shape[:2], factor=factor,
            min_pixels=option(options, "min_pixels", _IMAGE_MIN_TOKENS * factor**2),
            max_pixels=option(options, "max_pixels", _IMAGE_MAX_TOKENS * factor**2))
    else:
        raise VideoProblem(f"must be a list of frames, a path or a dict with 'video', got {type(source).__name__}")
    size = _frame_size(height, width, len(frames), options, factor)
    return _stack(frames, size), metadata


def sample_indices(total_frames: int, video_fps: float, options: Mapping[str, Any]) -> list[int]:
    """qwen_vl_utils' ``smart_nframes`` and its evenly spaced indices: which frames of a file are kept."""
    if option(options, "nframes") is not None and option(options, "fps") is not None:
        raise VideoProblem("sets both 'nframes' and 'fps'; give one")
    if option(options, "nframes") is not None:
        count = round(option(options, "nframes") / FRAME_FACTOR) * FRAME_FACTOR
    else:
        fps = option(options, "fps", _FPS)
        least = math.ceil(option(options, "min_frames", _MIN_FRAMES) / FRAME_FACTOR) * FRAME_FACTOR
        most = option(options, "max_frames", min(_MAX_FRAMES, total_frames)) // FRAME_FACTOR * FRAME_FACTOR
        wanted = min(max(total_frames / video_fps * fps, least), most, total_frames)
        count = math.floor(wanted / FRAME_FACTOR) * FRAME_FACTOR
    if not FRAME_FACTOR <= count <= total_frames:
        raise VideoProblem(f"has {total_frames} frame(s): too few to sample {count} of them (at least "
                           f"{FRAME_FACTOR}, at most the video's frames); lower 'nframes' / 'min_frames' or give a "
                           f"longer video")
    return torch.linspace(0, total_frames - 1, count).round().long().tolist()


# ---------------------------------------------------------------------------------------------- sources

def _read_file(source: str | Path, options: Mapping[str, Any]) -> tuple[list[np.ndarray], VideoMetadata]:
    text = str(source)
    if text.startswith(("http://", "https://")):
        raise VideoProblem(f"is a URL ({text!r}); videos are read from local files: download it first")
    path = Path(text.removeprefix("file://"))
    if not path.is_file():
        raise VideoProblem(f"file {str(path)!r} does not exist")
    capture = cv2.VideoCapture(str(path))
    try:
        if not capture.isOpened():
            raise VideoProblem(f"cannot be decoded ({str(path)!r}): OpenCV cannot open it as a video")
        video_fps = float(capture.get(cv2.CAP_PROP_FPS) or 0.0)
        total = int(capture.get(cv2.CAP_PROP_FRAME_COUNT) or 0)  # the container's count (decord's len() too)
        if total <= 0:
            total = _count_frames(capture)
    finally:
        capture.release()
    if total == 0:
        raise VideoProblem(f"has no frames ({str(path)!r})")
    if not video_fps > 0:
        raise VideoProblem(f"has no frame rate ({str(path)!r}, fps {video_fps}); give its frames as a list instead")
    indices = sample_indices(total, video_fps, options)
    frames = _decode(path, indices)
    if frames is None:  # the container counted frames that do not decode: count those that do, sample again
        capture = cv2.VideoCapture(str(path))
        total = _count_frames(capture)
        capture.release()
        indices = sample_indices(total, video_fps, options) if total else []
        frames = _decode(path, indices) if total else None
        if not frames:
            raise VideoProblem(f"cannot be decoded ({str(path)!r}): its frames do not decode")
    height, width = frames[0].shape[:2]
    metadata = VideoMetadata(total_num_frames=total, fps=video_fps, width=width, height=height,
                             duration=total / video_fps, video_backend="opencv", frames_indices=indices)
    return frames, metadata


def _count_frames(capture: cv2.VideoCapture) -> int:
    total = 0
    while capture.grab():
        total += 1
    return total


def _decode(path: Path, indices: Sequence[int]) -> list[np.ndarray] | None:
    """The frames at ``indices`` (sorted, repeats allowed) as RGB [H, W, 3] uint8, read in one pass; None when the
    video ends (or stops decoding) before the last of them."""
    capture = cv2.VideoCapture(str(path))
    frames, position, current = [], -1, None
    try:
        for index in indices:
            while position < index:
                if not capture.grab():
                    return None
                position, current = position + 1, None
            if current is None:
                ok, current = capture.retrieve()
                if not ok:
                    return None
            frames.append(cv2.cvtColor(current, cv2.COLOR_BGR2RGB))
    finally:
        capture.release()
    return frames


def _frame_list(items: list[Any], options: Mapping[str, Any]) -> tuple[list[np.ndarray], VideoMetadata]:
    if not items:
        raise VideoProblem("has no frames (an empty list)")
    frames = []
    for i, frame in enumerate(items):
        try:
            frames.append(np.asarray(to_rgb(open_item(frame)[0])))
        except ImageProblem as e:
            raise VideoProblem(f"frame {i} {e}") from None
        if 0 in frames[-1].shape[:2]:
            raise VideoProblem(f"frame {i} is empty ({frames[-1].shape[1]}x{frames[-1].shape[0]} pixels)")
    frames += [frames[-1]] * (-len(frames) % FRAME_FACTOR)  # qwen_vl_utils: the last frame to an even count
    sample_fps = float(option(options, "sample_fps", _FPS))
    raw_fps = float(option(options, "raw_fps", sample_fps))
    metadata = VideoMetadata(total_num_frames=round(len(frames) / sample_fps * raw_fps), fps=raw_fps,
                             frames_indices=list(range(len(frames))), video_backend="frames")
    return frames, metadata


# ---------------------------------------------------------------------------------------------- size

def _frame_size(height: int, width: int, num_frames: int, options: Mapping[str, Any],
                factor: int) -> tuple[int, int]:
    """qwen_vl_utils' size of every frame: per-frame limits, the ceiling shared out of ``total_pixels``."""
    min_pixels = option(options, "min_pixels", _MIN_TOKENS * factor**2)
    total_pixels = option(options, "total_pixels", _MODEL_SEQ_LEN * factor**2 * 0.9)
    ceiling = max(min(_MAX_TOKENS * factor**2, total_pixels / num_frames * FRAME_FACTOR), int(min_pixels * 1.05))
    max_pixels = min(option(options, "max_pixels", ceiling), ceiling)
    if max_pixels < min_pixels:
        raise VideoProblem(f"has max_pixels {max_pixels} below min_pixels {min_pixels} (default {_MIN_TOKENS} "
                           f"merged patches of {factor}x{factor} pixels): give both")
    try:
        if option(options, "resized_height") and option(options, "resized_width"):
            return smart_resize(options["resized_height"], options["resized_width"], factor=factor,
                                min_pixels=_IMAGE_MIN_TOKENS * factor**2, max_pixels=_IMAGE_MAX_TOKENS * factor**2)
        return smart_resize(height, width, factor=factor, min_pixels=min_pixels, max_pixels=max_pixels)
    except ValueError as e:  # e.g. an aspect ratio over 200
        raise VideoProblem(f"cannot be resized ({width}x{height} pixels): {e}") from None


def _stack(frames: list[np.ndarray], size: tuple[int, int]) -> torch.Tensor:
    """Frames (any sizes) -> uint8 [T, 3, H, W] at ``size`` (height, width); PIL's bicubic, as for images."""
    height, width = size
    out = np.empty((len(frames), height, width, 3), dtype=np.uint8)
    for i, frame in enumerate(frames):
        same = frame.shape[:2] == (height, width)
        out[i] = frame if same else np.asarray(Image.fromarray(frame).resize((width, height), Image.Resampling.BICUBIC))
    return torch.from_numpy(out).permute(0, 3, 1, 2).contiguous()
