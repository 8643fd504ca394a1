"""The trainer's reward function when ``reward_model.enable``: model scores (a sequence-classification RM, or
a generative judge with ``reward_model.judge.enable``), rule scores where the data source's combine mode needs
them, combined per sample and placed at the last valid response token.

Returns what ``RewardManager`` returns (``token_level_scores``, ``non_tensor_batch["score"]`` and the rule
scorers' extras, ``meta_info["reward_metrics"]``) plus ``rm_scores`` [B, R] (verl's key, the RM score at the
same position) and ``non_tensor_batch["rm_score"]``/``["rule_score"]`` (None where no rule ran). Metrics:
``reward/rm/mean``, ``reward/rule/mean`` (over the samples a rule scored), ``reward/score/mean`` (combined),
``reward/rm/truncated`` and the rule manager's ``reward/errors`` / ``reward/timeouts``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from megatron_rl.config.schema import PPOTrainerConfig
from megatron_rl.data import load_tokenizer
from megatron_rl.protocol import DataProto
from megatron_rl.reward.manager import RewardManager, decode_responses
from megatron_rl.reward.model.combine import CombinePlan, combine_scores
from megatron_rl.reward.model.inputs import RewardModelInputs
from megatron_rl.reward.model.judge import EngineJudgeBackend, GenerativeJudge, VerdictParser
from megatron_rl.reward.model.judge_actor import RayJudgeEngine, build_judge_engine
from megatron_rl.reward.placement import place_scores


# the batch -> ([B] model scores, metrics)
ModelScorer = Callable[[DataProto], tuple[torch.Tensor, dict[str, float]]]


class ClassifierScorer:
    """The RM worker group (anything with ``compute_rm_score(DataProto) -> {"rm_scores": [B]}``) on the RM
    token rows ``inputs`` makes of the batch."""

    def __init__(self, rm_group: Any, inputs: RewardModelInputs) -> None:
        self.rm_group, self.inputs = rm_group, inputs

    def __call__(self, data: DataProto) -> tuple[torch.Tensor, dict[str, float]]:
        if self.rm_group is None:
            raise RuntimeError("the reward model's worker group was never attached (ModelRewardFn.attach)")
        rows, metrics = self.inputs(data)
        return self.rm_group.compute_rm_score(rows).batch["rm_scores"].float().cpu(), metrics


class JudgeScorer:
    """A ``GenerativeJudge`` on the prompt (its last message), the decoded response and the ground truth."""

    def __init__(self, judge: Any, tokenizer: Any) -> None:
        self.judge, self.tokenizer = judge, tokenizer

    def __call__(self, data: DataProto) -> tuple[torch.Tensor, dict[str, float]]:
        data.require("raw_prompt", "reward_model", where="generative judge")
        prompts = [p if isinstance(p, str) else str(list(p)[-1]["content"]) for p in data.non_tensor_batch["raw_prompt"]]
        responses = decode_responses(self.tokenizer, data.batch["responses"], data.batch["response_mask"])
        truths = [rm.get("ground_truth") if isinstance(rm, dict) else None for rm in data.non_tensor_batch["reward_model"]]
        results = self.judge.score(prompts, responses, truths)
        return torch.tensor([r.score for r in results], dtype=torch.float32), dict(self.judge.last_metrics)


class ModelRewardFn:
    """Args:
    model_scorer: the batch -> model scores (``ClassifierScorer`` or ``JudgeScorer``).
    plan: the combine rule of each data source.
    rule: the rule-based manager, needed when some data source's mode is ``sum`` or ``gate``.
    close: stops what scores (the RM worker group).
    """

    def __init__(self, model_scorer: ModelScorer, plan: CombinePlan, rule: RewardManager | None = None,
                 close: Callable[[], None] = lambda: None) -> None:
        self.model_scorer = model_scorer
        self.plan = plan
        self.rule = rule
        self._close = close

    def __call__(self, data: DataProto) -> DataProto:
        data.require("responses", "response_mask", "data_source", where="reward model")
        mask = data.batch["response_mask"].cpu()
        rm, metrics = self.model_scorer(data)
        model_errors = metrics.pop("reward/errors", 0.0), metrics.pop("reward/timeouts", 0.0)
        rules = self.plan.rules([str(s) for s in data.non_tensor_batch["data_source"]])
        ruled = [i for i, r in enumerate(rules) if r.needs_rule_score]
        rule_scores = torch.zeros(len(data))
        non_tensor: dict[str, np.ndarray] = {"rule_score": _column([None] * len(data))}
        if ruled:
            if self.rule is None:
                raise RuntimeError("reward_model.combine asks for rule scores but no rule RewardManager was given")
            out = self.rule(data.select_idxs(ruled))
            rule_metrics = out.meta_info["reward_metrics"]
            rule_scores[ruled] = out.batch["token_level_scores"].sum(-1)
            non_tensor["rule_score"][ruled] = rule_scores[ruled].tolist()
            for key, column in out.non_tensor_batch.items():
                if key != "score":  # the rule's extras (acc, pred, ...), None for samples no rule scored
                    non_tensor[key] = _column([None] * len(data))
                    non_tensor[key][ruled] = list(column)
            metrics |= {k: v for k, v in rule_metrics.items() if k != "reward/score/mean"}
            metrics["reward/rule/mean"] = rule_metrics["reward/score/mean"]
        if any(model_errors) or "reward/errors" in metrics:  # a judge's failures count as the rule scorers' do
            metrics["reward/errors"] = metrics.get("reward/errors", 0.0) + model_errors[0]
            metrics["reward/timeouts"] = metrics.get("reward/timeouts", 0.0) + model_errors[1]
        scores = combine_scores(rules, rm, rule_scores)
        metrics |= {"reward/rm/mean": rm.mean().item() if len(rm) else 0.0,
                    "reward/score/mean": scores.mean().item() if len(scores) else 0.0}
        non_tensor |= {"score": _column(scores.tolist()), "rm_score": _column(rm.tolist())}
        tensors = {"token_level_scores": place_scores(scores, mask), "rm_scores": place_scores(rm, mask)}
        return DataProto.from_dict(tensors, non_tensor, {"reward_metrics": metrics})

    def attach(self, rm_group: Any, close: Callable[[], None] = lambda: None) -> None:
        """The RM worker group, built once the trainer's groups exist, and what stops it."""
        self.model_scorer.rm_group = rm_group
        self._close = close

    def close(self) -> None:
        if self.rule is not None:
            self.rule.close()
        self._close()


