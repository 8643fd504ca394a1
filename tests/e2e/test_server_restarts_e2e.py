"""A rollout server SIGKILLed during a disaggregated run on the real stack (CPU, embedded Ray, Megatron actor at
TP=2, HF-engine servers as Ray actors), one step off-policy and fully async with partial rollouts: with
``rollout.server_restarts=1`` the run replaces it, syncs the replacement and finishes; the rollouts' weight
versions are checked by the run itself (a sample from other weights fails it) and every sync is verified
against the trainer's log-probs."""
from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from e2e_support import assert_finite, tiny_config, train_steps
from megatron_rl.train import run
from megatron_rl_testing.processes import descendants

pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.usefixtures("shared_ray")]


def _rollout_servers() -> list[int]:
    """The pids of the run's HF-engine rollout servers: under Ray, actor processes of the servers' own pool
    (servers/ray_pool.py), titled ``ray::HFServerActor``; the Ray the run uses was started by this process, so
    they are its descendants (another test process's servers on the host are never touched)."""
    return [pid for pid, cmd in descendants(os.getpid()) if cmd.startswith("ray::HFServerActor")]

def _logged(metrics: Path, step: int) -> bool:
    try:
        return any(json.loads(line)["step"] >= step for line in metrics.read_text().splitlines())
    except (ValueError, KeyError):  # a line being written
        return False


def _kill_a_server_after_step(metrics: Path, step: int, killed: list[int]) -> None:
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if metrics.is_file() and _logged(metrics, step):
            pid = _rollout_servers()[0]
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
            return
        time.sleep(0.05)


# The synchronous loop's replacement (re-sync, same samples) is tested at the rollout level
# (tests/servers/test_server_restarts.py); its e2e twin cost ~90 s of the suite for no path of its own.
# Fully async with one batch ahead: batch k + 1 starts when step k takes batch k, as one step off's does; on top,
# each sync pauses and continues both servers, the dead one included, and a batch's first tokens may come after
# a sync (the rows sent again after the pause or the death), so its oldest version is bounded, not fixed.
ASYNC_MODES = {"one_step_off": ["async_training.mode=one_step_off"],
               "fully_async": ["async_training.mode=fully_async", "async_training.buffer_batches=1",
                               "async_training.max_staleness=1"]}


@pytest.mark.parametrize("mode", list(ASYNC_MODES))
def test_a_killed_server_is_replaced_and_the_run_finishes(tiny_assets, tmp_path, mode):
    """The kill lands in step 3's generation, started ahead on two servers: the survivor finishes the dead
    server's rows on the same weights (versions exact) and the replacement joins at the next sync."""
    killed: list[int] = []
    killer = threading.Thread(target=_kill_a_server_after_step, args=(tmp_path / "metrics.jsonl", 1, killed),
                              daemon=True)
    killer.start()
    result = run(tiny_config(
        tiny_assets, tmp_path, "trainer.total_training_steps=3", *ASYNC_MODES[mode],
        "actor_rollout_ref.rollout.mode=server", "actor_rollout_ref.rollout.num_servers=2",
        "actor_rollout_ref.rollout.server_restarts=1", "algorithm.rollout_correction.rollout_is=token",
    ))
    killer.join(timeout=5)
    assert len(killed) == 1
    steps = train_steps(result.metrics_path)
    assert sorted(steps) == [1, 2, 3]
    for record in steps.values():
        assert_finite(record)
        assert record["rollout/logprob_diff_max"] < 1e-4  # every server serves exactly the synced weights
    assert steps[1]["rollout/server_restarts"] == 0.0 and steps[3]["rollout/server_restarts"] == 1.0
    # the loop checks every sample's version against the servers' last sync
    versions = [steps[s]["async/weight_version_min"] for s in (1, 2, 3)]
    if mode == "one_step_off":
        assert versions == [0.0, 0.0, 1.0]
    else:  # step s trains with policy version s - 1; max_staleness=1
        assert all(max(s - 2, 0) <= v <= s - 1 for s, v in zip((1, 2, 3), versions)), versions
        assert all(steps[s]["async/staleness_max"] <= 1.0 for s in (1, 2, 3))
