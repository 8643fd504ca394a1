"""The RM reward function: RM and rule scores combined per data source, placed at the last valid token,
per-component metrics; the RM group is a stand-in that checks the rows it gets as the worker does."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megatron_rl.config import ConfigError, load_config
from megatron_rl.plan.validate import validate
from megatron_rl.protocol import DataProto
from megatron_rl.reward import RewardManager
from megatron_rl.reward.model.combine import CombinePlan, CombineRule, combine_scores
from megatron_rl.reward.model.inputs import RewardModelInputs
from megatron_rl.reward.model.reward_fn import ClassifierScorer, ModelRewardFn
from megatron_rl.workers.reward_model_role import check_rm_rows
from reward_batches import response_batch, reward_config


class LengthRM:
    """Scores a row by its number of real tokens / 10, after the worker's own checks of the rows."""

    def __init__(self) -> None:
        self.calls = 0

    def compute_rm_score(self, rows: DataProto) -> DataProto:
        check_rm_rows(rows, "compute_rm_score")
        self.calls += 1
        return DataProto.from_dict({"rm_scores": rows.batch["attention_mask"].sum(1).float() / 10})


def mixed_batch(tokenizer) -> DataProto:
    """Two copy-task samples (right, wrong) and two of an RLHF source without ground truth."""
    copy = response_batch(tokenizer, ["123", "999"], ["123", "456"])
    chat = response_batch(tokenizer, ["hello", "hi"], ["", ""], data_source="chat")
    chat.non_tensor_batch["reward_model"] = np.array([{"style": "model"}] * 2, dtype=object)
    batch = DataProto.concat([copy, chat])
    batch.batch["input_ids"] = batch.batch["responses"]  # prompt-free rows are enough for the RM rows
    batch.batch["attention_mask"] = batch.batch["response_mask"]
    return batch


def reward_fn(tokenizer, combine: dict) -> tuple[ModelRewardFn, LengthRM]:
    rm = LengthRM()
    rule = RewardManager(tokenizer, reward_config())
    return ModelRewardFn(ClassifierScorer(rm, RewardModelInputs(tokenizer)), CombinePlan(combine), rule), rm


def test_sum_for_rule_sources_rm_alone_elsewhere(tokenizer):
    fn, rm = reward_fn(tokenizer, {"mode": "rm", "weight": 2.0,
                                   "per_data_source": {"synthetic/copy": {"mode": "sum", "weight": 1.0}}})
    batch = mixed_batch(tokenizer)
    out = fn(batch)
    lengths = batch.batch["response_mask"].sum(1).float()
    rm_scores = lengths / 10
    expected = torch.tensor([1.0 + rm_scores[0], 0.0 + rm_scores[1], 2 * rm_scores[2], 2 * rm_scores[3]])
    assert torch.allclose(out.batch["token_level_scores"].sum(-1), expected)
    last = lengths.long() - 1  # every score sits on the last valid response token
    assert torch.equal(out.batch["token_level_scores"].nonzero()[:, 1], last)
    assert torch.allclose(out.batch["rm_scores"].sum(-1), rm_scores)
    assert list(out.non_tensor_batch["rule_score"]) == [1.0, 0.0, None, None]  # no rule ran on "chat"
    assert list(out.non_tensor_batch["acc"]) == [True, False, None, None]
    metrics = out.meta_info["reward_metrics"]
    assert metrics["reward/rule/mean"] == pytest.approx(0.5)
    assert metrics["reward/rm/mean"] == pytest.approx(rm_scores.mean().item())
    assert metrics["reward/score/mean"] == pytest.approx(expected.mean().item())
    assert metrics["reward/errors"] == 0.0 and rm.calls == 1


def test_gate_gives_the_rm_score_only_where_the_rule_passed():
    rules = [CombineRule("gate", 3.0, 0.5)] * 3
    got = combine_scores(rules, torch.tensor([0.2, 0.2, 0.2]), torch.tensor([1.0, 0.0, 0.5]))
    assert got.tolist() == pytest.approx([0.6, 0.0, 0.5])


def test_rm_only_never_calls_the_rule_scorer(tokenizer):
    fn = ModelRewardFn(ClassifierScorer(LengthRM(), RewardModelInputs(tokenizer)), CombinePlan({"mode": "rm"}), rule=None)
    out = fn(mixed_batch(tokenizer))  # "chat" has no ground truth: a rule scorer would count errors
    assert "reward/rule/mean" not in out.meta_info["reward_metrics"]
    assert "reward/errors" not in out.meta_info["reward_metrics"]


def test_bad_combine_settings_are_refused_by_key():
    with pytest.raises(ValueError, match=r"reward_model.combine.mode='max' is unknown"):
        CombinePlan({"mode": "max"})
    with pytest.raises(ValueError, match=r"per_data_source.gsm8k: unknown keys \['wieght'\]"):
        CombinePlan({"per_data_source": {"gsm8k": {"wieght": 2}}})
    with pytest.raises(ValueError, match=r"reward_model.combine.weight must be a number"):
        CombinePlan({"weight": "high"})


@pytest.mark.parametrize("overrides, message", [
    ([], "reward_model.enable=true needs reward_model.model.path"),
    (["reward_model.model.path=/rm", "reward_model.combine.mode=max"], "reward_model.combine.mode='max'"),
    (["reward_model.model.path=/rm", "reward_model.max_length=0"], "reward_model.max_length must be >= 1"),
    (["reward_model.model.path=/rm", "reward_model.micro_batch_size_per_gpu=0"],
     "reward_model.micro_batch_size_per_gpu must be a positive integer"),
    (["reward_model.model.path=/rm", "reward_model.megatron.tensor_model_parallel_size=4",
      "reward_model.enable_resource_pool=true"], "not a multiple of its TP x PP x CP = 4"),
    (["reward_model.model.path=/rm"],  # colocated by default: the actor's TP=2 is not the RM's TP=1
     "with reward_model.enable_resource_pool=false the reward model shares the actor's processes"),
    (["reward_model.model.path=/rm", "trainer.launcher=torchrun", "reward_model.enable_resource_pool=true"],
     "the reward model shares the actor's processes"),
])
def test_reward_model_config_is_checked_before_launch(overrides, message):
    base = ["+experiment=grpo_tiny_cpu", "data.train_files=[x.parquet]", "actor_rollout_ref.model.path=/m",
            "trainer.n_gpus_per_node=2", "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2"]  # pre-39 preset
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        validate(load_config(overrides=[*base, "reward_model.enable=true", *overrides]))
