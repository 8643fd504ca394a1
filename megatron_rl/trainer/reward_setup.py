"""The run's reward function: the rule scorers alone, or with a reward model (a Megatron role: its worker group
is attached by the runner) or a generative judge, combined as ``reward_model.combine`` says."""
from __future__ import annotations

from transformers import PreTrainedTokenizerBase

from megatron_rl.config.schema import PPOTrainerConfig
from megatron_rl.data import load_tokenizer
from megatron_rl.reward.manager import RewardManager
from megatron_rl.reward.model.combine import CombinePlan
from megatron_rl.reward.model.inputs import RewardModelInputs
from megatron_rl.reward.model.reward_fn import ClassifierScorer, JudgeScorer, ModelRewardFn, build_judge


def response_length(cfg: PPOTrainerConfig) -> int:
    """The longest response the rollout generates: actor_rollout_ref.rollout.response_length, null:
    data.max_response_length (what reward.reward_kwargs.max_resp_len: null stands for)."""
    length = cfg.actor_rollout_ref.rollout.response_length
    return int(length if length is not None else cfg.data.max_response_length)


def build_reward_fn(cfg: PPOTrainerConfig, tokenizer: PreTrainedTokenizerBase) -> RewardManager | ModelRewardFn:
    """``RewardManager`` (rule scorers, as reward.reward_manager says) unless ``reward_model.enable``; then the model
    scorer with the rule manager as the combine plan needs: a generative judge, started here; or the classifier RM,
    whose worker group the runner attaches once the trainer's groups exist (workers/reward_model.py
    reward_model_group, the one place it is placed and started)."""
    if not cfg.reward_model.enable:
        return RewardManager(tokenizer, cfg.reward, response_length(cfg))
    rm = cfg.reward_model
    plan = CombinePlan(rm.combine)
    needs_rule = plan.default.needs_rule_score or any(r.needs_rule_score for r in plan.per_source.values())
    rule = RewardManager(tokenizer, cfg.reward, response_length(cfg)) if needs_rule else None
    try:
        if rm.judge.enable:
            judge, close = build_judge(cfg)
            return ModelRewardFn(JudgeScorer(judge, tokenizer), plan, rule, close)
        input_tokenizer = load_tokenizer(rm.model.input_tokenizer) if rm.model.input_tokenizer else None
        inputs = RewardModelInputs(load_tokenizer(rm.model.path), input_tokenizer, rm.max_length)
    except BaseException:
        if rule is not None:
            rule.close()
        raise
    return ModelRewardFn(ClassifierScorer(None, inputs), plan, rule)
