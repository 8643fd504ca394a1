"""RLDataset: verl-format prompt files -> chat-templated, tokenized, left-padded prompts.

All rows are read, checked and tokenized when the dataset is built, so a bad row or an overlong prompt
is reported once, with its file and row, before training starts — never as a crash deep in the loop.
Rows with images or videos (verl's multimodal rows, megatron_rl.data.multimodal) are encoded by the model's
processor; their images and videos are decoded and checked at build time and decoded again per item, so only their
bytes (or paths) stay in memory.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset
from tqdm import tqdm
from transformers import PreTrainedTokenizerBase, ProcessorMixin

from megatron_rl.config.schema import DataConfig
from megatron_rl.data.multimodal import (
    IMAGE_PLACEHOLDER,
    VIDEO_PLACEHOLDER,
    ImageProblem,
    NoVisionError,
    VisionEncoder,
    build_messages,
    load_processor,
)
from megatron_rl.data.rows import MalformedRowError, SourceRow, check_row, read_rows

__all__ = ["RLDataset", "TRUNCATION_MODES", "MALFORMED_ROW_MODES"]

logger = logging.getLogger(__name__)

TRUNCATION_MODES = ("error", "left", "right", "middle")
MALFORMED_ROW_MODES = ("skip", "error")
_MAX_REPORTED_PROBLEMS = 5


@dataclass(frozen=True)
class _Prompt:
    token_ids: np.ndarray  # unpadded, at most max_prompt_length long
    raw_prompt: list[dict[str, str]]
    data_source: str
    reward_model: dict[str, Any]
    extra_info: dict[str, Any]
    index: int  # position of the row in the concatenated source files (stable across filtering)
    agent_name: str | None = None  # verl's column: the multi-turn environment of the row (rollout.multi_turn)
    images: list[Any] | None = None  # the row's image items as read (bytes or paths), decoded per item
    videos: list[Any] | None = None  # the row's video items as read (frames' bytes or paths), decoded per item
    text: str | None = None  # the chat-templated prompt of an image or video row, re-encoded per item for its pixels


@dataclass(frozen=True)
class _Accepted:
    row: SourceRow
    text: str  # chat-templated
    index: int
    ids: list[int] | None = None  # set for image / video rows (the processor's tokens); text rows: encoded per file
    images: list[Any] | None = None  # with videos, set (maybe empty) for every image / video row
    videos: list[Any] | None = None

    @property
    def visual(self) -> bool:
        return self.images is not None or self.videos is not None


class RLDataset(Dataset):
    """Prompts from one or more parquet/jsonl files, concatenated in the order given.

    ``dataset[i]`` is a dict: ``input_ids``, ``attention_mask``, ``position_ids`` (tensors of length
    ``max_prompt_length``, left-padded with the tokenizer's pad id) and ``raw_prompt`` (the chat messages),
    ``data_source``, ``reward_model``, ``extra_info``, ``index``.

    Rows with images (column ``image_key``) or videos (column ``video_key``) are encoded by ``processor`` (None: the
    processor of the tokenizer's directory, loaded on the first such row); when any row has either, every item also
    carries verl's ``multi_modal_data`` (``{"image": [PIL images], "video": [(frames uint8 [T, 3, H, W],
    VideoMetadata)]}``, each key only when the row has such items; what rollout engines take) and
    ``multi_modal_inputs`` (``pixel_values``, ``image_grid_thw``; ``pixel_values_videos``, ``video_grid_thw`` and,
    from Qwen2.5-VL's processor, ``second_per_grid_ts``), both ``{}`` for a row with neither. Their ``input_ids``
    hold the processor's expanded image and video tokens; ``position_ids`` stay 1-D (the model derives mRoPE
    positions itself). A prompt with images or videos is never truncated: an overlong one is dropped
    (``filter_overlong_prompts``) or refused. A row that has the image or video column (even empty) and a
    placeholder in its prompt is encoded as such, as verl does: a placeholder without its item is refused.

    Overlong prompts are dropped when ``filter_overlong_prompts`` (the count is logged once); otherwise
    ``truncation`` decides: ``error`` (raise, naming the row), ``left`` (keep the last tokens), ``right``
    (keep the first tokens) or ``middle`` (verl's: keep both ends). Malformed rows are skipped and reported together (``on_malformed_row="skip"``)
    or raise :class:`MalformedRowError` (``"error"``).
    """

    def __init__(
        self,
        files: str | Path | Sequence[str | Path],
        tokenizer: PreTrainedTokenizerBase,
        *,
        prompt_key: str = "prompt",
        max_prompt_length: int = 512,
        filter_overlong_prompts: bool = True,
        truncation: str = "error",
        on_malformed_row: str = "skip",
        image_key: str = "images",
        video_key: str = "videos",
        processor: ProcessorMixin | None = None,
        image_patch_size: int | None = None,
        mm_processor_kwargs: dict[str, Any] | None = None,
    ) -> None:
        self.files = [str(files)] if isinstance(files, (str, Path)) else [str(f) for f in files]
        _check_settings(self.files, tokenizer, max_prompt_length, truncation, on_malformed_row)
        self.tokenizer = tokenizer
        self.prompt_key = prompt_key
        self.max_prompt_length = max_prompt_length
        self.filter_overlong_prompts = filter_overlong_prompts
        self.truncation = truncation
        self.on_malformed_row = on_malformed_row
        self.image_key = image_key
        self.video_key = video_key
        self._processor = processor
        self._image_patch_size = image_patch_size
        self._mm_processor_kwargs = dict(mm_processor_kwargs or {})
        self._vision: VisionEncoder | None = None  # made on the first row with images or videos
        self.malformed: list[str] = []  # "location: problem" of every skipped row
        self.num_overlong = 0  # prompts dropped (filter) or cut (truncation) for exceeding max_prompt_length
        self._prompts: list[_Prompt] = []
        self._load()

    @classmethod
    def from_config(
        cls, files: Sequence[str], tokenizer: PreTrainedTokenizerBase, data_cfg: DataConfig
    ) -> RLDataset:
        """Build from the ``data`` config section (``DataConfig`` or its DictConfig)."""
        return cls(
            files,
            tokenizer,
            prompt_key=data_cfg.prompt_key,
            max_prompt_length=data_cfg.max_prompt_length,
            filter_overlong_prompts=data_cfg.filter_overlong_prompts,
            truncation=data_cfg.truncation,
            on_malformed_row=data_cfg.on_malformed_row,
            image_key=data_cfg.image_key,
            video_key=data_cfg.video_key,
            image_patch_size=data_cfg.image_patch_size,
            mm_processor_kwargs=dict(data_cfg.mm_processor_kwargs),
        )

    # ------------------------------------------------------------------ loading
    def _load(self) -> None:
        rows_read = 0
        longest = 0
        for path in self.files:
            accepted: list[_Accepted] = []
            for row in tqdm(read_rows(path), desc=f"reading {path}", disable=None, leave=False):
                if self._is_visual(row.data):
                    item = self._encode_visual(row, rows_read)
                else:
                    text = self._render(row)
                    item = None if text is None else _Accepted(row, text, rows_read)
                if item is not None:
                    accepted.append(item)
                rows_read += 1
            if not accepted:
                continue
            texts = [a.text for a in accepted if a.ids is None]
            encoded = iter(self.tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else [])
            for item in accepted:
                ids = item.ids if item.ids is not None else next(encoded)
                longest = max(longest, len(ids))
                ids = self._fit_length(item.row.location, ids, has_images=item.visual)
                if ids is not None:
                    self._prompts.append(self._make_prompt(item, ids))
        self._report(rows_read, longest)
        # verl's agent_name column travels with the rows that have one ("" elsewhere: the default agent)
        self._has_agent_name = any(p.agent_name for p in self._prompts)
        self._has_images = any(p.images or p.videos for p in self._prompts)

    @property
    def has_videos(self) -> bool:
        """Some prompt has a video (the rollout engine must take videos: rollout/engines.py ``takes_videos``)."""
        return any(p.videos for p in self._prompts)

    def _render(self, row: SourceRow) -> str | None:
        """Chat-template a checked row; None (after recording the problem) when the row is malformed."""
        problem = row.problem or check_row(row.data, self.prompt_key)
        if problem is None:
            try:
                return self.tokenizer.apply_chat_template(
                    row.data[self.prompt_key], add_generation_prompt=True, tokenize=False
                )
            except Exception as e:  # a template may reject roles or content; that is the row's problem
                problem = f"chat template failed: {type(e).__name__}: {e}"
        self._malformed(row, problem)
        return None

    def _is_visual(self, data: dict[str, Any] | None) -> bool:
        """A row with images or videos, or with the column (even empty) and a placeholder: verl builds its
        content parts whenever the column is there, so a placeholder without its item is the row's problem."""
        if data is None:
            return False
        if data.get(self.image_key) or data.get(self.video_key):
            return True
        prompt = data.get(self.prompt_key)
        return (self.image_key in data or self.video_key in data) and isinstance(prompt, list) and any(
            isinstance(m, dict) and isinstance(m.get("content"), str)
            and (IMAGE_PLACEHOLDER in m["content"] or VIDEO_PLACEHOLDER in m["content"]) for m in prompt)

    def _encode_visual(self, row: SourceRow, index: int) -> _Accepted | None:
        """A row with images or videos: checked, its items decoded, chat-templated and encoded by the processor."""
        problem = check_row(row.data, self.prompt_key)
        if problem is None:
            image_items = row.data.get(self.image_key) or []
            video_items = row.data.get(self.video_key) or []
            # a text model's refusal names the videos when the row has no images (but videos, or their column)
            vision = self._vision_encoder(row.location, videos=not image_items and (
                bool(video_items) or self.video_key in row.data))
            try:
                images = vision.load_images(image_items)
                videos = vision.load_videos(video_items)
                messages = vision.messages(row.data[self.prompt_key], len(images), len(videos))
                text = vision.render(messages)
                ids = vision.encode(text, images, videos)["input_ids"]
                return _Accepted(row, text, index, ids, list(image_items), list(video_items))
            except ImageProblem as e:  # VideoProblem too
                problem = str(e)
        self._malformed(row, problem)
        return None

    def _vision_encoder(self, location: str, videos: bool = False) -> VisionEncoder:
        if self._vision is None:
            processor = self._processor
            if processor is None:
                model_dir = self.tokenizer.name_or_path
                try:
                    processor = load_processor(model_dir)
                except NoVisionError as e:
                    what, key, name = ("videos", self.video_key, "video_key") if videos else (
                        "images", self.image_key, "image_key")
                    raise ValueError(
                        f"{location} has {what} (column {key!r}, data.{name}) but {e}; use a vision-language "
                        f"model, or drop the {what[:-1]} column (or set data.{name} to a column the rows do not "
                        f"have) to train on the text alone"
                    ) from None
            self._vision = VisionEncoder(processor, image_key=self.image_key, video_key=self.video_key,
                                         processor_kwargs=self._mm_processor_kwargs,
                                         patch_size=self._image_patch_size)
        return self._vision

    def _malformed(self, row: SourceRow, problem: str) -> None:
        if self.on_malformed_row == "error":
            raise MalformedRowError(
                f"{row.location}: {problem} (data.on_malformed_row=error; set it to 'skip' to drop such rows)"
            )
        self.malformed.append(f"{row.location}: {problem}")

    def _fit_length(self, location: str, ids: list[int], has_images: bool = False) -> list[int] | None:
        limit = self.max_prompt_length
        if len(ids) <= limit:
            return ids
        self.num_overlong += 1
        if self.filter_overlong_prompts:
            return None
        if has_images:  # a cut would split an image's (or a video's) tokens from its pixels
            raise ValueError(
                f"{location}: prompt with images is {len(ids)} tokens (image and video tokens included), longer than "
                f"data.max_prompt_length={limit}; prompts with images or videos are never truncated: set "
                f"data.filter_overlong_prompts=true to drop them, raise data.max_prompt_length, or lower the "
                f"images' max_pixels (data.mm_processor_kwargs) or the videos' max_pixels / fps (their items)"
            )
        if self.truncation == "left":
            return ids[-limit:]
        if self.truncation == "right":
            return ids[:limit]
        if self.truncation == "middle":  # verl's: keep both ends (the instruction and the generation prompt)
            head = limit // 2
            return ids[:head] + ids[len(ids) - (limit - head):]
        raise ValueError(
            f"{location}: prompt is {len(ids)} tokens, longer than data.max_prompt_length={limit} "
            f"(data.truncation=error); set data.filter_overlong_prompts=true to drop such prompts "
            f"or data.truncation=left|right|middle to cut them"
        )

    def _make_prompt(self, item: _Accepted, ids: list[int]) -> _Prompt:
        data = item.row.data
        raw_prompt = data[self.prompt_key]
        if item.visual:  # verl's raw_prompt of an image / video row: content lists with image and video parts
            raw_prompt = build_messages(raw_prompt, len(item.images or ()), len(item.videos or ()))
        return _Prompt(
            token_ids=np.asarray(ids, dtype=np.int32),  # half the memory of int64; widened per item
            raw_prompt=raw_prompt,
            data_source=data["data_source"],
            reward_model=data["reward_model"],
            extra_info=data.get("extra_info") or {},
            index=item.index,
            agent_name=data.get("agent_name") or None,
            images=item.images,
            videos=item.videos,
            text=item.text if item.visual else None,
        )

    def _report(self, total_rows: int, longest: int) -> None:
        if self.malformed:
            shown = "\n  ".join(self.malformed[:_MAX_REPORTED_PROBLEMS])
            more = len(self.malformed) - _MAX_REPORTED_PROBLEMS
            logger.warning(
                "skipped %d malformed rows of %d (data.on_malformed_row=skip):\n  %s%s",
                len(self.malformed),
                total_rows,
                shown,
                f"\n  ... and {more} more" if more > 0 else "",
            )
        if self.num_overlong:
            action = "dropped" if self.filter_overlong_prompts else f"truncated ({self.truncation})"
            logger.warning(
                "%s %d of %d prompts longer than data.max_prompt_length=%d tokens (longest: %d)",
                action,
                self.num_overlong,
                total_rows,
                self.max_prompt_length,
                longest,
            )
        if not self._prompts:
            raise ValueError(
                f"no usable prompts in {self.files}: {total_rows} rows read, {len(self.malformed)} "
                f"malformed, {self.num_overlong} longer than data.max_prompt_length="
                f"{self.max_prompt_length}"
            )

    # ------------------------------------------------------------------ access
    def __len__(self) -> int:
        return len(self._prompts)

    def __getitem__(self, i: int) -> dict[str, Any]:
        prompt = self._prompts[i]
        length, ids = self.max_prompt_length, torch.from_numpy(prompt.token_ids).long()
        input_ids = torch.full((length,), self.tokenizer.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros(length, dtype=torch.long)
        if len(ids):
            input_ids[-len(ids) :] = ids
            attention_mask[-len(ids) :] = 1
        position_ids = (attention_mask.cumsum(0) - 1).clamp(min=0)
        extra = {"agent_name": prompt.agent_name or ""} if self._has_agent_name else {}
        if self._has_images:
            extra.update(self._multi_modal(prompt))
        return {
            **extra,
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "position_ids": position_ids,
            "raw_prompt": prompt.raw_prompt,
            "data_source": prompt.data_source,
            "reward_model": prompt.reward_model,
            "extra_info": prompt.extra_info,
            "index": prompt.index,
        }

    def _multi_modal(self, prompt: _Prompt) -> dict[str, Any]:
        """verl's ``multi_modal_data`` and ``multi_modal_inputs`` of one prompt (both empty without images or
        videos)."""
        if not prompt.images and not prompt.videos:
            return {"multi_modal_data": {}, "multi_modal_inputs": {}}
        vision = self._vision_encoder(f"prompt {prompt.index}")
        images = vision.load_images(prompt.images or [])  # checked at build time: decodes again
        videos = vision.load_videos(prompt.videos or [])
        encoded = vision.encode(prompt.text, images, videos)
        data = {**({"image": images} if images else {}), **({"video": videos} if videos else {})}
        return {
            "multi_modal_data": data,
            "multi_modal_inputs": {k: v for k, v in encoded.items() if k != "input_ids"},
        }

    def __getstate__(self) -> dict[str, Any]:
        # a processor loaded here may be of a class made at run time (multimodal.load_processor), which does not
        # pickle: data-loader workers started by spawn load it again from the tokenizer's directory
        state = self.__dict__.copy()
        if self._processor is None:
            state["_vision"] = None
        return state


def _check_settings(
    files: list[str],
    tokenizer: PreTrainedTokenizerBase,
    max_prompt_length: int,
    truncation: str,
    on_malformed_row: str,
) -> None:
    if not files:
        raise ValueError("RLDataset needs at least one file (data.train_files / data.val_files is empty)")
    if not isinstance(max_prompt_length, int) or max_prompt_length < 1:
        raise ValueError(f"data.max_prompt_length must be a positive integer, got {max_prompt_length!r}")
    if truncation not in TRUNCATION_MODES:
        raise ValueError(f"data.truncation={truncation!r} is unknown; known: {list(TRUNCATION_MODES)}")
    if on_malformed_row not in MALFORMED_ROW_MODES:
        raise ValueError(
            f"data.on_malformed_row={on_malformed_row!r} is unknown; known: {list(MALFORMED_ROW_MODES)}"
        )
    if tokenizer.pad_token_id is None:
        raise ValueError("the tokenizer has no pad token; load it with megatron_rl.data.load_tokenizer")
