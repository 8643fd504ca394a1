"""verl's multimodal rows: an image column and ``<image>`` placeholders, a video column and ``<video>`` placeholders,
encoded by the checkpoint's processor.

A row's images (column ``data.image_key``, verl's default ``images``) are a list whose items are ``{"bytes": ...}``
(what HF datasets and verl's preprocessing scripts write), ``{"image": <path | bytes>}``, a path string or a
PIL image. Each ``<image>`` in a message becomes an image part of the message's content list, in order (verl's
``RLHFDataset._build_messages``); the chat template renders it as ``<|vision_start|><|image_pad|><|vision_end|>``
and the processor expands the pad to the image's ``grid_t*grid_h*grid_w / merge_size**2`` tokens.

Images are resized as verl's ``process_image`` (qwen_vl_utils' ``fetch_image``) does before the processor sees
them: to multiples of ``patch_size * 2`` within the item's ``min_pixels`` / ``max_pixels`` (or its
``resized_height`` / ``resized_width``), qwen_vl_utils' defaults otherwise; the rollout engines get those
resized images, so they and the trainer see the same pixels.

A row's videos (column ``data.video_key``, verl's default ``videos``) and their ``<video>`` placeholders work the
same way; megatron_rl.data.video reads them (frames and metadata, as verl's ``process_video``) and, without
torchvision, megatron_rl.data.video_processor stands in for transformers' video processor.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import transformers
from PIL import Image
from transformers import AutoConfig, AutoProcessor, ProcessorMixin
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize
from transformers.video_utils import VideoMetadata

from megatron_rl.data.pixels import SPATIAL_MERGE, ImageProblem, open_item, to_rgb
from megatron_rl.data.video import VIDEO_PLACEHOLDER, VideoProblem, load_video
from megatron_rl.data.video_processor import QwenVideoProcessor

__all__ = [
    "IMAGE_PLACEHOLDER",
    "VIDEO_PLACEHOLDER",
    "ImageProblem",
    "NoVisionError",
    "VideoProblem",
    "VisionEncoder",
    "build_messages",
    "has_vision",
    "load_image",
    "load_processor",
]

IMAGE_PLACEHOLDER = "<image>"
_PLACEHOLDER_SPLIT = re.compile(f"({re.escape(IMAGE_PLACEHOLDER)}|{re.escape(VIDEO_PLACEHOLDER)})")
# qwen_vl_utils' fetch_image defaults: between 4 and 16384 merged patches per image
_MIN_MERGED_PATCHES, _MAX_MERGED_PATCHES = 4, 16384
# the processors whose video processor QwenVideoProcessor stands in for (Qwen2VLVideoProcessor, Qwen3VLVideoProcessor)
_QWEN_VIDEO_PROCESSORS = ("Qwen2VLProcessor", "Qwen2_5_VLProcessor", "Qwen3VLProcessor", "Qwen3VLMoeProcessor")
Video = tuple[torch.Tensor, VideoMetadata]  # frames uint8 [T, 3, H, W] and their metadata (megatron_rl.data.video)


class NoVisionError(ValueError):
    """The model directory has no vision tower or image processor."""


# ---------------------------------------------------------------------------------------------- the processor

def has_vision(model_dir: str | Path) -> bool:
    """True when the directory's config has a vision tower and it ships an image processor config."""
    model_dir = Path(model_dir)
    if not (model_dir / "config.json").is_file() or not (model_dir / "preprocessor_config.json").is_file():
        return False
    config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    return getattr(config, "vision_config", None) is not None


def load_processor(model_dir: str | Path) -> ProcessorMixin:
    """The checkpoint's own processor (``AutoProcessor``, offline).

    Qwen-VL processors carry a video processor that needs torchvision; without torchvision the same processor
    class is built with its image processor and tokenizer, and megatron_rl.data.video_processor's stand-in as its
    video processor (same settings, same outputs), so that its ``__call__`` and chat template are the class's own.
    """
    model_dir = Path(model_dir)
    if not has_vision(model_dir):
        raise NoVisionError(
            f"the model at {str(model_dir)!r} has no vision: its config.json has no vision_config or the "
            f"directory has no preprocessor_config.json"
        )
    try:
        processor = AutoProcessor.from_pretrained(model_dir, local_files_only=True)
    except ImportError as e:
        if "torchvision" not in str(e).lower():
            raise
        processor = _image_only_processor_class(_processor_class_name(model_dir)).from_pretrained(
            model_dir, local_files_only=True)
    # without torchvision (also where vLLM's images-only processor stands in for transformers' class in this
    # process: rollout/vllm/torchvision_free) the stand-in is the video processor; the processor's __call__ finds it
    # as transformers' own would be found
    if importlib.util.find_spec("torchvision") is None:
        name = _processor_class_name(model_dir)
        if name in _QWEN_VIDEO_PROCESSORS:
            processor.video_processor = QwenVideoProcessor.from_pretrained(model_dir, name)
    return processor


