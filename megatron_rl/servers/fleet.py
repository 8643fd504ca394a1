"""The run's rollout servers as processes, for every engine: a launch spec (``ServerLaunch``: what an engine's
server runs), one launcher (``start_server``), one process record (``ServerProcess``) and one pool of child
processes (``ServerProcessPool``: torchrun, or no Ray); servers/ray_pool.py starts the same servers from Ray
actors.

A server gets a free port and the run's secret from the launcher, runs in a session of its own (so ``stop`` ends
its children too: vLLM's engine core), writes to a log file, and is ready once ``GET /health`` answers 200 to the
secret. One that exits first or misses its deadline is a ``RolloutServerDied`` naming the engine, the model, the
exit code (or the deadline and its key) and the log's tail, with nothing of it left running.

Adding an engine's servers: write its ``ServerLaunch`` (servers/hf_launch.py, servers/vllm_server.py's
``VLLMServerSettings``) and give it to these pools (trainer/disaggregated.py).
"""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Iterable, Protocol, Sequence

from megatron_rl.distributed.ports import free_port
from megatron_rl.rollout.server_key import ensure_server_api_key
from megatron_rl.servers.pool import RolloutServerDied, ServerPool

__all__ = ["ServerLaunch", "ServerProcess", "ServerProcessPool", "kill_group", "start_server"]

_FAST_POLL_S, _SLOW_POLL_S, _FAST_FOR_S = 0.1, 0.5, 10.0  # a small model is up in seconds; a big one in minutes


class ServerLaunch(Protocol):
    """What one engine's rollout server runs, as its launchers need it."""

    engine: str  # for messages: "HF", "vLLM"
    model_path: str
    start_timeout_s: float
    timeout_key: str  # the config key that sets start_timeout_s, for the error that names it
    seed: int  # server i runs with seed + i
    one_node_reason: str | None  # why its servers cannot spread over nodes (rollout.servers_per_node); None: they can

    def command(self, *, host: str, port: int, seed: int) -> list[str]:
        """The server's command line, listening on ``host:port``."""

    def environment(self, api_key: str, gpus: Sequence[Any]) -> dict[str, str]:
        """What the server's environment adds to the launcher's: the secret (never on the command line), the GPUs
        it may see."""

    def where_it_runs(self, gpus: Sequence[Any]) -> "ServerLaunch":
        """This spec as computed in the process that starts a server given ``gpus`` (none: on CPU)."""

    def host_gpus(self, num_servers: int) -> list[tuple[Any, ...]]:
        """Each child-process server's GPUs on this host."""

    def ray_gpus(self, cluster_has_gpus: bool) -> int:
        """GPUs each server's Ray actor reserves."""


@dataclass
class ServerProcess:
    """One started server: its process (the leader of its own process group), URL and log."""

    index: int
    proc: subprocess.Popen
    url: str
    log_path: str

    def describe(self) -> str:
        return f"rollout server {self.index} ({self.url}, pid {self.proc.pid})"

    def exit_status(self) -> str | None:
        code = self.proc.poll()
        return None if code is None else f"exited with code {code}"

    def stop(self) -> None:
        _kill_group(self.proc)


def start_server(spec: ServerLaunch, *, seed: int, host: str = "127.0.0.1", api_key: str | None = None,
                 log_dir: str | None = None, gpus: Sequence[Any] = (), index: int = 0) -> ServerProcess:
    """Start one server of ``spec`` on this host; returns it once ``/health`` answers 200 to ``api_key`` (default:
    the run's secret). ``gpus``: the physical GPUs it may see."""
    port = free_port(host)
    url = f"http://{host}:{port}"
    api_key = api_key or ensure_server_api_key()
    env = {**os.environ, **spec.environment(api_key, gpus)}
    log_dir = log_dir or tempfile.mkdtemp(prefix="mrl_servers_")
    log_path = os.path.join(log_dir, f"{spec.engine.lower()}_server_{port}.log")
    with open(log_path, "w") as log:
        proc = subprocess.Popen(spec.command(host=host, port=port, seed=seed), env=env, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
    what = f"the {spec.engine} rollout server for {spec.model_path}"
    try:
        start = time.monotonic()
        while (waited := time.monotonic() - start) < spec.start_timeout_s:
            if proc.poll() is not None:
                raise RolloutServerDied(f"{what} exited with code {proc.returncode} before it was ready; its log "
                                        f"({log_path}) ends:\n{_tail(log_path)}")
            if _healthy(url, api_key):
                return ServerProcess(index, proc, url, log_path)
            time.sleep(_FAST_POLL_S if waited < _FAST_FOR_S else _SLOW_POLL_S)
        raise RolloutServerDied(f"{what} was not ready within {spec.start_timeout_s:g} s ({spec.timeout_key}); its "
                                f"log ({log_path}) ends:\n{_tail(log_path)}")
    except BaseException:
        _kill_group(proc)  # its children too (vLLM's engine core outlives a server that died first)
        raise


def _healthy(url: str, api_key: str) -> bool:
    req = urllib.request.Request(url + "/health", headers={"Authorization": f"Bearer {api_key}"})
    try:
        with urllib.request.urlopen(req, timeout=2) as resp:
            return resp.status == 200
    except OSError:
        return False


def _tail(path: str, lines: int = 20) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError:
        return ""


def kill_group(pid: int) -> None:
    """SIGKILL the process group ``pid`` leads (a server's, started in a session of its own), if any is left."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _kill_group(proc: subprocess.Popen, timeout: float = 30.0) -> None:
    """End the server and its children (its own process group), politely first."""
    for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, None)):
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            proc.wait(timeout=wait)
            break
        except subprocess.TimeoutExpired:
            continue
    kill_group(proc.pid)  # a child may outlive a SIGKILLed leader for a moment


class ServerProcessPool(ServerPool):
    """``num_servers`` servers of ``spec``, child processes of this one (torchrun, or no Ray), each on its
    ``spec.host_gpus`` (none: CPU)."""

    def __init__(self, spec: ServerLaunch, num_servers: int) -> None:
        self.spec = spec
        self.gpus = spec.host_gpus(num_servers)
        self.log_dir = tempfile.mkdtemp(prefix="mrl_servers_")
        super().__init__(num_servers)

    def _start_many(self, indices: Iterable[int]) -> list[ServerProcess]:
        """All at once (they load in parallel), then each waited for; the started ones stop if one fails."""
        indices = list(indices)
        with ThreadPoolExecutor(max_workers=max(1, len(indices))) as threads:
            futures = [threads.submit(start_server, self.spec.where_it_runs(self.gpus[i]), seed=self.spec.seed + i,
                                      api_key=self.api_key, log_dir=self.log_dir, gpus=self.gpus[i], index=i)
                       for i in indices]
            started, error = [], None
            for future in futures:
                try:
                    started.append(future.result())
                except BaseException as exc:
                    error = error or exc
        if error is not None:
            for server in started:
                server.stop()
            raise error
        return started
