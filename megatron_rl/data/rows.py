"""Read verl-format rows from parquet or jsonl files and check each one before it reaches the tokenizer.

A verl row: ``prompt`` (list of chat messages ``{"role", "content"}``), ``data_source`` (selects the reward
scorer), ``reward_model`` (``{"style", "ground_truth"}``), optional ``extra_info`` (dict) and ``ability``, and
optionally images and videos (``data.image_key`` / ``data.video_key``, checked by megatron_rl.data.multimodal).
Every row carries its location (file and row/line) so a problem is reported where a person can find it.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pyarrow.parquet as pq

__all__ = ["MalformedRowError", "SourceRow", "check_row", "encoded_rows", "read_rows"]

T = TypeVar("T")


class MalformedRowError(ValueError):
    """A dataset row that cannot be used; the message names the file, the row and what is wrong."""


@dataclass(frozen=True)
class SourceRow:
    location: str  # "train.parquet row 3" (0-based, as pandas shows it) or "train.jsonl line 4" (1-based)
    data: dict[str, Any] | None  # None: the line is not a JSON object
    problem: str | None = None  # set when the row could not even be parsed


def read_rows(path: str | Path) -> Iterator[SourceRow]:
    """Yield the rows of one parquet or jsonl file, in file order."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"data file {str(path)!r} does not exist")
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        for i, row in enumerate(pq.read_table(path).to_pylist()):
            yield SourceRow(f"{path} row {i}", row)
    elif suffix in (".jsonl", ".json"):
        with path.open(encoding="utf-8") as f:
            for line_no, line in enumerate(f, start=1):
                if line.strip():
                    yield _parse_json_line(f"{path} line {line_no}", line)
    else:
        raise ValueError(f"data file {str(path)!r} has suffix {suffix!r}; expected .parquet or .jsonl")


def encoded_rows(files: str | Path | Sequence[str | Path], encode: Callable[[str, dict[str, Any]], T],
                 what: str) -> list[T]:
    """``encode(location, row)`` of every row of ``files`` (one path or several), in file order (the SFT and the
    preference datasets'). A row that cannot be parsed, or that ``encode`` refuses with a ValueError, is a
    MalformedRowError naming its file and row; files with no rows at all are a ValueError naming ``what`` rows."""
    out: list[T] = []
    for path in [files] if isinstance(files, (str, Path)) else list(files):
        for row in read_rows(path):
            if row.problem is not None or row.data is None:
                raise MalformedRowError(f"{row.location}: {row.problem or 'not a JSON object'}")
            try:
                out.append(encode(row.location, row.data))
            except ValueError as err:
                raise MalformedRowError(f"{row.location}: {err}") from None
    if not out:
        raise ValueError(f"no {what} rows in {files}")
    return out


def _parse_json_line(location: str, line: str) -> SourceRow:
    try:
        data = json.loads(line)
    except json.JSONDecodeError as e:
        return SourceRow(location, None, f"invalid JSON ({e.msg} at column {e.colno})")
    if not isinstance(data, dict):
        return SourceRow(location, None, f"expected a JSON object, got {type(data).__name__}")
    return SourceRow(location, data)


def check_row(row: dict[str, Any], prompt_key: str) -> str | None:
    """Return what is wrong with ``row`` (a short phrase), or None when it is usable."""
    prompt = row.get(prompt_key)
    if prompt is None:
        return f"missing {prompt_key!r}"
    if not isinstance(prompt, list) or not prompt:
        return f"{prompt_key!r} must be a non-empty list of chat messages, got {_describe(prompt)}"
    for i, message in enumerate(prompt):
        if not isinstance(message, dict):
            return f"{prompt_key}[{i}] must be a message dict, got {_describe(message)}"
        for field in ("role", "content"):
            if not isinstance(message.get(field), str):
                return f"{prompt_key}[{i}].{field} must be a string, got {_describe(message.get(field))}"
    if not isinstance(row.get("data_source"), str) or not row["data_source"]:
        return f"'data_source' must be a non-empty string, got {_describe(row.get('data_source'))}"
    reward_model = row.get("reward_model")
    if not isinstance(reward_model, dict) or reward_model.get("ground_truth") is None:
        return f"'reward_model' must be a dict with a 'ground_truth', got {_describe(reward_model)}"
    extra_info = row.get("extra_info")
    if extra_info is not None and not isinstance(extra_info, dict):
        return f"'extra_info' must be a dict, got {_describe(extra_info)}"
    return None


def _describe(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 60 else text[:57] + '...'}"
