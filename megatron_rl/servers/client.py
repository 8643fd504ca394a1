"""The driver's generation client to rollout servers (SGLang or servers/hf_server.py), for the async loops.

In server mode the weight updates stay where they are (trainer rank 0's SGLangEngine opens the servers'
sessions and broadcasts); generation for an async loop goes straight from the driver to the servers, so it can
run while the trainer ranks update. Every sample keeps the weight version the server reports for it
(``non_tensor_batch["weight_version"]``, ints: the oldest version among its tokens): the loop, not the client,
decides which versions it accepts.

Partial rollouts (``pause_generation`` / ``continue_generation``, SGLang's routes, mode ``abort``): a pause
returns every in-flight request with the tokens it has so far; the client sends such a row again as prompt +
those tokens for the tokens it has left (the server holds it until the continue), so a response may span a
weight update. Each token keeps the version that sampled it (``non_tensor_batch["token_weight_versions"]``,
one int array per row); the prefix keeps the old version's log-probs. This is the pattern slime and verl's
fully-async recipe use with SGLang, so it works against real SGLang servers too.

Each server has a lane of its own (one request at a time from this client, first come first served): when the
async loop has several batches generating at once (fully async, ``buffer_batches`` > 1), a server that finished
its part of one batch goes straight on with its part of the next while slower servers finish theirs, and a
batch's part never waits behind a later batch's on the same server.

Routing replay R3 (``rollout.enable_rollout_routing_replay``): every request asks for ``return_routed_experts``
(SGLang's field, which the HF-engine servers answer too; the servers must be started with
``--enable-return-routed-experts``, which their ``/server_info`` reports and the client checks once). A row's
routing is the one of the request that finished it: that request's prompt held every token the row had so far,
so its forwards computed the whole sequence ([prompt + all tokens - 1, L, k]); each row's goes to
``batch['routed_experts']`` [B, P + R, L, k] as the colocated engines return it (rollout/routed_experts.py). The
served model's layers and top-k come from the ``model_path`` its ``/server_info`` reports.

A batch's split is fixed (rows in order, one part per serving server), so its samples do not depend on what else
is generating.
A server that cannot be reached is named, with the pool's exit code when the pool started it. With
``restarts`` (servers/restarts.py) a server that died is replaced instead: the rows it had in flight go
to a surviving server, which holds the same weights, with the tokens they already have (their groups stay
whole, their tokens' versions exact), and its replacement gets work only after the next weight sync. While
the servers are paused for a sync no server may hold the last weights (a death during the sync can get every
server replaced, a survivor stuck in the broken broadcast too): rows then wait for the continue, which comes
once the retried sync gave every server the new version, and go on with it.
"""

from __future__ import annotations

import itertools
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Sequence

import numpy as np

from megatron_rl.config.schema import RolloutConfig
from megatron_rl.protocol import DataProto
from megatron_rl.rollout.batch_io import build_rollout_batch, check_prompt_batch, prompt_token_lists
from megatron_rl.rollout.routed_experts import (
    ROLLOUT_KEY,
    check_can_report,
    decode_sglang_routing,
    empty_routing,
    place_request_routing,
)
from megatron_rl.rollout.sampling import resolve_sampling_params
from megatron_rl.servers.pool import RolloutServerDied
from megatron_rl.servers.restarts import RESTARTS_KEY, ServerRestarts
from megatron_rl.rollout.sglang.adapter import parse_output, sampling_dict
from megatron_rl.rollout.sglang.contract import SGLangServerError, checked
from megatron_rl.rollout.sglang.server_transport import ServerHTTP, check_servers_report_routing

__all__ = ["ServerRolloutClient"]


class _Replaced(Exception):
    """The request's server died and was replaced: its rows go to another server."""


