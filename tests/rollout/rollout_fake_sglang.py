"""A fake SGLang HTTP server: sglang 0.5.23's routes and request fields, backed by a real HF model.

It runs in its own process (``start``), like a real server on another GPU. What it implements:
- the routes and request fields the adapter uses, answering like SGLang (``{"success", "message"}``,
  400 on failure, ``/generate`` results with ``meta_info.output_token_logprobs`` / ``finish_reason`` /
  ``weight_version``, ``/server_info`` with ``version``);
- the 0.5.23 session rule: weight updates are refused outside ``/begin_weight_update`` ...
  ``/end_weight_update`` (with SGLang's message); ``version="0.5.15"`` emulates a pre-session server
  that has no begin/end routes at all (as sglang 0.5.15.post1's http_server.py, which has every other
  route used here);
- ``flattened_bucket`` decoding for ``/update_weights_from_tensor`` (base64 -> unpickle -> slice the uint8
  tensor by metadata) and the packed receive bucket + broadcast of ``/update_weights_from_distributed``
  over a group joined through ``/init_weights_update_group`` (gloo here, NCCL in production).

Where it differs from SGLang, on purpose or by necessity:
- sglang is not importable here, so payloads are decoded with this module's own allowlist unpickler
  (SGLang's SafeUnpickler also allowlists globals; ours admits only what a CPU flattened bucket needs);
- it is stricter: an unknown request field is a 400 (SGLang ignores unknown fields) and so is an unknown
  tensor name or shape (SGLang's load_weights may skip names it does not map);
- generation is transformers on CPU via HFEngine: one sampling setting per request (rows differing in
  anything but ``sampling_seed`` are refused), ``sampling_seed`` is ignored (SGLang too, unless started
  with deterministic inference), no radix cache (``/flush_cache`` is a no-op), TP size 1, and
  release/resume of memory only flips HFEngine's sleep state.
"""

from __future__ import annotations

import base64
import io
import json
import multiprocessing
import pickle
import threading
from dataclasses import dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from packaging.version import Version

GENERATE_FIELDS = {
    "input_ids",
    "sampling_params",
    "return_logprob",
    "text",
    "rid",
    "stream",
    "logprob_start_len",
}
SAMPLING_FIELDS = {
    "max_new_tokens",
    "temperature",
    "top_p",
    "top_k",
    "stop_token_ids",
    "ignore_eos",
    "sampling_seed",
    "min_p",
    "n",
}
# route -> the request struct's fields in sglang 0.5.23 io_struct.py (all optional ones included)
ROUTE_FIELDS = {
    "/begin_weight_update": {"selector", "rid"},
    "/end_weight_update": {"rid"},
    "/update_weights_from_tensor": {
        "serialized_named_tensors",
        "load_format",
        "flush_cache",
        "abort_all_requests",
        "weight_version",
        "selector",
        "torch_empty_cache",
        "rid",
    },
    "/init_weights_update_group": {
        "master_address",
        "master_port",
        "rank_offset",
        "world_size",
        "group_name",
        "backend",
        "rid",
    },
    "/update_weights_from_distributed": {
        "names",
        "dtypes",
        "shapes",
        "group_name",
        "flush_cache",
        "abort_all_requests",
        "weight_version",
        "load_format",
        "selector",
        "torch_empty_cache",
        "rid",
    },
    "/destroy_weights_update_group": {"group_name", "rid"},
    "/release_memory_occupation": {"tags", "rid"},
    "/resume_memory_occupation": {"tags", "rid"},
}
SESSION_ROUTES = ("/begin_weight_update", "/end_weight_update")


@dataclass
class FlattenedTensorMetadata:
    """What ``sglang.srt.weight_sync.tensor_bucket.FlattenedTensorMetadata`` unpickles into here."""

    name: str
    shape: torch.Size
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int


class AllowlistUnpickler(pickle.Unpickler):
    """Admit only the globals a ForkingPickler dump of a CPU flattened bucket refers to."""

    ALLOWED: ClassVar[frozenset[tuple[str, str]]] = frozenset(
        {
            ("torch.multiprocessing.reductions", "rebuild_tensor"),
            ("torch.multiprocessing.reductions", "rebuild_typed_storage"),
            ("torch.multiprocessing.reductions", "rebuild_storage_fd"),
            ("torch.multiprocessing.reductions", "rebuild_storage_filename"),
            ("torch.storage", "UntypedStorage"),
            ("torch", "Tensor"),
            ("torch", "Size"),
            ("multiprocessing.resource_sharer", "DupFd"),
        }
    )
    RENAMED: ClassVar[dict[tuple[str, str], type]] = {
        ("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorMetadata"): FlattenedTensorMetadata
    }

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in self.RENAMED:
            return self.RENAMED[(module, name)]
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if (module, name) in self.ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"Blocked unsafe global ({module}.{name}) during pickle deserialization")


