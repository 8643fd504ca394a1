"""Tools as services (docs/rollout.md, "Tools as services"): a tool whose call is an HTTP request.

``HTTPTool`` (built-in name ``http``) POSTs the call's arguments as a JSON object to ``url`` and shows the model
the answer (its ``response_field``, else the whole JSON). It speaks to the service with the rollout servers'
client (``rollout/server_http.py``: JSON in and out, the run's secret as ``Authorization: Bearer``, one timeout
per request), so a service of this run (``agent/sandbox_service.py``) checks the same secret as its rollout
servers. Config (the ``config`` of a verl tool-config entry)::

    url: http://127.0.0.1:8080/execute   # required
    timeout_s: 10          # one request; a request past it is not sent again (the service may still run it)
    retries: 2             # more attempts after a connection error or a 5xx answer, nothing else
    backoff_s: 0.5         # wait before retry k: backoff_s * 2**k
    max_concurrency: 8     # requests in flight from this tool, across all samples' threads (and async callers)
    headers: {}            # sent with every request
    send_secret: true      # false: a service outside this run (its own auth in headers)
    response_field: text   # the answer's field the model sees; absent: the whole answer as JSON
    max_output_chars: 4000

A failure never raises out of ``execute``: it returns a ``ToolError`` (agent/tools.py), text the model sees
whose ``reason`` the agent loop counts in the sample's ``tool_error_counts`` / ``tool_error_reasons``:
``timeout``, ``connection`` (nothing listens, the connection broke), ``unauthorized`` (401/403: the wrong or no
secret), ``http_<code>`` (any other non-2xx), ``bad_json`` (an answer that is not JSON), ``bad_response`` (a
reply that is not HTTP), ``busy`` (no slot of ``max_concurrency`` freed within ``timeout_s``), and
``sandbox_error`` (SandboxFusionTool: the sandbox could not run the code).

``SandboxFusionTool`` (built-in name ``sandbox_fusion``; verl's class name
``verl.tools.sandbox_fusion_tools.SandboxFusionTool`` in a tool config means it too) runs the model's code on a
SandboxFusion ``/run_code`` route: ours (``python -m megatron_rl.agent.sandbox_service``) or a SandboxFusion
deployment (``send_secret: false``). It reads verl's config keys (``sandbox_fusion_url``, ``default_timeout``,
``default_language``, ``memory_limit_mb``, ``rate_limit`` -> max_concurrency) and shows what verl's tool shows:
stdout then stderr of a finished run.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import threading
import time
import urllib.error
from collections.abc import Mapping
from typing import Any

from megatron_rl.agent.tools import Tool, ToolError, truncate
from megatron_rl.rollout.server_http import ServerHTTPBase

__all__ = ["HTTPTool", "SandboxFusionTool", "ToolServiceError", "run_code_url"]


class ToolServiceError(RuntimeError):
    """One failed request to a tool service (the client's error type)."""


class _ServiceHTTP(ServerHTTPBase):
    engine = "tool service"
    error = ToolServiceError
    json_only = True


def _failure(err: ToolServiceError) -> tuple[str, bool]:
    """(reason, worth another attempt) of a failed request: connection errors and 5xx answers only are retried;
    a timeout is not (the service may still be running the call)."""
    cause = err.__cause__
    if isinstance(cause, urllib.error.HTTPError):
        if cause.code in (401, 403):
            return "unauthorized", False
        return f"http_{cause.code}", cause.code >= 500
    if isinstance(cause, TimeoutError) or isinstance(getattr(cause, "reason", None), TimeoutError):
        return "timeout", False
    if isinstance(cause, OSError):
        return "connection", True
    return "bad_json", False


class HTTPTool(Tool):
    """A tool served at ``url`` (module docstring). Needs a ``tool_schema`` (its name and parameters)."""

    def __init__(self, config: Mapping[str, Any] | None = None, tool_schema: Mapping[str, Any] | None = None):
        super().__init__(config, tool_schema)
        options = self.config
        self.url = str(options.get("url") or "")
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"tool {self.name!r} ({type(self).__name__}) needs config url: http(s)://host:port/route, "
                             f"got {self.url!r}")
        self.timeout_s = float(options.get("timeout_s", 10.0))
        self.retries = int(options.get("retries", 2))
        self.backoff_s = float(options.get("backoff_s", 0.5))
        self.max_concurrency = int(options.get("max_concurrency", 8))
        self.response_field = options.get("response_field", "text")
        self.max_output_chars = int(options.get("max_output_chars", 4000))
        if self.timeout_s <= 0 or self.retries < 0 or self.backoff_s < 0 or self.max_concurrency < 1:
            raise ValueError(f"tool {self.name!r}: timeout_s > 0, retries >= 0, backoff_s >= 0 and "
                             "max_concurrency >= 1, "
                             f"got {self.timeout_s}, {self.retries}, {self.backoff_s}, {self.max_concurrency}")
        headers = {str(k): str(v) for k, v in dict(options.get("headers") or {}).items()}
        self._http = _ServiceHTTP(self.url, self.timeout_s, headers, bool(options.get("send_secret", True)))
        self._slots = threading.BoundedSemaphore(self.max_concurrency)  # every thread's calls of this tool share it

    def execute(self, arguments: dict[str, Any], **kwargs: Any) -> str:
        """``arguments`` (the model's) with the row's ``tools_kwargs`` for this tool over them, POSTed."""
        answer = self.request({**arguments, **kwargs})
        return answer if isinstance(answer, ToolError) else self.observation(answer)

    async def aexecute(self, arguments: dict[str, Any], **kwargs: Any) -> str:
        """``execute`` for an asyncio caller, on a thread: the same ``max_concurrency`` slots as every thread's."""
        return await asyncio.to_thread(self.execute, arguments, **kwargs)

    def request(self, body: dict[str, Any]) -> Any:
        """The service's JSON answer to ``body``, or a ToolError naming why there is none."""
        if not self._slots.acquire(timeout=self.timeout_s):
            return ToolError(f"Error: tool {self.name} is busy ({self.max_concurrency} calls in flight); no slot freed "
                             f"within {self.timeout_s:g}s.", "busy")
        try:
            for attempt in range(self.retries + 1):
                try:
                    return self._http.request("", body)
                except ToolServiceError as err:
                    reason, again = _failure(err)
                    if not again or attempt == self.retries:
                        return ToolError(self._explain(reason, err, attempt + 1), reason)
                except (http.client.HTTPException, ValueError) as err:  # a reply that is not HTTP (cut off, garbled)
                    return ToolError(f"Error: tool {self.name} gave a broken answer: {type(err).__name__}: {err}",
                                     "bad_response")
                time.sleep(self.backoff_s * 2 ** attempt)
        finally:
            self._slots.release()
        raise AssertionError("unreachable: the last attempt returns")

    def _explain(self, reason: str, err: ToolServiceError, attempts: int) -> str:
        tried = f" ({attempts} attempts)" if attempts > 1 else ""
        if reason == "timeout":
            return f"Error: tool {self.name} gave no answer within {self.timeout_s:g}s."
        if reason == "unauthorized":
            return f"Error: tool {self.name} refused the call (not authorized: the service holds another secret)."
        if reason == "connection":
            return f"Error: tool {self.name} is unreachable{tried}: {err.__cause__}"
        if reason == "bad_json":
            return f"Error: tool {self.name} answered with something that is not JSON."
        return f"Error: tool {self.name} failed{tried}: {truncate(str(err), 300, 'right')}"

    def observation(self, answer: Any) -> str:
        """The text the model sees of a JSON answer."""
        if isinstance(answer, Mapping) and self.response_field and self.response_field in answer:
            answer = answer[self.response_field]
        text = answer if isinstance(answer, str) else _json_text(answer)
        return truncate(text, self.max_output_chars, "middle") if text else "(no output)"


