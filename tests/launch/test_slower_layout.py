"""The planner's 'slower than a smaller layout' note (issue 39): a model-parallel split of a narrow model that fits
unsplit is named in the plan and in --dry-run, with the keys that remove it; a wide model, or one that needs the
split to fit, gets no note."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_rl.config import load_config
from megatron_rl.plan import build_plan
from megatron_rl.plan.planner import SPLIT_MIN_HIDDEN, slower_layout_note

TP2 = ("trainer.n_gpus_per_node=2", "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2")


def qwen2(path: Path, hidden: int, layers: int = 2) -> Path:
    """An HF Qwen2 config.json: all the planner reads of a model."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 256, "hidden_size": hidden,
        "intermediate_size": 2 * hidden, "num_hidden_layers": layers, "num_attention_heads": 4,
        "num_key_value_heads": 2, "max_position_embeddings": 64, "tie_word_embeddings": False,
        "torch_dtype": "float32"}))
    return path


def plan_of(model: Path, *overrides: str):
    return build_plan(load_config(overrides=["+experiment=grpo_tiny_cpu", "data.train_files=[x.parquet]",
                                             f"actor_rollout_ref.model.path={model}", *overrides]))


def notes_about_slower(plan) -> list[str]:
    return [n for n in plan.notes if n.startswith("note: slower than a smaller layout")]


def test_tp2_on_a_narrow_model_is_named_with_the_keys_that_remove_it(tmp_path):
    plan = plan_of(qwen2(tmp_path / "m", 64), *TP2)
    (note,) = notes_about_slower(plan)
    assert "hidden size 64 (< 1024)" in note and "tensor_model_parallel_size=2" in note
    assert "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=1" in note
    assert "trainer.n_gpus_per_node=1" in note  # on CPU one rank is faster still
    assert note in plan.format()  # what --dry-run prints


def test_the_presets_own_layout_and_wide_models_get_no_note(tmp_path):
    assert notes_about_slower(plan_of(qwen2(tmp_path / "m", 64))) == []  # one rank, TP=1: nothing to say
    wide = plan_of(qwen2(tmp_path / "w", SPLIT_MIN_HIDDEN), *TP2)
    assert notes_about_slower(wide) == []


def test_no_note_when_the_model_needs_the_split_to_fit(tmp_path):
    model = qwen2(tmp_path / "m", 768, layers=200)  # narrow but deep: ~1.4B parameters, 16 B each to train
    gib = next((g for g in range(8, 400, 8) if _fits_split_only(model, g)), None)
    assert gib is not None, "no memory size where only the split fits"
    split = plan_of(model, "trainer.n_gpus_per_node=2", f"plan.gpu_memory_gib={gib}",
                    "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2")
    assert split.fits and notes_about_slower(split) == []


def _fits_split_only(model: Path, gib: int) -> bool:
    from megatron_rl.plan import PlanError

    try:
        plan_of(model, "trainer.n_gpus_per_node=2", f"plan.gpu_memory_gib={gib}",
                "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2")
    except PlanError:
        return False
    try:
        plan_of(model, "trainer.n_gpus_per_node=2", f"plan.gpu_memory_gib={gib}")
    except PlanError:
        return True
    return False


def test_dry_run_prints_the_note(tmp_path, capsys):
    from megatron_rl.plan.cli import main

    assert main(["+experiment=grpo_tiny_cpu", "data.train_files=[x.parquet]",
                 f"actor_rollout_ref.model.path={qwen2(tmp_path / 'm', 64)}", *TP2]) == 0
    assert "note: slower than a smaller layout" in capsys.readouterr().out


@pytest.mark.parametrize("split", ["actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2"])
def test_pipeline_splits_are_named_too(tmp_path, split):
    (note,) = notes_about_slower(plan_of(qwen2(tmp_path / "m", 64), "trainer.n_gpus_per_node=2", split))
    assert "pipeline_model_parallel_size=2" in note
