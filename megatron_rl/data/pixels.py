"""Opening the image items of verl's rows (and the frames of a video given as a list), shared by
megatron_rl.data.multimodal (images) and megatron_rl.data.video (frames).

An item is ``{"bytes": ...}``, ``{"image": <path | bytes | PIL>}``, a path string (``file://`` allowed), bytes or a
PIL image. Problems are :class:`ImageProblem` phrases; the dataset adds the file, the row and the column.
"""

from __future__ import annotations

from collections.abc import Mapping
from io import BytesIO
from pathlib import Path
from typing import Any

from PIL import Image

__all__ = ["SPATIAL_MERGE", "ImageProblem", "open_image", "open_item", "option", "to_rgb"]

SPATIAL_MERGE = 2  # Qwen-VL merges 2x2 patches into one token: sizes are multiples of patch_size * 2


class ImageProblem(ValueError):
    """What is wrong with a row's images (a short phrase; the dataset adds the file and row)."""


def option(options: Mapping[str, Any], key: str, default: Any = None) -> Any:
    """``options[key]``, or ``default`` when it is missing or None (a parquet struct column fills absent keys with
    None, so None means "not given")."""
    value = options.get(key)
    return default if value is None else value


def open_item(item: Any) -> tuple[Image.Image, Mapping[str, Any]]:
    """An image item -> (the opened image, the item's options: the dict itself, or {} for a bare item)."""
    if isinstance(item, Mapping):
        if item.get("bytes") is not None:
            return open_image(item["bytes"]), item
        if item.get("image") is not None:
            return open_image(item["image"]), item
        raise ImageProblem(f"has neither 'bytes' nor 'image' (keys: {sorted(item)})")
    return open_image(item), {}


def open_image(source: Any) -> Image.Image:
    """Bytes, a path or a PIL image -> a PIL image whose pixels are loaded (a corrupt body fails here, not later)."""
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


def to_rgb(image: Image.Image) -> Image.Image:
    if image.mode in ("RGBA", "LA") or "transparency" in image.info:
        rgba = image.convert("RGBA")
        background = Image.new("RGB", image.size, (255, 255, 255))  # qwen_vl_utils: transparency on white
        background.paste(rgba, mask=rgba.split()[3])
        return background
    return image.convert("RGB")
