"""An HF-engine rollout server that speaks SGLang's HTTP routes and weight-update protocol (sglang 0.5.23).

It is the CPU production path of ``rollout.mode=server`` with ``rollout.name=hf``: the replicas run in their
own processes (their own cores), the trainer drives them with the same client as SGLang servers
(``rollout.sglang.server_transport``): control over HTTP, weights over an update group joined through
``/init_weights_update_group`` (gloo on CPU, where SGLang uses NCCL) and broadcast per bucket with
``/update_weights_from_distributed``. ``python -m megatron_rl.servers.hf_server --model-path DIR --port P``
(its launcher: servers/fleet.py, with servers/hf_launch.py's spec) is ready once ``GET /health`` answers 200; it
exits when the process that started it does (a Ray actor SIGKILLed, a launcher gone).

Routes (fields SGLANG_CONTRACT lists; any other field is a 400, stricter than SGLang, so a client that
drifts from the contract fails here first):

- ``GET /server_info``: ``{"version", "tp_size": 1, "weight_version", "engine": "hf", "model_path",
  "enable_return_routed_experts"}`` (the last two as SGLang reports its ServerArgs); ``GET /health``;
- ``POST /generate``: SGLang's batched form (``input_ids`` lists, one ``sampling_params`` per row,
  ``return_logprob``, ``return_routed_experts``); each result's ``meta_info`` has ``output_token_logprobs``
  ([logprob, token, null]), ``finish_reason`` and ``weight_version`` (the version of the weights that produced
  it), and with ``return_routed_experts`` SGLang's ``routed_experts``: base64 of a C-order little-endian int32
  [prompt tokens + output tokens - 1, layers, top-k] array, each computed token's experts (routing replay R3,
  rollout/routed_experts.py). As in SGLang the server must be started for it (``--enable-return-routed-experts``:
  its engine captures its routers); asked of one that was not, the request is a 400;
- the weight-update session ``/begin_weight_update`` ... ``/end_weight_update`` (loads outside it are
  refused; the end refuses an incomplete update and the server then refuses to generate), ``/flush_cache``,
  ``/init_weights_update_group``, ``/update_weights_from_distributed`` (flattened bucket packed back to
  back), ``/destroy_weights_update_group``, ``/release_memory_occupation``, ``/resume_memory_occupation``;
- ``/pause_generation`` (``mode``: ``abort`` (SGLang's default), ``in_place``, ``retract``) and
  ``/continue_generation``, with SGLang's semantics (srt/managers/tokenizer_manager.py): ``abort`` returns
  every in-flight request with the tokens it has so far (``finish_reason`` ``{"type": "abort"}``) and answers
  once none runs; ``in_place``/``retract`` park them (they go on after ``/continue_generation``, on whatever
  weights are loaded then; this engine keeps no KV cache, so both recompute the prefix); while paused a new
  ``/generate`` waits for ``/continue_generation``.

Generation is token-chunked (``--chunk-tokens``): the engine decodes at most that many tokens per call and
the request's prefix is fed back for the next chunk, so a pause takes effect at the next chunk boundary and a
request can stop mid-response. Each chunk's engine call computes the whole prefix again, so the routing of a
request's last chunk covers all its tokens (prompt and every output token but the last). Weight and memory
routes run one at a time (a lock) and, as in SGLang, wait for running generations unless the server is paused
(then parked/aborted requests do not hold them up).
``/health`` and ``/server_info`` always answer, so a slow server is told apart from a dead one.
Every route needs the run's secret (``Authorization: Bearer``, ``$MEGATRON_RL_SERVER_API_KEY``; docs/rollout.md,
"Security"): without it the answer is 401 and nothing else. Rows of one
``/generate`` share one sampling generator seeded with the first row's ``sampling_seed`` (chunk c uses
seed + c): the same request gives the same samples.
"""

from __future__ import annotations

import argparse
import base64
import hmac
import json
import os
import threading
import time
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from contextlib import contextmanager
from typing import Any, Iterable, Iterator

import torch
import torch.distributed as dist

