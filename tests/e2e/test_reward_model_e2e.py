"""GRPO with a reward model for 3 steps on the real stack (embedded Ray, CPU): the Megatron actor at TP=2 and
the tiny RM at TP=2 in the same two processes, its score added to the copy task's rule score; and the RM on a
Ray pool of its own, scoring like transformers."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from megatron_rl.reward.model.inputs import right_padded
from megatron_rl_testing.reward_models import make_tiny_reward_model
from megatron_rl.train import run
from e2e_support import assert_finite, tiny_config, train_steps

pytestmark = pytest.mark.distributed

WEIGHT = 0.5


@pytest.fixture(scope="module")
def tiny_rm(tiny_assets, tmp_path_factory):
    """A random Qwen2ForSequenceClassification over the demo's tokenizer."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_assets["model"])
    path = make_tiny_reward_model(
        tmp_path_factory.mktemp("rm") / "rm", "qwen2", with_tokenizer=False, vocab_size=len(tokenizer),
        max_position_embeddings=64, pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id)
    tokenizer.save_pretrained(path)
    return path


def test_grpo_with_a_reward_model_added_to_the_rule_score(tiny_assets, tiny_rm, tmp_path, shared_ray):
    result = run(tiny_config(
        tiny_assets, tmp_path, "trainer.total_training_steps=3",
        "reward_model.enable=true", f"reward_model.model.path={tiny_rm}",
        # re-tokenized through the RM's tokenizer and chat template (here the policy's own, so the path is run)
        f"reward_model.model.input_tokenizer={tiny_assets['model']}",
        "reward_model.megatron.tensor_model_parallel_size=2", "reward_model.use_dynamic_bsz=true",
        "reward_model.forward_max_token_len_per_gpu=256",
        "reward_model.combine.mode=sum", f"reward_model.combine.weight={WEIGHT}",
    ))
    steps = train_steps(result.metrics_path)
    assert sorted(steps) == [1, 2, 3]
    for record in steps.values():
        assert_finite(record)
        rule, rm = record["reward/rule/mean"], record["reward/rm/mean"]
        assert record["reward/score/mean"] == pytest.approx(rule + WEIGHT * rm, abs=1e-5)
        assert record["critic/score/mean"] == pytest.approx(record["reward/score/mean"], abs=1e-5)
        assert record["reward/rm/truncated"] == 0.0 and record["reward/errors"] == 0.0
        assert "actor/pg_loss" in record
    assert len({round(r["reward/rm/mean"], 6) for r in steps.values()}) > 1  # the RM scored new responses


def test_reward_model_on_its_own_ray_pool_scores_like_transformers(tiny_assets, tiny_rm, tmp_path):
    from megatron_rl.controller import shutdown_ray
    from megatron_rl.config import typed_config
    from megatron_rl.workers.reward_model import reward_model_group

    cfg = tiny_config(tiny_assets, tmp_path, "reward_model.enable=true", f"reward_model.model.path={tiny_rm}",
                      "reward_model.enable_resource_pool=true", "reward_model.n_gpus_per_node=1")
    rows = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14]]
    group, close = reward_model_group(typed_config(cfg), colocated=None)  # as the runner calls it
    try:
        assert group.world_size == 1
        scores = group.compute_rm_score(right_padded(rows, pad_id=0)).batch["rm_scores"]
    finally:
        close()
        shutdown_ray()
    reference = AutoModelForSequenceClassification.from_pretrained(tiny_rm, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = torch.stack([reference(input_ids=torch.tensor([r])).logits[0, 0] for r in rows])
    assert (scores - expected).abs().max().item() <= 1e-4
