"""The trainer end to end with ``rollout.name=sglang`` against the strict SGLang 0.5.23 stand-in: 4 ranks (Ray
actors, each given its own GPU id by Ray), actor TP 2, rollout TP 2 -> 2 engines. Every generation — the
training one, ``val_before_train``, validation after every step, ReMax's greedy baseline, DAPO's refills —
runs on the weights of the last sync (the stand-in refuses released or NaN weights, the trainer refuses a
sample of another weight version), and every sync is verified against the trainer's log-probs."""

from __future__ import annotations

import pytest
from sglang_runs import check_run, sglang_overrides

from megatron_rl.config import load_config
from megatron_rl.train import run

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def test_grpo_on_two_sglang_engines_of_tp2(sglang_stand_in, assets, tmp_path):
    result = run(load_config(overrides=sglang_overrides(assets, tmp_path, "trainer.total_training_steps=3")))
    check_run(result.metrics_path, 3)


def test_remax_and_dapo_refills_run_on_current_weights_with_pp2(sglang_stand_in, assets, tmp_path):
    result = run(load_config(overrides=sglang_overrides(
        assets, tmp_path,
        "trainer.total_training_steps=2",
        "algorithm.adv_estimator=remax",
        "algorithm.filter_groups.enable=true",
        "algorithm.filter_groups.max_num_gen_batches=2",
        "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
        "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2",
    )))
    records = check_run(result.metrics_path, 2)
    assert all(records[s]["dynamic_sampling/num_gen_batches"] >= 1 for s in (1, 2))
