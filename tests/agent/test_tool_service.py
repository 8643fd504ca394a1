"""Tools as services (megatron_rl/agent/tool_service.py): an HTTP tool's timeouts, dead endpoint, slow endpoint
under concurrency, wrong secret, 5xx retries and bad answers each come back as a clear error text and a counted
error in the sample's metrics, and the agent loop goes on."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from megatron_rl.agent.tool_service import HTTPTool, SandboxFusionTool, run_code_url
from megatron_rl.agent.tools import ToolError, build_tools, load_tool_config
from megatron_rl.rollout.server_key import API_KEY_ENV
from megatron_rl.trainer.metrics import multi_turn_metrics
from megatron_rl_testing.agent_support import run_scripted, tiny_tokenizer

SECRET = "the-runs-secret"
SCHEMA = {"type": "function", "function": {"name": "lookup", "description": "look a thing up",
                                           "parameters": {"type": "object", "properties": {}}}}


class FakeService(ThreadingHTTPServer):
    """A tool service: checks the run's secret, answers per path, counts hits and the peak of requests in flight."""

    daemon_threads = False
    block_on_close = True

    def __init__(self, delay_s: float = 0.0, fail_first: int = 0) -> None:
        self.delay_s, self.fail_first = delay_s, fail_first
        self.hits: dict[str, int] = {}
        self.in_flight = self.peak = 0
        self.lock = threading.Lock()
        super().__init__(("127.0.0.1", 0), _FakeHandler)
        self.thread = threading.Thread(target=self.serve_forever, daemon=True)
        self.thread.start()

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}{path}"

    def stop(self) -> None:
        self.shutdown()
        self.thread.join()
        self.server_close()


