"""One launcher for every engine's rollout servers (megatron_rl/servers/fleet.py ``start_server``): the HF and
vLLM launch specs start the same way (a free port, a session of their own, ready once ``/health`` answers the
run's secret and refuses anyone else), ``stop`` leaves nothing of the server's process group; a server that
exits first or never gets ready is a ``RolloutServerDied`` naming the engine, the model, the exit code or the
deadline's key, and its log, with nothing of it left running."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any, Sequence

import pytest

from megatron_rl.config.schema import RolloutConfig
from megatron_rl.rollout.server_key import ensure_server_api_key
from megatron_rl.rollout.vllm.contract import vllm_missing
from megatron_rl.servers.fleet import start_server
from megatron_rl.servers.hf_launch import HFServerLaunch
from megatron_rl.servers.pool import RolloutServerDied
from megatron_rl_testing.vllm_support import MAX_LEN, tiny_model


@dataclass(frozen=True)
class CommandLaunch:
    """A launch spec of any command line: what the launcher does around a server, without one."""

    argv: tuple[str, ...]
    start_timeout_s: float = 60.0
    timeout_key: str = "test.start_timeout_s"
    model_path: str = "/no/model"
    engine: str = "Test"
    seed: int = 0
    one_node_reason: str | None = None

    def command(self, *, host: str, port: int, seed: int) -> list[str]:
        return list(self.argv)

    def environment(self, api_key: str, gpus: Sequence[Any]) -> dict[str, str]:
        return {}

    def where_it_runs(self, gpus: Sequence[Any]) -> "CommandLaunch":
        return self

    def host_gpus(self, num_servers: int) -> list[tuple[Any, ...]]:
        return [()] * num_servers

    def ray_gpus(self, cluster_has_gpus: bool) -> int:
        return 0


def _health(url: str, key: str | None) -> int:
    req = urllib.request.Request(url + "/health", headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code


def _group_gone(pgid: int, wait_s: float = 10.0) -> bool:
    """No live process is left in the process group ``pgid`` (a zombie waiting for its reaper counts as gone)."""
    deadline = time.monotonic() + wait_s
    while _group_members(pgid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _group_members(pgid: int) -> list[int]:
    members = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                state, _ppid, group = f.read().rsplit(")", 1)[1].split()[:3]
        except (OSError, ValueError, IndexError):  # not a process, or gone meanwhile
            continue
        if int(group) == pgid and state != "Z":
            members.append(int(entry))
    return members


def _hf_spec(tmp_path) -> HFServerLaunch:
    from megatron_rl_testing.rollout_models import tiny_qwen2_config

    tiny_qwen2_config().save_pretrained(tmp_path)
    return HFServerLaunch(str(tmp_path))


def _vllm_spec(tmp_path):
    if vllm_missing() and not os.environ.get("CI"):  # CI installs it: there a missing vLLM fails
        pytest.skip(f"vLLM is not installed here ({vllm_missing()}); `make install-vllm` installs it")
    from megatron_rl.servers.vllm_server import VLLMServerSettings

    return VLLMServerSettings.from_rollout(RolloutConfig(name="vllm"), str(tiny_model(tmp_path, seed=1)),
                                           max_model_len=MAX_LEN, start_timeout_s=400)


@pytest.mark.parametrize("make_spec", [_hf_spec, pytest.param(_vllm_spec, marks=pytest.mark.slow)], ids=["hf", "vllm"])
def test_one_launcher_starts_each_engines_server_behind_the_secret(make_spec, tmp_path):
    spec = make_spec(tmp_path)
    key = ensure_server_api_key()
    server = start_server(spec, seed=0, api_key=key, log_dir=str(tmp_path), index=2)
    try:
        assert server.url.startswith("http://127.0.0.1:") and server.exit_status() is None
        assert os.getpgid(server.proc.pid) == server.proc.pid != os.getpgid(0)  # a session of its own
        assert _health(server.url, key) == 200
        assert _health(server.url, None) == 401 and _health(server.url, "not-the-secret") == 401
        assert server.describe() == f"rollout server 2 ({server.url}, pid {server.proc.pid})"
        assert os.path.dirname(server.log_path) == str(tmp_path)
    finally:
        server.stop()
    assert server.exit_status() is not None and _group_gone(server.proc.pid)


def test_a_server_that_exits_at_once_is_named_with_its_code_and_log(tmp_path):
    code = "import sys; print('no model at /no/model', file=sys.stderr); sys.exit(3)"
    with pytest.raises(RolloutServerDied) as died:
        start_server(CommandLaunch((sys.executable, "-c", code)), seed=0, log_dir=str(tmp_path))
    message = str(died.value)
    assert "the Test rollout server for /no/model exited with code 3 before it was ready" in message, message
    assert "no model at /no/model" in message and str(tmp_path) in message


def test_a_server_that_never_gets_ready_times_out_naming_the_key_and_leaves_nothing(tmp_path):
    # the server starts a child, prints its group, then never answers /health
    code = ("import os, subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; "
            "time.sleep(600)']); print('group', os.getpgid(0), flush=True); time.sleep(600)")
    start = time.monotonic()
    with pytest.raises(RolloutServerDied) as died:
        start_server(CommandLaunch((sys.executable, "-c", code), start_timeout_s=3), seed=0, log_dir=str(tmp_path))
    message = str(died.value)
    assert time.monotonic() - start < 30
    assert "the Test rollout server for /no/model was not ready within 3 s (test.start_timeout_s)" in message, message
    [group] = re.findall(r"group (\d+)", message)  # the log's tail is in the error
    assert _group_gone(int(group)), _group_members(int(group))


def test_an_hf_server_exits_with_the_process_that_started_it(tmp_path):
    """A SIGKILLed launcher (a Ray actor: servers/ray_pool.py) leaves no HF server answering at a URL its pool
    replaced."""
    spec = _hf_spec(tmp_path)
    code = ("import sys; from megatron_rl.servers.fleet import start_server; "
            "from megatron_rl.servers.hf_launch import HFServerLaunch; "
            f"server = start_server(HFServerLaunch({spec.model_path!r}), seed=0); "
            "print(server.proc.pid, flush=True); sys.stdin.read()")
    launcher = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        server_pid = int(launcher.stdout.readline())
        launcher.send_signal(signal.SIGKILL)
        launcher.wait()
        assert _group_gone(server_pid), _group_members(server_pid)
    finally:
        launcher.kill()
        launcher.wait()
