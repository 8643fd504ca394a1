"""Transport 2: SGLang HTTP servers on other GPUs (``rollout.mode=server``), driven by ONE trainer rank.

Exactly one source rank (global rank 0, the leader of the only rollout replica in server mode) talks to the
servers: it opens their weight-update session, is rank 0 of the update group and broadcasts every bucket. The
batch is split across the servers. Weights travel over a process group joined through
``/init_weights_update_group`` whose world size is 1 + the sum of the servers' real TP sizes, read from
``/server_info`` (never the local config), and broadcast per bucket with ``/update_weights_from_distributed``
(``weight_transport="distributed"``, any node), or as base64 ``flattened_bucket`` payloads to
``/update_weights_from_tensor`` (``"tensor"``: the payload holds shared-memory / CUDA IPC handles, same node).
"""

from __future__ import annotations

import ipaddress
import logging
import itertools
import json
import socket
import sys
import urllib.error
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch.distributed as dist

from megatron_rl.rollout.bucket import WeightBucket
from megatron_rl.rollout.sglang.contract import (
    BUCKET_FORMAT,
    SGLANG_CONTRACT,
    SGLangServerError,
    check_result,
    checked,
)
from megatron_rl.rollout.sglang.payload import serialize_bucket
from megatron_rl.rollout.base import WeightUpdateError
from megatron_rl.rollout.update_group import init_weight_update_group

__all__ = ["ServerTransport", "update_group_address"]

logger = logging.getLogger(__name__)

UPDATE_GROUP_NAME = "megatron_rl_weight_update"


class _HTTPServer:
    """One SGLang HTTP server; JSON in, JSON out; errors name the URL, route and SGLang's message."""

    def __init__(self, url: str, timeout_s: float) -> None:
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s

    def request(self, route: str, body: dict[str, Any] | None = None, method: str = "POST") -> Any:
        if route not in SGLANG_CONTRACT["http_routes"]:
            raise AssertionError(f"route {route} is not declared in SGLANG_CONTRACT")
        data = None if body is None else json.dumps(checked("route", route, body)).encode()
        req = urllib.request.Request(
            self.url + route, data=data, method=method, headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace")[:500]
            raise SGLangServerError(f"SGLang {self.url}{route} answered {exc.code}: {detail}") from exc
        except (urllib.error.URLError, TimeoutError, ConnectionError) as exc:
            raise SGLangServerError(f"SGLang server {self.url}{route} unreachable: {exc}") from exc
        if not raw:
            return None
        try:
            return json.loads(raw)
        except json.JSONDecodeError:
            return raw.decode(errors="replace")


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
    ) -> None:
        if not server_urls:
            raise ValueError("rollout.mode=server needs rollout.server_urls (the SGLang servers' http://host:port)")
        if weight_transport not in ("distributed", "tensor"):
            raise ValueError(f"rollout.sglang.weight_transport must be distributed or tensor, got {weight_transport!r}")
        self._timeout_s = timeout_s
        self._servers = [_HTTPServer(url, timeout_s) for url in server_urls]
        self._pool = ThreadPoolExecutor(max_workers=max(2, len(self._servers)), thread_name_prefix="sglang-http")
        self._read_server_info()
        self.weight_transport = weight_transport
        self.update_group_backend = update_group_backend
        self.master_address = update_group_address(master_address, list(server_urls)) if weight_transport == "distributed" else None
        self._update_group: dist.ProcessGroup | None = None
        self._version = "0"

    def _read_server_info(self) -> None:
        urls = [s.url for s in self._servers]
        infos = [s.request("/server_info", method="GET") for s in self._servers]
        versions = {info["version"] for info in infos}
        if len(versions) != 1:
            raise ValueError(f"SGLang servers run different versions {sorted(versions)}: {urls}")
        self.version = versions.pop()
        # The update group spans every server's TP ranks, as the servers themselves report them.
        missing = [url for url, info in zip(urls, infos) if "tp_size" not in info]
        if missing:
            raise SGLangServerError(f"SGLang /server_info of {missing} does not report tp_size (sglang {self.version})")
        self.server_tp = [int(info["tp_size"]) for info in infos]
        self.tp_size = max(self.server_tp)

    def replace_servers(self, server_urls: list[str]) -> None:
        """Servers that died were replaced at new URLs (rollout/server_restarts.py): the survivors leave the
        update group (it has a dead member) and the next sync builds a fresh one with every server."""
        if len(server_urls) != len(self._servers):
            raise ValueError(f"{len(server_urls)} server URLs to replace {len(self._servers)} servers")
        survivors = [s for s, url in zip(self._servers, server_urls) if s.url == url.rstrip("/")]
        self._leave_update_group(survivors)
        self._servers = [_HTTPServer(url, self._timeout_s) for url in server_urls]
        self._read_server_info()

    def _leave_update_group(self, servers: list[_HTTPServer]) -> None:
        if self._update_group is None:
            return
        try:
            self._on_all("/destroy_weights_update_group", {"group_name": UPDATE_GROUP_NAME}, servers)
        finally:
            dist.destroy_process_group(self._update_group)
            self._update_group = None

    def _on_all(self, route: str, body: dict[str, Any] | None = None,
                servers: list[_HTTPServer] | None = None) -> list[Any]:
        futures = [self._pool.submit(s.request, route, body) for s in (self._servers if servers is None else servers)]
        return [f.result() for f in futures]

    # ------------------------------------------------------------------ the transport interface
    def generate(self, input_ids: list[list[int]], sampling: list[dict[str, Any]]) -> list[dict]:
        bounds = [len(input_ids) * i // len(self._servers) for i in range(len(self._servers) + 1)]
        futures = [
            self._pool.submit(
                server.request,
                "/generate",
                {"input_ids": input_ids[lo:hi], "sampling_params": sampling[lo:hi], "return_logprob": True},
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
            "group_name": UPDATE_GROUP_NAME,
            "flush_cache": False,
            "load_format": BUCKET_FORMAT["load_format"],
            "weight_version": self._version,
        }
        futures = [self._pool.submit(s.request, "/update_weights_from_distributed", body) for s in self._servers]
        dist.broadcast(bucket.flat(), src=0, group=self._update_group)
        for f in futures:
            check_result(f.result(), "/update_weights_from_distributed")

    def _join_update_group(self) -> dist.ProcessGroup:
        with socket.socket() as sock:
            sock.bind(("", 0))
            port = sock.getsockname()[1]
        world_size = 1 + sum(self.server_tp)
        offsets = list(itertools.accumulate([1, *self.server_tp]))
        futures = [
            self._pool.submit(
                server.request,
                "/init_weights_update_group",
                {
                    "master_address": self.master_address,
                    "master_port": port,
                    "rank_offset": offset,
                    "world_size": world_size,
                    "group_name": UPDATE_GROUP_NAME,
                    "backend": self.update_group_backend,
                },
            )
            for server, offset in zip(self._servers, offsets)
        ]
        group = init_weight_update_group(
            self.master_address, port, rank=0, world_size=world_size, group_name=UPDATE_GROUP_NAME,
            backend=self.update_group_backend,
        )
        for f in futures:
            check_result(f.result(), "/init_weights_update_group")
        return group

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
            self._pool.shutdown(wait=True)


def _require_packed(bucket: WeightBucket) -> None:
    offset = 0
    for entry in bucket.entries:
        if entry.start != offset:
            raise WeightUpdateError(
                f"bucket tensor {entry.name!r} starts at byte {entry.start}, not {offset}: SGLang's distributed "
                f"receiver packs tensors back to back, so a bucket must not mix dtypes that need padding"
            )
        offset = entry.end
