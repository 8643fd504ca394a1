"""Model-based rewards: a sequence-classification reward model on Megatron, scored at the last real token.

- ``role.RewardModelRole`` (on each rank, Megatron-sharded like the critic): ``rm_scores`` [B] of a batch
  of RM token rows; ``workers.reward_model.RewardModelWorker`` puts it in a worker group.
- ``inputs.RewardModelInputs`` (on the driver): the policy's samples as RM token rows, re-tokenized with
  the RM's own tokenizer and chat template when ``reward_model.model.input_tokenizer`` is set (as verl).
- ``combine``: per data source, the RM score alone, added to the rule score, or gated by it.
- ``reward_fn.ModelRewardFn``: the trainer's reward function when ``reward_model.enable``.
- ``judge``: a generative judge served by a rollout engine (prompt template + verdict parser).

Submodules are imported where used, so the rule-scorer processes never import Megatron.
"""