def _processor_class_name(model_dir: Path) -> str:
    for name in ("processor_config.json", "preprocessor_config.json"):
        path = model_dir / name
        if path.is_file() and (found := json.loads(path.read_text()).get("processor_class")):
            return found
    model_type = AutoConfig.from_pretrained(model_dir, local_files_only=True).model_type
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES

    if model_type not in PROCESSOR_MAPPING_NAMES:
        raise NoVisionError(f"the model at {str(model_dir)!r} (model_type {model_type!r}) has no known processor")
    return PROCESSOR_MAPPING_NAMES[model_type]


def _image_only_processor_class(name: str) -> type[ProcessorMixin]:
    base = getattr(transformers, name)

    # ProcessorMixin takes its sub-processors from __init__'s signature: without video_processor it loads
    # and checks only the image processor and the tokenizer; the base class gets None for the video (load_processor
    # then sets the stand-in as a plain attribute).
    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        base.__init__(self, image_processor=image_processor, tokenizer=tokenizer, video_processor=None,
                      chat_template=chat_template, **kwargs)

    return type(f"{name}ImagesOnly", (base,), {"__init__": __init__})


# ---------------------------------------------------------------------------------------------- images

def load_image(item: Any, patch_size: int = 14) -> Image.Image:
    """One item of a row's image list -> an RGB PIL image, resized as verl's ``process_image`` does."""
    image, options = open_item(item)
    width, height = image.size
    if width == 0 or height == 0:
        raise ImageProblem(f"is empty ({width}x{height} pixels)")
    factor = patch_size * SPATIAL_MERGE
    try:
        if options.get("resized_height") and options.get("resized_width"):
            height, width = options["resized_height"], options["resized_width"]
        size = smart_resize(
            height, width, factor=factor,
            min_pixels=options.get("min_pixels") or _MIN_MERGED_PATCHES * factor**2,
            max_pixels=options.get("max_pixels") or _MAX_MERGED_PATCHES * factor**2,
        )
    except ValueError as e:  # e.g. an aspect ratio over 200
        raise ImageProblem(f"cannot be resized ({width}x{height} pixels): {e}") from None
    return to_rgb(image).resize((size[1], size[0]))


# ---------------------------------------------------------------------------------------------- messages

def build_messages(messages: Sequence[Mapping[str, Any]], num_images: int,
                   num_videos: int = 0) -> list[dict[str, Any]]:
    """verl's ``_build_messages``: each ``<image>`` / ``<video>`` of a message's text becomes an image / video part,
    in order.

    Parts are ``{"type": "image"}`` / ``{"type": "video"}``: the items themselves travel in ``multi_modal_data``.
    Raises :class:`ImageProblem` when the placeholders of either kind and the items differ in number.
    """
    out, found = [], {IMAGE_PLACEHOLDER: 0, VIDEO_PLACEHOLDER: 0}
    for message in messages:
        parts = []
        for segment in _PLACEHOLDER_SPLIT.split(message["content"]):
            if segment in found:
                parts.append({"type": "image" if segment == IMAGE_PLACEHOLDER else "video"})
                found[segment] += 1
            elif segment:
                parts.append({"type": "text", "text": segment})
        out.append({**message, "content": parts})
    wanted = ((IMAGE_PLACEHOLDER, num_images, "image"), (VIDEO_PLACEHOLDER, num_videos, "video"))
    wrong = [f"{found[mark]} {mark} placeholder(s) but the row has {count} {kind}(s)"
             for mark, count, kind in wanted if found[mark] != count]
    if wrong:
        raise ImageProblem(
            f"the prompt has {' and '.join(wrong)}; each image needs one {IMAGE_PLACEHOLDER} and each video one "
            f"{VIDEO_PLACEHOLDER} where it belongs in the text"
        )
    return out


# ---------------------------------------------------------------------------------------------- encoding

