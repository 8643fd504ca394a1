"""vLLM OpenAI-compatible servers as the rollout engine (``rollout.name=vllm``, ``rollout.mode=server``): the
client side, driven by ONE trainer rank (global rank 0, the only replica's leader in server mode), as with
SGLang servers.

Servers: ``python -m vllm.entrypoints.openai.api_server`` with ``VLLM_SERVER_DEV_MODE=1`` (the ``/pause``,
``/resume``, ``/collective_rpc`` and ``/reset_prefix_cache`` routes exist only then), ``--skip-tokenizer-init``,
``--logprobs-mode processed_logprobs`` and ``--worker-extension-cls`` ``SERVER_EXTENSION`` (below), started by
the run (servers/vllm_server.py) or by the user (``rollout.server_urls``, same flags; see ``server_command``
there).

Generation: one ``/v1/completions`` request per row (token-id prompt, no seed: vLLM would sample seeded rows
one at a time; the servers' generators, seeded at start, draw every row; neutral values for every sampling field
vLLM would take from the checkpoint, ``contract.NEUTRAL_SAMPLING``), the rows split across the servers in order,
at most ``rollout.max_num_seqs`` in flight at each server (what its engine batches; more would only wait in its
queue), in threads made for the call (``map_bounded``). Tokens from ``return_token_ids``, log-probs from
``logprobs.token_logprobs`` (processed: the distribution the token was drawn from, our convention).

Images (a vision-language model, ``vision.py``): a row with images goes to ``/inference/v1/generate`` instead
(vLLM's token-in route, which takes images: ``token_ids`` with one image placeholder per image, ``content_parts``
of ``image_url`` data URLs, base64 PNG, ``sampling_params`` as vLLM's SamplingParams), asking ``return_token_ids`` so
that the prompt the server served is checked against the trainer's token for token. The servers must run
with ``--enable-scale-out`` (that route), without ``--skip-tokenizer-init`` (engine_args drops it for a
vision-language model: vLLM's multimodal processor needs the tokenizer) and, without torchvision,
``vision.torchvision_free_env``; after a weight update the servers' encoder and multimodal caches are reset too.

Weights: a session stages every bucket in a /dev/shm segment (``shm.py``, as the colocated engine does); at
its end, on every server: ``/pause?mode=wait`` (nothing in flight is cut; the driver's client pauses with
``abort`` before a partial-rollout sync), ``/collective_rpc mrl_load_weights`` (the extension's in-place
reload, all of one update in one call), ``/collective_rpc mrl_set_weight_version``, ``/reset_prefix_cache``
(cached KV was computed with the old weights), ``/resume``; then the segments are unlinked. Shared memory
reaches only servers on the sender's host: a server URL on another host is refused (servers elsewhere would
need vLLM's NCCL weight transfer, ``/init_weight_transfer_engine``, on GPUs: not implemented).

The served version lives in the servers' workers (``mrl_weight_version``; -1: never synced, random
``load_format=dummy`` weights): a sample is refused unless every server it came from holds the engine's
version, and a replaced server serves nothing before a sync gave it the weights.

Security: vLLM checks ``VLLM_API_KEY`` (the run's secret) on ``/v1`` routes only; ``server_command``'s
``--middleware`` (servers/route_auth.py) puts every route, the dev routes included, behind it, and this client
sends it on every request. The workers map only the run's own segments (segment_guard.py).
"""

from __future__ import annotations

import ipaddress
import socket
import sys
import time
import urllib.parse
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import torch

from megatron_rl.config.schema import RolloutConfig
from megatron_rl.protocol import DataProto
from megatron_rl.rollout.base import WeightUpdateError
from megatron_rl.rollout.batch_io import build_rollout_batch, cut_at_finish, prompt_token_lists
from megatron_rl.rollout.hf_engine import resolve_dtype
from megatron_rl.rollout.sampling import SamplingParams
from megatron_rl.rollout.sglang.contract import SGLangServerError
from megatron_rl.rollout.server_http import ServerHTTPBase
from megatron_rl.rollout.vllm.contract import NEUTRAL_SAMPLING
from megatron_rl.rollout.vllm.session import StagedWeightsEngine
from megatron_rl.rollout.vllm.vision import (
    check_served_prompt, engine_prompts, image_data_url, image_token_id, row_images,
)
from megatron_rl.rollout.vllm.worker_extension import WorkerExtension

