"""A torchvision-free stand-in for transformers' ``Qwen2VLVideoProcessor`` / ``Qwen3VLVideoProcessor``.

transformers' Qwen-VL video processors import torchvision (their resize). Without it,
megatron_rl.data.multimodal.load_processor gives the checkpoint's processor class this stand-in as its
``video_processor``, so that the processor's own ``__call__`` runs unchanged: its video token expansion,
Qwen2.5-VL's ``second_per_grid_ts`` and Qwen3-VL's ``<t seconds>`` timestamps.

It reads the same settings (``processor_config.json``'s ``video_processor``, else ``video_preprocessor_config.json``,
else ``preprocessor_config.json``; the class's defaults for what they lack) and gives the same outputs:
``pixel_values_videos`` [sum(t*h*w), C*tp*P*P] in transformers' patch order, ``video_grid_thw`` [videos, 3] and
``video_metadata``. Frames are resized (PIL bicubic, only when the size differs from ``smart_resize``'s: per frame for
Qwen2-VL, over all frames for Qwen3-VL), rescaled and normalized as there. Frames are never sampled here
(``do_sample_frames=False``): megatron_rl.data.video.load_video samples them, as verl does before the processor.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import fields
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from transformers.feature_extraction_utils import BatchFeature
from transformers.image_utils import IMAGENET_STANDARD_MEAN, IMAGENET_STANDARD_STD, OPENAI_CLIP_MEAN, OPENAI_CLIP_STD
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize as frame_smart_resize
from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize as video_smart_resize
from transformers.processing_utils import VideosKwargs
from transformers.video_utils import VideoMetadata

__all__ = ["QwenVideoProcessor"]

# the two transformers classes this stands in for, by the resize rule that tells them apart, and their defaults
_DEFAULTS = {
    "qwen2": dict(patch_size=14, size={"shortest_edge": 128 * 28 * 28, "longest_edge": 28 * 28 * 768},
                  image_mean=list(OPENAI_CLIP_MEAN), image_std=list(OPENAI_CLIP_STD), do_sample_frames=False),
    "qwen3": dict(patch_size=16, size={"shortest_edge": 128 * 32 * 32, "longest_edge": 32 * 32 * 768},
                  image_mean=list(IMAGENET_STANDARD_MEAN), image_std=list(IMAGENET_STANDARD_STD),
                  do_sample_frames=True),
}
_COMMON = dict(temporal_patch_size=2, merge_size=2, do_resize=True, do_rescale=True, rescale_factor=1 / 255,
               do_normalize=True)
_SETTINGS = ("size", "patch_size", "temporal_patch_size", "merge_size", "do_resize", "do_rescale", "rescale_factor",
             "do_normalize", "image_mean", "image_std")
# accepted and without effect here: sampling settings (frames come sampled), conversions the frames need not
_IGNORED = frozenset({"do_convert_rgb", "device", "input_data_format", "data_format", "fps", "num_frames", "min_frames",
                      "max_frames", "resample", "default_to_square", "do_center_crop", "crop_size", "do_pad",
                      "max_video_tokens", "cap_pixels_per_frame"})


class _Kwargs(VideosKwargs, total=False):
    """What ProcessorMixin routes to a video processor (its ``valid_kwargs``), as transformers' Qwen classes."""

    min_pixels: int
    max_pixels: int
    patch_size: int
    temporal_patch_size: int
    merge_size: int
    min_frames: int
    max_frames: int
    cap_pixels_per_frame: bool
    max_video_tokens: int


