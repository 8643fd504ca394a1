"""Issue 56, end to end (the tiny preset, one rank in the driver, scoring inline as the preset does): a scorer that
hangs ends the run with a message naming the row and reward.timeout_s, and a second stop signal ends it at once."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from e2e_support import REPO, tiny_overrides
from megatron_rl.trainer.signals import EXIT_FORCED

ONE_RANK = ("trainer.n_gpus_per_node=1", "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=1")


def _hanging_scorer(tmp_path: Path) -> tuple[Path, Path]:
    path, cue = tmp_path / "hang.py", tmp_path / "scoring"
    path.write_text(textwrap.dedent(f"""
        import pathlib, time

        def compute_score(data_source, solution_str, ground_truth, extra_info=None):
            pathlib.Path({str(cue)!r}).touch()
            time.sleep(3600)
    """))
    return path, cue


def _train(tiny_assets, tmp_path: Path, *extra: str) -> subprocess.Popen:
    overrides = tiny_overrides(tiny_assets, tmp_path / "run", *ONE_RANK, "reward.num_workers=0", *extra)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([sys.executable, "-m", "megatron_rl.train", *overrides], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.mark.slow
def test_a_hung_inline_scorer_ends_the_run_naming_the_time_limit(tiny_assets, tmp_path):
    scorer, _ = _hanging_scorer(tmp_path)
    proc = _train(tiny_assets, tmp_path, "reward.timeout_s=2", f"reward.custom_reward_function.path={scorer}")
    output, _ = proc.communicate(timeout=600)  # before issue 56: no message, no end
    assert proc.returncode == 1, output[-3000:]
    assert "ran past reward.timeout_s=2 s in this process (reward.num_workers=0)" in output, output[-3000:]
    assert "row 0 of the batch" in output and "hang.py', 'compute_score')" in output


@pytest.mark.slow
def test_sigterm_then_ctrl_c_ends_a_run_whose_inline_scorer_hangs(tiny_assets, tmp_path):
    scorer, cue = _hanging_scorer(tmp_path)
    proc = _train(tiny_assets, tmp_path, "reward.timeout_s=3600", f"reward.custom_reward_function.path={scorer}")
    deadline = time.monotonic() + 600
    while not cue.exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0][-3000:]
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)  # the first asks for a stop after the step: the step never ends
    time.sleep(1)
    proc.send_signal(signal.SIGINT)  # ctrl-C counts as the second
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == EXIT_FORCED, output[-3000:]
    assert "received SIGTERM: will save a checkpoint" in output
    assert "received SIGINT, a second stop signal: exiting now" in output, output[-3000:]
