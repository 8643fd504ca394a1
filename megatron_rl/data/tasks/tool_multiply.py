"""``tool_multiply``: multiply two 6-digit numbers, with a calculator tool (a multi-turn, tool-using task).

A 12-digit product is beyond what a small model computes in its head, so the task is solved by calling
the tool: ``<tool_call>{"name": "calculator", "arguments": {"expression": "A * B"}}</tool_call>``, reading
the ``tool`` message that comes back, and answering ``#### <product>``. Rows are verl-format with
``agent_name="tool_agent"`` (also in ``extra_info``, where the dataset keeps it) and ``extra_info.tools_kwargs``;
``extra_info.answer`` is the worked multi-turn transcript (for SFT warm-up and the tiny tokenizer).
Scored by ``synthetic/tool_multiply`` (megatron_rl.reward.scorers.tool_multiply): 1 for the exact
product after ``####``.
"""

from __future__ import annotations

import json
import random
from typing import Any

__all__ = ["SYSTEM_PROMPT", "make_tool_multiply_rows", "tool_call_text"]

_CALCULATOR_SCHEMA = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression exactly.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                       "required": ["expression"]},
    },
}

# Hermes/Qwen-style tool instructions (what a Qwen chat template renders from tools=[...]).
SYSTEM_PROMPT = (
    "You may call the tool below. To call it, write <tool_call>{\"name\": \"calculator\", \"arguments\": "
    "{\"expression\": \"...\"}}</tool_call> and wait for its result.\n<tools>\n"
    + json.dumps(_CALCULATOR_SCHEMA)
    + "\n</tools>"
)


def tool_call_text(expression: str) -> str:
    return "<tool_call>" + json.dumps({"name": "calculator", "arguments": {"expression": expression}}) + "</tool_call>"


def make_tool_multiply_rows(n: int, rng: random.Random, split: str) -> list[dict[str, Any]]:
    rows = []
    for index in range(n):
        a, b = rng.randint(100_000, 999_999), rng.randint(100_000, 999_999)
        question = f"What is {a} * {b}? Use the calculator tool and write the result after \"####\"."
        call = tool_call_text(f"{a} * {b}")
        rows.append(
            {
                "data_source": "synthetic/tool_multiply",
                "agent_name": "tool_agent",
                "prompt": [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": question}],
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": str(a * b)},
                "extra_info": {
                    "split": split,
                    "index": index,
                    "agent_name": "tool_agent",
                    "question": question,
                    "final_answer_pattern": r"####\s*-?[0-9]",
                    "nudge": "Call the calculator, then write the result after ####.",
                    "tools_kwargs": {"calculator": {"create_kwargs": {"ground_truth": str(a * b)}}},
                    "answer": f"{call}\ntool\n{a * b}\n#### {a * b}",
                },
            }
        )
    return rows
