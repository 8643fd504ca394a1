"""The HF-engine server's launch spec (servers/fleet.py ``ServerLaunch``): ``python -m
megatron_rl.servers.hf_server`` with the run's rollout settings. Kept apart from hf_server.py so that a launcher
(a Ray actor, the driver) reads it without importing torch."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Sequence

from megatron_rl.rollout.server_key import API_KEY_ENV

__all__ = ["HFServerLaunch"]


@dataclass(frozen=True)
class HFServerLaunch:
    """HF-engine servers of the actor's architecture (``model_path``), on CPU. ``routed_experts``: they capture
    their routing (``--enable-return-routed-experts``, routing replay R3)."""

    model_path: str
    dtype: str = "float32"
    seed: int = 0
    threads: int = 1
    chunk_tokens: int = 8
    routed_experts: bool = False
    start_timeout_s: float = 120.0
    timeout_key: str = "ray_init.timeout_s"
    engine: str = "HF"
    one_node_reason: str | None = None  # weights come over a gloo update group: servers may run on any node

    def command(self, *, host: str, port: int, seed: int) -> list[str]:
        return [sys.executable, "-m", "megatron_rl.servers.hf_server", "--model-path", str(self.model_path),
                "--host", host, "--port", str(port), "--dtype", self.dtype, "--seed", str(seed),
                "--threads", str(self.threads), "--chunk-tokens", str(self.chunk_tokens),
                *(["--enable-return-routed-experts"] if self.routed_experts else [])]

    def environment(self, api_key: str, gpus: Sequence[Any]) -> dict[str, str]:
        return {"OMP_NUM_THREADS": str(self.threads), API_KEY_ENV: api_key}

    def where_it_runs(self, gpus: Sequence[Any]) -> "HFServerLaunch":
        return self  # CPU only: nothing depends on where it runs

    def host_gpus(self, num_servers: int) -> list[tuple[Any, ...]]:
        return [()] * num_servers

    def ray_gpus(self, cluster_has_gpus: bool) -> int:
        return 0