from megatron_rl.config.schema import RolloutConfig
from megatron_rl.protocol import DataProto
from megatron_rl.rollout.hf_engine import HFEngine
from megatron_rl.rollout.sglang.contract import BUCKET_FORMAT, MEMORY_TAGS, SGLANG_CONTRACT, SGLANG_PIN
from megatron_rl.rollout.server_key import API_KEY_ENV, ensure_server_api_key
from megatron_rl.rollout.update_group import init_weight_update_group
from megatron_rl.rollout.http_reply import send_json

__all__ = ["HFServerApp", "main"]

ROUTES = SGLANG_CONTRACT["http_routes"]
SAMPLING_FIELDS = set(SGLANG_CONTRACT["sampling_params"])
PAUSE_MODES = ("abort", "in_place", "retract")  # io_struct.py PauseGenerationReqInput.mode
UNCONTROLLED = ("/generate", "/pause_generation", "/continue_generation")  # not behind the control lock
ROUTING_FLAG = "enable_return_routed_experts"  # SGLang's ServerArgs field (and flag); this server's flag too


class BadRequest(ValueError):
    """A request the server refuses (400); the message names the route and the field."""


class HFServerApp:
    """The routes over one HFEngine. ``engine`` must start unsynced (random weights) or from a checkpoint."""

    def __init__(self, engine, chunk_tokens: int = 8, model_path: str = "") -> None:
        """``engine``: an HFEngine; built with ``enable_rollout_routing_replay`` it captures its routers and
        the server answers ``return_routed_experts`` (``--enable-return-routed-experts``). ``model_path``: what
        ``/server_info`` reports (SGLang's ServerArgs.model_path)."""
        if chunk_tokens < 1:
            raise ValueError(f"--chunk-tokens must be >= 1, got {chunk_tokens}")
        self.engine = engine
        self.chunk_tokens = int(chunk_tokens)
        self.model_path = str(model_path)
        self.routed_experts = bool(getattr(engine, "reports_routing", False))  # test engines may lack it
        self.lock = threading.Lock()  # control routes, one at a time
        self.engine_lock = threading.Lock()  # one engine call at a time (a chunk, a load)
        self.state = threading.Condition()  # guards paused / pause_mode / running / controlling
        self.paused, self.pause_mode = False, "abort"
        self.running = 0  # generations inside a chunk or between chunks (not parked)
        self.controlling = False
        self.served_version = "0"  # SGLang's weight_version: the string the last update sent
        self._pending_version: str | None = None
        self._groups: dict[str, dist.ProcessGroup] = {}
        self._released: set[str] = set()

    # ------------------------------------------------------------------ dispatch
    def handle(self, method: str, route: str, body: Any) -> Any:
        if method == "GET":
            if route == "/server_info":
                # SGLang's /server_info reports its ServerArgs: model_path and enable_return_routed_experts among them
                return {"version": SGLANG_PIN, "tp_size": 1, "weight_version": self.served_version, "engine": "hf",
                        "model_path": self.model_path, ROUTING_FLAG: self.routed_experts}
            if route == "/health":
                return {}
            raise LookupError(route)
        if route not in ROUTES:
            raise LookupError(route)
        body = {} if body is None else body
        if not isinstance(body, dict):
            raise BadRequest(f"{route}: the request body must be a JSON object")
        unknown = sorted(set(body) - set(ROUTES[route][1]))
        if unknown:
            raise BadRequest(f"{route}: unknown fields {unknown}; this server takes {sorted(ROUTES[route][1])}")
        if route in UNCONTROLLED:
            return getattr(self, route.strip("/"))(body)
        with self.lock, self.control():
            return getattr(self, route.strip("/"))(body)

    @contextmanager
    def control(self) -> Iterator[None]:
        """A weight/memory operation: waits until no generation runs (parked ones do not count), and no
        generation starts or resumes until it is done."""
        with self.state:
            self.state.wait_for(lambda: self.running == 0)
            self.controlling = True
        try:
            with self.engine_lock:
                yield
        finally:
            with self.state:
                self.controlling = False
                self.state.notify_all()

    # ------------------------------------------------------------------ pause / continue
    def pause_generation(self, body: dict) -> dict:
        mode = body.get("mode", "abort")
        if mode not in PAUSE_MODES:
            raise BadRequest(f"/pause_generation: mode must be one of {list(PAUSE_MODES)}, got {mode!r}")
        with self.state:
            self.paused, self.pause_mode = True, mode
            self.state.notify_all()  # the state changed: whoever waits on it re-checks (not only at a timeout)
            self.state.wait_for(lambda: self.running == 0)  # aborted ones returned, parked ones wait
        return {"message": "Generation paused successfully.", "status": "ok"}

    def continue_generation(self, body: dict) -> dict:
        with self.state:
            self.paused = False
            self.state.notify_all()
        return {"message": "Generation continued successfully.", "status": "ok"}

    def _may_run(self) -> bool:
        return not self.paused and not self.controlling

    def _next_chunk_allowed(self) -> bool:
        """At a chunk boundary: False when a pause aborts the request; parks it for in_place/retract."""
        with self.state:
            if self._may_run():
                return True
            if self.paused and self.pause_mode == "abort":
                return False
            self.running -= 1
            self.state.notify_all()
            self.state.wait_for(self._may_run)
            self.running += 1
            return True

    # ------------------------------------------------------------------ generation
    def generate(self, body: dict) -> list[dict]:
        input_ids, params = body.get("input_ids"), body.get("sampling_params")
        if not isinstance(input_ids, list) or not input_ids or not all(isinstance(r, list) and r for r in input_ids):
            raise BadRequest("/generate: input_ids must be a non-empty list of non-empty token lists")
        if isinstance(params, dict):
            params = [params] * len(input_ids)
        if not isinstance(params, list) or len(params) != len(input_ids):
            raise BadRequest(f"/generate: {len(input_ids)} prompts need as many sampling_params")
        meta = _common_sampling(params)
        routing = body.get("return_routed_experts", False)
        if not isinstance(routing, bool):
            raise BadRequest(f"/generate: return_routed_experts must be true or false, got {routing!r}")
        if routing and not self.routed_experts:
            raise BadRequest("/generate: return_routed_experts=true, but this server does not capture its routing: "
                             "start it with --enable-return-routed-experts (an MoE model; the run's pool does so "
                             "when actor_rollout_ref.rollout.enable_rollout_routing_replay=true)")
        with self.state:
            self.state.wait_for(self._may_run)  # SGLang: a request sent while paused waits for the continue
            self.running += 1
        try:
            rows = self._generate_chunked(input_ids, meta)
        finally:
            with self.state:
                self.running -= 1
                self.state.notify_all()
        return [row.result(meta["eos_token_id"], self.served_version, routing) for row in rows]

    def _generate_chunked(self, input_ids: list[list[int]], meta: dict[str, Any]) -> list["_Row"]:
        """Chunk after chunk until every row is done (or aborted by a pause); each row keeps the routing of
        its last chunk, whose forwards computed its whole prefix."""
        rows = [_Row(list(r)) for r in input_ids]
        limit, chunk = meta["response_length"], 0
        while live := [r for r in rows if not r.done(limit, meta["eos_token_id"])]:
            if not self._next_chunk_allowed():
                for r in live:
                    r.aborted = True
                break
            pad = self.engine.pad_token_id if self.engine.pad_token_id is not None else meta["eos_token_id"][0]
            prompts = _left_padded([r.prompt + r.tokens for r in live], pad)
            prompts.meta_info.update(meta, pad_token_id=int(pad),
                                     response_length=min(self.chunk_tokens, limit - len(live[0].tokens)))
            if "seed" in meta:
                prompts.meta_info["seed"] = meta["seed"] + chunk
            with self.engine_lock:
                out = self.engine.generate_sequences(prompts)
                version = self.served_version
            routed = out.batch["routed_experts"] if self.routed_experts else None
            for i, (r, n, tokens, lps) in enumerate(zip(live, out.batch["response_mask"].sum(-1).tolist(),
                                                        out.batch["responses"], out.batch["rollout_log_probs"])):
                if routed is not None:  # [prefix | fed tokens] at the row's real tokens; the last one unfed
                    computed = len(r.prompt) + len(r.tokens) + n - 1
                    r.routing = routed[i][out.batch["attention_mask"][i].bool()][:computed]
                r.extend(tokens[:n].tolist(), lps[:n].tolist(), version)
            chunk += 1
        return rows

    # ------------------------------------------------------------------ weights
    def begin_weight_update(self, body: dict) -> dict:
        self.engine.begin_weight_update(0)  # SGLang's session carries no version; the loads do
        self._pending_version = None
        return _ok("weight update session opened")

    def update_weights_from_distributed(self, body: dict) -> dict:
        group = self._groups.get(body["group_name"])
        if group is None:
            raise BadRequest(f"group {body['group_name']!r} not in {sorted(self._groups)}; "
                             "call /init_weights_update_group first")
        if body.get("load_format") != BUCKET_FORMAT["load_format"]:
            raise BadRequest(f"/update_weights_from_distributed: load_format must be {BUCKET_FORMAT['load_format']!r}")
        names, dtypes, shapes = body["names"], body["dtypes"], body["shapes"]
        if not names or not len(names) == len(dtypes) == len(shapes):
            raise BadRequest("/update_weights_from_distributed: names, dtypes, shapes must be non-empty and equally long")
        types = [getattr(torch, d) for d in dtypes]
        sizes = [torch.Size(s).numel() * t.itemsize for s, t in zip(shapes, types)]
        flat = torch.empty(sum(sizes), dtype=torch.uint8)
        dist.broadcast(flat, src=0, group=group)
        named, offset = [], 0
        for name, shape, t, size in zip(names, shapes, types, sizes):
            named.append((name, flat[offset:offset + size].view(t).view(shape)))
            offset += size
        self.load_tensors(named, body.get("weight_version"))
        return _ok(f"loaded {len(named)} tensors")

    def load_tensors(self, named: Iterable[tuple[str, torch.Tensor]], weight_version: Any = None) -> None:
        """The load step of an update, inside a begin/end session; the version is served from the end."""
        self.engine.load_named_tensors(named)  # refuses unknown names and shape mismatches, naming the tensor
        if weight_version is not None:
            self._pending_version = str(weight_version)

    def end_weight_update(self, body: dict) -> dict:
        self.engine.end_weight_update()  # refuses an update that left parameters out
        if self._pending_version is not None:
            self.served_version = self._pending_version
        return _ok(f"serving weight version {self.served_version}")

    def init_weights_update_group(self, body: dict) -> dict:
        missing = [k for k in ROUTES["/init_weights_update_group"][1] if k not in body]
        if missing:
            raise BadRequest(f"/init_weights_update_group: missing fields {missing}")
        if body["group_name"] in self._groups:
            raise BadRequest(f"update group {body['group_name']!r} exists already")
        self._groups[body["group_name"]] = init_weight_update_group(
            body["master_address"], int(body["master_port"]), rank=int(body["rank_offset"]),
            world_size=int(body["world_size"]), group_name=body["group_name"], backend=body["backend"])
        return _ok("joined the update group")

    def destroy_weights_update_group(self, body: dict) -> dict:
        group = self._groups.pop(body.get("group_name"), None)
        if group is None:
            raise BadRequest(f"group {body.get('group_name')!r} not in {sorted(self._groups)}")
        dist.destroy_process_group(group)
        return _ok("destroyed the update group")

    def flush_cache(self, body: dict) -> dict:
        return _ok("no prefix cache")  # the HF engine keeps no KV cache between requests

    # ------------------------------------------------------------------ memory
    def release_memory_occupation(self, body: dict) -> dict:
        tags = _tags(body)
        self.engine.sleep()
        self._released.update(tags)
        return _ok(f"released {tags}")

    def resume_memory_occupation(self, body: dict) -> dict:
        tags = _tags(body)
        never = sorted(set(tags) - self._released)
        if never:  # SGLang's scheduler dies on this; refuse it loudly
            raise BadRequest(f"resume of memory {never} that was never released (released: {sorted(self._released)})")
        self._released.difference_update(tags)
        if not self._released:
            self.engine.wake_up()
        return _ok(f"resumed {tags}")


