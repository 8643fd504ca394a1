"""The sandboxed code runner served over HTTP (megatron_rl/agent/sandbox_service.py): SandboxFusion's /run_code as
verl's client reads it, our /execute as the python tool, the run's secret, the concurrency limit, and a stop that
leaves no thread, process or socket behind."""

from __future__ import annotations

import base64
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import psutil
import pytest

from megatron_rl.agent.sandbox import sandbox_report
from megatron_rl.agent.sandbox_service import serve
from megatron_rl.agent.tool_service import HTTPTool, SandboxFusionTool
from megatron_rl.agent.tools import PythonTool, ToolError
from megatron_rl.rollout.server_key import API_KEY_ENV
from megatron_rl_testing.verl_oracle import verl_module

SECRET = "sandbox-secret"
# an empty root where this machine allows one (the service's default), else the host's filesystem read-only
FILESYSTEM = "empty_root" if sandbox_report().empty_root else "host"
PY = {"type": "function", "function": {"name": "python", "parameters": {"type": "object", "properties": {}}}}


def post(url: str, body: dict, secret: str | None = SECRET, timeout: float = 30) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json"}
    if secret is not None:
        headers["Authorization"] = f"Bearer {secret}"
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def sockets_of_this_process() -> list:
    return sorted(c.laddr for c in psutil.Process().net_connections(kind="inet"))


@pytest.fixture
def server(monkeypatch):
    monkeypatch.setenv(API_KEY_ENV, SECRET)
    box = serve(max_concurrency=2, queue_timeout_s=10, filesystem=FILESYSTEM, default_timeout_s=5).start()
    yield box
    box.stop()


def run_code(server, **body) -> dict:
    status, answer = post(server.url + "/run_code", {"language": "python", **body})
    assert status == 200, answer
    return answer


def test_run_code_answers_as_sandbox_fusion(server):
    ok = run_code(server, code="import sys\nprint(input()[::-1])\nprint('warn', file=sys.stderr)", stdin="abc\n")
    assert ok["status"] == "Success" and ok["compile_result"] is None
    run = ok["run_result"]
    assert (run["status"], run["return_code"], run["stdout"], run["stderr"]) == ("Finished", 0, "cba\n", "warn\n")
    assert isinstance(run["execution_time"], float)
    failed = run_code(server, code="raise SystemExit(3)")
    assert failed["status"] == "Failed" and failed["run_result"]["status"] == "Finished"
    assert failed["run_result"]["return_code"] == 3
    slow = run_code(server, code="while True: pass", run_timeout=1)
    assert slow["status"] == "Failed" and slow["run_result"]["status"] == "TimeLimitExceeded"
    files = run_code(server, code="print(open('data/in.txt').read())",
                     files={"data/in.txt": base64.b64encode(b"payload").decode()})
    assert files["run_result"]["stdout"] == "payload\n"
    other = run_code(server, code="console.log(1)", language="nodejs")
    assert other["status"] == "SandboxError" and "python only" in other["message"]
    status, bad = post(server.url + "/run_code", {"code": "print(1)", "files": {"../x": ""}})
    assert status == 400 and "relative path" in bad["message"]


def test_every_route_needs_the_runs_secret(server):
    for secret in (None, "wrong"):
        status, answer = post(server.url + "/run_code", {"code": "print(1)"}, secret=secret)
        assert (status, answer) == (401, {"detail": "Unauthorized"})
    monkey = SandboxFusionTool({"sandbox_fusion_url": server.url, "send_secret": False})
    out = monkey.execute({"code": "print(1)"})
    assert isinstance(out, ToolError) and out.reason == "unauthorized"


def test_verl_reads_our_answers_as_it_reads_sandbox_fusions(server):
    """The fields and decisions of verl's client (verl/utils/reward_score/sandbox_fusion/utils.py,
    _process_single_case): status, run_result.status / stdout / stderr / return_code / execution_time."""
    right = run_code(server, code="print(int(input()) * 2)", stdin="21", run_timeout=5, compile_timeout=5,
                     memory_limit_MB=512, fetch_files=[])
    assert right["status"] == "Success" and right["run_result"]["status"] == "Finished"
    assert right["run_result"]["stdout"].rstrip("\n") == "42"  # verl's comparison
    crash = run_code(server, code="1/0")
    assert crash["status"] == "Failed" and crash["run_result"]["return_code"] != 0  # verl: runtime_error (-2)
    assert "ZeroDivisionError" in crash["run_result"]["stderr"]


