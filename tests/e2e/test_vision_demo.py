"""The vision demo (`python -m megatron_rl.demo --vision`): a random tiny Qwen2.5-VL learns to count the squares of
the shapes task by GRPO on CPU, the images going through the dataset, the HF engine and the Megatron actor;
validation exact match from below chance (no answer format yet) to at least REQUIRED_EXACT_MATCH (chance: 0.25)."""
from __future__ import annotations

import pytest

from megatron_rl.demo import REQUIRED_EXACT_MATCH, VISION_DATA_SOURCE, learning_summary, main as demo_main

pytestmark = pytest.mark.distributed


@pytest.mark.slow
def test_vision_demo_learns(tmp_path):
    assert demo_main(["--vision", "--out", str(tmp_path)]) == 0
    summary = learning_summary(tmp_path / "run" / "metrics.jsonl", VISION_DATA_SOURCE)
    assert summary.first_exact_match <= 0.25 and summary.last_exact_match >= REQUIRED_EXACT_MATCH
    assert (tmp_path / "run" / "curves.png").stat().st_size > 0
