"""Transport 2: SGLang HTTP servers on other GPUs (``rollout.mode=server``), driven by ONE trainer rank.

Exactly one source rank (global rank 0, the leader of the only rollout replica in server mode) talks to the
servers: it opens their weight-update session, is rank 0 of the update group and broadcasts every bucket. The
batch is split across the servers. Weights travel over a process group joined through
``/init_weights_update_group`` whose world size is 1 + the sum of the servers' real TP sizes, read from
``/server_info`` (never the local config), and broadcast per bucket with ``/update_weights_from_distributed``
(``weight_transport="distributed"``, any node), or as base64 ``flattened_bucket`` payloads to
``/update_weights_from_tensor`` (``"tensor"``: the payload holds shared-memory / CUDA IPC handles, same node).

A broadcast (and the group's join) is one collective of the trainer and every server: when a member dies or
refuses a bucket, the others can wait in it until the group's timeout (NCCL never tells a receiver that a peer
is gone). So the trainer watches every server's request while it broadcasts or joins: the first failure
breaks the group, each other
server gets ``rollout.sglang.broken_group_wait_s`` to answer its request, and one that does not is *stuck*
(blocked in the broken collective, its weight routes behind it): no later request waits for it, and
``replace_servers`` hands it back to be replaced like a dead one. The broken group is abandoned, not
destroyed: tearing down a group with a collective still pending blocks in its destructor.
"""

from __future__ import annotations

import ipaddress
import logging
import itertools
import socket
import sys
import urllib.parse
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from megatron_rl.bucket import WeightBucket
from megatron_rl.distributed.ports import free_port
from megatron_rl.rollout.sglang.contract import (
    BUCKET_FORMAT,
    SGLANG_CONTRACT,
    SGLangServerError,
    check_result,
    checked,
)
from megatron_rl.rollout.sglang.payload import serialize_bucket
from megatron_rl.rollout.base import WeightUpdateError
from megatron_rl.rollout.server_http import ServerHTTPBase, check_reachable
from megatron_rl.rollout.update_group import init_weight_update_group

__all__ = ["ServerTransport", "UpdateGroupBroken", "update_group_address"]

logger = logging.getLogger(__name__)

UPDATE_GROUP_NAME = "megatron_rl_weight_update"
WAIT_KEY = "actor_rollout_ref.rollout.sglang.broken_group_wait_s"


class UpdateGroupBroken(WeightUpdateError):
    """A bucket's broadcast failed: names what each server did (answered, failed, stuck) and the cause."""


class ServerHTTP(ServerHTTPBase):
    """One SGLang HTTP server (or an HF-engine server, which speaks its routes); every route and body is checked
    against SGLANG_CONTRACT before it is sent."""

    engine, error = "SGLang", SGLangServerError

    def __init__(self, url: str, timeout_s: float | None, engine: str = "SGLang") -> None:
        super().__init__(url, timeout_s)
        self.engine = engine  # the HF-engine servers speak SGLang's routes: their errors name them, not SGLang

    def checked_body(self, route: str, body: dict[str, Any]) -> dict[str, Any]:
        return checked("route", route, body)

    def request(self, route: str, body: dict[str, Any] | None = None, method: str = "POST") -> Any:
        if route not in SGLANG_CONTRACT["http_routes"]:
            raise AssertionError(f"route {route} is not declared in SGLANG_CONTRACT")
        return super().request(route, body, method)


# rollout.name -> the servers' name in errors: the HF-engine servers (servers/hf_server.py) speak SGLang's routes
SERVER_ENGINE_NAMES = {"sglang": "SGLang", "hf": "HF-engine"}
PROBE_TIMEOUT_S = 10.0  # preflight's wait for a server's first answer (rollout.sglang.request_timeout_s if shorter)


def server_engine_name(rollout_name: str) -> str:
    return SERVER_ENGINE_NAMES.get(str(rollout_name), str(rollout_name))


def check_servers_answer(server_urls: list[str], rollout_name: str, timeout_s: float | None) -> None:
    """The servers of rollout.server_urls answer the client's first request (``/server_info``, what
    ``ServerTransport`` reads when it is built): preflight's check (rollout/engines.py), ValueError naming the key."""
    wait = PROBE_TIMEOUT_S if timeout_s is None else min(float(timeout_s), PROBE_TIMEOUT_S)
    engine = server_engine_name(rollout_name)
    check_reachable([ServerHTTP(url, wait, engine) for url in server_urls], "/server_info")


