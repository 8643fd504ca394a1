"""Tool-call parsing for the Qwen / Hermes format: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``.

Parsing never raises: every malformed call becomes a :class:`ToolCallError` whose message is shown to the
model as the observation (so it can correct itself), and the well-formed calls of the same turn still run.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

__all__ = ["ToolCall", "ToolCallError", "parse_tool_calls"]

_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_OPEN = "<tool_call>"


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ToolCallError:
    """A call that could not be parsed; ``message`` is what the model is told."""

    message: str
    raw: str = ""


def parse_tool_calls(text: str) -> tuple[list[ToolCall | ToolCallError], str]:
    """The calls of one model turn, in order, and the text outside them (the turn's content)."""
    calls: list[ToolCall | ToolCallError] = []
    for match in _CALL.finditer(text):
        calls.append(_parse_one(match.group(1)))
    rest = _CALL.sub("", text)
    if _OPEN in rest:  # an opened call that never closed
        raw = rest[rest.index(_OPEN):]
        calls.append(ToolCallError("Error: <tool_call> was opened but never closed with </tool_call>.", raw))
        rest = rest[: rest.index(_OPEN)]
    return calls, rest.strip()


def _parse_one(body: str) -> ToolCall | ToolCallError:
    raw = body.strip()
    try:
        payload = json.loads(raw)
    except (json.JSONDecodeError, ValueError) as exc:
        return ToolCallError(f"Error: the tool call is not valid JSON ({exc.msg} at position {exc.pos}); "
                             'expected {"name": <tool name>, "arguments": {...}}.', raw)
    if not isinstance(payload, dict):
        return ToolCallError('Error: the tool call must be a JSON object {"name": ..., "arguments": {...}}.', raw)
    name = payload.get("name")
    if not isinstance(name, str) or not name:
        return ToolCallError('Error: the tool call has no "name" (a string).', raw)
    arguments = payload.get("arguments", payload.get("parameters", {}))
    if isinstance(arguments, str):  # OpenAI's wire form: arguments as a JSON string
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except (json.JSONDecodeError, ValueError):
            return ToolCallError(f'Error: the "arguments" of {name} are not valid JSON.', raw)
    if arguments is None:
        arguments = {}
    if not isinstance(arguments, dict):
        return ToolCallError(f'Error: the "arguments" of {name} must be a JSON object.', raw)
    return ToolCall(name, arguments)
