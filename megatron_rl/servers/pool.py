"""The rollout servers' own resource pool: HF-engine servers (``rollout.hf_server``) started as processes of
their own, watched, and replaced when one dies.

Disaggregated placement on CPU: the trainer's ranks and the rollout servers are different processes, so
generation runs on other cores than training and the two can overlap (trainer/off_policy.py). A server that
exits is found by ``check()`` (its exit code and URL named in the error); ``replace(i)`` starts a fresh one
at a new URL, which serves nothing until the next weight sync.

``ServerPool`` is what the trainer, servers/restarts.py and servers/client.py use;
``RolloutServerPool`` starts the servers as child processes (torchrun, or no Ray), and
servers/ray_pool.py as Ray actors on a resource pool of their own.
"""

from __future__ import annotations

import os
import selectors
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Iterable, Protocol, Sequence

from megatron_rl.rollout.server_key import API_KEY_ENV, ensure_server_api_key

__all__ = ["RolloutServer", "RolloutServerDied", "RolloutServerPool", "ServerPool", "require_servers", "start_hf_server"]


class RolloutServerDied(RuntimeError):
    """A rollout server exited or stopped answering; the message names it."""


class RolloutServer(Protocol):
    """One running server as its pool watches it."""

    index: int
    url: str

    def describe(self) -> str: ...

    def exit_status(self) -> str | None:
        """None while it runs; once it died, how (``exited with code -9``), for the error that names it."""

    def stop(self) -> None:
        """End it (if still running) and wait until it is gone."""


@dataclass
class ServerProcess:
    index: int
    proc: subprocess.Popen
    url: str

    def describe(self) -> str:
        return f"rollout server {self.index} ({self.url}, pid {self.proc.pid})"

    def exit_status(self) -> str | None:
        code = self.proc.poll()
        return None if code is None else f"exited with code {code}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()


def start_hf_server(model_path: str, *, dtype: str = "float32", seed: int = 0, threads: int = 1,
                    chunk_tokens: int = 8, timeout_s: float = 120.0, api_key: str | None = None,
                    routed_experts: bool = False) -> tuple[subprocess.Popen, str]:
    """Start ``python -m megatron_rl.servers.hf_server`` on this host's loopback; returns the process and its URL
    once it listens. ``api_key``: the secret every request must carry (default: the run's), passed in the
    child's environment, never on its command line. ``routed_experts``: ``--enable-return-routed-experts``
    (routing replay R3: ``rollout.enable_rollout_routing_replay``)."""
    cmd = [sys.executable, "-m", "megatron_rl.servers.hf_server", "--model-path", str(model_path),
           "--dtype", dtype, "--seed", str(seed), "--threads", str(threads), "--chunk-tokens", str(chunk_tokens),
           *(["--enable-return-routed-experts"] if routed_experts else [])]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), API_KEY_ENV: api_key or ensure_server_api_key()}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True)
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RolloutServerDied(f"the HF rollout server for {model_path} exited with code {proc.returncode} "
                                    "before it listened (its error is above)")
        if sel.select(timeout=0.5):
            line = proc.stdout.readline()
            if line.startswith("READY "):
                sel.close()
                return proc, f"http://127.0.0.1:{int(line.split()[1])}"
    proc.kill()
    proc.wait()
    raise RolloutServerDied(f"the HF rollout server for {model_path} did not listen within {timeout_s:.0f} s")


def require_servers(num_servers: int) -> None:
    if num_servers < 1:
        raise ValueError(f"actor_rollout_ref.rollout.num_servers must be >= 1, got {num_servers}")


class ServerPool:
    """``num_servers`` servers started by ``_start_many`` (a subclass's), watched and replaced by index."""

    def __init__(self, num_servers: int) -> None:
        require_servers(num_servers)
        self.api_key = ensure_server_api_key()  # the run's secret: its servers require it, its clients send it
        self.servers: list[RolloutServer] = []
        try:
            self.servers = list(self._start_many(range(num_servers)))
        except BaseException:
            self.close()
            raise

    def _start_many(self, indices: Iterable[int]) -> Sequence[RolloutServer]:
        raise NotImplementedError

    @property
    def urls(self) -> list[str]:
        return [s.url for s in self.servers]

    def dead(self) -> list[RolloutServer]:
        return [s for s in self.servers if s.exit_status() is not None]

    def check(self) -> None:
        """Raise RolloutServerDied naming every server that died (and how)."""
        gone = self.dead()
        if gone:
            raise RolloutServerDied("; ".join(f"{s.describe()} {s.exit_status()}" for s in gone))

    def replace(self, index: int) -> str:
        """Start a fresh server in place of server ``index`` (stopped first if still running); its new URL."""
        self.servers[index].stop()
        [self.servers[index]] = self._start_many([index])
        return self.servers[index].url

    def close(self) -> None:
        for server in self.servers:
            server.stop()


class RolloutServerPool(ServerPool):
    """``num_servers`` HF-engine servers of the actor's architecture (``model_path``), child processes of this one.
    ``routed_experts``: they capture their routing (``--enable-return-routed-experts``, routing replay R3)."""

    def __init__(self, model_path: str, num_servers: int, *, dtype: str = "float32", seed: int = 0,
                 threads: int = 1, chunk_tokens: int = 8, routed_experts: bool = False) -> None:
        self.model_path, self.dtype, self.seed, self.threads = model_path, dtype, seed, threads
        self.chunk_tokens, self.routed_experts = chunk_tokens, bool(routed_experts)
        super().__init__(num_servers)

    def _start_many(self, indices: Iterable[int]) -> list[ServerProcess]:
        started = []
        for index in indices:
            proc, url = start_hf_server(self.model_path, dtype=self.dtype, seed=self.seed + index,
                                        threads=self.threads, chunk_tokens=self.chunk_tokens, api_key=self.api_key,
                                        routed_experts=self.routed_experts)
            started.append(ServerProcess(index, proc, url))
        return started
