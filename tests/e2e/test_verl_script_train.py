"""verl's current GPG script (examples/gpg_trainer/run_qwen3_8b_megatron.sh at 1dda039b9, vLLM rollout; its recorded
arguments are tests/compat/verl_scripts/gpg_qwen3_8b_megatron_vllm.args) trains two steps for real on CPU through
``python -m megatron_rl.compat.verl.trainer.main_ppo``: every key the script passes is kept; only the model and data
paths, the sizes (batch, lengths, token budgets, ranks and the layout that fits two CPU ranks) and the machine
(trainer.device=cpu) are overridden after it, as a user shrinking the script would. Its loggers (console, wandb) log
for real, wandb offline; jsonl is added for the assertions. verl's defaults apply (compat/verl/defaults.py): packed
sequences, sequence parallelism at TP 2, balance_batch, validation before training."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from megatron_rl.demo import prepare_assets
from megatron_rl.rollout.vllm.contract import vllm_missing
from megatron_rl.trainer.tracking import read_metrics
from megatron_rl_testing.wandb_offline import read_offline_run, use_wandb
from e2e_support import assert_finite, run_module

if vllm_missing() and not os.environ.get("CI"):
    pytest.skip(f"vLLM is not installed here ({vllm_missing()}); `make install-vllm` installs it",
                allow_module_level=True)

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

SCRIPT = Path(__file__).parents[1] / "compat" / "verl_scripts" / "gpg_qwen3_8b_megatron_vllm.args"
SHRUNK = [
    "data.train_batch_size=8", "data.max_prompt_length=16", "data.max_response_length=6",
    "actor_rollout_ref.actor.ppo_mini_batch_size=4",
    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=256",
    "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=256",
    "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=256",
    "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=1",
    "actor_rollout_ref.ref.megatron.pipeline_model_parallel_size=1",
    "actor_rollout_ref.rollout.vllm.cpu_threads_bind='0|1'",
    "trainer.n_gpus_per_node=2", "trainer.total_training_steps=2", "trainer.device=cpu",
    "trainer.logger=[console,wandb,jsonl]", "ray_init.num_cpus=4", "reward.num_workers=0",
]


def test_verls_gpg_script_trains_two_steps_on_cpu(tmp_path_factory, tmp_path, monkeypatch):
    train, val, model = prepare_assets(tmp_path_factory.mktemp("verl_script"), n_train=64, n_val=8,
                                       attention_heads=(2, 2))
    args = [a.replace("Qwen/Qwen3-8B", str(model)) for a in SCRIPT.read_text().splitlines()]
    args = [f"data.train_files=['{train}']" if a.startswith("data.train_files=") else
            f"data.val_files=['{val}']" if a.startswith("data.val_files=") else a for a in args]
    wandb_dir = tmp_path_factory.mktemp("wandb")
    use_wandb(monkeypatch)
    monkeypatch.setenv("WANDB_DIR", str(wandb_dir))
    proc = run_module(["megatron_rl.compat.verl.trainer.main_ppo", *args, *SHRUNK,
                       f"trainer.default_local_dir={tmp_path}"], timeout=1200)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "verl key actor_rollout_ref.model.use_remove_padding=True ->" in proc.stderr  # the rewrites are logged
    assert "verl default trainer.balance_batch=true" in proc.stderr
    records = read_metrics(tmp_path / "metrics.jsonl")
    steps = {r["step"]: r for r in records if "actor/pg_loss" in r}
    assert sorted(steps) == [1, 2]
    for record in steps.values():
        assert_finite(record)
        assert record["training/rollout_probs_diff_max"] < 1e-5  # vLLM's samples came from the step's weights
        assert "global_seqlen/balanced_max" in record or any(k.startswith("global_seqlen/") for k in record)
    assert any(k.startswith("val-core/") for r in records if r["step"] == 0 for k in r)  # val_before_train
    logged = {row["_step"]: row for row in read_offline_run(wandb_dir).history}  # the script's wandb, offline
    assert [logged[step]["actor/pg_loss"] for step in (1, 2)] == [steps[step]["actor/pg_loss"] for step in (1, 2)]
