"""Replacing rollout servers that die during a run (``actor_rollout_ref.rollout.server_restarts``).

A request that fails on a server the pool (servers/pool.py) sees exited is a death: it is named
(warning + ``rollout/server_restarts``) and the pool starts a fresh server at a new URL. The fresh server holds
no weights of the run (it refuses to generate), so it serves nothing until it has the current version:

- synchronous loop (``RestartingSync.generate_sequences``, its ``generate``): the workers rebuild their
  weight-update group with the new server, the current version is synced again at once (the trainer still
  holds exactly those weights: nothing updated since the last sync), and the batch is generated again (same
  seeds);
- async loops (servers/client.py): the trainer's weights have moved on during the update, so only the
  surviving servers hold the version the batch in flight was sampled with; the dead server's rows go to a
  survivor with the tokens they already have, and the replacement joins at the next weight sync.

A death during a weight sync (every loop is given ``RestartingSync.sync_weights`` as its sync) breaks that
bucket's broadcast: the transport stops at the first failed request and names what each server did
(rollout/sglang/server_transport.py). The dead server is replaced, so is a survivor left stuck in the broken
broadcast (it answers nothing until the group's timeout; not counted against the budget, which counts
deaths), and the same version is synced again from the start to every server on a fresh update group: a
survivor holding a half-applied update (it refused to serve it when its session ended) ends with the
trainer's weights too. Every trainer rank takes part in the retry
(weights/replica.py makes them agree on the failure).

Once ``server_restarts`` servers were replaced, the next death fails the run naming the server, its exit code,
what it died during and the key.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Any

from megatron_rl.protocol import DataProto
from megatron_rl.servers.pool import RolloutServerDied, ServerPool

__all__ = ["RESTARTS_KEY", "RestartingSync", "ServerRestarts"]

logger = logging.getLogger(__name__)

RESTARTS_KEY = "actor_rollout_ref.rollout.server_restarts"


class ServerRestarts:
    """The pool's dead servers replaced, ``budget`` of them over the run (0: the first death fails the run).
    ``exit_wait_s``: how long a failed request waits for its server's exit to show (a SIGKILLed process is
    reaped a moment after its sockets close). Thread-safe: the rollout thread and the trainer both call it."""

    def __init__(self, pool: ServerPool, budget: int, *, exit_wait_s: float = 2.0) -> None:
        if budget < 0:
            raise ValueError(f"{RESTARTS_KEY} must be >= 0 (0: a dead server fails the run), got {budget}")
        self.pool, self.budget, self.exit_wait_s = pool, budget, exit_wait_s
        self.count = 0  # deaths replaced
        self.stuck_count = 0  # live servers replaced because a death left them stuck in a weight broadcast
        self._unsynced: set[int] = set()  # replaced servers that have not received the current weights
        self._lock = threading.Lock()

    def handle(self, failed_url: str | None = None, *, during: str = "a request") -> bool:
        """After a failed request (to ``failed_url``, or anywhere) made during ``during`` (for the error):
        replace every server that exited. True when a server was replaced (the failed one now, or by another
        thread before); False when none exited (the failure is not a death: the caller raises it)."""
        with self._lock:
            if failed_url is not None and failed_url not in self.pool.urls:
                return True
            deadline = time.monotonic() + self.exit_wait_s
            while not self.pool.dead() and time.monotonic() < deadline:
                time.sleep(0.05)
            return self._replace_exited(during)

    def check(self) -> None:
        """Replace the servers that exited by now (a death noticed between requests)."""
        with self._lock:
            self._replace_exited("the run")

    def replace_stuck(self, urls: list[str], during: str) -> None:
        """Replace the live servers at ``urls``, stuck in a broadcast a death broke: they would answer nothing
        before the update group's timeout. Outside the budget, which counts deaths (the one that broke the
        broadcast was counted): one death must not cost more than one restart because of where it struck."""
        with self._lock:
            for server in [server for server in self.pool.servers if server.url in urls]:
                logger.warning("%s is stuck in the weight-update group broken during %s: starting a replacement",
                               server.describe(), during)
                self.pool.replace(server.index)
                self.stuck_count += 1
                self._unsynced.add(server.index)

    def _replace_exited(self, during: str) -> bool:
        """Replace every server that exited (each against the budget); whether there was one."""
        gone = self.pool.dead()
        for server in gone:
            status = server.exit_status()
            if self.count >= self.budget:
                raise RolloutServerDied(
                    f"{server.describe()} {status} during {during}, and {self.count} of "
                    f"{RESTARTS_KEY}={self.budget} replacements are used: raise it to replace more")
            logger.warning("%s %s during %s: starting a replacement (%d of %s=%d)", server.describe(), status,
                           during, self.count + 1, RESTARTS_KEY, self.budget)
            self.pool.replace(server.index)
            self.count += 1
            self._unsynced.add(server.index)
        return bool(gone)

    def serving(self, index: int) -> bool:
        """Server ``index`` is alive and holds the weights of the last sync."""
        with self._lock:
            return index not in self._unsynced and self.pool.servers[index].exit_status() is None

    def unsynced(self) -> set[int]:
        with self._lock:
            return set(self._unsynced)

    def synced(self, indices: set[int]) -> None:
        """``indices`` (from ``unsynced()`` before the sync) received the weights of a complete sync."""
        with self._lock:
            self._unsynced -= indices

    def metrics(self) -> dict[str, float]:
        return {"rollout/server_restarts": float(self.count), "rollout/stuck_servers_replaced": float(self.stuck_count)}


class RestartingSync:
    """How a server-mode run with a ``ServerRestarts`` syncs weights and (synchronous loop) generates on its
    actor/rollout ``workers``; the trainer passes ``sync_weights`` and ``generate_sequences`` to its loop as
    functions (every other call goes to the workers directly). Each sync first points the workers at the
    replaced servers (a fresh update group) and reports ``rollout/server_restarts``; a generation on the workers
    that loses a server is repeated on the replacement, synced first."""

    def __init__(self, workers: Any, restarts: ServerRestarts) -> None:
        self.workers, self.restarts = workers, restarts
        self.version = 0  # the workers' init_model synced version 0

    def sync_weights(self, version: int, *args: Any) -> dict[str, float]:
        """Sync ``version``; a server lost during it is replaced and the same version synced again from the
        start (the trainer's weights have not moved), to every server."""
        during = f"the weight sync to version {version}"
        self.restarts.check()  # a server found dead now joins this sync instead of failing it
        while True:
            replaced = self._rejoin_replaced(during)
            try:
                metrics = self.workers.sync_weights(version, *args)
                break
            except Exception as exc:
                if not self.restarts.handle(during=during):
                    raise
                logger.warning("%s lost a server (%s): syncing it again", during, exc)
        self.version = version
        self.restarts.synced(replaced)
        return {**metrics, **self.restarts.metrics()}

    def _rejoin_replaced(self, during: str) -> set[int]:
        """Point the workers at the replaced servers (the survivors leave the old update group); survivors
        stuck in a broken broadcast are replaced as well. The replaced servers' indices."""
        while self.restarts.unsynced():
            stuck = self.workers.replace_rollout_servers(self.restarts.pool.urls)
            if not stuck:
                break
            self.restarts.replace_stuck(stuck, during)
        return self.restarts.unsynced()

    def generate_sequences(self, prompts: DataProto) -> DataProto:
        """The whole batch again after a death (the workers' result is all or nothing; per-row seeds make the
        repeat sample what the first try would have)."""
        while True:
            try:
                return self.workers.generate_sequences(prompts)
            except Exception:
                if not self.restarts.handle():
                    raise
            self.sync_weights(self.version)
