"""The multi-turn rollout of a run (``rollout.multi_turn.enable``): the agent loop, or with ``multi_turn.agent_program``
the user's program through the agent proxy, over any ``generate_sequences``: a colocated replica's engine
(workers/hybrid.py) or the async trainers' server client (trainer/disaggregated.py, ``MultiTurnClient``)."""

from __future__ import annotations

from typing import Any

from megatron_rl.agent.loop import AgentLoop
from megatron_rl.agent.program import AgentProgramRollout
from megatron_rl.agent.turns import GenerateFn
from megatron_rl.config.schema import PPOTrainerConfig
from megatron_rl.protocol import DataProto

__all__ = ["MultiTurnClient", "multi_turn_rollout"]


def multi_turn_rollout(generate_fn: GenerateFn, tokenizer: Any, cfg: PPOTrainerConfig,
                       eos_token_id: int | list[int] | None = None) -> AgentLoop | AgentProgramRollout:
    """The rollout ``rollout.multi_turn`` asks for; turns end at ``eos_token_id`` (default the tokenizer's) and
    ``rollout.stop_token_ids``."""
    rollout = cfg.actor_rollout_ref.rollout
    multi_turn = rollout.multi_turn
    eos = tokenizer.eos_token_id if eos_token_id is None else eos_token_id
    finish = [*([eos] if isinstance(eos, int) else list(eos)), *rollout.stop_token_ids]
    length = rollout.response_length or cfg.data.max_response_length
    if multi_turn.agent_program:
        return AgentProgramRollout(generate_fn, tokenizer, multi_turn.agent_program, response_length=length,
                                   finish_token_ids=finish, max_concurrency=multi_turn.agent_concurrency,
                                   timeout_s=multi_turn.agent_timeout_s)
    return AgentLoop(generate_fn, tokenizer, multi_turn, response_length=length, finish_token_ids=finish)


class MultiTurnClient:
    """An async trainer's server client whose ``generate_sequences`` runs each sample through ``agent`` (every model
    turn one call of the client's own, so a turn a weight swap interrupts resumes on the new weights with its tool
    results already in context, its tokens keeping their versions); pausing, continuing and the rest are the
    client's."""

    def __init__(self, client: Any, agent: AgentLoop | AgentProgramRollout) -> None:
        self.client, self.agent = client, agent

    def generate_sequences(self, prompts: DataProto) -> DataProto:
        return self.agent.generate_sequences(prompts)

    def close(self) -> None:
        if isinstance(self.agent, AgentProgramRollout):
            self.agent.close()
        close = getattr(self.client, "close", None)
        if close is not None:
            close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.client, name)