def check_servers_report_routing(urls: list[str], infos: list[dict[str, Any]], engine: str) -> None:
    """Routing replay R3 with servers: each must have been started with ``--enable-return-routed-experts`` (its
    ``/server_info`` says so, as SGLang reports its ServerArgs); else ValueError naming the servers and keys."""
    without = [url for url, info in zip(urls, infos) if not info.get("enable_return_routed_experts")]
    if without:
        raise ValueError(f"actor_rollout_ref.rollout.enable_rollout_routing_replay=true, but the {engine} servers "
                         f"{without} do not report routed experts: start them with --enable-return-routed-experts "
                         "(their /server_info says enable_return_routed_experts is not set)")


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
    except (OSError, ValueError):
        return False


def _this_node_address() -> str:
    """This process's routable address: under Ray its node's IP (what the servers on other nodes reach; the
    hostname may resolve to loopback), else the hostname's."""
    ray = sys.modules.get("ray")  # a torchrun run never imports Ray
    if ray is not None and ray.is_initialized():
        return ray.util.get_node_ip_address()
    return socket.gethostbyname(socket.gethostname())


def update_group_address(master_address: str | None, server_urls: list[str]) -> str:
    """The address the servers reach this trainer at: ``rollout.sglang.master_address`` or this host's
    address; a loopback address is refused when any server is on another host."""
    address = master_address or _this_node_address()
    remote = [url for url in server_urls if not _is_loopback(urllib.parse.urlparse(url).hostname or "")]
    if remote and _is_loopback(address):
        raise ValueError(
            f"actor_rollout_ref.rollout.sglang.master_address resolves to loopback ({address}) but the SGLang "
            f"servers {remote} are on other hosts and could not join the weight-update group: set it to this "
            "trainer's address as the servers see it"
        )
    return address


