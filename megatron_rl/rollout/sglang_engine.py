"""SGLangEngine: SGLang as the rollout engine — in-process next to the trainer, or HTTP servers elsewhere.

Pinned to sglang==0.5.23 (``pip install megatron-rl[sglang]``; needs CUDA). ``SGLANG_CONTRACT`` below is
the one list of every SGLang method, keyword, HTTP route, request field and result key this adapter
uses; every call goes through a helper that refuses anything not in it, and
tests/rollout/test_sglang_contract.py checks the list against the pinned wheel's source. Version branch:
since 0.5.23 SGLang refuses weight updates outside ``begin_weight_update`` ... ``end_weight_update``;
older versions have no session, so the adapter opens one only when the engine is >= 0.5.23.

Modes (``rollout.mode``):
- ``colocated``: ``sglang.Engine`` in this process, sharing the trainer's GPUs. A weight bucket is sent as
  SGLang's ``flattened_bucket`` payload (one uint8 tensor + FlattenedTensorMetadata, serialized per engine
  TP rank with SGLang's MultiprocessingSerializer, i.e. CUDA IPC handles, no copy); ``sleep``/``wake_up``
  release/resume all of SGLang's GPU memory (weights, KV cache, CUDA graphs). SGLang discards released
  weights, so after ``wake_up`` the engine refuses to generate until the next complete weight sync.
- ``server``: SGLang servers on other GPUs (``rollout.server_urls``), batch split across them. Weights
  travel either over a NCCL group joined through ``/init_weights_update_group`` and broadcast per bucket
  with ``/update_weights_from_distributed`` (``weight_transport="distributed"``, any node), or as base64
  ``flattened_bucket`` payloads to ``/update_weights_from_tensor`` (``"tensor"``, same node only: the
  payload holds shared-memory / CUDA IPC handles, not the bytes).

sglang is imported only inside this engine. Log-probs are SGLang's ``output_token_logprobs``: the
temperature-scaled full-vocabulary log-prob of each sampled token (log_softmax(logits) when greedy),
the same convention as the HF engine. ``meta_info['seed']`` becomes a per-row ``sampling_seed``, which
SGLang honours only when started with ``enable_deterministic_inference``.
"""

from __future__ import annotations

import itertools
import json
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
import torch.distributed as dist
from packaging.version import Version

from megatron_rl.protocol import DataProto
from megatron_rl.rollout.base import RolloutEngine, WeightUpdateError
from megatron_rl.rollout.batch_io import build_rollout_batch, check_prompt_batch, prompt_token_lists
from megatron_rl.rollout.bucket import WeightBucket
from megatron_rl.rollout.hf_engine import resolve_dtype
from megatron_rl.rollout.sampling import SamplingParams, resolve_sampling_params
from megatron_rl.rollout.update_group import init_weight_update_group

__all__ = ["SGLANG_CONTRACT", "SGLANG_PIN", "SGLangEngine", "SGLangServerError", "SGLangUnavailableError"]

SGLANG_PIN = "0.5.23"
WEIGHT_UPDATE_SESSION_SINCE = Version("0.5.23")  # sglang PR #28001
UPDATE_GROUP_NAME = "megatron_rl_weight_update"