__all__ = ["SERVER_EXTENSION", "ServerWorkerExtension", "VLLMServerEngine", "VLLMServerError", "VLLMServerHTTP",
           "build_vllm_server_engine", "completion_request", "map_bounded", "parse_choice", "require_local_servers"]

SERVER_EXTENSION = "megatron_rl.rollout.vllm.server.ServerWorkerExtension"
NEVER_SYNCED = -1


class ServerWorkerExtension(WorkerExtension):
    """The weight loader plus the served weight version, kept in every worker of a vLLM server."""

    def mrl_set_weight_version(self, version: int) -> int:
        self._mrl_weight_version = int(version)
        return self._mrl_weight_version

    def mrl_weight_version(self) -> int:
        return int(getattr(self, "_mrl_weight_version", NEVER_SYNCED))


class VLLMServerError(SGLangServerError):
    """A vLLM server refused a request or could not be reached (an SGLangServerError, so the server-restart
    machinery, servers/restarts.py, treats it as any rollout server's failure); names the URL and route."""


class VLLMServerHTTP(ServerHTTPBase):
    """One vLLM server (every route requires the run's secret: servers/route_auth.py)."""

    engine, error = "vLLM", VLLMServerError

    def rpc(self, method: str, *args: Any) -> list[str]:
        """``/collective_rpc``: one result per worker (vLLM returns them ``str()``-ed)."""
        out = self.request("/collective_rpc", {"method": method, "args": list(args)})
        if not isinstance(out, dict) or "results" not in out:
            raise VLLMServerError(f"vLLM {self.url}/collective_rpc {method} answered {out!r}")
        return list(out["results"])

    def weight_version(self) -> int:
        """The version every worker of the server holds (-1: never synced)."""
        try:
            results = self.rpc("mrl_weight_version")
        except VLLMServerError as exc:
            if "mrl_weight_version" in str(exc) or "answered 404" in str(exc):  # no extension / no dev routes
                raise VLLMServerError(
                    f"vLLM server {self.url} has no megatron-rl worker extension ({exc}): start it with "
                    f"VLLM_SERVER_DEV_MODE=1 and --worker-extension-cls {SERVER_EXTENSION} "
                    "(servers/vllm_server.py server_command)") from exc
            raise
        versions = {int(r) for r in results}
        if len(versions) != 1:
            raise VLLMServerError(f"vLLM server {self.url}'s workers hold different weight versions {sorted(versions)}")
        return versions.pop()

    def workers(self) -> int:
        return len(self.rpc("mrl_weight_version"))

    def model_name(self) -> str:
        models = self.request("/v1/models", method="GET")
        return str(models["data"][0]["id"])


# ---------------------------------------------------------------------------------------------- locality
def _local_addresses() -> set[str]:
    addresses = set()
    try:
        addresses.update(socket.gethostbyname_ex(socket.gethostname())[2])
    except OSError:
        pass
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        addresses.add(ray.util.get_node_ip_address())
    return addresses


def require_local_servers(server_urls: Sequence[str]) -> None:
    """Weights reach vLLM servers through /dev/shm segments of the sender's host: refuse servers elsewhere."""
    local = None
    remote = []
    for url in server_urls:
        host = urllib.parse.urlparse(url).hostname or ""
        try:
            address = socket.gethostbyname(host)
        except OSError:
            remote.append(url)
            continue
        if ipaddress.ip_address(address).is_loopback:
            continue
        local = _local_addresses() if local is None else local
        if address not in local:
            remote.append(url)
    if remote:
        raise ValueError(
            f"actor_rollout_ref.rollout.server_urls {remote}: vLLM rollout servers must run on the host of trainer "
            "rank 0 (the weight sender): weights reach them through /dev/shm segments of this host. Servers on "
            "other nodes would need vLLM's NCCL weight transfer on GPUs, which megatron-rl does not implement; "
            "run them here, or use rollout.name=sglang (update group over the network) for remote servers")


