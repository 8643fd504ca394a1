"""An OpenAI-compatible chat endpoint served by the run's engine, so that any agent program can be trained.

Each trajectory is a session with its own base URL, ``{url}/sessions/{session_id}/v1``: an agent written with the
``openai`` client (or LangChain, or anything that speaks ``/v1/chat/completions``) is pointed at it and needs to know
nothing else. Requests need the run's secret (``Authorization: Bearer``, what the ``openai`` client's ``api_key``
sends). ``POST .../chat/completions`` takes ``messages``, ``tools``, ``max_tokens`` / ``max_completion_tokens`` and
``stream``; the reply is a ``chat.completion`` (or its ``chat.completion.chunk`` events, then ``[DONE]``) whose
message carries the model's text and its tool calls as OpenAI ``tool_calls``. The request's sampling settings
(temperature, top_p, seed, n > 1) are not taken: the run's rollout settings sample every turn, as the trainer's
importance ratios assume; ``n`` other than 1 is refused.

The HTTP threads only record; generation runs on the thread that calls ``serve`` (the engine's owner: engines are
thread-affine), which sends the model turns of all sessions waiting at that moment (after ``batch_window_s``) as one
``generate_sequences`` call, so concurrent agents batch like the agent loop's samples. What each session saw is kept
as tokens (agent/chat_session.py); agent/program.py turns finished sessions into training samples.
"""

from __future__ import annotations

import hmac
import json
import logging
import queue
import re
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from megatron_rl.agent.chat_session import ChatSession, Reply, SessionRefused
from megatron_rl.agent.turns import GenerateFn, Turn, generate_turns
from megatron_rl.rollout.http_reply import send_json

__all__ = ["AgentProxy"]

logger = logging.getLogger(__name__)

_ROUTE = re.compile(r"^/sessions/([A-Za-z0-9_.:-]+)/v1/(chat/completions|models)/?$")


@dataclass
class _Waiting:
    """A model turn an HTTP thread waits for."""

    session: ChatSession
    context: list[int]
    max_tokens: int
    done: threading.Event = field(default_factory=threading.Event)
    turn: Turn | None = None
    error: str | None = None


class AgentProxy:
    """The endpoint (``start`` / ``close``, or a ``with`` block); sessions are opened and closed by the caller."""

    def __init__(self, tokenizer: Any, *, budget: int, finish_token_ids: set[int] | frozenset[int], api_key: str,
                 model_name: str = "megatron-rl", host: str = "127.0.0.1", port: int = 0,
                 batch_window_s: float = 0.02, request_timeout_s: float = 600.0) -> None:
        self.tokenizer, self.budget = tokenizer, int(budget)
        self.finish_token_ids = frozenset(finish_token_ids)
        self.api_key, self.model_name = api_key, model_name
        self.batch_window_s, self.request_timeout_s = float(batch_window_s), float(request_timeout_s)
        self._sessions: dict[str, ChatSession] = {}
        self._lock = threading.Lock()
        self._queue: queue.Queue[_Waiting] = queue.Queue()
        self._server = ThreadingHTTPServer((host, port), _handler(self))
        self._server.daemon_threads = True
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ lifecycle
    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def base_url(self, session_id: str) -> str:
        """The OpenAI ``base_url`` of one session."""
        return f"{self.url}/sessions/{session_id}/v1"

    def start(self) -> AgentProxy:
        self._thread = threading.Thread(target=self._server.serve_forever, name="agent-proxy", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=10)
        while not self._queue.empty():  # nobody will generate these any more
            waiting = self._queue.get_nowait()
            waiting.error = "the agent proxy closed"
            waiting.done.set()

    def __enter__(self) -> AgentProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ sessions
    def open_session(self, session_id: str | None = None) -> ChatSession:
        session_id = session_id or uuid.uuid4().hex
        if not _ROUTE.match(f"/sessions/{session_id}/v1/models"):
            raise ValueError(f"session id {session_id!r}: letters, digits and _ . : - only")
        with self._lock:
            if session_id in self._sessions:
                raise ValueError(f"session {session_id!r} is open already")
            session = ChatSession(session_id, self.tokenizer, self.budget, self.finish_token_ids)
            self._sessions[session_id] = session
        return session

    def close_session(self, session_id: str) -> ChatSession:
        """The session's record; later requests to it are refused (404)."""
        with self._lock:
            return self._sessions.pop(session_id)

    def _session(self, session_id: str) -> ChatSession | None:
        with self._lock:
            return self._sessions.get(session_id)

    # ------------------------------------------------------------------ generation (the engine's thread)
    def serve(self, generate_fn: GenerateFn, meta: Mapping[str, Any], until: Callable[[], bool],
              poll_s: float = 0.05) -> int:
        """Generate the waiting model turns, batch after batch, until ``until()`` holds; returns the number of
        engine calls. Runs on the caller's thread."""
        calls = 0
        while not until():
            try:
                first = self._queue.get(timeout=poll_s)
            except queue.Empty:
                continue
            if self.batch_window_s > 0:
                time.sleep(self.batch_window_s)  # near-simultaneous requests join this call
            batch = [first]
            while not self._queue.empty():
                batch.append(self._queue.get_nowait())
            try:
                turns = generate_turns(generate_fn, [w.context for w in batch], [w.max_tokens for w in batch],
                                       meta, pad_token_id=_pad_id(self.tokenizer, self.finish_token_ids))
            except Exception as exc:  # the engine's failure is every waiting request's, and the caller's
                for waiting in batch:
                    waiting.error = f"generation failed: {type(exc).__name__}: {exc}"
                    waiting.done.set()
                raise
            for waiting, turn in zip(batch, turns):
                waiting.turn = turn
                waiting.done.set()
            calls += 1
        return calls

    # ------------------------------------------------------------------ one request (an HTTP thread)
    def complete(self, session_id: str, body: Mapping[str, Any]) -> tuple[Reply, int]:
        """The reply to one chat request and its prompt tokens; raises SessionRefused (400), KeyError (404),
        TimeoutError / RuntimeError (503)."""
        session = self._session(session_id)
        if session is None:
            raise KeyError(f"session {session_id!r} is not open (finished, or never opened by the run)")
        if int(body.get("n") or 1) != 1:
            raise SessionRefused(f"session {session_id!r}: n={body.get('n')}: one choice per request (each "
                                 "trajectory is its own session)")
        if not session.busy.acquire(blocking=False):
            raise SessionRefused(f"session {session_id!r}: a request of this session is still being answered; a "
                                 "conversation's turns come one after the other")
        try:
            context = session.context(list(body.get("messages") or []), body.get("tools"))
            if context is None:  # no room left in the sample
                return Reply("", [], "length", 0), len(session.prompt or [])
            asked = body.get("max_completion_tokens") or body.get("max_tokens") or session.room()
            waiting = _Waiting(session, context, max(1, min(int(asked), session.room())))
            self._queue.put(waiting)
            if not waiting.done.wait(self.request_timeout_s):
                raise TimeoutError(f"session {session_id!r}: no model turn within {self.request_timeout_s:g}s: the "
                                   "run is not serving the proxy (its rollout is not in progress)")
            if waiting.error is not None:
                raise RuntimeError(f"session {session_id!r}: {waiting.error}")
            return session.record(waiting.turn), len(context)
        finally:
            session.busy.release()

    def authorized(self, header: str | None) -> bool:
        return hmac.compare_digest((header or "").encode(), f"Bearer {self.api_key}".encode())


