"""Images through vLLM (``rollout.name=vllm``, Qwen2-VL / Qwen2.5-VL): what the colocated engine and the servers'
client share.

A prompt row of a vision-language batch carries verl's ``multi_modal_data`` (``{"image": [PIL.Image, ...]}``, the
images already resized as verl's ``process_image`` does) and its ``input_ids`` are the processor's EXPANDED tokens
(each image ``<|vision_start|>`` + N x ``<|image_pad|>`` + ``<|vision_end|>``). vLLM 0.32 always expands an image's
placeholder itself: its Qwen2-VL prompt update replaces ONE ``<|image_pad|>`` per image by the image's N
(vllm/model_executor/models/qwen2_vl.py ``_get_prompt_updates``, a ``PromptReplacement`` of target
``[image_token_id]``; vllm/multimodal/processing/processor.py ``_apply_prompt_updates`` applies it without looking
for an expansion already there). Sent expanded, a one-image prompt of N pads would come back with 2N - 1 (seen:
21 tokens -> 26). So vLLM gets verl's ``raw_prompt_ids`` form (every run of pads collapsed to one, ``engine_prompts``),
re-expands it from the same images with the checkpoint's processor, and the prompt it served is checked against
the trainer's token for token (``check_served_prompt``): the response follows exactly the prompt the trainer scores,
or the call fails naming the row.

vLLM's multimodal processor needs the tokenizer (``BaseMultiModalProcessor.requires_tokenizer``,
vllm/multimodal/processing/processor.py:1047): a vision-language engine starts without ``skip_tokenizer_init``
(requests still send token ids and ask no detokenisation). On CPU without torchvision, ``torchvision_free`` lets
vLLM's Qwen-VL code import (``torchvision_free/sitecustomize.py``).
"""

from __future__ import annotations

import base64
import contextlib
import io
import json
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from megatron_rl.protocol import DataProto

__all__ = [
    "MULTI_MODAL_DATA", "check_served_prompt", "collapse_image_pads", "engine_prompts", "image_data_url",
    "image_token_id", "row_images", "torchvision_free", "torchvision_free_env",
]

MULTI_MODAL_DATA = "multi_modal_data"  # verl's column: each row's {"image": [PIL.Image, ...]} (or None: text only)
_SITE = Path(__file__).with_name("torchvision_free")


def image_token_id(model_path: str | os.PathLike) -> int | None:
    """The checkpoint's ``<|image_pad|>`` id when it is a vision-language model (config.json has a vision_config),
    else None."""
    file = Path(model_path) / "config.json"
    if not file.is_file():
        return None
    config_json = json.loads(file.read_text())
    if not config_json.get("vision_config"):
        return None
    token = config_json.get("image_token_id")
    if not isinstance(token, int):
        raise ValueError(f"{file} has a vision_config but no integer image_token_id")
    return token


def row_images(prompts: DataProto, engine: str) -> list[list[Any]] | None:
    """Each row's images (a list; [] for a text row) from ``multi_modal_data``, or None when the batch has none.
    Other modalities are refused, naming the row."""
    column = prompts.non_tensor_batch.get(MULTI_MODAL_DATA)
    if column is None:
        return None
    rows: list[list[Any]] = []
    for row, data in enumerate(column):
        data = data or {}
        if not isinstance(data, dict):
            raise ValueError(f"{engine}: {MULTI_MODAL_DATA}[{row}] must be a dict such as {{'image': [...]}}, "
                             f"got {type(data).__name__}")
        other = sorted(k for k, v in data.items() if k != "image" and v is not None and len(v))
        if other:
            raise ValueError(f"{engine}: {MULTI_MODAL_DATA}[{row}] has {other}; only images reach the rollout engine")
        images = data.get("image")
        rows.append(list(images) if images is not None else [])
    return rows if any(rows) else None