class _Row:
    """One request row: its prompt and what the chunks generated so far, with each token's weight version."""

    def __init__(self, prompt: list[int]) -> None:
        self.prompt, self.tokens, self.log_probs, self.versions = prompt, [], [], []
        self.aborted = False
        self.routing: torch.Tensor | None = None  # the last chunk's [prompt + tokens - 1, L, k]

    def extend(self, tokens: list[int], log_probs: list[float], version: str) -> None:
        self.tokens += tokens
        self.log_probs += log_probs
        self.versions += [version] * len(tokens)

    def done(self, limit: int, eos: list[int]) -> bool:
        return self.aborted or len(self.tokens) >= limit or bool(self.tokens and self.tokens[-1] in eos)

    def result(self, eos: list[int], served_version: str, routing: bool = False) -> dict:
        if self.aborted:
            finish = {"type": "abort", "message": "generation paused (mode abort)"}
        elif self.tokens and self.tokens[-1] in eos:
            finish = {"type": "stop", "matched": self.tokens[-1]}
        else:
            finish = {"type": "length", "length": len(self.tokens)}
        # SGLang reports one weight_version per result: the weights of its last token
        version = self.versions[-1] if self.versions else served_version
        meta = {"output_token_logprobs": [[lp, tok, None] for lp, tok in zip(self.log_probs, self.tokens)],
                "finish_reason": finish, "weight_version": version}
        if routing and self.routing is not None:  # none for a row a pause aborted before its first chunk
            meta["routed_experts"] = encode_routing(self.routing)
        return {"meta_info": meta}