# Everything this adapter uses from SGLang. Paths are inside the sglang wheel.
SGLANG_CONTRACT: dict[str, Any] = {
    # srt/entrypoints/engine.py, class Engine: method -> keyword arguments we pass
    "engine_methods": {
        "generate": ("input_ids", "sampling_params", "return_logprob"),
        "update_weights_from_tensor": ("named_tensors", "load_format", "flush_cache"),
        "begin_weight_update": (),
        "end_weight_update": (),
        "flush_cache": (),
        "release_memory_occupation": ("tags",),
        "resume_memory_occupation": ("tags",),
        "shutdown": (),
    },
    # srt/arg_groups/fields/*.py: ServerArgs fields we pass to sglang.Engine(**kwargs)
    "server_args": (
        "model_path",
        "tp_size",
        "mem_fraction_static",
        "enable_memory_saver",
        "base_gpu_id",
        "skip_tokenizer_init",
        "load_format",
        "random_seed",
        "dtype",
        "log_level",
    ),
    # srt/arg_groups/choices.py LOAD_FORMAT_CHOICES: the engine starts with random weights; ours arrive by sync
    "load_formats": ("dummy",),
    # srt/entrypoints/http_server.py: route -> (request struct in srt/managers/io_struct.py, fields we send)
    "http_routes": {
        "/generate": ("GenerateReqInput", ("input_ids", "sampling_params", "return_logprob")),
        "/server_info": (None, ()),
        "/flush_cache": (None, ()),
        "/begin_weight_update": ("BeginWeightUpdateReqInput", ()),
        "/end_weight_update": ("EndWeightUpdateReqInput", ()),
        "/update_weights_from_tensor": (
            "UpdateWeightsFromTensorReqInput",
            ("serialized_named_tensors", "load_format", "flush_cache", "weight_version"),
        ),
        "/init_weights_update_group": (
            "InitWeightsUpdateGroupReqInput",
            ("master_address", "master_port", "rank_offset", "world_size", "group_name", "backend"),
        ),
        "/update_weights_from_distributed": (
            "UpdateWeightsFromDistributedReqInput",
            ("names", "dtypes", "shapes", "group_name", "flush_cache", "load_format", "weight_version"),
        ),
        "/destroy_weights_update_group": ("DestroyWeightsUpdateGroupReqInput", ("group_name",)),
        "/release_memory_occupation": ("ReleaseMemoryOccupationReqInput", ("tags",)),
        "/resume_memory_occupation": ("ResumeMemoryOccupationReqInput", ("tags",)),
    },
    # srt/sampling/sampling_params.py, class SamplingParams: fields we send
    "sampling_params": (
        "max_new_tokens",
        "temperature",
        "top_p",
        "top_k",
        "stop_token_ids",
        "ignore_eos",
        "sampling_seed",
    ),
    # keys we read from results: /generate (srt/managers/tokenizer_manager.py), /server_info (http_server.py)
    "result_keys": {
        "srt/managers/tokenizer_manager.py": (
            "meta_info",
            "output_token_logprobs",
            "finish_reason",
            "weight_version",
        ),
        "srt/entrypoints/http_server.py": ("version", "success", "message"),
    },
    # importable names: module -> attributes
    "symbols": {
        "sglang": ("Engine", "__version__"),
        "sglang.srt.utils.common": ("MultiprocessingSerializer",),  # re-exported by sglang.srt.utils
        "sglang.srt.weight_sync.tensor_bucket": ("FlattenedTensorMetadata",),
        "sglang.srt.utils.patch_torch": ("monkey_patch_torch_reductions",),
    },
    # srt/weight_sync/tensor_bucket.py FlattenedTensorMetadata fields, and the payload dict keys read by
    # srt/model_executor/model_runner_components/weight_updater.py
    "flattened_bucket": {
        "load_format": "flattened_bucket",
        "metadata_fields": ("name", "shape", "dtype", "start_idx", "end_idx", "numel"),
        "payload_keys": ("flattened_tensor", "metadata"),
    },
    "serializer_methods": {"serialize": ("obj", "output_str")},  # MultiprocessingSerializer
    "memory_tags": ("weights", "kv_cache", "cuda_graph"),  # srt/constants.py GPU_MEMORY_ALL_TYPES
}
_BUCKET = SGLANG_CONTRACT["flattened_bucket"]


class SGLangUnavailableError(ImportError):
    """sglang is not installed (it needs CUDA)."""


class SGLangServerError(RuntimeError):
    """An SGLang server refused a request or could not be reached; names the URL, route and SGLang's message."""


def _import(module: str, name: str) -> Any:
    """Import one SGLang symbol named in the contract, with an actionable error when sglang is missing."""
    if name not in SGLANG_CONTRACT["symbols"].get(module, ()):
        raise AssertionError(f"{module}.{name} is not in SGLANG_CONTRACT['symbols']")
    try:
        mod = __import__(module, fromlist=[name])
    except ImportError as exc:
        raise SGLangUnavailableError(
            f"rollout.name=sglang needs sglang=={SGLANG_PIN} ({exc}). Install it on a CUDA machine with "
            f"`pip install megatron-rl[sglang]` (SGLang has no CPU build), or use rollout.name=hf."
        ) from exc
    return getattr(mod, name)