class ServerRolloutClient:
    """``config``: the rollout config; ``urls``: the servers; a batch is split across them in order.
    ``pool``: the ServerPool that started them (names a dead server's exit code), if any.
    ``restarts``: replaces the pool's dead servers (its pool is then ``pool``). ``routing_shape``: (layers,
    top-k) of the served MoE model for routing replay R3; None: read from the servers' ``/server_info``."""

    def __init__(self, config: RolloutConfig, urls: Sequence[str], *, response_length: int, eos_token_id: Any,
                 pad_token_id: int | None, timeout_s: float = 600.0, pool: Any = None,
                 restarts: ServerRestarts | None = None, routing_shape: tuple[int, int] | None = None) -> None:
        if not urls:
            raise ValueError("the async rollout client needs rollout servers (actor_rollout_ref.rollout.server_urls "
                             "or rollout.num_servers)")
        self.config, self.restarts = config, restarts
        self.pool = restarts.pool if restarts is not None else pool
        self.response_length = int(config.response_length or response_length)
        self.eos_token_id, self.pad_token_id = eos_token_id, pad_token_id
        self._servers = [ServerHTTP(url, timeout_s) for url in urls]
        self._lanes = [ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"rollout-client-{i}")
                       for i in range(len(self._servers))]
        self._continued = threading.Event()  # clear between pause_generation and continue_generation
        self._continued.set()
        self.routing = bool(getattr(config, "enable_rollout_routing_replay", False))
        self._routing_shape = routing_shape
        self._routing_checked = False  # the servers' /server_info said they capture routing

    def generate_sequences(self, prompts: DataProto) -> DataProto:
        check_prompt_batch(prompts)
        params = resolve_sampling_params(self.config, prompts.meta_info, response_length=self.response_length,
                                         eos_token_id=self.eos_token_id, pad_token_id=self.pad_token_id)
        start = time.perf_counter()
        input_ids = prompt_token_lists(prompts)
        sampling = [checked("sampling", None, sampling_dict(params, row)) for row in range(len(input_ids))]
        serving = self._serving()
        if self.routing and not self._routing_checked:
            self._check_routing(serving)
        bounds = [len(input_ids) * i // len(serving) for i in range(len(serving) + 1)]
        parts = [(index, lo, hi) for index, (lo, hi) in zip(serving, itertools.pairwise(bounds)) if hi > lo]
        futures = [self._lanes[index].submit(self._generate_on, index, input_ids[lo:hi], sampling[lo:hi])
                   for index, lo, hi in parts]
        outputs = [out for f in futures for out in f.result()]
        responses, log_probs, token_versions = [], [], []
        for row, (output, versions) in enumerate(outputs):
            tokens, lps = parse_output(output, row, params)
            responses.append(tokens)
            log_probs.append(lps)
            if not tokens:
                raise RuntimeError(f"rollout server result {row} has no response token")
            token_versions.append(np.asarray(versions[:len(tokens)], dtype=np.int64))
        oldest = np.asarray([v.min() for v in token_versions], dtype=np.int64)
        out = build_rollout_batch(prompts, responses, log_probs, response_length=params.max_response_length,
                                  pad_token_id=params.pad_token_id, weight_version=int(oldest.min()),
                                  seconds=time.perf_counter() - start)
        out.non_tensor_batch["weight_version"] = oldest
        out.non_tensor_batch["token_weight_versions"] = _object_array(token_versions)
        if self.routing:
            out.batch["routed_experts"] = self._routed_experts([o for o, _ in outputs], input_ids, responses,
                                                               prompts, out)
        return out

    def _check_routing(self, serving: list[int]) -> None:
        """Once: every serving server captures its routing (``/server_info``), and the model's (layers, top-k)."""
        servers = [self._servers[i] for i in serving]
        infos = [server.request("/server_info", method="GET") for server in servers]
        engine = servers[0].engine
        check_servers_report_routing([s.url for s in servers], infos, engine)
        if self._routing_shape is None:
            path = infos[0].get("model_path")
            if not path:
                raise ValueError(f"{ROLLOUT_KEY}=true: the {engine} server {servers[0].url} reports no model_path in "
                                 "/server_info, so the served model's layers and top-k are unknown")
            from transformers import AutoConfig  # lazy: only routing replay needs the served model's config

            hf = AutoConfig.from_pretrained(path)
            check_can_report(True, f"the {engine} servers", hf)
            self._routing_shape = (int(hf.num_hidden_layers), int(hf.num_experts_per_tok))
        self._routing_checked = True

    def _routed_experts(self, outputs: list[dict], input_ids: list[list[int]], responses: list[list[int]],
                        prompts: DataProto, out: DataProto) -> Any:
        """Each row's routing (its finishing request's ``meta_info.routed_experts``, see ``_generate_on``) at
        its row: [B, P + R, L, k] int16, -1 where no token was computed."""
        routed = empty_routing(*out.batch["input_ids"].shape, *self._routing_shape)
        for row, output in enumerate(outputs):
            meta = output["meta_info"]
            payload = meta.get("routed_experts")
            where = f"rollout server result {row}"
            if payload is None:
                raise RuntimeError(f"{where} has no meta_info.routed_experts although the request asked for it "
                                   "(return_routed_experts): was the server started with "
                                   "--enable-return-routed-experts?")
            array = decode_sglang_routing(payload, *self._routing_shape, where)
            expected = len(input_ids[row]) + len(meta["output_token_logprobs"]) - 1
            if array.shape[0] < expected:  # e.g. the routing of a request that did not finish the row
                raise RuntimeError(f"{where}: routed experts cover {array.shape[0]} tokens, expected {expected} (its "
                                   f"{len(input_ids[row])} prompt tokens and {len(meta['output_token_logprobs'])} "
                                   "output tokens but the last): the finishing request's routing must cover the "
                                   "whole row")
            place_request_routing(routed, row, array, prompts.batch["attention_mask"][row], len(responses[row]), where)
        return routed

    def pause_generation(self) -> None:
        """Every server: in-flight requests come back partial (their rows are sent again and wait there)."""
        self._continued.clear()
        try:
            self._on_every_server("/pause_generation", {"mode": "abort"})
        except BaseException:
            self._continued.set()  # no continue follows a failed pause: nothing may wait for one
            raise

    def continue_generation(self) -> None:
        try:
            self._on_every_server("/continue_generation", {})
        finally:
            self._continued.set()

    def _on_every_server(self, route: str, body: dict) -> None:
        for index in range(len(self._servers)):
            try:
                self._call(index, route, body)
            except _Replaced:
                pass  # its replacement generates nothing before the next sync

    def _serving(self, instead_of: int | None = None) -> list[int]:
        """The servers that hold the weights of the last sync (all, without restarts). While paused for a
        sync, none may: a death during the sync can leave every server replaced until its retry ends, and a
        paused server would hold the rows until the continue anyway, so they wait for it."""
        if self.restarts is None:
            return list(range(len(self._servers)))
        while True:
            self.restarts.check()
            serving = [i for i in range(len(self._servers)) if self.restarts.serving(i)]
            if serving or self._continued.is_set():
                break
            self._continued.wait()
        if not serving:
            replaced = "" if instead_of is None else f"server {instead_of} died and "
            raise RolloutServerDied(
                f"{replaced}no rollout server holds the weights of the last sync: a replacement receives them at "
                f"the next sync, which waits for this generation outside a pause for one ({RESTARTS_KEY} needs a "
                "surviving server in the async loops: rollout.num_servers >= 2)")
        return serving

    def _generate_on(self, index: int, input_ids: list, sampling: list) -> list[tuple[dict, list[int]]]:
        """Each row to its end, across pauses and server deaths: (its output with all its tokens, each token's
        version). A death loses only the request in flight; its rows go on from their kept tokens elsewhere."""
        entries: list[list] = [[] for _ in input_ids]
        versions: list[list[int]] = [[] for _ in input_ids]
        finish: list[Any] = [None] * len(input_ids)
        routed: list[str | None] = [None] * len(input_ids)
        todo = list(range(len(input_ids)))
        while todo:
            left = [sampling[i]["max_new_tokens"] - len(entries[i]) for i in todo]
            try:
                outputs = self._request(index, [input_ids[i] + [int(e[1]) for e in entries[i]] for i in todo],
                                        [dict(sampling[i], max_new_tokens=n) for i, n in zip(todo, left)])
            except _Replaced:
                serving = self._serving(instead_of=index)
                index = serving[index % len(serving)]
                continue
            again = []
            for i, n, output in zip(todo, left, outputs):
                meta = output["meta_info"]
                got = meta["output_token_logprobs"]
                entries[i] += got
                versions[i] += [int(meta["weight_version"])] * len(got)
                finish[i] = meta["finish_reason"]
                # the routing of the request that finishes the row: its prompt held every earlier token, so its
                # (re-)prefill computed them all, under the weights the later tokens attended over
                routed[i] = meta.get("routed_experts")
                if finish[i] and finish[i].get("type") == "abort" and len(got) < n:
                    again.append(i)
            todo = again
        return [({"meta_info": {"output_token_logprobs": e, "finish_reason": f,
                                **({"routed_experts": r} if r is not None else {})}}, v)
                for e, f, v, r in zip(entries, finish, versions, routed)]

    def _call(self, index: int, route: str, body: dict) -> Any:
        server = self._servers[index]
        try:
            return server.request(route, body)
        except SGLangServerError as exc:
            if self.restarts is not None and self.restarts.handle(server.url):
                self._servers[index] = ServerHTTP(self.pool.urls[index], server.timeout_s)
                raise _Replaced(index) from exc
            if self.pool is not None:
                self.pool.check()  # names the server that exited and its code
            raise RolloutServerDied(f"rollout server {server.url} failed {route}: {exc}") from exc

    def _request(self, index: int, input_ids: list, sampling: list) -> list[dict]:
        server = self._servers[index]
        outputs = self._call(index, "/generate", {"input_ids": input_ids, "sampling_params": sampling,
                                                   "return_logprob": True,
                                                   **({"return_routed_experts": True} if self.routing else {})})
        if not isinstance(outputs, list) or len(outputs) != len(input_ids):
            raise RuntimeError(f"rollout server {server.url} returned {len(outputs) if isinstance(outputs, list) else outputs!r} "
                               f"results for {len(input_ids)} prompts")
        return outputs

    def close(self) -> None:
        for lane in self._lanes:
            lane.shutdown(wait=True)


def _object_array(rows: list[np.ndarray]) -> np.ndarray:
    """One entry per row (numpy would make a 2-D array of equally long rows)."""
    out = np.empty(len(rows), dtype=object)
    for i, row in enumerate(rows):
        out[i] = row
    return out
