"""Environments of the agent loop: one instance per sample, ``reset(sample)`` then ``step(text)`` after
every model turn, registered by name and chosen per sample from the data's ``agent_name`` (verl's field;
also read from ``extra_info["agent_name"]``), else ``multi_turn.default_agent``.

``step`` gets the text of the model turn just generated and returns a :class:`StepResult`: the
observation as chat messages (``{"role": "tool" | "user", "content": ...}``), appended to the context
through the chat template, and whether the episode is over. An environment should not raise; if it does,
the loop turns the exception into an error observation for that sample.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from megatron_rl.agent.parser import ToolCall, ToolCallError, parse_tool_calls
from megatron_rl.agent.tools import Tool, ToolError, truncate

__all__ = ["AgentEnv", "ENV_REGISTRY", "SingleTurnEnv", "StepResult", "ToolEnv", "get_env", "register_env"]


@dataclass
class StepResult:
    observation: list[dict[str, str]] = field(default_factory=list)
    done: bool = False
    tool_calls: int = 0  # calls the model made in this turn (malformed ones included)
    tool_errors: list[str] = field(default_factory=list)  # the reason of each call that failed on the tool's side
    info: dict[str, Any] = field(default_factory=dict)


class AgentEnv:
    """Base environment. ``tools``: the tools the loop was configured with (name -> Tool)."""

    def __init__(self, tools: Mapping[str, Tool] | None = None, **config: Any) -> None:
        self.tools = dict(tools or {})
        self.config = config

    def reset(self, sample: Mapping[str, Any]) -> None:
        """``sample``: the row's ``raw_prompt``, ``extra_info``, ``reward_model``, ``data_source`` (what is present)."""

    def step(self, text: str) -> StepResult:  # pragma: no cover - abstract
        raise NotImplementedError


ENV_REGISTRY: dict[str, type[AgentEnv]] = {}


def register_env(name: str) -> Callable[[type[AgentEnv]], type[AgentEnv]]:
    """Class decorator: ``@register_env("my_env")`` makes rows with ``agent_name="my_env"`` use it."""

    def wrap(cls: type[AgentEnv]) -> type[AgentEnv]:
        known = ENV_REGISTRY.get(name)
        if known is not None and known.__qualname__ != cls.__qualname__:
            raise ValueError(f"environment {name!r} is already registered ({known.__qualname__})")
        ENV_REGISTRY[name] = cls
        return cls

    return wrap


def get_env(name: str) -> type[AgentEnv]:
    try:
        return ENV_REGISTRY[name]
    except KeyError:
        raise ValueError(f"no agent environment {name!r}; registered: {sorted(ENV_REGISTRY)} "
                         "(register one with megatron_rl.agent.register_env)") from None


@register_env("single_turn_agent")
class SingleTurnEnv(AgentEnv):
    """One model turn, no observation (verl's single_turn_agent)."""

    def step(self, text: str) -> StepResult:
        return StepResult(done=True)


@register_env("tool_agent")
class ToolEnv(AgentEnv):
    """verl's tool_agent: each ``<tool_call>`` of a turn is run and its result becomes a ``tool`` message;
    a turn without a tool call is the final answer. Malformed calls, unknown tools and tool errors
    become observations. Config: ``max_parallel_calls`` (calls run per turn; the rest are refused in the
    observation), ``max_tool_response_length`` / ``tool_response_truncate_side`` (characters, verl's keys).
    ``extra_info["tools_kwargs"][tool_name]`` (verl's field) is passed to that tool's execute.
    ``extra_info["final_answer_pattern"]`` (a regex) with ``extra_info["nudge"]`` (a user message): a turn
    without a tool call that does not match the pattern is answered with the nudge instead of ending the
    episode (the model is told to use the tool or to answer in the expected form)."""

    def reset(self, sample: Mapping[str, Any]) -> None:
        extra = sample.get("extra_info") or {}
        extra = extra if isinstance(extra, Mapping) else {}
        self.tools_kwargs = dict(extra.get("tools_kwargs") or {})
        pattern = extra.get("final_answer_pattern")
        self.final_answer = re.compile(pattern) if pattern else None
        self.nudge = str(extra.get("nudge") or "Use a tool, or give the final answer.")

    def step(self, text: str) -> StepResult:
        calls, _ = parse_tool_calls(text)
        if not calls:
            if self.final_answer is not None and not self.final_answer.search(text):
                return StepResult(observation=[{"role": "user", "content": self.nudge}])
            return StepResult(done=True)
        limit = int(self.config.get("max_parallel_calls", 1) or 1)
        width = int(self.config.get("max_tool_response_length", 256) or 0)
        side = str(self.config.get("tool_response_truncate_side", "middle"))
        messages, errors = [], []
        for index, call in enumerate(calls):
            if index >= limit:
                content = f"Error: at most {limit} tool call(s) per turn; this one was not run."
            elif isinstance(call, ToolCallError):
                content = call.message
            else:
                content = self._run(call)
            if isinstance(content, ToolError):  # the tool's failure, not the model's: counted in the metrics
                errors.append(content.reason)
            messages.append({"role": "tool", "content": truncate(content, width, side)})
        return StepResult(observation=messages, done=False, tool_calls=len(calls), tool_errors=errors)

    def _run(self, call: ToolCall) -> str:
        tool = self.tools.get(call.name)
        if tool is None:
            return f"Error: unknown tool {call.name!r}; available: {sorted(self.tools)}."
        kwargs = self.tools_kwargs.get(call.name) or {}
        try:
            result = tool.execute(call.arguments, **(kwargs if isinstance(kwargs, Mapping) else {}))
        except Exception as exc:  # a tool must not take the rollout down
            return ToolError(f"Error: tool {call.name} failed: {type(exc).__name__}: {exc}", "exception")
        return result if isinstance(result, ToolError) else str(result)
