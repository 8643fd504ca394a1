"""Row builders and file writers shared by the data tests."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq


def user_row(content: str, data_source: str = "synthetic/copy", ground_truth: str = "1") -> dict[str, Any]:
    return {
        "data_source": data_source,
        "prompt": [{"role": "user", "content": content}],
        "ability": "digits",
        "reward_model": {"style": "rule", "ground_truth": ground_truth},
        "extra_info": {"split": "train"},
    }


def write_jsonl(path: Path, rows: list[Any]) -> Path:
    """Rows are dicts (written as JSON) or raw strings (written as they are, to make broken lines)."""
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def write_parquet(path: Path, rows: list[dict[str, Any]]) -> Path:
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path
