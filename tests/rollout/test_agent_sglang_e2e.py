"""Multi-turn GRPO through the trainer with rollout.name=sglang against the strict SGLang 0.5.23 stand-in (4 Ray
ranks, actor TP 2, rollout TP 2 -> 2 engines): every model turn is a generate call on the engine leaders, the
trainer's log-probs equal the engines' on every model token, syncs verified, validation multi-turn too."""

from __future__ import annotations

import pytest
from sglang_runs import check_run, sglang_overrides

from megatron_rl.config import load_config
from megatron_rl.train import run
from megatron_rl.trainer.tracking import read_metrics

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


@pytest.fixture(scope="module")
def tool_assets(tmp_path_factory):
    import pyarrow.parquet as pq
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    from megatron_rl.data import build_tiny_tokenizer
    from megatron_rl.data.tasks import task_texts, write_task

    out = tmp_path_factory.mktemp("tool_assets")
    paths = write_task("tool_multiply", out / "data", n_train=64, n_val=8, seed=0)
    rows = [row for path in paths.values() for row in pq.read_table(path).to_pylist()]
    model_dir = out / "model"
    tokenizer = build_tiny_tokenizer(model_dir, task_texts(rows), vocab_size=200)
    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(model_dir)
    return {"train": paths["train"], "val": paths["val"], "model": model_dir}


def test_multi_turn_grpo_on_two_sglang_engines(sglang_stand_in, tool_assets, tmp_path):
    result = run(load_config(overrides=sglang_overrides(
        tool_assets, tmp_path,
        "trainer.total_training_steps=2",
        "data.max_prompt_length=192",
        "data.max_response_length=96",
        f"actor_rollout_ref.rollout.stop_token_ids={list(range(40, 52))}",
        "actor_rollout_ref.rollout.multi_turn.enable=true",
        "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=3",
    )))
    check_run(result.metrics_path, 2)
    for record in read_metrics(result.metrics_path):
        if record["step"] == 0:
            continue
        assert record["num_turns/max"] >= 5 and record["num_turns/mean"] > 3
        assert record["training/rollout_probs_diff_max"] < 1e-5