class RequestError(Exception):
    """A 400 answer with SGLang's {"success": false, "message": ...} body."""


class FakeSGLang:
    def __init__(self, model_kwargs: dict[str, Any], version: str) -> None:
        from rollout_models import source_model, tiny_qwen2_config

        from megatron_rl.config.schema import RolloutConfig
        from megatron_rl.rollout.hf_engine import HFEngine

        torch.set_num_threads(1)
        config = tiny_qwen2_config(**model_kwargs)
        self.engine = HFEngine(RolloutConfig(response_length=1), config)
        self.engine.update_weights(
            source_model(1000, config).state_dict().items(), version=0
        )  # "dummy" weights
        self.params = self.engine.model.state_dict(keep_vars=True)
        self.version = version
        self.has_session = Version(version) >= Version("0.5.23")
        self.session_open = False
        self.weight_version = "default"
        self.groups: dict[str, dist.ProcessGroup] = {}
        self.lock = threading.Lock()  # one control operation at a time, like SGLang's scheduler

    # ------------------------------------------------------------------ routes
    def handle(self, route: str, body: dict[str, Any] | None) -> Any:
        if route == "/server_info":
            return {"version": self.version, "tp_size": 1}
        if route == "/flush_cache":
            return "Cache flushed.\n"
        if route == "/generate":
            _check_fields(route, body, GENERATE_FIELDS)
            return self.generate(body)
        if route not in ROUTE_FIELDS or (route in SESSION_ROUTES and not self.has_session):
            raise LookupError(route)
        _check_fields(route, body, ROUTE_FIELDS[route])
        with self.lock:
            return getattr(self, route.strip("/"))(body)

    def begin_weight_update(self, body: dict) -> dict:
        if self.session_open:
            raise RequestError("a weight-update session is already open; call end_weight_update() first")
        self.session_open = True
        return {"success": True, "message": "Success"}

    def end_weight_update(self, body: dict) -> dict:
        if not self.session_open:
            raise RequestError("no weight-update session is open; call begin_weight_update() first")
        self.session_open = False
        return {"success": True, "message": "Success"}

    def update_weights_from_tensor(self, body: dict) -> dict:
        self._require_session("update_weights_from_tensor")
        if body.get("load_format") != "flattened_bucket":
            raise RequestError(
                f"this fake decodes only load_format=flattened_bucket, got {body.get('load_format')!r}"
            )
        payload = AllowlistUnpickler(io.BytesIO(base64.b64decode(body["serialized_named_tensors"][0]))).load()
        flat = payload["flattened_tensor"]
        self._load(
            [(m.name, flat[m.start_idx : m.end_idx].view(m.dtype).view(m.shape)) for m in payload["metadata"]]
        )
        return self._updated(body)

    def init_weights_update_group(self, body: dict) -> dict:
        from megatron_rl.rollout.update_group import init_weight_update_group

        self.groups[body["group_name"]] = init_weight_update_group(
            body["master_address"],
            body["master_port"],
            rank=body["rank_offset"],
            world_size=body["world_size"],
            group_name=body["group_name"],
            backend=body.get("backend", "nccl"),
        )
        return {"success": True, "message": "Succeeded to initialize custom process group."}

    def update_weights_from_distributed(self, body: dict) -> dict:
        self._require_session("update_weights_from_distributed")
        group = self.groups.get(body.get("group_name", "weight_update_group"))
        if group is None:
            raise RequestError(
                f"Group {body.get('group_name')} not in {list(self.groups)}. "
                "Please call `init_weights_update_group` first."
            )
        dtypes = [getattr(torch, d) for d in body["dtypes"]]
        sizes = [torch.Size(s).numel() * d.itemsize for s, d in zip(body["shapes"], dtypes)]
        flat = torch.empty(sum(sizes), dtype=torch.uint8)
        dist.broadcast(flat, src=0, group=group)
        tensors, offset = [], 0
        for name, shape, dtype, size in zip(body["names"], body["shapes"], dtypes, sizes):
            tensors.append((name, flat[offset : offset + size].view(dtype).view(shape)))
            offset += size
        self._load(tensors)
        return self._updated(body)

    def destroy_weights_update_group(self, body: dict) -> dict:
        dist.destroy_process_group(self.groups.pop(body.get("group_name", "weight_update_group")))
        return {"success": True, "message": "Succeeded to destroy custom process group."}

    def release_memory_occupation(self, body: dict) -> None:
        self.engine.sleep()

    def resume_memory_occupation(self, body: dict) -> None:
        self.engine.wake_up()

    def generate(self, body: dict) -> list[dict]:
        from megatron_rl.protocol import DataProto

        rows, sampling = body["input_ids"], body["sampling_params"]
        sampling = sampling if isinstance(sampling, list) else [sampling] * len(rows)
        for sp in sampling:
            _check_fields("sampling_params", sp, SAMPLING_FIELDS)
        shared = [{k: v for k, v in sp.items() if k != "sampling_seed"} for sp in sampling]
        if any(sp != shared[0] for sp in shared):
            raise RequestError("this fake needs one sampling setting per request (except sampling_seed)")
        sp = shared[0]
        width = max(len(r) for r in rows)
        ids = torch.tensor([[0] * (width - len(r)) + r for r in rows])
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
        stop = list(sp.get("stop_token_ids") or []) + (
            [] if sp.get("ignore_eos") else [self.engine.eos_token_id]
        )
        temperature = sp.get("temperature", 1.0)
        meta = {
            "do_sample": temperature > 0,
            "temperature": temperature,
            "top_p": sp.get("top_p", 1.0),
            "top_k": sp.get("top_k", -1),
            "response_length": sp.get("max_new_tokens", 128),
            "eos_token_id": stop,
        }
        prompts = DataProto.from_dict(
            {"input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1).clamp(min=0)},
            meta_info=meta,
        )
        out = self.engine.generate_sequences(prompts)
        results = []
        for i in range(len(rows)):
            n = int(out.batch["response_mask"][i].sum())
            tokens = out.batch["responses"][i, :n].tolist()
            lps = out.batch["rollout_log_probs"][i, :n].tolist()
            finish = (
                {"type": "stop", "matched": tokens[-1]}
                if tokens and tokens[-1] in stop
                else {"type": "length", "length": n}
            )
            results.append(
                {
                    "text": None,
                    "output_ids": tokens,
                    "meta_info": {
                        "id": str(i),
                        "finish_reason": finish,
                        "weight_version": self.weight_version,
                        "output_token_logprobs": [[lp, tok, None] for lp, tok in zip(lps, tokens)],
                    },
                }
            )
        return results

    # ------------------------------------------------------------------ helpers
    def _require_session(self, op: str) -> None:
        if self.has_session and not self.session_open:
            raise RequestError(f"{op} must run between begin_weight_update() and end_weight_update()")

    @torch.no_grad()
    def _load(self, named: list[tuple[str, torch.Tensor]]) -> None:
        for name, tensor in named:
            if name not in self.params or self.params[name].shape != tensor.shape:
                raise RequestError(
                    f"Failed to update parameter online: cannot load {name!r} {tuple(tensor.shape)}"
                )
            self.params[name].copy_(tensor)

    def _updated(self, body: dict) -> dict:
        if body.get("weight_version") is not None:
            self.weight_version = body["weight_version"]
        return {"success": True, "message": "Success"}


def _check_fields(where: str, body: Any, allowed: set[str]) -> None:
    if not isinstance(body, dict):
        raise RequestError(f"{where}: request body must be a JSON object, got {type(body).__name__}")
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise RequestError(f"{where}: unknown fields {unknown}")


def _handler(app: FakeSGLang) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self._serve(None)

        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            self._serve(json.loads(self.rfile.read(length)) if length else None)

        def _serve(self, body: dict | None) -> None:
            try:
                status, answer = HTTPStatus.OK, app.handle(self.path, body)
            except LookupError:
                status, answer = HTTPStatus.NOT_FOUND, {"detail": "Not Found"}
            except Exception as exc:  # noqa: BLE001 - every failure goes back to the client, like SGLang's 400s
                status, answer = HTTPStatus.BAD_REQUEST, {"success": False, "message": str(exc)}
            data = json.dumps(answer).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: Any) -> None:  # keep test output clean
            pass

    return Handler


def _serve(conn, model_kwargs: dict[str, Any], version: str) -> None:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(FakeSGLang(model_kwargs, version)))
    conn.send(server.server_address[1])
    server.serve_forever()


def start(
    model_kwargs: dict[str, Any] | None = None, version: str = "0.5.23", timeout_s: float = 120.0
) -> tuple[multiprocessing.Process, str]:
    """Start a fake server process; returns it and its URL."""
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_serve, args=(child, model_kwargs or {}, version), daemon=True)
    proc.start()
    if not parent.poll(timeout_s):
        proc.kill()
        raise TimeoutError(f"fake SGLang server did not start within {timeout_s} s")
    return proc, f"http://127.0.0.1:{parent.recv()}"