def _checked(kind: str, key: str | None, kwargs: dict[str, Any]) -> dict[str, Any]:
    """Refuse to send SGLang a keyword the contract does not list (so the contract test covers it)."""
    allowed = {
        "engine": lambda: SGLANG_CONTRACT["engine_methods"][key],
        "route": lambda: SGLANG_CONTRACT["http_routes"][key][1],
        "server_args": lambda: SGLANG_CONTRACT["server_args"],
        "sampling": lambda: SGLANG_CONTRACT["sampling_params"],
    }[kind]()
    unknown = sorted(set(kwargs) - set(allowed))
    if unknown:
        raise AssertionError(f"SGLang {kind} {key or ''}: {unknown} not declared in SGLANG_CONTRACT")
    return kwargs


def _check_result(result: Any, what: str) -> Any:
    """SGLang answers control calls with (success, message) or {"success", "message"}."""
    success, message = None, ""
    if isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], bool):
        success, message = result
    elif isinstance(result, dict) and "success" in result:
        success, message = result["success"], result.get("message", "")
    if success is False:
        raise WeightUpdateError(f"SGLang {what} failed: {message}")
    return result


# ---------------------------------------------------------------------------------------------- transport
class _HTTPServer:
    """One SGLang HTTP server; JSON in, JSON out; errors name the URL, route and SGLang's message."""

    def __init__(self, url: str, timeout_s: float) -> None:
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s

    def request(self, route: str, body: dict[str, Any] | None = None, method: str = "POST") -> Any:
        if route not in SGLANG_CONTRACT["http_routes"]:
            raise AssertionError(f"route {route} is not declared in SGLANG_CONTRACT")
        data = None if body is None else json.dumps(_checked("route", route, body)).encode()
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