class QwenVideoProcessor:
    """Qwen-VL videos -> ``pixel_values_videos``, ``video_grid_thw`` (and ``video_metadata``), without torchvision.

    ``rule``: ``"qwen2"`` (Qwen2VLVideoProcessor: each frame within ``size``, ``min_pixels`` / ``max_pixels``
    override it) or ``"qwen3"`` (Qwen3VLVideoProcessor: ``size`` bounds frames * height * width).
    """

    valid_kwargs = _Kwargs
    model_input_names = ["pixel_values_videos", "video_grid_thw"]

    def __init__(self, rule: str = "qwen2", **settings: Any) -> None:
        if rule not in _DEFAULTS:
            raise ValueError(f"unknown video processor rule {rule!r}; known: {sorted(_DEFAULTS)}")
        self.rule = rule
        given = {key: value for key, value in settings.items() if value is not None}
        for key, default in {**_COMMON, **_DEFAULTS[rule]}.items():
            setattr(self, key, given.get(key, default))
        # Qwen2VLVideoProcessor lets min_pixels / max_pixels override size; Qwen3VLVideoProcessor ignores them
        self.size = self._size(self.size, given if rule == "qwen2" else {})

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, processor_class: str | None = None) -> QwenVideoProcessor:
        """The stand-in with the settings transformers' AutoVideoProcessor would read from ``model_dir``."""
        settings = _read_settings(Path(model_dir))
        kind = str(settings.get("video_processor_type") or processor_class or settings.get("processor_class") or "")
        return cls("qwen3" if kind.startswith("Qwen3") else "qwen2", **settings)

    def _size(self, size: Any, overrides: Mapping[str, Any]) -> dict[str, int]:
        size = dict(size) if isinstance(size, Mapping) else {k: getattr(size, k, None)
                                                                for k in ("shortest_edge", "longest_edge")}
        for key, edge in (("min_pixels", "shortest_edge"), ("max_pixels", "longest_edge")):
            if overrides.get(key) is not None:
                size[edge] = overrides[key]
        if not size.get("shortest_edge") or not size.get("longest_edge"):
            raise ValueError(f"the video processor's size needs 'shortest_edge' and 'longest_edge', got {size}")
        return size

    def __call__(self, videos: Any, video_metadata: Any = None, do_sample_frames: bool | None = None,
                 return_tensors: str | None = None, return_metadata: bool = False, **kwargs: Any) -> BatchFeature:
        unknown = sorted(set(kwargs) - set(_SETTINGS) - _IGNORED - {"min_pixels", "max_pixels"})
        if unknown:
            raise TypeError(f"{type(self).__name__} got unknown keyword argument(s) {unknown}")
        if do_sample_frames if do_sample_frames is not None else self.do_sample_frames:
            raise ValueError("this video processor (no torchvision) does not sample frames: sample them first "
                             "(megatron_rl.data.video.load_video) and call with do_sample_frames=False")
        if kwargs.get("cap_pixels_per_frame"):
            raise ValueError("cap_pixels_per_frame=True is not built here; frames from load_video are capped as "
                             "qwen_vl_utils caps them")
        if self.rule != "qwen2" and {"min_pixels", "max_pixels"} & set(kwargs):
            raise TypeError("min_pixels / max_pixels are not settings of Qwen3VLVideoProcessor (its size bounds "
                            "frames * height * width); give size={'shortest_edge': ..., 'longest_edge': ...}")
        settings = {key: kwargs.get(key) if kwargs.get(key) is not None else getattr(self, key) for key in _SETTINGS}
        settings["size"] = self._size(settings["size"], kwargs)
        videos = _as_videos(videos)
        metadata = _as_metadata(video_metadata, videos)
        pixels, grids = zip(*(self._encode(video, **settings) for video in videos)) if videos else ((), ())
        out = BatchFeature(data={"pixel_values_videos": torch.cat(pixels) if pixels else torch.empty(0),
                                 "video_grid_thw": torch.tensor(list(grids), dtype=torch.long).reshape(-1, 3)},
                           tensor_type=return_tensors)
        if return_metadata:
            out["video_metadata"] = metadata
        return out

    def _encode(self, video: torch.Tensor, *, size: dict[str, int], patch_size: int, temporal_patch_size: int,
                merge_size: int, do_resize: bool, do_rescale: bool, rescale_factor: float, do_normalize: bool,
                image_mean: Sequence[float], image_std: Sequence[float]) -> tuple[torch.Tensor, list[int]]:
        frames, _, height, width = video.shape
        factor = patch_size * merge_size
        if do_resize:
            if self.rule == "qwen2":
                target = frame_smart_resize(height, width, factor=factor, min_pixels=size["shortest_edge"],
                                            max_pixels=size["longest_edge"])
            else:
                target = video_smart_resize(frames, height, width, temporal_factor=temporal_patch_size,
                                            factor=factor, min_pixels=size["shortest_edge"],
                                            max_pixels=size["longest_edge"])
            if tuple(target) != (height, width):
                video = _resize(video, *target)
        video = _rescale_and_normalize(video, do_rescale, rescale_factor, do_normalize, image_mean, image_std)
        return _patchify(video, patch_size, merge_size, temporal_patch_size)


def _read_settings(model_dir: Path) -> dict[str, Any]:
    """AutoVideoProcessor's order: the nested processor config, the video processor's file, the image processor's."""
    nested = model_dir / "processor_config.json"
    if nested.is_file() and isinstance(found := json.loads(nested.read_text()).get("video_processor"), dict):
        return found
    for name in ("video_preprocessor_config.json", "preprocessor_config.json"):
        if (model_dir / name).is_file():
            return json.loads((model_dir / name).read_text())
    return {}


# ---------------------------------------------------------------------------------------------- inputs

def _is_frames(value: Any) -> bool:
    if isinstance(value, (torch.Tensor, np.ndarray)):
        return value.ndim == 4
    return isinstance(value, (list, tuple)) and bool(value) and all(
        isinstance(f, Image.Image) or (isinstance(f, (torch.Tensor, np.ndarray)) and f.ndim == 3) for f in value)