class _FakeHandler(BaseHTTPRequestHandler):
    server: FakeService

    def do_POST(self) -> None:
        service = self.server
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"null")
        with service.lock:
            hits = service.hits[self.path] = service.hits.get(self.path, 0) + 1
            service.in_flight += 1
            service.peak = max(service.peak, service.in_flight)
        try:
            if self.headers.get("Authorization") != f"Bearer {SECRET}":
                return self._send(401, b'{"detail": "Unauthorized"}')
            if self.path == "/slow":
                time.sleep(service.delay_s)
            if self.path == "/flaky" and hits <= service.fail_first:
                return self._send(503, b'{"detail": "warming up"}')
            if self.path == "/missing":
                return self._send(404, b'{"detail": "Not Found"}')
            if self.path == "/notjson":
                return self._send(200, b"<html>oops</html>")
            if self.path == "/headers":
                return self._send(200, json.dumps({"text": self.headers.get("X-Team", "")}).encode())
            self._send(200, json.dumps({"text": f"got {body}"}).encode())
        finally:
            with service.lock:
                service.in_flight -= 1

    def _send(self, status: int, data: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def secret(monkeypatch):
    monkeypatch.setenv(API_KEY_ENV, SECRET)
    return SECRET


@pytest.fixture
def service():
    server = FakeService(delay_s=0.4, fail_first=2)
    yield server
    server.stop()


def tool(url: str, **options) -> HTTPTool:
    return HTTPTool({"url": url, "backoff_s": 0.01, **options}, SCHEMA)


def test_a_call_posts_the_arguments_with_the_runs_secret(secret, service):
    out = tool(service.url("/echo")).execute({"q": "x"}, task="t1")
    assert out == "got {'q': 'x', 'task': 't1'}" and not isinstance(out, ToolError)
    assert tool(service.url("/headers"), headers={"X-Team": "rl"}).execute({}) == "rl"


def test_a_timeout_is_an_error_text_and_not_retried(secret, service):
    out = tool(service.url("/slow"), timeout_s=0.1).execute({})  # the endpoint answers after 0.4 s
    assert isinstance(out, ToolError) and out.reason == "timeout"
    assert "gave no answer within 0.1s" in out
    assert service.hits["/slow"] == 1  # (no wall-clock bound: a loaded machine may stretch any)


def test_a_dead_endpoint_is_retried_then_an_error_text(secret):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tool(f"http://127.0.0.1:{port}/x", retries=2).execute({})
    assert isinstance(out, ToolError) and out.reason == "connection"
    assert "unreachable (3 attempts)" in out


def test_the_wrong_secret_is_refused_and_not_retried(monkeypatch, service):
    monkeypatch.setenv(API_KEY_ENV, "another-run")
    out = tool(service.url("/echo")).execute({})
    assert isinstance(out, ToolError) and out.reason == "unauthorized" and "not authorized" in out
    assert service.hits["/echo"] == 1


def test_5xx_is_retried_with_backoff_4xx_and_bad_json_are_not(secret, service):
    assert tool(service.url("/flaky"), retries=2).execute({"a": 1}) == "got {'a': 1}"
    assert service.hits["/flaky"] == 3
    out = tool(service.url("/missing"), retries=3).execute({})
    assert isinstance(out, ToolError) and out.reason == "http_404" and service.hits["/missing"] == 1
    out = tool(service.url("/notjson"), retries=3).execute({})
    assert isinstance(out, ToolError) and out.reason == "bad_json" and service.hits["/notjson"] == 1


def test_max_concurrency_bounds_the_requests_in_flight_across_threads_and_async_calls(secret, service):
    slow = tool(service.url("/slow"), max_concurrency=2, timeout_s=5)
    threads = [threading.Thread(target=slow.execute, args=({},)) for _ in range(6)]
    start = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.monotonic() - start
    assert service.peak == 2 and service.hits["/slow"] == 6
    assert elapsed >= 3 * 0.4 - 0.05  # six calls, two at a time

    async def many() -> list[str]:
        return await asyncio.gather(*(slow.aexecute({}) for _ in range(4)))

    service.peak = 0
    assert all(out == "got {}" for out in asyncio.run(many()))
    assert service.peak == 2


def test_a_call_that_waits_too_long_for_a_slot_is_busy(secret, service):
    slow = tool(service.url("/slow"), max_concurrency=1, timeout_s=0.6)
    first = threading.Thread(target=slow.execute, args=({},))
    first.start()
    deadline = time.monotonic() + 10
    while service.hits.get("/slow", 0) < 1 and time.monotonic() < deadline:  # the first holds the slot (a loaded
        time.sleep(0.005)                                                    # machine may start it late)
    slow.timeout_s = 0.1  # the second call's wait for the slot
    out = slow.execute({})
    first.join()
    assert isinstance(out, ToolError) and out.reason == "busy"


def test_tool_config_names_the_service_tools(tmp_path, secret, service):
    path = tmp_path / "tools.yaml"
    path.write_text(f"""tools:
  - class_name: http
    config: {{url: "{service.url('/echo')}"}}
    tool_schema: {json.dumps(SCHEMA)}
  - class_name: verl.tools.sandbox_fusion_tools.SandboxFusionTool
    config: {{sandbox_fusion_url: "http://127.0.0.1:1/run_code", rate_limit: 3, default_timeout: 7, num_workers: 4}}
    tool_schema: {{type: function, function: {{name: code_interpreter, description: run code,
                   parameters: {{type: object, properties: {{code: {{type: string}}}}, required: [code]}}}}}}
""")
    tools = load_tool_config(path)
    assert isinstance(tools["lookup"], HTTPTool)
    box = tools["code_interpreter"]
    assert isinstance(box, SandboxFusionTool) and box.max_concurrency == 3 and box.timeout_s == 17
    assert box.url == "http://127.0.0.1:1/run_code" and run_code_url("http://h:1/") == "http://h:1/run_code"
    with pytest.raises(ValueError, match="needs config url"):
        build_tools([{"class_name": "http", "config": {}, "tool_schema": SCHEMA}])


def test_the_loop_counts_each_failed_call_and_goes_on(tmp_path, secret, service):
    tok = tiny_tokenizer(tmp_path)
    tools = {"lookup": tool(service.url("/slow"), timeout_s=0.1)}
    call = '<tool_call>{"name": "lookup", "arguments": {}}</tool_call>'
    out, _ = run_scripted(tok, ["q0", "q1"], [[call, call, "#### 1"], ["#### 2"]],
                          settings={"max_assistant_turns": 5}, tools=tools)
    nt = out.non_tensor_batch
    assert list(nt["tool_call_counts"]) == [2, 0] and list(nt["tool_error_counts"]) == [2, 0]
    assert list(nt["tool_error_reasons"][0]) == ["timeout", "timeout"] and list(nt["tool_error_reasons"][1]) == []
    assert list(nt["stop_reason"]) == ["final", "final"]  # the sample went on to its answer
    metrics = multi_turn_metrics(out)
    assert metrics["tool_error_counts/max"] == 2 and metrics["tool_errors/timeout"] == 2


def test_a_reply_that_is_not_http_is_an_error_text(secret):
    listener = socket.create_server(("127.0.0.1", 0))

    def garble() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.recv(65536)
            conn.sendall(b"SSH-2.0-OpenSSH\r\n\r\n")

    thread = threading.Thread(target=garble)
    thread.start()
    try:
        out = tool(f"http://127.0.0.1:{listener.getsockname()[1]}/x", retries=0).execute({})
    finally:
        thread.join()
        listener.close()
    assert isinstance(out, ToolError) and out.reason == "bad_response" and "broken answer" in out