class SGLangEngine(RolloutEngine):
    def __init__(
        self,
        config: Any,
        model_path: str,
        *,
        response_length: int | None = None,
        eos_token_id: int | Sequence[int] | None = None,
        pad_token_id: int | None = None,
        weight_transport: str = "distributed",
        update_group_backend: str = "nccl",
        master_address: str | None = None,
        base_gpu_id: int = 0,
        request_timeout_s: float = 600.0,
    ) -> None:
        """``config``: rollout config. ``model_path``: HF directory of the actor (config + tokenizer; the
        weights are random until the first sync). Server mode: ``weight_transport`` is ``distributed`` or
        ``tensor``; ``master_address`` is this trainer's address as the servers see it."""
        if config.mode not in ("colocated", "server"):
            raise ValueError(f"rollout.mode must be colocated or server, got {config.mode!r}")
        if weight_transport not in ("distributed", "tensor"):
            raise ValueError(f"weight_transport must be distributed or tensor, got {weight_transport!r}")
        length = config.response_length if config.response_length is not None else response_length
        if length is None or int(length) < 1:
            raise ValueError(
                f"rollout.response_length must be >= 1 (or pass response_length), got {length!r}"
            )
        self.config = config
        self.response_length = int(length)
        self.eos_token_id, self.pad_token_id = eos_token_id, pad_token_id
        self.dtype = resolve_dtype(str(config.dtype), torch.device("cuda"))
        self.tp_size = int(config.tensor_model_parallel_size)
        self.weight_transport = weight_transport
        self.update_group_backend = update_group_backend
        self.master_address = master_address
        self.weight_version = 0
        self._in_session = False
        self._session_version = 0
        self._needs_sync: str | None = None
        self._update_group: dist.ProcessGroup | None = None
        self._engine = None
        self._servers: list[_HTTPServer] = []
        if config.mode == "colocated":
            kwargs = _checked(
                "server_args",
                None,
                {
                    "model_path": model_path,
                    "tp_size": self.tp_size,
                    "mem_fraction_static": float(config.gpu_memory_utilization),
                    "enable_memory_saver": True,  # needed by release/resume_memory_occupation
                    "base_gpu_id": base_gpu_id,
                    "skip_tokenizer_init": True,
                    "load_format": "dummy",
                    "random_seed": int(config.seed),
                    "dtype": str(config.dtype),
                    "log_level": "error",
                },
            )
            self._engine = _import("sglang", "Engine")(**kwargs)
            version = _import("sglang", "__version__")
            self._needs_sync = "the engine starts with random weights (load_format=dummy)"
        else:
            if not config.server_urls:
                raise ValueError(
                    "rollout.mode=server needs rollout.server_urls (the SGLang servers' http://host:port)"
                )
            self._servers = [_HTTPServer(url, request_timeout_s) for url in config.server_urls]
            versions = {s.request("/server_info", method="GET")["version"] for s in self._servers}
            if len(versions) != 1:
                raise ValueError(
                    f"SGLang servers run different versions {sorted(versions)}: {config.server_urls}"
                )
            version = versions.pop()
            self._needs_sync = "the servers have not received the trainer's weights yet"
        self.sglang_version = str(version)
        self.uses_session = Version(self.sglang_version) >= WEIGHT_UPDATE_SESSION_SINCE
        self._pool = ThreadPoolExecutor(max_workers=max(2, len(self._servers)), thread_name_prefix="sglang")

    # ------------------------------------------------------------------ calls
    def _engine_call(self, method: str, **kwargs: Any) -> Any:
        return getattr(self._engine, method)(**_checked("engine", method, kwargs))

    def _on_all_servers(self, route: str, body: dict[str, Any] | None = None) -> list[Any]:
        futures = [self._pool.submit(s.request, route, body) for s in self._servers]
        return [f.result() for f in futures]

    # ------------------------------------------------------------------ generation
    def generate_sequences(self, prompts: DataProto) -> DataProto:
        if self._in_session:
            raise RuntimeError(
                "SGLangEngine has an open weight-update session; call end_weight_update() first"
            )
        if self._needs_sync is not None:
            raise RuntimeError(
                f"SGLangEngine cannot generate yet: {self._needs_sync}; run a complete weight sync"
            )
        check_prompt_batch(prompts)
        params = resolve_sampling_params(
            self.config,
            prompts.meta_info,
            response_length=self.response_length,
            eos_token_id=self.eos_token_id,
            pad_token_id=self.pad_token_id,
        )
        start = time.perf_counter()
        input_ids = prompt_token_lists(prompts)
        sampling = [_checked("sampling", None, _sampling_dict(params, row)) for row in range(len(input_ids))]
        if self._engine is not None:
            outputs = self._engine_call(
                "generate", input_ids=input_ids, sampling_params=sampling, return_logprob=True
            )
        else:
            outputs = self._generate_on_servers(input_ids, sampling)
        responses, log_probs = [], []
        for row, output in enumerate(outputs):
            tokens, lps = _parse_output(output, row, params)
            self._check_served_version(output, row)
            responses.append(tokens)
            log_probs.append(lps)
        return build_rollout_batch(
            prompts,
            responses,
            log_probs,
            response_length=params.max_response_length,
            pad_token_id=params.pad_token_id,
            weight_version=self.weight_version,
            seconds=time.perf_counter() - start,
        )

    def _generate_on_servers(self, input_ids: list[list[int]], sampling: list[dict[str, Any]]) -> list[dict]:
        shards = _split(len(input_ids), len(self._servers))
        futures = [
            self._pool.submit(
                server.request,
                "/generate",
                {"input_ids": input_ids[lo:hi], "sampling_params": sampling[lo:hi], "return_logprob": True},
            )
            for server, (lo, hi) in zip(self._servers, shards)
            if hi > lo
        ]
        outputs = [out for f in futures for out in f.result()]
        if len(outputs) != len(input_ids):
            raise RuntimeError(f"SGLang returned {len(outputs)} results for {len(input_ids)} prompts")
        return outputs

    def _check_served_version(self, output: dict, row: int) -> None:
        """Server mode tags updates with our version; a sample from other weights must not slip through."""
        if not self._servers:
            return
        served = output["meta_info"].get("weight_version")
        if served != str(self.weight_version):
            raise RuntimeError(
                f"sample {row} was generated with weight version {served!r}, expected "
                f"{self.weight_version}: a server missed a weight sync"
            )

    # ------------------------------------------------------------------ weights
    def begin_weight_update(self, version: int) -> None:
        if self._in_session:
            raise WeightUpdateError("a weight-update session is already open; call end_weight_update() first")
        if self.uses_session:
            if self._engine is not None:
                _check_result(self._engine_call("begin_weight_update"), "begin_weight_update")
            else:
                for result in self._on_all_servers("/begin_weight_update", {}):
                    _check_result(result, "/begin_weight_update")
        self._in_session = True
        self._session_version = int(version)

    def load_named_tensors(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """SGLang always receives flattened buckets: pack these tensors into one (in the engine dtype)."""
        items = [(name, t) for name, t in named_tensors]
        if not items:
            return
        cast = [(n, t, self.dtype if t.is_floating_point() else t.dtype) for n, t in items]
        bucket = WeightBucket(
            sum(t.numel() * d.itemsize + d.itemsize for _, t, d in cast), items[0][1].device
        )
        for name, tensor, dtype in cast:
            bucket.add(name, tensor, dtype)
        self.load_weight_bucket(bucket)

    def load_weight_bucket(self, bucket: WeightBucket) -> None:
        if not self._in_session:
            raise WeightUpdateError("load outside a weight-update session; call begin_weight_update() first")
        if self._engine is not None:
            payloads = self._serialized_bucket(bucket, as_text=False)
            _check_result(
                self._engine_call(
                    "update_weights_from_tensor",
                    named_tensors=payloads,
                    load_format=_BUCKET["load_format"],
                    flush_cache=False,
                ),
                "update_weights_from_tensor",
            )
        elif self.weight_transport == "tensor":
            body = {
                "serialized_named_tensors": self._serialized_bucket(bucket, as_text=True),
                "load_format": _BUCKET["load_format"],
                "flush_cache": False,
                "weight_version": str(self._session_version),
            }
            for result in self._on_all_servers("/update_weights_from_tensor", body):
                _check_result(result, "/update_weights_from_tensor")
        else:
            self._broadcast_bucket(bucket)

    def _serialized_bucket(self, bucket: WeightBucket, *, as_text: bool) -> list:
        """SGLang's flattened_bucket payload, one serialized copy per engine TP rank."""
        serializer = _import("sglang.srt.utils.common", "MultiprocessingSerializer")
        metadata_cls = _import("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorMetadata")
        flat = bucket.flat()
        if flat.is_cuda:
            _import(
                "sglang.srt.utils.patch_torch", "monkey_patch_torch_reductions"
            )()  # device UUIDs across processes
        metadata = [
            metadata_cls(
                name=e.name,
                shape=torch.Size(e.shape),
                dtype=e.dtype,
                start_idx=e.start,
                end_idx=e.end,
                numel=e.end - e.start,
            )
            for e in bucket.entries
        ]
        payload = dict(zip(_BUCKET["payload_keys"], (flat, metadata)))
        return [serializer.serialize(payload, output_str=as_text) for _ in range(self.tp_size)]

    def _broadcast_bucket(self, bucket: WeightBucket) -> None:
        """Server mode, distributed: the servers allocate the bucket from (names, dtypes, shapes), packed
        back to back, and receive it by one broadcast from us (rank 0) in the update group."""
        _require_packed(bucket)
        if self._update_group is None:
            self._update_group = self._join_update_group()
        body = {
            "names": [e.name for e in bucket.entries],
            "dtypes": [str(e.dtype).replace("torch.", "") for e in bucket.entries],
            "shapes": [list(e.shape) for e in bucket.entries],
            "group_name": UPDATE_GROUP_NAME,
            "flush_cache": False,
            "load_format": _BUCKET["load_format"],
            "weight_version": str(self._session_version),
        }
        futures = [
            self._pool.submit(s.request, "/update_weights_from_distributed", body) for s in self._servers
        ]
        dist.broadcast(bucket.flat(), src=0, group=self._update_group)
        for f in futures:
            _check_result(f.result(), "/update_weights_from_distributed")

    def _join_update_group(self) -> dist.ProcessGroup:
        address = self.master_address or socket.gethostbyname(socket.gethostname())
        with socket.socket() as sock:
            sock.bind(("", 0))
            port = sock.getsockname()[1]
        world_size = 1 + len(self._servers) * self.tp_size
        futures = [
            self._pool.submit(
                server.request,
                "/init_weights_update_group",
                {
                    "master_address": address,
                    "master_port": port,
                    "rank_offset": 1 + i * self.tp_size,
                    "world_size": world_size,
                    "group_name": UPDATE_GROUP_NAME,
                    "backend": self.update_group_backend,
                },
            )
            for i, server in enumerate(self._servers)
        ]
        group = init_weight_update_group(
            address,
            port,
            rank=0,
            world_size=world_size,
            group_name=UPDATE_GROUP_NAME,
            backend=self.update_group_backend,
        )
        for f in futures:
            _check_result(f.result(), "/init_weights_update_group")
        return group

    def end_weight_update(self) -> None:
        if not self._in_session:
            raise WeightUpdateError("no weight-update session is open; call begin_weight_update() first")
        self._close_session()
        self._flush_cache()  # cached prefixes hold KV computed with the old weights
        self.weight_version = self._session_version
        self._needs_sync = None

    def abort_weight_update(self, reason: str) -> None:
        self._needs_sync = reason
        if self._in_session:
            self._close_session()

    def _close_session(self) -> None:
        self._in_session = False
        if not self.uses_session:
            return
        if self._engine is not None:
            _check_result(self._engine_call("end_weight_update"), "end_weight_update")
        else:
            for result in self._on_all_servers("/end_weight_update", {}):
                _check_result(result, "/end_weight_update")

    def _flush_cache(self) -> None:
        if self._engine is not None:
            self._engine_call("flush_cache")
        else:
            self._on_all_servers("/flush_cache")

    # ------------------------------------------------------------------ memory
    def sleep(self) -> None:
        self._memory_call("release_memory_occupation")
        self._needs_sync = "its weights were released by sleep()"

    def wake_up(self) -> None:
        self._memory_call("resume_memory_occupation")

    def _memory_call(self, what: str) -> None:
        tags = list(SGLANG_CONTRACT["memory_tags"])
        if self._engine is not None:
            self._engine_call(what, tags=tags)
        else:
            self._on_all_servers(f"/{what}", {"tags": tags})

    def shutdown(self) -> None:
        if self._engine is not None:
            self._engine_call("shutdown")
        if self._update_group is not None:
            self._on_all_servers("/destroy_weights_update_group", {"group_name": UPDATE_GROUP_NAME})
            dist.destroy_process_group(self._update_group)
            self._update_group = None
        self._pool.shutdown(wait=True)


# ---------------------------------------------------------------------------------------------- helpers
def _sampling_dict(params: SamplingParams, row: int) -> dict[str, Any]:
    out: dict[str, Any] = {
        "max_new_tokens": params.max_response_length,
        "temperature": 0.0 if params.greedy else params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k,
        "stop_token_ids": list(params.finish_token_ids),
        "ignore_eos": False,
    }
    if params.seed is not None:
        out["sampling_seed"] = params.seed + row
    return out


def _parse_output(output: dict, row: int, params: SamplingParams) -> tuple[list[int], list[float]]:
    """Response tokens and log-probs from ``meta_info.output_token_logprobs`` ([logprob, token_id, text]),
    cut after the first finishing token."""
    try:
        entries = output["meta_info"]["output_token_logprobs"]
    except (KeyError, TypeError) as exc:
        raise RuntimeError(
            f"SGLang result {row} has no meta_info.output_token_logprobs (keys: "
            f"{sorted(output) if isinstance(output, dict) else type(output).__name__})"
        ) from exc
    tokens = [int(e[1]) for e in entries]
    log_probs = [float(e[0]) for e in entries]
    finish = set(params.finish_token_ids)
    for i, token in enumerate(tokens):
        if token in finish:
            tokens, log_probs = tokens[: i + 1], log_probs[: i + 1]
            break
    if len(tokens) > params.max_response_length:
        raise RuntimeError(
            f"SGLang result {row} has {len(tokens)} tokens, more than max_new_tokens "
            f"{params.max_response_length}"
        )
    return tokens, log_probs


def _split(n: int, parts: int) -> list[tuple[int, int]]:
    """Contiguous, near-equal [lo, hi) ranges covering range(n)."""
    bounds = [n * i // parts for i in range(parts + 1)]
    return list(itertools.pairwise(bounds))


def _require_packed(bucket: WeightBucket) -> None:
    offset = 0
    for entry in bucket.entries:
        if entry.start != offset:
            raise WeightUpdateError(
                f"bucket tensor {entry.name!r} starts at byte {entry.start}, not {offset}: SGLang's distributed "
                f"receiver packs tensors back to back, so a bucket must not mix dtypes that need padding"
            )
        offset = entry.end