def _pad_id(tokenizer: Any, finish_token_ids: frozenset[int]) -> int:
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(finish_token_ids)


def _completion(proxy: AgentProxy, reply: Reply, prompt_tokens: int) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": reply.content}
    if reply.tool_calls:
        message["tool_calls"] = reply.tool_calls
    return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
            "model": proxy.model_name,
            "choices": [{"index": 0, "message": message, "finish_reason": reply.finish_reason, "logprobs": None}],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": reply.completion_tokens,
                      "total_tokens": prompt_tokens + reply.completion_tokens}}


def _chunks(proxy: AgentProxy, reply: Reply) -> list[dict[str, Any]]:
    """The streamed form of a reply: the role, the text, each tool call, then the finish reason."""
    head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion.chunk", "created": int(time.time()),
            "model": proxy.model_name}
    deltas: list[dict[str, Any]] = [{"role": "assistant", "content": ""}]
    if reply.content:
        deltas.append({"content": reply.content})
    deltas += [{"tool_calls": [{"index": k, **call}]} for k, call in enumerate(reply.tool_calls)]
    chunks = [{**head, "choices": [{"index": 0, "delta": d, "finish_reason": None}]} for d in deltas]
    chunks.append({**head, "choices": [{"index": 0, "delta": {}, "finish_reason": reply.finish_reason}]})
    return chunks


def _handler(proxy: AgentProxy) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:  # requests are the agents' business, not the log's
            logger.debug("agent proxy: " + format, *args)

        def _error(self, status: int, message: str) -> None:
            kind = "invalid_request_error" if status == 400 else HTTPStatus(status).phrase.lower().replace(" ", "_")
            send_json(self, status, {"error": {"message": message, "type": kind, "code": status}})

        def _route(self) -> tuple[str, str] | None:
            if not proxy.authorized(self.headers.get("Authorization")):
                self._error(401, "the run's secret is required (Authorization: Bearer <key>)")
                return None
            match = _ROUTE.match(self.path.split("?")[0])
            if match is None:
                self._error(404, f"no route {self.path}; a session's base URL is /sessions/<id>/v1")
                return None
            return match.group(1), match.group(2)

        def do_GET(self) -> None:
            route = self._route()
            if route is None:
                return
            if route[1] != "models":
                self._error(405, "chat/completions takes POST")
                return
            send_json(self, 200, {"object": "list", "data": [{"id": proxy.model_name, "object": "model",
                                                              "owned_by": "megatron-rl"}]})

        def do_POST(self) -> None:
            route = self._route()
            if route is None:
                return
            if route[1] != "chat/completions":
                self._error(405, "models takes GET")
                return
            try:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
                if not isinstance(body, dict):
                    raise SessionRefused("the request body must be a JSON object")
                reply, prompt_tokens = proxy.complete(route[0], body)
            except (SessionRefused, ValueError) as exc:
                self._error(400, str(exc))
                return
            except KeyError as exc:
                self._error(404, str(exc.args[0]))
                return
            except (TimeoutError, RuntimeError) as exc:
                self._error(503, str(exc))
                return
            if not body.get("stream"):
                send_json(self, 200, _completion(proxy, reply, prompt_tokens))
                return
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-cache")
            self.end_headers()  # HTTP/1.0: the stream ends when the connection closes
            for chunk in _chunks(proxy, reply):
                self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
            self.wfile.write(b"data: [DONE]\n\n")

    return Handler
