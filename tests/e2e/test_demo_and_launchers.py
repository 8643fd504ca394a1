"""The demo learns its task (exact match up, responses stop); torchrun mode reproduces the Ray run."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from megatron_rl.data import build_tiny_tokenizer
from megatron_rl.demo import (REQUIRED_EXACT_MATCH, SCORE_KEY, VAL_ACC_KEY, VAL_LENGTH_KEY, learning_summary,
                              main as demo_main, stop_token_ids)
from megatron_rl.distributed import free_port
from megatron_rl.train import run
from e2e_support import REPO, comparable, tiny_config, tiny_overrides, train_steps

pytestmark = pytest.mark.distributed


@pytest.mark.slow
def test_demo_learns(tmp_path):
    assert demo_main(["--out", str(tmp_path)]) == 0
    summary = learning_summary(tmp_path / "run" / "metrics.jsonl")
    assert summary.first_exact_match <= 0.1 and summary.last_exact_match >= REQUIRED_EXACT_MATCH
    # the answer is one digit + eos: the responses stop instead of running to the cap of 4
    assert summary.last_length <= 2.5 < summary.first_length
    assert (tmp_path / "run" / "curves.png").stat().st_size > 0


def test_demo_verdict_reads_validation_exact_match_and_length(tmp_path):
    path = tmp_path / "metrics.jsonl"
    records = [{"step": 0, VAL_ACC_KEY: 0.0, VAL_LENGTH_KEY: 4.0}]
    records += [{"step": s, SCORE_KEY: s / 20} for s in range(1, 21)]
    records += [{"step": 20, VAL_ACC_KEY: 0.75, VAL_LENGTH_KEY: 2.0}]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    summary = learning_summary(path)
    assert (summary.first_exact_match, summary.last_exact_match, summary.first_length, summary.last_length) == (
        0.0, 0.75, 4.0, 2.0)
    assert summary.learned and summary.first_score == pytest.approx(0.15)
    path.write_text("".join(json.dumps(r) + "\n" for r in records[1:]))  # validation never ran
    with pytest.raises(RuntimeError, match="test_freq"):
        learning_summary(path)


def test_demo_stops_responses_on_tokens_the_scorer_cannot_see(tmp_path):
    tokenizer = build_tiny_tokenizer(tmp_path, ["copy: 12", "3 4\n5"])
    stops = stop_token_ids(tmp_path)
    assert tokenizer.eos_token_id not in stops
    assert set(tokenizer.all_special_ids) - {tokenizer.eos_token_id} <= set(stops)
    assert {tokenizer.convert_tokens_to_ids(t) for t in ("Ġ", "Ċ")} <= set(stops)  # space, newline
    assert not {tokenizer.convert_tokens_to_ids(d) for d in "12345"} & set(stops)


def test_torchrun_mode_matches_ray_mode(tiny_assets, tmp_path, shared_ray):
    ray_result = run(tiny_config(tiny_assets, tmp_path / "ray"))
    # through the launcher script users run (launch/torchrun.sh), on CPU: 2 processes, no GPUs
    env = {**os.environ, "GPUS_PER_NODE": "0", "NPROC_PER_NODE": "2", "PYTHON": sys.executable,
           "MASTER_PORT": str(free_port()), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(["bash", "launch/torchrun.sh", *tiny_overrides(tiny_assets, tmp_path / "torchrun")],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    ray_steps = train_steps(ray_result.metrics_path)
    torchrun_steps = train_steps(tmp_path / "torchrun" / "metrics.jsonl")
    assert sorted(torchrun_steps) == sorted(ray_steps) == [1, 2]
    for step in ray_steps:
        want, have = comparable(ray_steps[step]), comparable(torchrun_steps[step])
        assert want.keys() == have.keys()
        diffs = {k: (want[k], have[k]) for k in want if abs(want[k] - have[k]) > 1e-5 * max(1.0, abs(want[k]))}
        assert not diffs, f"step {step}: torchrun differs from Ray: {diffs}"