def collapse_image_pads(ids: Sequence[int], pad: int, images: int, where: str) -> list[int]:
    """``ids`` with every run of ``pad`` collapsed to one pad (verl's raw_prompt_ids form: one per image); the
    runs must be as many as the row's images."""
    out: list[int] = []
    runs = 0
    for token in ids:
        if token == pad:
            if out and out[-1] == pad:
                continue
            runs += 1
        out.append(int(token))
    if runs != images:
        raise ValueError(f"{where}: the prompt has {runs} image placeholder run(s) (token {pad}) for {images} image(s)")
    return out


def engine_prompts(token_lists: list[list[int]], images: list[list[Any]] | None, pad: int | None,
                   engine: str) -> list[dict[str, Any]]:
    """vLLM prompts: ``{"prompt_token_ids": ids}`` for a text row, plus ``multi_modal_data`` with the image
    placeholders collapsed for a row with images. A text model (``pad`` None) refuses images."""
    if images is None:
        return [{"prompt_token_ids": ids} for ids in token_lists]
    if pad is None:
        row = next(i for i, r in enumerate(images) if r)
        raise ValueError(f"{engine}: prompt row {row} has images ({MULTI_MODAL_DATA}) but the model is a text model "
                         "(its config.json has no vision_config)")
    prompts = []
    for row, (ids, row_imgs) in enumerate(zip(token_lists, images)):
        if not row_imgs:
            if pad in ids:
                raise ValueError(f"{engine}: prompt row {row} has image tokens (id {pad}) but no image")
            prompts.append({"prompt_token_ids": ids})
            continue
        prompts.append({"prompt_token_ids": collapse_image_pads(ids, pad, len(row_imgs), f"{engine}: prompt row {row}"),
                        "multi_modal_data": {"image": row_imgs}})
    return prompts


def check_served_prompt(expected: Sequence[int], served: Sequence[int] | None, row: int, engine: str) -> None:
    """The prompt vLLM served (its placeholders expanded from the images) is the trainer's, token for token."""
    if served is None or list(served) != list(expected):
        length = "none" if served is None else len(served)
        raise RuntimeError(
            f"{engine}: prompt row {row} was served as {length} tokens, the trainer's prompt has {len(expected)}: vLLM "
            "expanded the image placeholders otherwise than the trainer's processor (other min_pixels / max_pixels, "
            "data.mm_processor_kwargs, or images not resized as the data side resizes them); the response would not "
            "follow the prompt the trainer scores")


def image_data_url(image: Any) -> str:
    """A PIL image (or a path / bytes) as a ``data:image/png;base64,...`` URL, lossless: the server decodes the same
    pixels."""
    if isinstance(image, (str, os.PathLike)):
        data = Path(image).read_bytes()
    elif isinstance(image, (bytes, bytearray)):
        data = bytes(image)
    else:
        buffer = io.BytesIO()
        image.save(buffer, format="PNG")
        data = buffer.getvalue()
    return "data:image/png;base64," + base64.b64encode(data).decode()


def torchvision_free_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """``env`` (default: this process's) with ``torchvision_free/`` first on PYTHONPATH, for a process that runs
    vLLM's Qwen-VL code without torchvision (a vLLM server's launcher)."""
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = os.pathsep.join([str(_SITE), *filter(None, [env.get("PYTHONPATH")])])
    return env


@contextlib.contextmanager
def torchvision_free(needed: bool) -> Iterator[bool]:
    """While vLLM starts a vision-language engine without torchvision: the finder in this process (vLLM's renderer
    processes the images here) and ``torchvision_free/`` on PYTHONPATH of every process it starts meanwhile (engine
    core, workers, the model-inspection subprocess). Yields whether it was needed; does nothing where torchvision
    imports or ``needed`` is false."""
    if not needed:
        yield False
        return
    import importlib.util

    spec = importlib.util.spec_from_file_location("_mrl_torchvision_free", _SITE / "sitecustomize.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not module.install():
        yield False
        return
    before = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = torchvision_free_env()["PYTHONPATH"]
    try:
        yield True
    finally:
        if before is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = before