def encode_routing(routing: torch.Tensor) -> str:
    """SGLang's ``meta_info['routed_experts']``: base64 of the C-order little-endian int32 array [tokens, L, k]
    (``rollout.routed_experts.decode_sglang_routing`` reads it)."""
    array = routing.to(torch.int32).numpy().astype("<i4", copy=False)
    return base64.b64encode(array.tobytes(order="C")).decode("ascii")


def _ok(message: str) -> dict:
    return {"success": True, "message": message}


def _tags(body: dict) -> list[str]:
    tags = list(body.get("tags") or MEMORY_TAGS)
    unknown = sorted(set(tags) - set(MEMORY_TAGS))
    if unknown:
        raise BadRequest(f"unknown memory tags {unknown}; known: {list(MEMORY_TAGS)}")
    return tags


def _common_sampling(params: list[dict]) -> dict[str, Any]:
    """One batch, one sampling setting: every row must agree on all fields but ``sampling_seed``."""
    for row, p in enumerate(params):
        unknown = sorted(set(p) - SAMPLING_FIELDS)
        if unknown:
            raise BadRequest(f"/generate: sampling_params[{row}] has unknown fields {unknown}")
    first = {k: v for k, v in params[0].items() if k != "sampling_seed"}
    for row, p in enumerate(params[1:], start=1):
        if {k: v for k, v in p.items() if k != "sampling_seed"} != first:
            raise BadRequest(f"/generate: sampling_params[{row}] differs from row 0 in more than sampling_seed")
    if "max_new_tokens" not in first:
        raise BadRequest("/generate: sampling_params need max_new_tokens")
    temperature = float(first.get("temperature", 1.0))
    meta: dict[str, Any] = {
        "do_sample": temperature > 0, "temperature": temperature if temperature > 0 else 1.0,
        "top_p": float(first.get("top_p", 1.0)), "top_k": int(first.get("top_k", -1)),
        "response_length": int(first["max_new_tokens"]), "eos_token_id": list(first.get("stop_token_ids") or []),
    }
    if not meta["eos_token_id"]:
        raise BadRequest("/generate: sampling_params need stop_token_ids (the tokens that end a response)")
    if params[0].get("sampling_seed") is not None:
        meta["seed"] = int(params[0]["sampling_seed"])
    return meta


