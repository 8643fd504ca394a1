"""What a run's rollout servers are to their users: a ``ServerPool`` of ``RolloutServer``s, watched and
replaced when one dies, whichever engine they run and however they were started.

Disaggregated placement: the trainer's ranks and the rollout servers are different processes, so generation
runs on other cores (or GPUs) than training and the two can overlap (trainer/off_policy.py). A server that
exits is found by ``check()`` (its exit code and URL named in the error); ``replace(i)`` starts a fresh one
at a new URL, which serves nothing until the next weight sync.

``ServerPool`` is what the trainer, servers/restarts.py and servers/client.py use; servers/fleet.py's
``ServerProcessPool`` starts the servers as child processes (torchrun, or no Ray), servers/ray_pool.py's
``RayServerPool`` from Ray actors on a resource pool of their own.
"""

from __future__ import annotations

from typing import Iterable, Protocol, Sequence

from megatron_rl.rollout.server_key import ensure_server_api_key

__all__ = ["RolloutServer", "RolloutServerDied", "ServerPool", "require_servers"]


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
