"""An HTTP server process around the strict SGLang stand-in Engine (sglang 0.5.23 routes and answers).

``start(model_dir, tp_size=2, env=...) -> (process, url)`` launches ``python sglang_server.py`` with
``tests/stand_ins`` on PYTHONPATH; the process builds ``sglang.Engine(tp_size=...)`` (its schedulers are
its children) and serves, from the Engine's own thread (one request at a time, like SGLang's control path):

- ``GET /server_info`` (also ``/get_server_info``): ``{"version", "tp_size", "weight_version", "model_path",
  "enable_return_routed_experts"}`` (SGLang reports all its ServerArgs); ``GET /health``;
- ``POST /generate``, ``/begin_weight_update``, ``/end_weight_update``, ``/flush_cache``,
  ``/update_weights_from_tensor`` (``serialized_named_tensors``: one base64 payload per TP rank, checked
  against each scheduler's GPU), ``/init_weights_update_group`` (scheduler i joins at rank
  ``rank_offset + i``, gloo), ``/update_weights_from_distributed`` (each scheduler receives the broadcast
  from rank 0 and keeps its shard), ``/destroy_weights_update_group``, ``/release_memory_occupation``,
  ``/resume_memory_occupation``;
- stand-in only: ``GET /stand_in/weights_sha256`` ({HF name: sha256 of the fp32 bytes}, after pending
  copies) and ``POST /stand_in/shutdown``.

Answers are ``{"success", "message"}`` with 400 on failure; an unknown request field is a 400 (SGLang
ignores them). ``/generate`` results carry ``meta_info.weight_version`` = the last version sent with an
update. When the Engine dies (e.g. an unmatched resume) the server answers 500 and exits (code 1), as
SGLang's server is killed with its scheduler. SIGTERM stops the server (the Engine's ignore-SIGTERM handler
is replaced by the default after start).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import hmac
import json
import os
import signal
import subprocess
import sys
import time
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent

ROUTE_FIELDS = {
    "/generate": {
        "input_ids",
        "sampling_params",
        "return_logprob",
        "text",
        "rid",
        "stream",
        "logprob_start_len",
        "image_data",
        # refused (400) unless the server was started with --enable-return-routed-experts, as the Engine refuses it
        "return_routed_experts",
    },
    "/begin_weight_update": {"selector", "rid"},
    "/end_weight_update": {"rid"},
    "/flush_cache": set(),
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
    "/stand_in/shutdown": set(),
}


class BadRequest(Exception):
    pass


SESSION_SINCE = (0, 5, 23)  # sglang PR #28001: weight updates only inside begin/end_weight_update


class App:
    def __init__(self, engine, version: str = "0.5.23") -> None:
        self.engine = engine
        self.tp = engine._tp
        self.version = version
        # an older server (slime's 0.5.15.post1) has no session routes and updates without one
        self.has_session = tuple(int(p) for p in version.split(".")[:3]) >= SESSION_SINCE

    def handle(self, method: str, route: str, body: Any) -> Any:
        if method == "GET":
            if route in ("/server_info", "/get_server_info"):
                args = self.engine._args  # the Engine's ServerArgs; /server_info answers even after it died
                return {"version": self.version, "tp_size": self.tp, "weight_version": self.engine.weight_version,
                        "model_path": args.get("model_path"),
                        "enable_return_routed_experts": bool(args.get("enable_return_routed_experts"))}
            if route == "/health":
                return {}
            if route == "/stand_in/weights_sha256":
                return {
                    k: hashlib.sha256(v.contiguous().numpy().tobytes()).hexdigest()
                    for k, v in self.engine.stand_in_state_dict().items()
                }
            if route == "/flush_cache":
                self.engine.flush_cache()
                return "Cache flushed.\n"
            raise LookupError(route)
        if route not in ROUTE_FIELDS or (route in ("/begin_weight_update", "/end_weight_update")
                                         and not self.has_session):
            raise LookupError(route)
        body = {} if body is None else body
        if not isinstance(body, dict):
            raise BadRequest(f"{route}: request body must be a JSON object")
        unknown = sorted(set(body) - ROUTE_FIELDS[route])
        if unknown:
            raise BadRequest(f"{route}: unknown fields {unknown}")
        return getattr(self, route.strip("/").replace("stand_in/", "stand_in_"))(body)

    @staticmethod
    def _answer(result: tuple[bool, str]) -> dict:
        ok, message = result
        if not ok:
            raise BadRequest(message)
        return {"success": True, "message": message}

    def generate(self, body: dict) -> Any:
        if body.get("text") is not None:
            raise BadRequest("the stand-in has no tokenizer: send input_ids")
        return self.engine.generate(
            input_ids=body.get("input_ids"),
            sampling_params=body.get("sampling_params"),
            return_logprob=bool(body.get("return_logprob", False)),
            return_routed_experts=bool(body.get("return_routed_experts", False)),
            stream=bool(body.get("stream", False)),
            image_data=body.get("image_data"),
        )

    def begin_weight_update(self, body: dict) -> dict:
        return self._answer(self.engine.begin_weight_update(body.get("selector", "all")))

    def end_weight_update(self, body: dict) -> dict:
        return self._answer(self.engine.end_weight_update())

    def flush_cache(self, body: dict) -> str:
        self.engine.flush_cache()
        return "Cache flushed.\n"

    def _update(self, load) -> dict:
        if self.has_session:
            return self._answer(load())
        self._answer(self.engine.begin_weight_update())  # the stand-in engine is 0.5.23 underneath
        try:
            return self._answer(load())
        finally:
            self.engine.end_weight_update()

    def update_weights_from_tensor(self, body: dict) -> dict:
        return self._update(lambda: self.engine._update_weights_from_serialized(
            body.get("serialized_named_tensors"), body.get("load_format"), body.get("weight_version")))

    def init_weights_update_group(self, body: dict) -> dict:
        missing = [
            k
            for k in ("master_address", "master_port", "rank_offset", "world_size", "group_name")
            if k not in body
        ]
        if missing:
            raise BadRequest(f"/init_weights_update_group: missing fields {missing}")
        return self._answer(
            self.engine.init_weights_update_group(
                body["master_address"],
                int(body["master_port"]),
                int(body["rank_offset"]),
                int(body["world_size"]),
                body["group_name"],
                body.get("backend", "nccl"),
            )
        )

    def update_weights_from_distributed(self, body: dict) -> dict:
        return self._update(lambda: self.engine.update_weights_from_distributed(
            body["names"],
            body["dtypes"],
            body["shapes"],
            body.get("group_name", "weight_update_group"),
            bool(body.get("flush_cache", True)),
            body.get("load_format"),
            body.get("weight_version"),
        ))

    def destroy_weights_update_group(self, body: dict) -> dict:
        return self._answer(
            self.engine.destroy_weights_update_group(body.get("group_name", "weight_update_group"))
        )

    def release_memory_occupation(self, body: dict) -> dict:
        self.engine.release_memory_occupation(body.get("tags"))
        return {"success": True, "message": "Success"}

    def resume_memory_occupation(self, body: dict) -> dict:
        self.engine.resume_memory_occupation(body.get("tags"))
        return {"success": True, "message": "Success"}

    def stand_in_shutdown(self, body: dict) -> dict:
        raise SystemExit(0)


def _handler(app: App, server_state: dict, api_key: str | None = None) -> type[BaseHTTPRequestHandler]:
    """``api_key``: as SGLang's ``--api-key``, every request must then carry ``Authorization: Bearer <key>``
    (else 401); without it any request is served."""
    from sglang.srt.entrypoints.engine import EngineDead

    class Handler(BaseHTTPRequestHandler):
        def _authorized(self) -> bool:
            if api_key is None or hmac.compare_digest(self.headers.get("Authorization", "").encode(),
                                                      f"Bearer {api_key}".encode()):
                return True
            self.close_connection = True
            self._send(HTTPStatus.UNAUTHORIZED, {"error": "Unauthorized"})
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
                self._send(HTTPStatus.BAD_REQUEST, {"success": False, "message": "body is not JSON"})
                return
            self._serve("POST", body)

        def _serve(self, method: str, body: Any) -> None:
            try:
                status, answer = HTTPStatus.OK, app.handle(method, self.path, body)
            except LookupError:
                status, answer = HTTPStatus.NOT_FOUND, {"detail": "Not Found"}
            except SystemExit:
                status, answer = HTTPStatus.OK, {"success": True, "message": "shutting down"}
                server_state["stop"] = True
            except EngineDead as exc:
                status, answer = HTTPStatus.INTERNAL_SERVER_ERROR, {"success": False, "message": str(exc)}
                server_state["stop"] = server_state["dead"] = True
            except Exception as exc:  # noqa: BLE001 - failures go back as SGLang's 400s
                status, answer = HTTPStatus.BAD_REQUEST, {"success": False, "message": f"{exc}"}
            self._send(status, answer)

        def _send(self, status: HTTPStatus, answer: Any) -> None:
            data = json.dumps(answer).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: Any) -> None:
            pass

    return Handler


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--tp-size", type=int, default=2)
    parser.add_argument("--base-gpu-id", type=int, default=0)
    parser.add_argument("--nccl-port", type=int, default=None)
    parser.add_argument("--random-seed", type=int, default=1)
    parser.add_argument("--version", default="0.5.23", help="the sglang version to answer as (0.5.15: no session)")
    parser.add_argument("--api-key", default=None, help="as SGLang's: requests need Authorization: Bearer <key>")
    parser.add_argument("--enable-return-routed-experts", action="store_true",
                        help="as SGLang's: capture the MoE routing; /generate may then ask return_routed_experts")
    args = parser.parse_args(argv)

    import torch

    torch.set_num_threads(1)
    from sglang import Engine

    engine = Engine(
        model_path=args.model_path,
        tp_size=args.tp_size,
        base_gpu_id=args.base_gpu_id,
        nccl_port=args.nccl_port,
        load_format="dummy",
        skip_tokenizer_init=True,
        enable_memory_saver=True,
        random_seed=args.random_seed,
        enable_return_routed_experts=args.enable_return_routed_experts,
    )
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    state: dict[str, bool] = {"stop": False, "dead": False}
    server = HTTPServer(("127.0.0.1", 0), _handler(App(engine, args.version), state, args.api_key))
    print(f"READY {server.server_address[1]}", flush=True)
    try:
        while not state["stop"]:
            server.handle_request()
    finally:
        server.server_close()
        with contextlib.suppress(Exception):
            engine.shutdown()
    if state["dead"]:
        sys.exit(1)  # SGLang's server goes down with its scheduler


def start(
    model_dir: str,
    tp_size: int = 2,
    env: dict[str, str] | None = None,
    timeout_s: float = 180.0,
    **options: Any,
) -> tuple[subprocess.Popen, str]:
    """Start a server process; returns it and its URL. ``env`` is merged into os.environ (it must give
    SGLANG_STAND_IN_ROOT, and usually SGLANG_STAND_IN_NODE / CUDA_VISIBLE_DEVICES). ``options``:
    base_gpu_id, nccl_port, random_seed, version ("0.5.15": a pre-session server without begin/end routes),
    api_key (SGLang's --api-key), enable_return_routed_experts=True (a flag: routing replay R3)."""
    full_env = {**os.environ, **(env or {})}
    full_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE), full_env.get("PYTHONPATH")]))
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--model-path",
        str(model_dir),
        "--tp-size",
        str(tp_size),
    ]
    for key, value in options.items():
        if value is True:  # a flag
            cmd.append(f"--{key.replace('_', '-')}")
        elif value is not None and value is not False:
            cmd += [f"--{key.replace('_', '-')}", str(value)]
    proc = subprocess.Popen(cmd, env=full_env, stdout=subprocess.PIPE, text=True)
    deadline = time.monotonic() + timeout_s
    import selectors

    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(
                f"SGLang stand-in server exited with code {proc.returncode} before it was ready"
            )
        if sel.select(timeout=0.5):
            line = proc.stdout.readline()
            if line.startswith("READY "):
                return proc, f"http://127.0.0.1:{int(line.split()[1])}"
    proc.kill()
    proc.wait()
    raise TimeoutError(f"SGLang stand-in server did not start within {timeout_s} s")


if __name__ == "__main__":
    main()