def _left_padded(rows: list[list[int]], pad: int) -> DataProto:
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), int(pad), dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r):] = torch.as_tensor(r, dtype=torch.long)
        mask[i, width - len(r):] = 1
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    return DataProto.from_dict({"input_ids": ids, "attention_mask": mask, "position_ids": pos})


def _handler(app: HFServerApp, api_key: str | None = None) -> type[BaseHTTPRequestHandler]:
    """Every route requires ``Authorization: Bearer <api_key>`` (default: the run's, ``ensure_server_api_key``);
    anything else gets 401 and no detail, before the route or the body is looked at."""
    expected = f"Bearer {api_key or ensure_server_api_key()}".encode()

    class Handler(BaseHTTPRequestHandler):
        def _authorized(self) -> bool:
            given = (self.headers.get("Authorization") or "").encode("latin-1", "replace")
            if hmac.compare_digest(given, expected):
                return True
            self.close_connection = True  # the body, if any, is not read
            self._send(HTTPStatus.UNAUTHORIZED, {"detail": "Unauthorized"})
            return False

        def do_GET(self) -> None:
            if self._authorized():
                self._serve("GET", None)

        def do_POST(self) -> None:
            if not self._authorized():
                return
            length = int(self.headers.get("Content-Length") or 0)
            try:
                body = json.loads(self.rfile.read(length)) if length else None
            except ValueError:
                self._send(HTTPStatus.BAD_REQUEST, {"success": False, "message": "the body is not JSON"})
                return
            self._serve("POST", body)

        def _serve(self, method: str, body: Any) -> None:
            try:
                status, answer = HTTPStatus.OK, app.handle(method, self.path, body)
            except LookupError:
                status, answer = HTTPStatus.NOT_FOUND, {"detail": "Not Found"}
            except Exception as exc:  # noqa: BLE001 - every refusal goes back as SGLang's 400
                status, answer = HTTPStatus.BAD_REQUEST, {"success": False, "message": f"{type(exc).__name__}: {exc}"}
            self._send(status, answer)

        def _send(self, status: HTTPStatus, answer: Any) -> None:
            send_json(self, status, answer)

        def log_message(self, *args: Any) -> None:
            pass

    return Handler