# ---------------------------------------------------------------------------------------------- requests
def completion_request(model: str, prompt: list[int], *, max_tokens: int, temperature: float, top_p: float,
                       top_k: int, stop_token_ids: Sequence[int]) -> dict[str, Any]:
    """One row's ``/v1/completions`` body: token ids in and out, the sampled token's processed log-prob. No seed
    (the server's generator draws the row; a seeded row is sampled on its own) and NEUTRAL_SAMPLING for the fields
    a server would fill from the checkpoint's generation_config.json (vLLM's completion protocol: request value,
    else the server's default, vllm/entrypoints/openai/completion/protocol.py to_sampling_params)."""
    return {
        "model": model, "prompt": [list(prompt)], "max_tokens": int(max_tokens),
        "temperature": float(temperature), "top_p": float(top_p), "top_k": int(top_k) if top_k > 0 else 0,
        "stop_token_ids": [int(t) for t in stop_token_ids],
        "ignore_eos": True,  # our finish ids, not the checkpoint's generation config, end a response
        "logprobs": 0, "return_token_ids": True, "return_tokens_as_token_ids": True,
        "skip_special_tokens": False, **NEUTRAL_SAMPLING,
    }


IMAGE_ROUTE = "/inference/v1/generate"


def image_request(model: str, prompt: dict[str, Any], params: SamplingParams) -> dict[str, Any]:
    """One image row's ``/inference/v1/generate`` body (vllm/entrypoints/scale_out/token_in_token_out/protocol.py
    GenerateRequest): ``prompt`` is vision.engine_prompts' (placeholders collapsed, ``multi_modal_data``); sampling as
    ``completion_request``'s, in vLLM's SamplingParams fields."""
    sampling = {
        "n": 1, "max_tokens": params.max_response_length,
        "temperature": 0.0 if params.greedy else float(params.temperature), "top_p": float(params.top_p),
        "top_k": int(params.top_k) if params.top_k > 0 else 0,
        "stop_token_ids": [int(t) for t in params.finish_token_ids], "ignore_eos": True, "logprobs": 0,
        "detokenize": False, "skip_special_tokens": False, **NEUTRAL_SAMPLING,
    }
    return {"model": model, "token_ids": list(prompt["prompt_token_ids"]),
            "content_parts": [{"type": "image_url", "url": image_data_url(image)}
                              for image in prompt["multi_modal_data"]["image"]],
            "sampling_params": sampling, "return_token_ids": True, "output_mode": "tokens"}


def parse_generate(result: dict[str, Any], url: str) -> tuple[list[int], list[float], list[int] | None]:
    """(token ids, their log-probs, the prompt served) of one ``/inference/v1/generate`` answer."""
    choice = result["choices"][0]
    tokens = [int(t) for t in (choice.get("token_ids") or [])]
    content = (choice.get("logprobs") or {}).get("content") or []
    if len(content) < len(tokens):
        raise RuntimeError(f"vLLM server {url}{IMAGE_ROUTE} returned {len(tokens)} tokens but {len(content)} "
                           "log-probs (the request asks logprobs=0)")
    return tokens, [float(c["logprob"]) for c in content[: len(tokens)]], result.get("prompt_token_ids")


def params_request(model: str, prompt: list[int], params: SamplingParams) -> dict:
    return completion_request(model, prompt, max_tokens=params.max_response_length,
                              temperature=0.0 if params.greedy else params.temperature, top_p=params.top_p,
                              top_k=params.top_k, stop_token_ids=params.finish_token_ids)


T = TypeVar("T")
R = TypeVar("R")


def map_bounded(call: Callable[[T], R], items: Sequence[T], limit: int) -> list[R]:
    """``call(item)`` for every item, at most ``limit`` at once (a server's ``rollout.max_num_seqs``), in threads
    made for this call and ended with it, so none idles between calls. The first failure is raised once the
    running calls are done; the calls not yet started are cancelled."""
    if not items:
        return []
    pool = ThreadPoolExecutor(max_workers=max(1, min(len(items), int(limit))), thread_name_prefix="vllm-rows")
    try:
        futures = [pool.submit(call, item) for item in items]
        return [future.result() for future in futures]
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def parse_choice(choice: dict[str, Any], url: str) -> tuple[list[int], list[float], str | None]:
    """(token ids, their log-probs, finish reason) of one completion choice."""
    tokens = [int(t) for t in (choice.get("token_ids") or [])]
    logprobs = (choice.get("logprobs") or {}).get("token_logprobs") or []
    if len(logprobs) < len(tokens):
        raise RuntimeError(f"vLLM server {url} returned {len(tokens)} tokens but {len(logprobs)} log-probs "
                           "(the request asks logprobs=0)")
    return tokens, [float(lp) for lp in logprobs[: len(tokens)]], choice.get("finish_reason")


