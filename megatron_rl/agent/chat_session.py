"""One agent conversation through the OpenAI-compatible proxy (agent/proxy.py), kept as the tokens the model saw.

The first request's messages (and ``tools``) are rendered with the model's chat template: that is the sample's
prompt. Every later request must repeat the conversation so far unchanged (the earlier messages and each assistant
reply as the proxy returned it) and add only new user or tool messages; those are rendered as the agent loop renders
observations (``observation_token_ids``) and appended with loss mask 0. The model's replies enter the context as the
tokens the engine generated, never re-tokenized from their text: a request whose history differs from what was
recorded (an edited message, a reply re-worded, other tools) would put text the model never produced into the
context, and is refused naming the session and the message (``SessionRefused``).

A reply's text is parsed for tool calls in the Hermes / Qwen form (agent/parser.py) and returned as OpenAI
``tool_calls``; a reply with a malformed call is returned as plain text.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from megatron_rl.agent.loop import observation_token_ids
from megatron_rl.agent.parser import ToolCall, parse_tool_calls
from megatron_rl.agent.turns import TokenRecord, Turn

__all__ = ["ChatSession", "Reply", "SessionRefused", "normalized_messages"]


class SessionRefused(ValueError):
    """A request the session cannot take (its message names the session and what is wrong)."""


@dataclass(frozen=True)
class Reply:
    """The assistant message the proxy returns for one model turn, and why the turn ended."""

    content: str | None
    tool_calls: list[dict[str, Any]]
    finish_reason: str  # stop | tool_calls | length
    completion_tokens: int


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, Sequence):  # OpenAI content parts: only text parts are read
        return "".join(str(part.get("text", "")) for part in content if isinstance(part, Mapping)
                       and part.get("type") == "text")
    raise SessionRefused(f"message content must be a string or a list of parts, got {type(content).__name__}")


def _call(call: Mapping[str, Any]) -> tuple[str, Any]:
    function = call.get("function") or {}
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except ValueError:
            pass  # compared as the string the client sent
    return str(function.get("name")), arguments


def normalized_messages(messages: Sequence[Mapping[str, Any]]) -> list[tuple[str, str, list[tuple[str, Any]]]]:
    """What two messages must share to be the same turn: role, text and tool calls (name, parsed arguments)."""
    out = []
    for message in messages:
        if not isinstance(message, Mapping) or "role" not in message:
            raise SessionRefused(f"every message needs a role, got {message!r:.80}")
        out.append((str(message["role"]), _text(message.get("content")),
                    [_call(c) for c in message.get("tool_calls") or []]))
    return out


def _template_message(message: Mapping[str, Any]) -> dict[str, Any]:
    """A new user / tool message as chat templates take it (plain-text content)."""
    return {**{k: v for k, v in message.items() if k in ("role", "name", "tool_call_id")},
            "content": _text(message.get("content"))}


@dataclass
class ChatSession(TokenRecord):
    """The token record of one conversation. ``budget``: tokens after the prompt (model and observation tokens
    together, as the agent loop's response length)."""

    session_id: str
    tokenizer: Any
    budget: int
    finish_token_ids: frozenset[int]
    prompt: list[int] | None = None
    tools: Any = None
    history: list[tuple[str, str, list[tuple[str, Any]]]] = field(default_factory=list)
    model_turns: int = 0
    obs_turns: int = 0
    tool_calls: int = 0
    stop_reason: str | None = None
    busy: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def _refuse(self, what: str) -> SessionRefused:
        return SessionRefused(f"session {self.session_id!r}: {what}")

    def context(self, messages: Sequence[Mapping[str, Any]], tools: Any) -> list[int] | None:
        """The token context the next model turn continues (prompt + every turn so far + the new messages), or
        None when the new messages leave no room for a model token (the session ends: ``length``)."""
        if not messages:
            raise self._refuse("the request has no messages")
        given = normalized_messages(messages)
        if self.prompt is None:
            text = self.tokenizer.apply_chat_template([dict(m) for m in messages], tools=tools, tokenize=False,
                                                      add_generation_prompt=True)
            self.prompt = list(self.tokenizer.encode(text, add_special_tokens=False))
            self.tools, self.history = tools, given
            return list(self.prompt)
        if self.stop_reason == "length":
            return None
        if tools != self.tools:
            raise self._refuse("the request's tools differ from the first request's; the prompt the model saw "
                               "declared those (start a new session for other tools)")
        for index, (seen, sent) in enumerate(zip(self.history, given)):
            if seen != sent:
                raise self._refuse(
                    f"message {index} ({sent[0]}) differs from the conversation the model saw ({seen[0]}: "
                    f"{seen[1]!r:.60}); its tokens would be re-tokenized from this text, not the ones the model "
                    "generated. Send the history back unchanged, each assistant reply as returned")
        if len(given) <= len(self.history):
            raise self._refuse(f"the request repeats {len(given)} of the {len(self.history)} messages so far and "
                               "adds none; a request adds user or tool messages after the last reply")
        new = list(messages[len(self.history):])
        if any(m.get("role") == "assistant" for m in new):
            raise self._refuse("a new assistant message the model did not generate; only user and tool messages "
                               "may follow the last reply")
        observation = observation_token_ids(self.tokenizer, [_template_message(m) for m in new])
        self.history = given
        if len(self.tokens) + len(observation) >= self.budget:  # no room for the observation and a model token
            self.stop_reason = "length"
            return None
        self.add_observation(observation)
        self.obs_turns += 1
        return self.prompt + self.tokens

    def room(self) -> int:
        """Model tokens the next turn may take."""
        return self.budget - len(self.tokens)

    def record(self, turn: Turn) -> Reply:
        """Append the model's turn; the reply the proxy returns (and the history's assistant message)."""
        self.add_turn(turn)
        self.model_turns += 1
        ended = bool(turn.tokens) and turn.tokens[-1] in self.finish_token_ids
        body = turn.tokens[:-1] if ended else turn.tokens
        text = self.tokenizer.decode(body, skip_special_tokens=True)
        calls, rest = parse_tool_calls(text)
        tool_calls = []
        if calls and all(isinstance(c, ToolCall) for c in calls):
            tool_calls = [{"id": f"call_{self.session_id}_{self.model_turns}_{k}", "type": "function",
                           "function": {"name": c.name, "arguments": json.dumps(c.arguments)}}
                          for k, c in enumerate(calls)]
            content = rest or None
        else:  # no call, or a malformed one: the model's text as it is
            content = text
        self.tool_calls += len(tool_calls)
        if not ended:
            self.stop_reason = "length"
        finish = "length" if not ended else "tool_calls" if tool_calls else "stop"
        assistant = {"role": "assistant", "content": content, "tool_calls": tool_calls}
        self.history = self.history + normalized_messages([assistant])
        return Reply(content, tool_calls, finish, len(turn.tokens))