def _column(values: list[Any]) -> np.ndarray:
    column = np.empty(len(values), dtype=object)
    column[:] = values
    return column


def build_judge(cfg: PPOTrainerConfig) -> tuple[Any, Callable[[], None]]:
    """``reward_model.judge`` (greedy answers) and what stops it: its engine in the driver, or in a Ray actor of
    its own with ``reward_model.enable_resource_pool`` (reward/model/judge_actor.py)."""
    judge_cfg, device = cfg.reward_model.judge, cfg.trainer.device
    if cfg.reward_model.enable_resource_pool:
        from megatron_rl.controller import init_ray_from_config  # lazy: Ray (torchrun runs never import it)

        init_ray_from_config(cfg.ray_init)  # does nothing when Ray is already up
        engine = RayJudgeEngine(judge_cfg, device, cfg.ray_init.timeout_s)
        close = engine.close
    else:
        engine, close = build_judge_engine(judge_cfg, device), (lambda: None)
    parser = VerdictParser(judge_cfg.verdict_pattern, judge_cfg.verdict_scale)
    judge = GenerativeJudge(EngineJudgeBackend(engine, load_tokenizer(judge_cfg.model.path)), judge_cfg.template,
                            parser, judge_cfg.timeout_s, judge_cfg.retries)
    return judge, close