class ServerTransport:
    colocated = False
    #: ``tensor`` payloads are handles the servers copy from after answering; broadcasts complete on return
    async_loads = True

    def __init__(
        self,
        server_urls: list[str],
        *,
        timeout_s: float,
        weight_transport: str,
        update_group_backend: str,
        master_address: str | None,
        broken_group_wait_s: float = 30.0,
        engine: str = "SGLang",
        routed_experts: bool = False,
    ) -> None:
        self._engine = engine  # SGLang, or the HF-engine servers (rollout.name=hf), which speak its routes
        # routing replay R3: every /generate asks for return_routed_experts; the servers must capture it
        self.routed_experts = bool(routed_experts)
        if not server_urls:
            raise ValueError(f"rollout.mode=server needs rollout.server_urls (the {engine} servers' http://host:port)")
        if weight_transport not in ("distributed", "tensor"):
            raise ValueError(f"rollout.sglang.weight_transport must be distributed or tensor, got {weight_transport!r}")
        if broken_group_wait_s <= 0:
            raise ValueError(f"{WAIT_KEY} must be > 0 seconds, got {broken_group_wait_s}")
        self._timeout_s, self._broken_wait_s = timeout_s, float(broken_group_wait_s)
        self._stuck: set[str] = set()  # URLs of servers blocked in a broken broadcast: no request waits on them
        self._abandoned: list[dist.ProcessGroup] = []  # broken groups, kept alive (see the module docstring)
        self._servers = [ServerHTTP(url, timeout_s, engine) for url in server_urls]
        self._pool = ThreadPoolExecutor(max_workers=max(2, len(self._servers)), thread_name_prefix="sglang-http")
        self._read_server_info()
        self.weight_transport = weight_transport
        self.update_group_backend = update_group_backend
        self.master_address = update_group_address(master_address, list(server_urls)) if weight_transport == "distributed" else None
        self._update_group: dist.ProcessGroup | None = None
        self._in_broken_group = False  # servers still hold the group a broadcast broke
        self._joins, self._group_name = 0, UPDATE_GROUP_NAME
        self._version = "0"

    def _read_server_info(self) -> None:
        urls = [s.url for s in self._servers]
        infos = [s.request("/server_info", method="GET") for s in self._servers]
        versions = {info["version"] for info in infos}
        if len(versions) != 1:
            raise ValueError(f"{self._engine} servers run different versions {sorted(versions)}: {urls}")
        self.version = versions.pop()
        # The update group spans every server's TP ranks, as the servers themselves report them.
        missing = [url for url, info in zip(urls, infos) if "tp_size" not in info]
        if missing:
            raise SGLangServerError(f"SGLang /server_info of {missing} does not report tp_size (sglang {self.version})")
        self.server_tp = [int(info["tp_size"]) for info in infos]
        self.tp_size = max(self.server_tp)
        if self.routed_experts:
            check_servers_report_routing(urls, infos, self._engine)

    def replace_servers(self, server_urls: list[str]) -> list[str]:
        """Servers that died were replaced at new URLs (servers/restarts.py): the survivors leave the
        update group (it has a dead member) and the next sync builds a fresh one with every server. Returns the
        URLs among ``server_urls`` of servers stuck in a broken broadcast: they can leave nothing and serve
        nothing, so the caller replaces them too (then calls this again)."""
        if len(server_urls) != len(self._servers):
            raise ValueError(f"{len(server_urls)} server URLs to replace {len(self._servers)} servers")
        urls = [url.rstrip("/") for url in server_urls]
        survivors = [s for s, url in zip(self._servers, urls) if s.url == url]
        self._leave_update_group(survivors)
        self._stuck &= set(urls)
        stuck = [url for url in urls if url in self._stuck]
        self._servers = [ServerHTTP(url, self._timeout_s, self._engine) for url in urls]
        if not stuck:
            self._read_server_info()
        return stuck

    def _leave_update_group(self, servers: list[ServerHTTP]) -> None:
        """The servers drop the group (SGLang's ``/destroy_weights_update_group``), then the trainer does. After
        a broken broadcast the trainer's end is abandoned (see the module docstring) and the servers that
        answered drop theirs, which frees its sockets; a dead server has none left."""
        if self._update_group is not None:
            try:
                self._on_all("/destroy_weights_update_group", {"group_name": self._group_name}, servers)
            finally:
                dist.destroy_process_group(self._update_group)
                self._update_group = None
        elif self._in_broken_group:
            self._in_broken_group = False
            for server in self._live(servers):
                try:
                    server.request("/destroy_weights_update_group", {"group_name": self._group_name})
                except SGLangServerError as exc:  # it may never have joined (the group broke while joining)
                    logger.warning("a server leaving the broken weight-update group: %s", exc)

    def _live(self, servers: list[ServerHTTP] | None = None) -> list[ServerHTTP]:
        return [s for s in (self._servers if servers is None else servers) if s.url not in self._stuck]

    def _on_all(self, route: str, body: dict[str, Any] | None = None,
                servers: list[ServerHTTP] | None = None) -> list[Any]:
        """``route`` on every server not stuck in a broken broadcast (a stuck one would never answer)."""
        futures = [self._pool.submit(s.request, route, body) for s in self._live(servers)]
        return [f.result() for f in futures]

    # ------------------------------------------------------------------ the transport interface
    def generate(self, input_ids: list[list[int]], sampling: list[dict[str, Any]],
                 image_data: list[list[str] | None] | None = None) -> list[dict]:
        bounds = [len(input_ids) * i // len(self._servers) for i in range(len(self._servers) + 1)]
        futures = [
            self._pool.submit(
                server.request,
                "/generate",
                {"input_ids": input_ids[lo:hi], "sampling_params": sampling[lo:hi], "return_logprob": True,
                 **({"return_routed_experts": True} if self.routed_experts else {}),
                 **({"image_data": image_data[lo:hi]} if image_data is not None else {})},
            )
            for server, (lo, hi) in zip(self._servers, itertools.pairwise(bounds))
            if hi > lo
        ]
        outputs = [out for f in futures for out in f.result()]
        if len(outputs) != len(input_ids):
            raise RuntimeError(f"SGLang returned {len(outputs)} results for {len(input_ids)} prompts")
        return outputs

    def session(self, what: str) -> None:
        for result in self._on_all(f"/{what}", {}):
            check_result(result, f"/{what}")

    def set_version(self, version: int) -> None:
        self._version = str(version)

    def load_bucket(self, bucket: WeightBucket) -> None:
        if self.weight_transport == "tensor":
            body = {
                "serialized_named_tensors": [serialize_bucket(bucket, as_text=True)] * self.tp_size,
                "load_format": BUCKET_FORMAT["load_format"],
                "flush_cache": False,
                "weight_version": self._version,
            }
            for result in self._on_all("/update_weights_from_tensor", body):
                check_result(result, "/update_weights_from_tensor")
        else:
            self._broadcast(bucket)

    def _broadcast(self, bucket: WeightBucket) -> None:
        """The servers allocate the bucket from (names, dtypes, shapes), packed back to back, and receive it by
        one broadcast from us (rank 0 of the update group)."""
        _require_packed(bucket)
        if self._update_group is None:
            self._update_group = self._join_update_group()
        body = {
            "names": [e.name for e in bucket.entries],
            "dtypes": [str(e.dtype).replace("torch.", "") for e in bucket.entries],
            "shapes": [list(e.shape) for e in bucket.entries],
            "group_name": self._group_name,
            "flush_cache": False,
            "load_format": BUCKET_FORMAT["load_format"],
            "weight_version": self._version,
        }
        futures = {s.url: self._pool.submit(s.request, "/update_weights_from_distributed", body) for s in self._servers}
        work = dist.broadcast(bucket.flat(), src=0, group=self._update_group, async_op=True)
        self._watched("/update_weights_from_distributed", futures, work.is_completed, work.wait,
                      f"the broadcast of weight version {self._version}")

    def _watched(self, route: str, futures: dict[str, Future], trainer_done: Callable[[], bool],
                 trainer_result: Callable[[], Any], what: str) -> Any:
        """The trainer's side of a collective with the servers (``trainer_done``/``trainer_result``) and every
        server's ``route`` request for it. A request that fails (a dead server, a refusal) means that server
        never takes its part: the group breaks at once instead of waiting in the collective for it."""
        try:
            pending = set(futures.values())
            while not trainer_done() and pending:
                finished, pending = wait(pending, timeout=0.05, return_when=FIRST_EXCEPTION)
                for f in finished:
                    check_result(f.result(), route)
            result = trainer_result()
            for f in futures.values():
                check_result(f.result(), route)
            return result
        except Exception as exc:
            raise self._group_broke(futures, exc, what) from exc

    def _group_broke(self, futures: dict[str, Future], cause: Exception, what: str) -> UpdateGroupBroken:
        """Wait (bounded) for every server's answer to the failed collective ``what``; name what each did."""
        if self._update_group is not None:
            self._abandoned.append(self._update_group)
        self._update_group, self._in_broken_group = None, True
        wait(futures.values(), timeout=self._broken_wait_s)
        outcomes = []
        for index, (url, f) in enumerate(futures.items()):
            if not f.done():
                self._stuck.add(url)
                outcomes.append(f"server {index} ({url}) did not answer within {WAIT_KEY}={self._broken_wait_s:g} s: "
                                "stuck in the broken collective")
            elif f.exception() is not None:
                outcomes.append(f"server {index} ({url}) failed: {f.exception()}")
            else:
                outcomes.append(f"server {index} ({url}) took its part")
        return UpdateGroupBroken(f"{what} to the SGLang servers failed ({cause}); " + "; ".join(outcomes))

    def _join_update_group(self) -> dist.ProcessGroup:
        port = free_port("")  # bound by this process's TCPStore only once the servers were asked to join
        # A fresh name per group: a broken group stays registered (abandoned, on the trainer; on a server that
        # could not be told to drop it), and torch and the servers refuse a second group of the same name.
        self._joins += 1
        self._group_name = f"{UPDATE_GROUP_NAME}_{self._joins}"
        world_size = 1 + sum(self.server_tp)
        offsets = list(itertools.accumulate([1, *self.server_tp]))
        futures = {
            server.url: self._pool.submit(
                server.request,
                "/init_weights_update_group",
                {
                    "master_address": self.master_address,
                    "master_port": port,
                    "rank_offset": offset,
                    "world_size": world_size,
                    "group_name": self._group_name,
                    "backend": self.update_group_backend,
                },
            )
            for server, offset in zip(self._servers, offsets)
        }
        # The trainer's rendezvous on a thread of its own: it waits for every member, so a server that died
        # before joining would hold it until the group's timeout (then the thread ends; nothing waits for it).
        joiner = ThreadPoolExecutor(max_workers=1, thread_name_prefix="update-group-join")
        joined = joiner.submit(
            init_weight_update_group, self.master_address, port, rank=0, world_size=world_size,
            group_name=self._group_name, backend=self.update_group_backend,
        )
        joiner.shutdown(wait=False)
        return self._watched("/init_weights_update_group", futures, joined.done, joined.result,
                             "joining the weight-update group")

    def flush_cache(self) -> None:
        self._on_all("/flush_cache")

    def memory(self, what: str, tags: list[str]) -> None:
        self._on_all(f"/{what}", {"tags": tags})

    def shutdown(self) -> None:
        try:
            self._leave_update_group(self._servers)
        except SGLangServerError as exc:  # a server that died has no group to leave; the group is gone here
            logger.warning("leaving the weight-update group at shutdown: %s", exc)
        finally:
            # A request to a stuck server returns only when that server is stopped: do not wait for it.
            self._pool.shutdown(wait=not self._stuck)


def _require_packed(bucket: WeightBucket) -> None:
    offset = 0
    for entry in bucket.entries:
        if entry.start != offset:
            raise WeightUpdateError(
                f"bucket tensor {entry.name!r} starts at byte {entry.start}, not {offset}: SGLang's distributed "
                f"receiver packs tensors back to back, so a bucket must not mix dtypes that need padding"
            )
        offset = entry.end
