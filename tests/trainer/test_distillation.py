"""On-policy distillation end to end (docs/distillation.md): a random student distilled from a teacher the demo model
became by SFT reaches the teacher's exact match; the estimator modes and the task-reward mix run in the RL loop; a
teacher the run cannot use is refused before start, naming the key."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_rl.config import ConfigError, load_config
from megatron_rl.data.tasks import write_sft_task
from megatron_rl.demo import prepare_assets
from megatron_rl.sft import run as run_sft
from megatron_rl.train import run

REQUIRED_EXACT_MATCH = 0.9
VAL_ACC = "val-core/synthetic/copy/acc/mean@1"


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> dict[str, Path]:
    """The copy1 task, a random student, and the teacher: the same model after 60 SFT steps (exact match 1.0)."""
    root = tmp_path_factory.mktemp("distill")
    train, val, model = prepare_assets(root, 0, task="copy1", n_train=512, n_val=32)
    sft = write_sft_task("copy1", root / "data", 512, 32, 0)
    teacher = run_sft(load_config(overrides=[
        "+experiment=sft_tiny_cpu", f"actor_rollout_ref.model.path={model}", f"data.train_files=[{sft['train']}]",
        f"trainer.default_local_dir={root / 'teacher'}", "trainer.logger=[jsonl]"]))
    return {"train": train, "val": val, "student": model, "teacher": teacher.hf_dir}


def overrides(assets: dict[str, Path], out: Path, *extra: str) -> list[str]:
    return ["+experiment=grpo_tiny_cpu", f"actor_rollout_ref.model.path={assets['student']}",
            f"data.train_files=[{assets['train']}]", f"data.val_files=[{assets['val']}]",
            f"trainer.default_local_dir={out}", "distillation.enabled=true",
            f"distillation.teacher_models.teacher_model.model_path={assets['teacher']}",
            "data.max_response_length=4", "data.train_batch_size=16", "actor_rollout_ref.rollout.n=2",
            "actor_rollout_ref.actor.ppo_mini_batch_size=16", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=32",
            "actor_rollout_ref.actor.megatron.share_prompts=false", "trainer.logger=[jsonl]", *extra]


def metrics_of(path: Path) -> dict[int, dict]:
    return {record["step"]: record for record in map(json.loads, path.read_text().splitlines())}


def test_the_student_reaches_the_teachers_exact_match(assets, tmp_path):
    result = run(load_config(overrides=overrides(
        assets, tmp_path, "distillation.distillation_loss.loss_mode=forward_kl_topk",
        "distillation.distillation_loss.topk=8", "distillation.distillation_loss.use_task_rewards=false",
        "trainer.total_training_steps=80", "trainer.test_freq=40", "trainer.val_before_train=true")))
    metrics = metrics_of(result.metrics_path)
    assert metrics[0][VAL_ACC] == 0.0  # the random student
    assert metrics[80][VAL_ACC] >= REQUIRED_EXACT_MATCH  # the teacher's is 1.0
    assert metrics[80]["distillation/loss"] < metrics[1]["distillation/loss"] / 2
    assert metrics[80]["distillation/student_mass"] > 0.5 > metrics[1]["distillation/student_mass"]
    assert "timing_s/teacher" in metrics[1]


def test_estimator_modes_with_task_rewards_run_in_the_loop(assets, tmp_path):
    result = run(load_config(overrides=overrides(
        assets, tmp_path, "distillation.distillation_loss.loss_mode=k3", "trainer.total_training_steps=2",
        "distillation.distillation_loss.distillation_loss_coef=0.5", "trainer.test_freq=-1")))
    metrics = metrics_of(result.metrics_path)
    assert metrics[2]["distillation/abs_loss"] > 0 and "distillation/loss" in metrics[2]


def test_a_teacher_served_by_an_hf_engine_on_another_layout_scores_as_the_megatron_one(assets, tmp_path, shared_ray):
    """Actor TP2 on two ranks; the teacher either a frozen Megatron engine at TP2 or (inference.name=hf) one whole
    transformers copy on each of the two TP1 rollout replicas' leaders: the same scores, so the same first steps."""
    two_ranks = ["trainer.n_gpus_per_node=2", "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
                 "distillation.distillation_loss.loss_mode=forward_kl_topk", "distillation.distillation_loss.topk=8",
                 "trainer.total_training_steps=2", "trainer.test_freq=-1", "trainer.save_freq=-1",
                 "trainer.save_hf_at_end=false"]
    megatron = metrics_of(run(load_config(overrides=overrides(assets, tmp_path / "megatron", *two_ranks))).metrics_path)
    served = metrics_of(run(load_config(overrides=overrides(
        assets, tmp_path / "hf", *two_ranks, "+distillation.teacher_models.teacher_model.inference.name=hf")))
        .metrics_path)
    for step in (1, 2):
        for name in ("distillation/loss", "distillation/teacher_mass", "actor/grad_norm"):
            assert served[step][name] == pytest.approx(megatron[step][name], rel=1e-4), (step, name)


@pytest.mark.parametrize(("setting", "message"), [
    ("distillation.n_gpus_per_node=4", r"distillation.n_gpus_per_node=4: a GPU pool of the teacher's own is not built"),
    ("+distillation.teacher_models.teacher_model.inference.name=vllm",
     r"distillation.teacher_models.teacher_model.inference.name='vllm': a teacher served by vllm is not built"),
    ("+distillation.teacher_models.teacher_model.inference={name: hf, gpu_memory_utilization: 0.4}",
     r"inference: \['gpu_memory_utilization'\] set for the HF engine teacher"),
    ("distillation.teacher_models.teacher_model.num_replicas=2", r"num_replicas=2: a teacher on replicas of its own"),
    ("distillation.teacher_models.teacher_model.model_path=null", r"needs exactly one teacher"),
    ("distillation.distillation_loss.loss_mode=kl2", r"distillation.distillation_loss: unknown .*loss_mode 'kl2'"),
    ("async_training.mode=one_step_off", r"async_training.mode=one_step_off is not built"),
])
def test_settings_the_run_cannot_honour_are_refused(assets, tmp_path, setting, message):
    with pytest.raises(ConfigError, match=message):
        run(load_config(overrides=overrides(assets, tmp_path, setting)), dry_run=True)


def test_a_teacher_with_another_tokenizer_is_refused(assets, tmp_path):
    _, _, other = prepare_assets(tmp_path / "other", 0, task="arith", n_train=64, n_val=8)
    cfg = load_config(overrides=overrides(assets, tmp_path / "out",
                                          f"distillation.teacher_models.teacher_model.model_path={other}"))
    with pytest.raises(ConfigError, match=r"distillation.teacher_models.teacher_model.model_path=.*needs one tokenizer"):
        run(cfg, dry_run=True)