def build_engine(model_path: str, dtype: str, seed: int, threads: int, routed_experts: bool = False) -> HFEngine:
    """The server's HFEngine: the actor's architecture, random weights until the first sync. ``routed_experts``:
    capture its routers (routing replay R3; refused for a dense model)."""
    torch.set_num_threads(threads)
    config = RolloutConfig(name="hf", dtype=dtype, seed=seed, response_length=1,
                           enable_rollout_routing_replay=bool(routed_experts))
    return HFEngine(config, model_path, device="cpu")


def listen(model_path: str, *, host: str = "127.0.0.1", port: int = 0, dtype: str = "float32", seed: int = 0,
           threads: int = 1, chunk_tokens: int = 8, api_key: str | None = None,
           routed_experts: bool = False) -> ThreadingHTTPServer:
    """The server bound to ``host:port`` (0: a free port this process picks), not yet serving: the caller runs
    ``serve_forever`` (this process's main loop, or a test's thread). Every
    route requires ``api_key`` (default: ``$MEGATRON_RL_SERVER_API_KEY``, generated when unset).
    ``routed_experts``: answer ``return_routed_experts`` (``--enable-return-routed-experts``)."""
    app = HFServerApp(build_engine(model_path, dtype, seed, threads, routed_experts), chunk_tokens, model_path)
    server = ThreadingHTTPServer((host, port), _handler(app, api_key))
    server.daemon_threads = True
    return server


def _exit_with_parent(poll_s: float = 0.5) -> None:
    """End this server when the process that started it is gone: a server of a SIGKILLed Ray actor must not go on
    answering at a URL its pool has replaced (the pool sees the actor dead, the client would not)."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model-path", required=True, help="the actor's HF directory (config.json)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0: any free port (printed once it listens)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the engine")
    parser.add_argument("--chunk-tokens", type=int, default=8,
                        help="tokens decoded per engine call: a pause takes effect at the next chunk boundary")
    parser.add_argument("--enable-return-routed-experts", action="store_true",
                        help="capture the MoE routers' choices and answer /generate's return_routed_experts "
                             "(SGLang's flag; routing replay R3)")
    args = parser.parse_args(argv)
    api_key = os.environ.get(API_KEY_ENV)
    if not api_key:  # never on the command line: other users of the host can read that (ps)
        parser.error(f"set {API_KEY_ENV} (the secret every request must carry as 'Authorization: Bearer ...'); "
                     "the run's pool sets it")
    server = listen(args.model_path, host=args.host, port=args.port, dtype=args.dtype, seed=args.seed,
                    threads=args.threads, chunk_tokens=args.chunk_tokens, api_key=api_key,
                    routed_experts=args.enable_return_routed_experts)
    print(f"listening on http://{args.host}:{server.server_address[1]}", flush=True)
    _exit_with_parent()
    try:
        server.serve_forever()
    finally:
        server.server_close()


if __name__ == "__main__":
    main()
