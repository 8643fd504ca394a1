"""verl's multimodal rows: an image column and ``<image>`` placeholders, encoded by the checkpoint's processor.

A row's images (column ``data.image_key``, verl's default ``images``) are a list whose items are ``{"bytes": ...}``
(what HF datasets and verl's preprocessing scripts write), ``{"image": <path | bytes>}``, a path string or a
PIL image. Each ``<image>`` in a message becomes an image part of the message's content list, in order (verl's
``RLHFDataset._build_messages``); the chat template renders it as ``<|vision_start|><|image_pad|><|vision_end|>``
and the processor expands the pad to the image's ``grid_t*grid_h*grid_w / merge_size**2`` tokens.

Images are resized as verl's ``process_image`` (qwen_vl_utils' ``fetch_image``) does before the processor sees
them: to multiples of ``patch_size * 2`` within the item's ``min_pixels`` / ``max_pixels`` (or its
``resized_height`` / ``resized_width``), qwen_vl_utils' defaults otherwise; the rollout engines get those
resized images, so they and the trainer see the same pixels.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from io import BytesIO
from pathlib import Path
from typing import Any

import transformers
from PIL import Image
from transformers import AutoConfig, AutoProcessor, ProcessorMixin
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

__all__ = [
    "IMAGE_PLACEHOLDER",
    "ImageProblem",
    "NoVisionError",
    "VisionEncoder",
    "build_messages",
    "has_vision",
    "load_image",
    "load_processor",
]

IMAGE_PLACEHOLDER = "<image>"
_PLACEHOLDER_SPLIT = re.compile(f"({re.escape(IMAGE_PLACEHOLDER)})")
# qwen_vl_utils' fetch_image defaults: between 4 and 16384 merged patches per image
_MIN_MERGED_PATCHES, _MAX_MERGED_PATCHES = 4, 16384
_SPATIAL_MERGE = 2


class ImageProblem(ValueError):
    """What is wrong with a row's images (a short phrase; the dataset adds the file and row)."""


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
    class is built with only its image processor and tokenizer (its ``__call__`` and chat template are the
    class's own), since megatron-rl's rows carry images, not videos.
    """
    model_dir = Path(model_dir)
    if not has_vision(model_dir):
        raise NoVisionError(
            f"the model at {str(model_dir)!r} has no vision: its config.json has no vision_config or the "
            f"directory has no preprocessor_config.json"
        )
    try:
        return AutoProcessor.from_pretrained(model_dir, local_files_only=True)
    except ImportError as e:
        if "torchvision" not in str(e).lower():
            raise
    return _image_only_processor_class(_processor_class_name(model_dir)).from_pretrained(
        model_dir, local_files_only=True
    )


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
    # and checks only the image processor and the tokenizer; the base class gets None for the video.
    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        base.__init__(self, image_processor=image_processor, tokenizer=tokenizer, video_processor=None,
                      chat_template=chat_template, **kwargs)

    return type(f"{name}ImagesOnly", (base,), {"__init__": __init__})


# ---------------------------------------------------------------------------------------------- images

def load_image(item: Any, patch_size: int = 14) -> Image.Image:
    """One item of a row's image list -> an RGB PIL image, resized as verl's ``process_image`` does."""
    if isinstance(item, Mapping):
        if item.get("bytes") is not None:
            image = _open(item["bytes"])
        elif item.get("image") is not None:
            image = _open(item["image"])
        else:
            raise ImageProblem(f"has neither 'bytes' nor 'image' (keys: {sorted(item)})")
        options = item
    else:
        image, options = _open(item), {}
    width, height = image.size
    if width == 0 or height == 0:
        raise ImageProblem(f"is empty ({width}x{height} pixels)")
    factor = patch_size * _SPATIAL_MERGE
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
    return _to_rgb(image).resize((size[1], size[0]))


def _open(source: Any) -> Image.Image:
    if isinstance(source, Image.Image):
        return source
    if isinstance(source, (bytes, bytearray)):
        data, what = BytesIO(source), f"{len(source)} bytes"
    elif isinstance(source, (str, Path)):
        path = Path(str(source).removeprefix("file://"))
        if not path.is_file():
            raise ImageProblem(f"file {str(path)!r} does not exist")
        data, what = path, repr(str(path))
    else:
        raise ImageProblem(f"must be bytes, a path or a dict with 'bytes' or 'image', got {type(source).__name__}")
    try:
        image = Image.open(data)
        image.load()  # open() reads the header only; a truncated or corrupt body fails here
    except Exception as e:
        raise ImageProblem(f"cannot be decoded ({what}): {type(e).__name__}: {e}") from None
    return image


def _to_rgb(image: Image.Image) -> Image.Image:
    if image.mode in ("RGBA", "LA") or "transparency" in image.info:
        rgba = image.convert("RGBA")
        background = Image.new("RGB", image.size, (255, 255, 255))  # qwen_vl_utils: transparency on white
        background.paste(rgba, mask=rgba.split()[3])
        return background
    return image.convert("RGB")


# ---------------------------------------------------------------------------------------------- messages

def build_messages(messages: Sequence[Mapping[str, Any]], num_images: int) -> list[dict[str, Any]]:
    """verl's ``_build_messages``: each ``<image>`` of a message's text becomes an image part, in order.

    Image parts are ``{"type": "image"}``: the images themselves travel in ``multi_modal_data``.
    Raises :class:`ImageProblem` when the placeholders and the images differ in number.
    """
    out, found = [], 0
    for message in messages:
        parts = []
        for segment in _PLACEHOLDER_SPLIT.split(message["content"]):
            if segment == IMAGE_PLACEHOLDER:
                parts.append({"type": "image"})
                found += 1
            elif segment:
                parts.append({"type": "text", "text": segment})
        out.append({**message, "content": parts})
    if found != num_images:
        raise ImageProblem(
            f"the prompt has {found} {IMAGE_PLACEHOLDER} placeholder(s) but the row has {num_images} image(s); "
            f"each image needs one {IMAGE_PLACEHOLDER} where it belongs in the text"
        )
    return out


# ---------------------------------------------------------------------------------------------- encoding

@dataclass
class VisionEncoder:
    """Chat-templates and encodes multimodal rows with one processor.

    ``processor_kwargs``: verl's ``data.mm_processor_kwargs``, passed to every processor call (``min_pixels`` /
    ``max_pixels`` there become the image processor's ``size``, the name transformers reads them by).
    ``patch_size``: verl's ``data.image_patch_size`` for the pre-resize; None: the image processor's own.
    ``image_key``: the rows' image column, named in problems.
    """

    processor: ProcessorMixin
    image_key: str = "images"
    processor_kwargs: Mapping[str, Any] = field(default_factory=dict)
    patch_size: int | None = None

    def __post_init__(self) -> None:
        self.patch_size = self.patch_size or getattr(self.processor.image_processor, "patch_size", 14)
        kwargs = dict(self.processor_kwargs)
        if "min_pixels" in kwargs or "max_pixels" in kwargs:
            size = dict(self.processor.image_processor.size)
            size["shortest_edge"] = kwargs.pop("min_pixels", size.get("shortest_edge"))
            size["longest_edge"] = kwargs.pop("max_pixels", size.get("longest_edge"))
            kwargs["size"] = size
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

    def render(self, messages: list[dict[str, Any]]) -> str:
        return self.processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)

    def encode(self, text: str, images: list[Image.Image]) -> dict[str, Any]:
        """The processor's output for one prompt: ``input_ids`` (1-D list, image pads expanded),
        ``pixel_values`` [num_patches, C*T*P*P] and ``image_grid_thw`` [num_images, 3]."""
        try:
            out = self.processor(text=[text], images=images, return_tensors="pt", **self._call_kwargs)
        except Exception as e:  # the processor's own refusal of an image (size, aspect ratio) is the row's
            raise ImageProblem(f"the processor refused the images: {type(e).__name__}: {e}") from None
        return {
            "input_ids": out["input_ids"][0].tolist(),
            "pixel_values": out["pixel_values"],
            "image_grid_thw": out["image_grid_thw"],
        }