@dataclass
class VisionEncoder:
    """Chat-templates and encodes multimodal rows with one processor.

    ``processor_kwargs``: verl's ``data.mm_processor_kwargs``, passed to every processor call (``min_pixels`` /
    ``max_pixels`` there become the image processor's ``size``, the name transformers reads them by).
    ``patch_size``: verl's ``data.image_patch_size`` for the pre-resize of images and video frames; None: the
    image processor's own. ``image_key`` / ``video_key``: the rows' columns, named in problems.
    """

    processor: ProcessorMixin
    image_key: str = "images"
    processor_kwargs: Mapping[str, Any] = field(default_factory=dict)
    patch_size: int | None = None
    video_key: str = "videos"

    def __post_init__(self) -> None:
        self.patch_size = self.patch_size or getattr(self.processor.image_processor, "patch_size", 14)
        kwargs = dict(self.processor_kwargs)
        if "min_pixels" in kwargs or "max_pixels" in kwargs:
            size = dict(self.processor.image_processor.size)
            size["shortest_edge"] = kwargs.pop("min_pixels", size.get("shortest_edge"))
            size["longest_edge"] = kwargs.pop("max_pixels", size.get("longest_edge"))
            # the images' only: a video processor's size means other things (Qwen3-VL: frames * height * width)
            kwargs["images_kwargs"] = {**kwargs.get("images_kwargs", {}), "size": size}
        self._call_kwargs = kwargs

    def load_images(self, items: Any) -> list[Image.Image]:
        """The row's image column -> RGB images; :class:`ImageProblem` naming the item that is wrong."""
        if not isinstance(items, (list, tuple)):
            raise ImageProblem(f"{self.image_key!r} (data.image_key) must be a list of images, "
                               f"got {type(items).__name__}")
        images = []
        for i, item in enumerate(items):
            try:
                images.append(load_image(item, self.patch_size))
            except ImageProblem as e:
                raise ImageProblem(f"{self.image_key}[{i}] {e}") from None
        return images

    def load_videos(self, items: Any) -> list[Video]:
        """The row's video column -> (frames, metadata) per video; :class:`VideoProblem` naming the item."""
        if not isinstance(items, (list, tuple)):
            raise VideoProblem(f"{self.video_key!r} (data.video_key) must be a list of videos, "
                               f"got {type(items).__name__}")
        videos = []
        for i, item in enumerate(items):
            try:
                videos.append(load_video(item, self.patch_size))
            except ImageProblem as e:  # VideoProblem, or an ImageProblem of a listed frame
                raise VideoProblem(f"{self.video_key}[{i}] {e}") from None
        return videos

    def messages(self, prompt: Sequence[Mapping[str, Any]], num_images: int, num_videos: int) -> list[dict[str, Any]]:
        """:func:`build_messages`, its problem naming the columns."""
        try:
            return build_messages(prompt, num_images, num_videos)
        except ImageProblem as e:
            raise ImageProblem(f"{e} (columns {self.image_key!r} / {self.video_key!r}: data.image_key / "
                               f"data.video_key)") from None

    def render(self, messages: list[dict[str, Any]]) -> str:
        return self.processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)

    def encode(self, text: str, images: list[Image.Image], videos: Sequence[Video] = ()) -> dict[str, Any]:
        """The processor's output for one prompt: ``input_ids`` (1-D list, image and video pads expanded); with
        images ``pixel_values`` [patches, C*T*P*P] and ``image_grid_thw`` [images, 3]; with videos
        ``pixel_values_videos`` [patches, C*T*P*P], ``video_grid_thw`` [videos, 3] and, where the processor gives
        it (Qwen2.5-VL), ``second_per_grid_ts`` (float [videos])."""
        kwargs = dict(self._call_kwargs)
        if videos:
            if getattr(self.processor, "video_processor", None) is None:
                raise VideoProblem(f"the processor ({type(self.processor).__name__}) takes no videos "
                                   f"({self.video_key!r}, data.video_key)")
            # the frames come sampled (load_video); copies: Qwen3-VL's processor may fill in a missing fps
            kwargs.update(videos=[frames for frames, _ in videos], do_sample_frames=False,
                          video_metadata=[copy.copy(metadata) for _, metadata in videos])
        try:
            out = self.processor(text=[text], images=images or None, return_tensors="pt", **kwargs)
        except Exception as e:  # the processor's own refusal of an image or a video (size, aspect ratio) is the row's
            what = "images and videos" if images and videos else "videos" if videos else "images"
            raise (VideoProblem if videos else ImageProblem)(
                f"the processor refused the {what}: {type(e).__name__}: {e}") from None
        encoded = {"input_ids": out["input_ids"][0].tolist()}
        keys = [*(("pixel_values", "image_grid_thw") if images else ()),
                *(("pixel_values_videos", "video_grid_thw") if videos else ())]
        encoded.update({key: out[key] for key in keys})
        if videos and out.get("second_per_grid_ts") is not None:
            encoded["second_per_grid_ts"] = torch.as_tensor(out["second_per_grid_ts"], dtype=torch.float32).reshape(-1)
        return encoded
