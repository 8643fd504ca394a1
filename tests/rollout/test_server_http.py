"""One HTTP client for every engine's servers (rollout/server_http.py): SGLang's (and the HF-engine servers') and
vLLM's are the same code with their engine's name, error type and route checks. Against a local server that
checks the run's secret, answers JSON, text, an error or nothing in time."""
from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from megatron_rl.rollout.server_key import API_KEY_ENV
from megatron_rl.rollout.sglang.contract import SGLangServerError
from megatron_rl.rollout.sglang.server_transport import ServerHTTP
from megatron_rl.rollout.vllm.server import VLLMServerError, VLLMServerHTTP

SECRET = "s3cret"


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass

    def _answer(self) -> None:
        if self.headers.get("Authorization") != f"Bearer {SECRET}":
            self.send_response(401), self.end_headers(), self.wfile.write(b"no secret")
            return
        length = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(length)) if length else None
        if self.path == "/slow":
            time.sleep(2)
        status, payload = {"/broken": (500, b"boom"), "/text": (200, b"plain words"), "/empty": (200, b"")}.get(
            self.path, (200, json.dumps({"route": self.path, "body": body}).encode()))
        try:
            self.send_response(status)
            self.end_headers()
            self.wfile.write(payload)
        except BrokenPipeError:  # /slow: the client gave up first, as it should
            pass

    do_GET = do_POST = _answer


@pytest.fixture(scope="module")
def url():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}"
    server.shutdown()


@pytest.mark.parametrize("client, error, engine", [(VLLMServerHTTP, VLLMServerError, "vLLM"),
                                                   (ServerHTTP, SGLangServerError, "SGLang")])
def test_both_engines_clients_are_one_client(url, monkeypatch, client, error, engine):
    monkeypatch.setattr(ServerHTTP, "checked_body", lambda self, route, body: body)  # routes of this test server
    monkeypatch.setattr("megatron_rl.rollout.sglang.server_transport.SGLANG_CONTRACT",
                        {"http_routes": ("/x", "/text", "/empty", "/broken", "/slow")})
    monkeypatch.setenv(API_KEY_ENV, SECRET)
    server = client(url + "/", timeout_s=0.5)
    assert server.request("/x", {"a": 1}) == {"route": "/x", "body": {"a": 1}}
    assert server.request("/text", method="GET") == "plain words" and server.request("/empty") is None
    with pytest.raises(error, match=rf"^{engine} {url}/broken answered 500: boom"):
        server.request("/broken")
    with pytest.raises(error, match=rf"{engine} server {url}/slow gave no answer within 0.5 s: raise "
                                    r"actor_rollout_ref.rollout.sglang.request_timeout_s"):
        server.request("/slow")
    monkeypatch.delenv(API_KEY_ENV)
    with pytest.raises(error, match="answered 401: no secret"):
        client(url, timeout_s=5).request("/x", {})
    with pytest.raises(error, match=rf"{engine} server http://127.0.0.1:9/x unreachable"):
        client("http://127.0.0.1:9", timeout_s=5).request("/x", {})


def test_sglang_routes_are_checked_against_its_contract(url):
    with pytest.raises(AssertionError, match="route /not_a_route is not declared in SGLANG_CONTRACT"):
        ServerHTTP(url, 5).request("/not_a_route", {})
