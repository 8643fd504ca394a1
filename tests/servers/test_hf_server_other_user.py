"""Issue 56, item 1, the HF-engine server: another local user (``nobody``, on loopback, with curl) gets 401 on
every route, POST and GET. (Every route has needed the secret since issue 33, test_hf_server.py; this is the
issue's second-user case against the same server, beside the vLLM one in test_vllm_server_auth.py.)"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading

import pytest

from megatron_rl.servers.hf_server import ROUTES, listen

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or not (shutil.which("runuser") and shutil.which("curl")),
                                reason="needs root, runuser and curl (to act as the host's user nobody)")


@pytest.fixture(scope="module")
def server(model_dir):
    key = "the-runs-secret-" + os.urandom(8).hex()
    httpd = listen(model_dir, api_key=key)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}", key
    httpd.shutdown()
    httpd.server_close()


def _as_nobody_curl(method: str, url: str, body: dict | None, key: str | None = None) -> str:
    args = ["runuser", "-u", "nobody", "--", "curl", "-s", "-o", "/dev/null", "-w", "%{http_code}", "-X", method, url]
    if body is not None:
        args += ["-H", "Content-Type: application/json", "-d", json.dumps(body)]
    if key is not None:
        args += ["-H", f"Authorization: Bearer {key}"]
    return subprocess.run(args, capture_output=True, text=True, timeout=60).stdout


def test_another_local_user_gets_401_on_every_route(server):
    url, key = server
    routes = [("POST", route, {}) for route in ROUTES] + [("GET", "/health", None), ("GET", "/server_info", None)]
    assert len(routes) > 8, routes
    answers = {(method, route): _as_nobody_curl(method, url + route, body) for method, route, body in routes}
    assert set(answers.values()) == {"401"}, answers
    assert _as_nobody_curl("GET", url + "/health", None, key) == "200"  # the same user with the secret: served