def _json_text(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def run_code_url(url: str) -> str:
    """verl gives SandboxFusion's whole route (``http://host:port/run_code``); a bare server address gets it."""
    url = url.rstrip("/")
    return url if url.endswith("/run_code") else url + "/run_code"


class SandboxFusionTool(HTTPTool):
    """Code on a SandboxFusion ``/run_code`` route (module docstring); arguments ``code`` (and verl's optional
    ``timeout``, ``language``)."""

    name = "code_interpreter"
    description = "Run a program and return what it prints (stdout, then stderr)."
    parameters = {
        "type": "object",
        "properties": {"code": {"type": "string", "description": "the program; print() the result"}},
        "required": ["code"],
    }

    def __init__(self, config: Mapping[str, Any] | None = None, tool_schema: Mapping[str, Any] | None = None):
        options = dict(config or {})
        url = options.pop("sandbox_fusion_url", None) or options.get("url") or ""
        self.default_timeout = float(options.pop("default_timeout", 30))
        self.default_language = str(options.pop("default_language", "python"))
        self.memory_limit_mb = int(options.pop("memory_limit_mb", 1024))
        rate_limit = options.pop("rate_limit", None)
        for verl_only in ("num_workers", "enable_global_rate_limit"):  # verl's Ray pool; the slots do their work
            options.pop(verl_only, None)
        options["url"] = run_code_url(url) if url else ""
        options.setdefault("max_concurrency", rate_limit if rate_limit is not None else 10)
        # a run takes up to its timeout: the request waits for that and some more (verl: + 10 s)
        options.setdefault("timeout_s", self.default_timeout + 10.0)
        options.setdefault("response_field", None)
        super().__init__(options, tool_schema)

    def execute(self, arguments: dict[str, Any], **kwargs: Any) -> str:
        code = arguments.get("code")
        if not isinstance(code, str):
            return f'Error: {self.name} needs {{"code": "<program>"}}.'
        timeout = float(arguments.get("timeout") or self.default_timeout)
        timeout = min(timeout, self.default_timeout)  # the model may shorten its run, not lengthen it
        answer = self.request({"code": code, "language": str(arguments.get("language") or self.default_language),
                               "run_timeout": timeout, "compile_timeout": timeout, "stdin": None,
                               "memory_limit_MB": self.memory_limit_mb, "files": {}, "fetch_files": []})
        if isinstance(answer, ToolError):
            return answer
        return self._shown(answer, timeout)

    def _shown(self, answer: Any, timeout: float) -> str:
        run = answer.get("run_result") if isinstance(answer, Mapping) else None
        status = answer.get("status") if isinstance(answer, Mapping) else None
        if status == "SandboxError" or not isinstance(run, Mapping):
            message = answer.get("message") if isinstance(answer, Mapping) else answer
            return ToolError(f"Error: the sandbox failed: {truncate(str(message), 300, 'right')}", "sandbox_error")
        if run.get("status") == "TimeLimitExceeded":
            return f"Error: the program ran longer than {timeout:g}s and was killed."
        text = f"{run.get('stdout') or ''}{run.get('stderr') or ''}"
        code = run.get("return_code")
        if code not in (0, None):
            text = f"{text}\n[exit status {code}]".strip()
        return truncate(text, self.max_output_chars, "middle") if text else "(no output)"