# ---------------------------------------------------------------------------------------------- the engine
class VLLMServerEngine(StagedWeightsEngine):
    """The rollout engine of trainer rank 0 over vLLM servers: generation (sync loop, verification probes),
    weight-update sessions and server replacement (servers/restarts.py)."""

    def __init__(self, config: RolloutConfig, server_urls: Sequence[str], *, response_length: int | None = None,
                 eos_token_id: int | Sequence[int] | None = None, pad_token_id: int | None = None,
                 timeout_s: float | None = 600.0, compute_device: str = "cpu",
                 image_token_id: int | None = None) -> None:
        length = config.response_length if config.response_length is not None else response_length
        if length is None or int(length) < 1:
            raise ValueError(f"rollout.response_length must be >= 1 (or pass response_length), got {length!r}")
        if not server_urls:
            raise ValueError("rollout.mode=server needs rollout.server_urls (the vLLM servers' http://host:port) "
                             "or rollout.num_servers >= 1")
        self.config = config
        self.response_length = int(length)
        self.eos_token_id, self.pad_token_id = eos_token_id, pad_token_id
        self.dtype = resolve_dtype(str(config.dtype), torch.device(compute_device))
        self.timeout_s = timeout_s
        self.image_token = image_token_id  # a vision-language model's <|image_pad|> (None: a text model)
        self.tp_size = 1  # as the trainer sees it: rank 0 sends full tensors; each server shards them itself
        self.is_server = True
        self.weight_version = 0
        self._start_sessions("the servers have not received the trainer's weights yet")
        self.last_update_ms: float | None = None
        self._connect(server_urls)

    def _connect(self, server_urls: Sequence[str]) -> None:
        require_local_servers(server_urls)
        self.servers = [VLLMServerHTTP(url, self.timeout_s) for url in server_urls]
        # one thread per server: each runs that server's calls (its rows in threads of their own, map_bounded)
        self._pool = getattr(self, "_pool", None) or ThreadPoolExecutor(max_workers=len(self.servers),
                                                                        thread_name_prefix="vllm-http")
        self.server_workers = list(self._pool.map(lambda s: s.workers(), self.servers))
        for server in self.servers:
            server.weight_version()  # names a server started without our worker extension
        self.models = list(self._pool.map(lambda s: s.model_name(), self.servers))

    # ------------------------------------------------------------------ generation
    def generate_sequences(self, prompts: DataProto) -> DataProto:
        params = self._call_params(prompts)
        start = time.perf_counter()
        self._check_versions()
        token_lists = prompt_token_lists(prompts)
        images = row_images(prompts, "VLLMServerEngine")
        requests = engine_prompts(token_lists, images, self.image_token, "VLLMServerEngine")
        n = len(self.servers)
        owner = [row * n // len(token_lists) for row in range(len(token_lists))]  # rows in order, one part per server

        def body(i: int, request: dict[str, Any]) -> tuple[str, dict[str, Any]]:
            if "multi_modal_data" in request:
                return IMAGE_ROUTE, image_request(self.models[i], request, params)
            return "/v1/completions", params_request(self.models[i], request["prompt_token_ids"], params)

        parts = [[body(i, r) for r, o in zip(requests, owner) if o == i] for i in range(n)]
        limit = int(self.config.max_num_seqs)
        results = [r for part in self._pool.map(
            lambda i: map_bounded(lambda rb: self.servers[i].request(*rb), parts[i], limit),
            range(n)) for r in part]
        responses, log_probs = [], []
        for row, result in enumerate(results):
            if "multi_modal_data" in requests[row]:
                tokens, lps, served = parse_generate(result, self.servers[owner[row]].url)
                check_served_prompt(token_lists[row], served, row, f"VLLMServerEngine ({self.servers[owner[row]].url})")
            else:
                tokens, lps, _ = parse_choice(result["choices"][0], self.servers[owner[row]].url)
            tokens, lps = cut_at_finish(tokens, lps, params.finish_token_ids, params.max_response_length,
                                        f"vLLM result {row} of {self.servers[owner[row]].url}")
            responses.append(tokens)
            log_probs.append(lps)
        self._check_versions()  # no server was updated behind this engine's back meanwhile
        return build_rollout_batch(prompts, responses, log_probs, response_length=params.max_response_length,
                                   pad_token_id=params.pad_token_id, weight_version=self.weight_version,
                                   seconds=time.perf_counter() - start)

    def _check_versions(self) -> None:
        served = list(self._pool.map(lambda s: s.weight_version(), self.servers))
        wrong = [(s.url, v) for s, v in zip(self.servers, served) if v != self.weight_version]
        if wrong:
            raise RuntimeError(f"vLLM servers {wrong} serve other weight versions than the last sync's "
                               f"({self.weight_version}): a server missed a weight sync")

    # ------------------------------------------------------------------ weights
    def load_payloads(self, payloads: list[dict[str, Any]]) -> None:
        raise WeightUpdateError("vLLM servers take every bucket from trainer rank 0 (load_weight_bucket); "
                                "per-rank payloads are for colocated engines")

    def end_weight_update(self) -> None:
        if not self._in_session:
            raise WeightUpdateError("no weight-update session is open; call begin_weight_update() first")
        version, layouts = self._session_version, self._layouts_by_rank()[0]
        start = time.perf_counter()
        vision = self.image_token is not None
        futures = [self._pool.submit(self._update_server, server, workers, layouts, version, vision)
                   for server, workers in zip(self.servers, self.server_workers)]
        failures = []
        for server, future in zip(self.servers, futures):
            try:
                future.result()
            except Exception as exc:
                failures.append(f"{server.url}: {exc}")
        self._release_segments()
        self._in_session = False
        if failures:
            self._needs_sync = f"the update to version {version} failed on {len(failures)} server(s)"
            raise WeightUpdateError(f"vLLM servers failed to load the weights of version {version}: " + "; ".join(failures))
        self.last_update_ms = (time.perf_counter() - start) * 1e3
        self.weight_version = version
        self._needs_sync = None

    @staticmethod
    def _update_server(server: VLLMServerHTTP, workers: int, layouts: list[dict[str, Any]], version: int,
                       vision: bool = False) -> None:
        """Paused (in-flight requests finish first), loaded, versioned, prefix cache dropped, resumed. A failed
        load leaves the server at version -1 (resumed, so that nothing waits on it): every client refuses its
        samples until a complete update."""
        server.request("/pause?mode=wait")
        try:
            server.rpc("mrl_set_weight_version", NEVER_SYNCED)
            server.rpc("mrl_load_weights", [layouts] * workers)  # every worker maps the full tensors, shards itself
            server.rpc("mrl_set_weight_version", version)
            server.request("/reset_prefix_cache")  # cached prefixes hold KV computed with the old weights
            if vision:  # the reload dropped the workers' encoder outputs, not the scheduler's / renderer's records
                server.request("/reset_encoder_cache")
                server.request("/reset_mm_cache")
        except BaseException:
            try:
                server.request("/resume")
            except VLLMServerError:
                pass  # dead: the restart machinery names it
            raise
        server.request("/resume")

    def replace_servers(self, server_urls: list[str]) -> list[str]:
        """Dead servers were replaced at new URLs (servers/restarts.py); nothing is generated before a complete
        sync. No server is ever stuck (no collective spans the servers): returns []."""
        if len(server_urls) != len(self.servers):
            raise ValueError(f"{len(server_urls)} server URLs to replace {len(self.servers)} servers")
        self._connect(server_urls)
        self._needs_sync = f"rollout servers were replaced ({list(server_urls)}) and have not received the weights yet"
        return []

    # ------------------------------------------------------------------ memory
    def sleep(self) -> None:
        """The servers keep their memory: their devices are not the trainer's."""

    def wake_up(self) -> None:
        """Nothing was released."""

    def shutdown(self) -> None:
        self._release_segments()
        self._pool.shutdown(wait=False)


def build_vllm_server_engine(config: RolloutConfig, model_path: str, *, response_length: int | None = None,
                             eos_token_id: int | Sequence[int] | None = None,
                             pad_token_id: int | None = None) -> VLLMServerEngine:
    """Trainer rank 0's engine over ``rollout.server_urls`` (started by the run, or by the user with
    servers/vllm_server.py's flags). ``model_path`` is where the servers were started from."""
    if config.mode != "server":
        raise ValueError(f"build_vllm_server_engine is for rollout.mode=server, got {config.mode!r}")
    return VLLMServerEngine(config, list(config.server_urls), response_length=response_length,
                            eos_token_id=eos_token_id, pad_token_id=pad_token_id,
                            timeout_s=config.sglang.request_timeout_s,
                            compute_device="cuda" if torch.cuda.is_available() else "cpu",
                            image_token_id=image_token_id(model_path))
