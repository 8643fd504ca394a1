"""End-to-end runs of the real stack on CPU under an embedded Ray: Megatron actor at TP=2 on two
ranks, HF rollout engines colocated, weight sync with verification every step."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from megatron_rl.train import run
from e2e_support import (
    REPO,
    assert_finite,
    comparable,
    run_module,
    run_python,
    tiny_config,
    tiny_overrides,
    train_steps,
)

pytestmark = pytest.mark.distributed

REQUIRED_METRICS = (
    "critic/score/mean", "critic/rewards/mean", "critic/advantages/mean", "response_length/mean",
    "timing_s/step", "timing_s/gen", "timing_s/old_log_prob", "timing_s/update_actor", "timing_s/sync_weights",
    "perf/throughput", "actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl", "actor/entropy", "actor/grad_norm",
    "actor/lr", "weight_sync/GBps", "rollout/logprob_diff_mean", "rollout/logprob_diff_max",
)


def test_grpo_runs_with_finite_metrics_and_writes_outputs(tiny_assets, tmp_path):
    """Also: a run that starts Ray stops it (test_ppo_with_critic_and_kl_in_reward: one that finds it up keeps it)."""
    import ray

    result = run(tiny_config(tiny_assets, tmp_path, "trainer.test_freq=2", "trainer.save_hf_at_end=true"))
    assert not ray.is_initialized()
    steps = train_steps(result.metrics_path)
    assert sorted(steps) == [1, 2]
    for record in steps.values():
        assert_finite(record)
        missing = [k for k in REQUIRED_METRICS if k not in record]
        assert not missing, f"missing metrics {missing}"
        # the engine serves exactly the trainer's weights after every sync
        assert record["rollout/logprob_diff_max"] < 1e-4
    assert "val-core/synthetic/copy/acc/mean@1" in steps[2] and "val-aux/synthetic/copy/reward/mean@1" in steps[2]
    assert result.plot_path is not None and result.plot_path.stat().st_size > 0
    assert (result.hf_dir / "config.json").is_file() and any(result.hf_dir.glob("*.safetensors"))


def test_ppo_with_critic_and_kl_in_reward(tiny_assets, tmp_path, shared_ray):
    cfg = tiny_config(
        tiny_assets, tmp_path,
        "algorithm.adv_estimator=gae", "algorithm.gamma=1.0", "algorithm.lam=0.95",
        "algorithm.use_kl_in_reward=true", "algorithm.kl_ctrl.type=adaptive",
        "critic.ppo_micro_batch_size_per_gpu=16",
        "critic.optim.lr=1e-3",
    )
    result = run(cfg)
    import ray

    # the Ray the run found up (shared_ray) is still up, and the run gave back everything it reserved there
    # (killed actors return their CPUs a moment later)
    assert ray.is_initialized()
    deadline = time.monotonic() + 10
    while ray.available_resources().get("CPU") != ray.cluster_resources()["CPU"] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ray.available_resources().get("CPU") == ray.cluster_resources()["CPU"]
    for record in train_steps(result.metrics_path).values():
        assert_finite(record)
        for key in ("critic/vf_loss", "critic/vf_clipfrac", "critic/vpred_mean", "critic/grad_norm",
                    "critic/values/mean", "actor/reward_kl_penalty", "actor/reward_kl_penalty_coeff", "timing_s/ref",
                    "timing_s/values", "timing_s/update_critic"):
            assert key in record, key


def test_resume_continues_like_an_uninterrupted_run(tiny_assets, tmp_path, shared_ray):
    straight = run(tiny_config(tiny_assets, tmp_path / "straight", "trainer.total_training_steps=4"))
    run(tiny_config(tiny_assets, tmp_path / "resumed", "trainer.save_freq=2"))  # stops after step 2
    resumed = run(tiny_config(tiny_assets, tmp_path / "resumed", "trainer.total_training_steps=4",
                              "trainer.save_freq=2", "trainer.resume_mode=auto"))
    expected, got = train_steps(straight.metrics_path), train_steps(resumed.metrics_path)
    assert sorted(got) == [1, 2, 3, 4]
    for step in (3, 4):
        want, have = comparable(expected[step]), comparable(got[step])
        assert want.keys() == have.keys()
        diffs = {k: (want[k], have[k]) for k in want if abs(want[k] - have[k]) > 1e-5 * max(1.0, abs(want[k]))}
        assert not diffs, f"step {step} differs after resume: {diffs}"


# `python -m megatron_rl.train ARGS`, saying at its exit whether it imported Megatron-Core
_TRAIN_TELLING_IMPORTS = """import atexit, runpy, sys
atexit.register(lambda: print("imported megatron.core:", "megatron.core" in sys.modules, flush=True))
runpy.run_module("megatron_rl.train", run_name="__main__", alter_sys=True)
"""


def test_bad_config_is_rejected_before_ray_starts(tiny_assets, tmp_path):
    """Before Ray, and before Megatron-Core is imported (the planner imports it; the validation does not)."""
    overrides = tiny_overrides(tiny_assets, tmp_path, "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=64")
    proc = run_python(["-c", _TRAIN_TELLING_IMPORTS, *overrides], timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "ppo_micro_batch_size_per_gpu=64 is larger than the 16 responses" in proc.stderr
    assert "Started a local Ray instance" not in proc.stdout + proc.stderr
    assert "imported megatron.core: False" in proc.stdout, proc.stdout[-2000:]


def _environ_has(pid: int, entry: str) -> bool:
    """Whether process ``pid`` has ``entry`` (NAME=value) in its environment (Ray's workers inherit the driver's)."""
    try:
        return entry.encode() in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:  # gone, or not ours to read
        return False


def test_killed_worker_fails_the_driver_with_role_and_rank(tiny_assets, tmp_path):
    overrides = tiny_overrides(tiny_assets, tmp_path, "trainer.total_training_steps=200")
    tag = f"MRL_KILL_TEST={uuid.uuid4().hex}"  # marks this run's processes: others may run Ray on the machine
    proc = subprocess.Popen([sys.executable, "-m", "megatron_rl.train", *overrides], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1", "MRL_KILL_TEST": tag.split("=")[1]})
    try:
        metrics = tmp_path / "metrics.jsonl"
        deadline = time.monotonic() + 240
        while not (metrics.exists() and metrics.read_text().strip()):
            assert proc.poll() is None, "training ended before the first step"
            assert time.monotonic() < deadline, "no training step within 240 s"
            time.sleep(1)
        victims = subprocess.run(["pgrep", "-f", "ray::ActorRolloutRefWorker"], capture_output=True, text=True)
        pids = [int(p) for p in victims.stdout.split() if _environ_has(int(p), tag)]  # this run's workers only
        assert pids, "found no worker process to kill"
        os.kill(pids[-1], signal.SIGKILL)
        output, _ = proc.communicate(timeout=120)  # fails fast: well before ray_init.timeout_s (600 s)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode != 0
    assert "actor_rollout rank" in output and "died" in output, output[-3000:]
    log = (tmp_path / "train.log").read_text()
    assert "the run failed" in log and "died" in log, log[-3000:]  # train.log holds the error


def test_sigterm_mid_run_checkpoints_and_exits_resumable(tiny_assets, tmp_path):
    """Issue 15: a stopped run is not 'finished' (rc 75, not 0), says how to resume, and its train.log and
    checkpoint are there; a re-run into the directory without a checkpoint would be refused instead."""
    from megatron_rl.trainer.signals import EXIT_STOPPED_RESUMABLE

    overrides = tiny_overrides(tiny_assets, tmp_path, "trainer.total_training_steps=50", "trainer.save_freq=-1")
    proc = subprocess.Popen([sys.executable, "-m", "megatron_rl.train", *overrides], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        metrics = tmp_path / "metrics.jsonl"
        deadline = time.monotonic() + 240
        while not (metrics.exists() and metrics.read_text().strip()):
            assert proc.poll() is None, "training ended before the first step"
            assert time.monotonic() < deadline, "no training step within 240 s"
            time.sleep(1)
        proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == EXIT_STOPPED_RESUMABLE, output[-3000:]
    assert "stopped by SIGTERM after step" in output and "final HF checkpoint: None" not in output
    assert "Fatal Python error" not in output and "core dumped" not in output
    steps = sorted(int(p.name.split("_")[-1]) for p in tmp_path.glob("global_step_*"))
    assert steps and (tmp_path / f"global_step_{steps[-1]}" / "manifest.json").is_file()
    assert (tmp_path / "train.log").is_file()


def test_rerun_into_a_finished_run_without_a_checkpoint_is_refused(tiny_assets, tmp_path):
    """Issue 15 item 1, through the command line: rc 2 before Ray, the results untouched."""
    (tmp_path / "metrics.jsonl").write_text("".join(f'{{"step": {s}}}\n' for s in range(1, 11)))
    (tmp_path / "hf_final").mkdir()
    proc = run_module(["megatron_rl.train", *tiny_overrides(tiny_assets, tmp_path, "trainer.save_freq=-1")],
                      timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert f"trainer.default_local_dir={tmp_path} already holds the results of a run" in proc.stderr
    assert "metrics.jsonl (10 records)" in proc.stderr and "trainer.overwrite=true" in proc.stderr
    assert "Started a local Ray instance" not in proc.stdout + proc.stderr
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 10


def test_dry_run_checks_the_data_files_like_the_real_start(tiny_assets, tmp_path):
    """Issue 15 item 8: a directory given as a data file is named as such, in --dry-run and in a real start."""
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    overrides = tiny_overrides(tiny_assets, tmp_path / "run", f"data.train_files=[{data_dir}]")
    outputs = []
    for extra in (["--dry-run"], []):
        proc = run_module(["megatron_rl.train", *overrides, *extra], timeout=120)
        assert proc.returncode == 2, proc.stderr[-2000:]
        outputs.append(proc.stderr.strip().splitlines()[-1])
    assert outputs[0] == outputs[1]
    assert f"data.train_files: {data_dir} is a directory, expected a .parquet or .jsonl file" in outputs[0]