def _as_videos(videos: Any) -> list[torch.Tensor]:
    """One video or a list of them (each [T, C, H, W] / [T, H, W, C], or a list of frames) -> [T, 3, H, W] each."""
    if _is_frames(videos):
        videos = [videos]
    elif isinstance(videos, (torch.Tensor, np.ndarray)) and videos.ndim == 5:
        videos = list(videos)
    out = []
    for video in videos:
        if not _is_frames(video):
            raise ValueError(f"a video must be a 4-D array or a list of frames, got {type(video).__name__}")
        if isinstance(video, (list, tuple)):
            video = np.stack([np.asarray(f.convert("RGB")) if isinstance(f, Image.Image) else np.asarray(f)
                              for f in video])
        video = torch.as_tensor(video)
        if video.shape[1] not in (1, 3) and video.shape[-1] in (1, 3):  # channels last
            video = video.permute(0, 3, 1, 2)
        if video.shape[1] == 1:
            video = video.expand(-1, 3, -1, -1)
        if video.shape[1] != 3:
            raise ValueError(f"a video's frames must have 3 channels, got shape {tuple(video.shape)}")
        out.append(video.contiguous())
    return out


def _as_metadata(metadata: Any, videos: list[torch.Tensor]) -> list[VideoMetadata]:
    """The videos' metadata as VideoMetadata (dicts too, as qwen_vl_utils writes them); defaults where None."""
    if metadata is None:
        metadata = [None] * len(videos)
    elif isinstance(metadata, Mapping):  # VideoMetadata is a Mapping too
        metadata = [metadata]
    metadata = list(metadata)
    if len(metadata) != len(videos):
        raise ValueError(f"{len(metadata)} video_metadata for {len(videos)} videos")
    names = {f.name for f in fields(VideoMetadata)}
    out = []
    for item, video in zip(metadata, videos):
        if item is None:
            item = VideoMetadata(total_num_frames=len(video), frames_indices=list(range(len(video))),
                                 height=video.shape[-2], width=video.shape[-1])
        elif not isinstance(item, VideoMetadata):
            item = VideoMetadata(**{key: value for key, value in item.items() if key in names})
        out.append(item)
    return out


# ---------------------------------------------------------------------------------------------- pixels

def _resize(video: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """Bicubic with PIL, frame by frame (uint8 frames as RGB images, float ones channel by channel)."""
    size, bicubic = (width, height), Image.Resampling.BICUBIC
    if video.dtype == torch.uint8:
        frames = [np.asarray(Image.fromarray(f.permute(1, 2, 0).numpy()).resize(size, bicubic)) for f in video]
        return torch.from_numpy(np.stack(frames)).permute(0, 3, 1, 2).contiguous()
    planes = [[np.asarray(Image.fromarray(c.float().numpy(), mode="F").resize(size, bicubic)) for c in f]
              for f in video]
    return torch.from_numpy(np.asarray(planes, dtype=np.float32))


def _rescale_and_normalize(video: torch.Tensor, do_rescale: bool, rescale_factor: float, do_normalize: bool,
                           image_mean: Sequence[float], image_std: Sequence[float]) -> torch.Tensor:
    """transformers' fused form: (x - mean / r) / (std / r) in float32 when both are on."""
    video = video.to(torch.float32)
    if do_normalize:
        mean, std = torch.tensor(image_mean), torch.tensor(image_std)
        if do_rescale:
            mean, std = mean * (1.0 / rescale_factor), std * (1.0 / rescale_factor)
        return (video - mean[:, None, None]) / std[:, None, None]
    return video * rescale_factor if do_rescale else video


def _patchify(video: torch.Tensor, patch: int, merge: int, temporal: int) -> tuple[torch.Tensor, list[int]]:
    """[T, C, H, W] -> ([t*h*w, C*temporal*patch*patch], [t, h, w]) in transformers' order: temporal patches, then
    merge windows row by row, the patches of a window row by row; each row is channels x frames x pixels."""
    if pad := -len(video) % temporal:  # the last frame repeated to a whole temporal patch
        video = torch.cat([video, video[-1:].expand(pad, -1, -1, -1)])
    frames, channels, height, width = video.shape
    t, h, w = frames // temporal, height // patch, width // patch
    blocks = video.reshape(t, temporal, channels, h // merge, merge, patch, w // merge, merge, patch)
    # (t, temporal, C, h/m, m, P, w/m, m, P) -> (t, h/m, w/m, m, m, C, temporal, P, P)
    blocks = blocks.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return blocks.reshape(t * h * w, channels * temporal * patch * patch), [t, h, w]
