"""An agent written with the ``openai`` client, trained by megatron-rl through its agent proxy.

Run it on the tool_multiply task (a calculator tool; docs/rollout.md, "Agent programs"):

    python -m megatron_rl.train ... \
        actor_rollout_ref.rollout.multi_turn.enable=true \
        actor_rollout_ref.rollout.multi_turn.agent_program=examples/agents/openai_tool_agent.py:run

The program knows nothing of megatron-rl: it gets an OpenAI ``base_url`` / ``api_key`` (its session), the task's
messages, and talks to the model as to any OpenAI-compatible server. Every model turn it asks for becomes part of one
training sample; the tool results it sends back are context (masked from the loss). It returns None, so the run's
reward function scores the final answer; returning a number would be the sample's reward instead.
"""

from __future__ import annotations

import json

import openai

from megatron_rl.agent.program import AgentTask
from megatron_rl.agent.tools import safe_arithmetic

MAX_MODEL_TURNS = 3
NUDGE = 'Call the calculator tool, then answer with "#### <result>".'


def calculator(arguments: str) -> str:
    try:
        return str(safe_arithmetic(str(json.loads(arguments)["expression"])))
    except Exception as exc:  # the model sees its mistake and may correct it
        return f"Error: {type(exc).__name__}: {exc}"


def run(task: AgentTask) -> float | None:
    client = openai.OpenAI(base_url=task.base_url, api_key=task.api_key, max_retries=0)
    messages = list(task.messages)
    for _ in range(MAX_MODEL_TURNS):
        choice = client.chat.completions.create(model=task.model, messages=messages).choices[0]
        if choice.finish_reason == "length":  # the sample's token budget is spent
            return None
        message = choice.message
        messages.append(message.model_dump(exclude_none=True))
        if message.tool_calls:
            messages += [{"role": "tool", "tool_call_id": call.id, "content": calculator(call.function.arguments)}
                         for call in message.tool_calls]
        elif "####" in (message.content or ""):
            return None
        else:
            messages.append({"role": "user", "content": NUDGE})
    return None
