"""The rollout servers' own resource pool: HF-engine servers (``rollout.hf_server``) started as processes of
their own, watched, and replaced when one dies.

Disaggregated placement on CPU: the trainer's ranks and the rollout servers are different processes, so
generation runs on other cores than training and the two can overlap (trainer/off_policy.py). A server that
exits is found by ``check()`` (its exit code and URL named in the error); ``replace(i)`` starts a fresh one
at a new URL, which serves nothing until the next weight sync.
"""

from __future__ import annotations

import os
import selectors
import subprocess
import sys
import time
from dataclasses import dataclass

__all__ = ["RolloutServerDied", "RolloutServerPool", "start_hf_server"]


class RolloutServerDied(RuntimeError):
    """A rollout server exited or stopped answering; the message names it."""


@dataclass
class ServerProcess:
    index: int
    proc: subprocess.Popen
    url: str

    def describe(self) -> str:
        return f"rollout server {self.index} ({self.url}, pid {self.proc.pid})"


def start_hf_server(model_path: str, *, dtype: str = "float32", seed: int = 0, threads: int = 1,
                    chunk_tokens: int = 8, timeout_s: float = 120.0) -> tuple[subprocess.Popen, str]:
    """Start ``python -m megatron_rl.rollout.hf_server``; returns the process and its URL once it listens."""
    cmd = [sys.executable, "-m", "megatron_rl.rollout.hf_server", "--model-path", str(model_path),
           "--dtype", dtype, "--seed", str(seed), "--threads", str(threads), "--chunk-tokens", str(chunk_tokens)]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
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


class RolloutServerPool:
    """``num_servers`` HF-engine servers of the actor's architecture (``model_path``)."""

    def __init__(self, model_path: str, num_servers: int, *, dtype: str = "float32", seed: int = 0,
                 threads: int = 1, chunk_tokens: int = 8) -> None:
        if num_servers < 1:
            raise ValueError(f"actor_rollout_ref.rollout.num_servers must be >= 1, got {num_servers}")
        self.model_path, self.dtype, self.seed, self.threads = model_path, dtype, seed, threads
        self.chunk_tokens = chunk_tokens
        self.servers: list[ServerProcess] = []
        try:
            for i in range(num_servers):
                self.servers.append(self._start(i))
        except BaseException:
            self.close()
            raise

    def _start(self, index: int) -> ServerProcess:
        proc, url = start_hf_server(self.model_path, dtype=self.dtype, seed=self.seed + index, threads=self.threads,
                                    chunk_tokens=self.chunk_tokens)
        return ServerProcess(index, proc, url)

    @property
    def urls(self) -> list[str]:
        return [s.url for s in self.servers]

    def dead(self) -> list[ServerProcess]:
        return [s for s in self.servers if s.proc.poll() is not None]

    def check(self) -> None:
        """Raise RolloutServerDied naming every server that exited (and its exit code)."""
        gone = self.dead()
        if gone:
            raise RolloutServerDied("; ".join(f"{s.describe()} exited with code {s.proc.returncode}" for s in gone))

    def replace(self, index: int) -> str:
        """Start a fresh server in place of server ``index`` (killed first if still running); its new URL."""
        old = self.servers[index]
        if old.proc.poll() is None:
            old.proc.kill()
        old.proc.wait()
        self.servers[index] = self._start(index)
        return self.servers[index].url

    def close(self) -> None:
        for server in self.servers:
            if server.proc.poll() is None:
                server.proc.terminate()
        for server in self.servers:
            try:
                server.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                server.proc.kill()
                server.proc.wait()
            if server.proc.stdout is not None:
                server.proc.stdout.close()