def test_verls_own_client_against_our_server(server, monkeypatch):
    utils = verl_module("verl.utils.reward_score.sandbox_fusion.utils")  # the oracle make test installs
    post_ = utils.requests.post

    def with_secret(url, headers=None, **kw):  # verl sends no secret; a deployment adds it (a proxy, a header)
        return post_(url, headers={**(headers or {}), "Authorization": f"Bearer {SECRET}"}, **kw)

    monkeypatch.setattr(utils.requests, "post", with_secret)
    results, _ = utils.check_correctness(server.url + "/run_code", {"inputs": ["1 2", "3 4"], "outputs": ["3", "8"]},
                                         "a, b = map(int, input().split())\nprint(a + b)", timeout=5)
    assert results == [True, False]


def test_execute_is_the_python_tool_served(server):
    remote = HTTPTool({"url": server.url + "/execute"}, PY)
    local = PythonTool({"filesystem": FILESYSTEM, "memory_mb": 1024})
    for code in ("print(6 * 7)", "import sys\nsys.exit(4)", "print('a')\nraise ValueError('b')"):
        assert remote.execute({"code": code}) == local.execute({"code": code})
    assert HTTPTool({"url": server.url + "/execute"}, PY).execute({}) == 'Error: python needs {"code": "<program>"}.'
    box = SandboxFusionTool({"sandbox_fusion_url": server.url + "/run_code", "default_timeout": 1})
    assert box.execute({"code": "import sys; print(1); print(2, file=sys.stderr)"}) == "1\n2\n"
    assert box.execute({"code": "while 1: pass"}) == "Error: the program ran longer than 1s and was killed."


def test_the_concurrency_limit_holds_and_a_full_queue_is_503(monkeypatch):
    monkeypatch.setenv(API_KEY_ENV, SECRET)
    box = serve(max_concurrency=2, queue_timeout_s=0.3, filesystem=FILESYSTEM).start()
    try:
        answers = []
        threads = [threading.Thread(target=lambda: answers.append(post(box.url + "/run_code", {
            "code": "import time; time.sleep(1)", "run_timeout": 5}))) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert box.service.peak_in_flight == 2
        statuses = sorted(status for status, _ in answers)
        assert statuses == [200, 200, 503, 503], answers
        assert next(a for s, a in answers if s == 503)["status"] == "SandboxError"
    finally:
        box.stop()


def test_stop_leaves_no_thread_process_or_socket(monkeypatch):
    monkeypatch.setenv(API_KEY_ENV, SECRET)
    threads, sockets = set(threading.enumerate()), sockets_of_this_process()
    # children an earlier test of this worker process left (a vLLM engine, torch's shm manager) are not this one's
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    box = serve(max_concurrency=2, filesystem=FILESYSTEM).start()
    url = box.url
    running = threading.Thread(target=post, args=(url + "/run_code", {"code": "import time; time.sleep(1.5)"}))
    running.start()
    time.sleep(0.5)  # the program is running
    assert {p.pid for p in psutil.Process().children(recursive=True)} - before
    box.stop()  # waits for the request in flight
    running.join(timeout=10)
    assert not running.is_alive()
    assert set(threading.enumerate()) <= threads
    assert [p for p in psutil.Process().children(recursive=True) if p.pid not in before] == []
    assert sockets_of_this_process() == sockets
    with pytest.raises(urllib.error.URLError):
        post(url + "/run_code", {"code": "print(1)"}, timeout=2)


def test_the_command_line_server_starts_serves_and_stops_on_sigterm(tmp_path):
    env = {**os.environ, API_KEY_ENV: SECRET}
    cmd = [sys.executable, "-m", "megatron_rl.agent.sandbox_service", "--port", "0", "--filesystem", FILESYSTEM]
    refused = subprocess.run(cmd, env={k: v for k, v in env.items() if k != API_KEY_ENV}, capture_output=True,
                             text=True, timeout=120)
    assert refused.returncode == 2 and API_KEY_ENV in refused.stderr
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True)
    try:
        port = int(proc.stdout.readline().split()[1])
        status, answer = post(f"http://127.0.0.1:{port}/run_code", {"code": "print('hi')"})
        assert status == 200 and answer["run_result"]["stdout"] == "hi\n"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
    with pytest.raises(urllib.error.URLError):
        post(f"http://127.0.0.1:{port}/run_code", {"code": "print(1)"}, timeout=2)
