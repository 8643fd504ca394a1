"""Our sandboxed code runner (agent/sandbox.py) served over HTTP (docs/rollout.md, "Tools as services").

``python -m megatron_rl.agent.sandbox_service --port 8080`` (``$MEGATRON_RL_SERVER_API_KEY`` set: the run's
secret) prints ``READY <port>`` once it listens; tests and a driver start it in-process with ``serve(...)``
(an ephemeral port, ``.stop()``). Every request needs ``Authorization: Bearer <the run's secret>``, as the
run's rollout servers do (servers/hf_server.py); anything else is a 401 before the body is read. Routes:

- ``POST /execute``: the ``python`` tool as a service (body: the tool's arguments ``{"code"}``), answering
  ``{"text", "timed_out", "return_code"}`` where ``text`` is what the in-process tool shows the model: an
  ``http`` tool (agent/tool_service.py) with ``url: http://host:port/execute`` is the python tool, remote.
- ``POST /run_code``: SandboxFusion's route, what verl's sandbox-fusion client and tool send
  (``{"code", "language", "stdin", "run_timeout", "compile_timeout", "memory_limit_MB", "files", "fetch_files"}``)
  and read (``status``: Success | Failed | SandboxError, ``message``, ``compile_result`` (null: Python is not
  compiled), ``run_result``: ``{"status": Finished | TimeLimitExceeded | Error, "execution_time",
  "return_code", "stdout", "stderr"}``, ``files``). Python only (``language`` python or python3); ``files``
  (path -> base64) are written beside the program; ``fetch_files`` must be empty.
- ``GET /health``: ``{"ok": true, "in_flight", "peak_in_flight"}``.

At most ``max_concurrency`` programs run at once; a request waits up to ``queue_timeout_s`` for a slot, then
gets 503 (the tools retry a 5xx). Limits a request asks for are capped by the server's (``max_timeout_s``,
``max_memory_mb``). ``stop()`` stops listening, waits for the requests in flight (each bounded by its timeout;
their programs are killed and reaped by the sandbox) and closes the socket: nothing is left behind.
"""

from __future__ import annotations

import argparse
import base64
import binascii
import hmac
import json
import os
import posixpath
import signal
import threading
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from megatron_rl.agent.sandbox import FILESYSTEMS, SandboxLimits, SandboxRun, sandbox_for
from megatron_rl.agent.tools import program_text
from megatron_rl.rollout.server_key import API_KEY_ENV, ensure_server_api_key
from megatron_rl.rollout.http_reply import send_json

__all__ = ["SandboxService", "SandboxServer", "main", "serve"]

LANGUAGES = ("python", "python3")
MAX_BODY_BYTES = 16 << 20


class BadRequest(ValueError):
    """A request the service refuses (400), naming the field."""


class SandboxService:
    """The routes over this machine's sandbox (``sandbox_for(isolate_network, filesystem)``), with the slots."""

    def __init__(self, *, max_concurrency: int = 4, queue_timeout_s: float = 30.0, filesystem: str = "empty_root",
                 isolate_network: bool = True, default_timeout_s: float = 10.0, max_timeout_s: float = 60.0,
                 default_memory_mb: int = 1024, max_memory_mb: int = 4096, max_output_chars: int = 1 << 16) -> None:
        if max_concurrency < 1:
            raise ValueError(f"--max-concurrency must be >= 1, got {max_concurrency}")
        if filesystem not in FILESYSTEMS:
            raise ValueError(f"--filesystem {filesystem!r}: choose one of {', '.join(FILESYSTEMS)}")
        self.sandbox = sandbox_for(isolate_network, filesystem)  # refused here (empty_root impossible), not per call
        self.max_concurrency, self.queue_timeout_s = int(max_concurrency), float(queue_timeout_s)
        self.default_timeout_s, self.max_timeout_s = float(default_timeout_s), float(max_timeout_s)
        self.default_memory_mb, self.max_memory_mb = int(default_memory_mb), int(max_memory_mb)
        self.max_output_chars = int(max_output_chars)
        self._slots = threading.BoundedSemaphore(self.max_concurrency)
        self._lock = threading.Lock()
        self.in_flight = self.peak_in_flight = 0

    def handle(self, method: str, path: str, body: Any) -> tuple[HTTPStatus, dict[str, Any]]:
        if (method, path) == ("GET", "/health"):
            return HTTPStatus.OK, {"ok": True, "in_flight": self.in_flight, "peak_in_flight": self.peak_in_flight}
        route = {"/execute": self._execute, "/run_code": self._run_code}.get(path)
        if route is None or method != "POST":
            return HTTPStatus.NOT_FOUND, {"detail": "Not Found"}
        if not isinstance(body, dict):
            return HTTPStatus.BAD_REQUEST, {"status": "SandboxError",
                                            "message": f"{path}: the body must be a JSON object"}
        try:
            return route(body)
        except BadRequest as err:
            return HTTPStatus.BAD_REQUEST, {"status": "SandboxError", "message": f"{path}: {err}"}

    def run(self, code: str, limits: SandboxLimits, stdin: str | None = None, files: dict[str, bytes] | None = None,
            merge_stderr: bool = False) -> SandboxRun | None:
        """One program in a slot; None when no slot freed within ``queue_timeout_s``."""
        if not self._slots.acquire(timeout=self.queue_timeout_s):
            return None
        with self._lock:
            self.in_flight += 1
            self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
        try:
            return self.sandbox.execute(code, limits, stdin=stdin, files=files, merge_stderr=merge_stderr)
        finally:
            with self._lock:
                self.in_flight -= 1
            self._slots.release()

    def _limits(self, timeout: Any, memory: Any) -> SandboxLimits:
        try:
            timeout_s = float(timeout) if timeout is not None else self.default_timeout_s
            memory_mb = int(memory) if memory is not None else self.default_memory_mb
        except (TypeError, ValueError):
            raise BadRequest(f"run_timeout / memory_limit_MB must be numbers, got {timeout!r}, {memory!r}") from None
        if timeout_s <= 0 or memory_mb <= 0:
            raise BadRequest(f"run_timeout and memory_limit_MB must be > 0, got {timeout_s}, {memory_mb}")
        return SandboxLimits(timeout_s=min(timeout_s, self.max_timeout_s), memory_mb=min(memory_mb, self.max_memory_mb),
                             output_bytes=4 * self.max_output_chars)

    def _busy(self) -> tuple[HTTPStatus, dict[str, Any]]:
        return HTTPStatus.SERVICE_UNAVAILABLE, {
            "status": "SandboxError",
            "message": f"all {self.max_concurrency} slots busy for {self.queue_timeout_s:g}s; try again"}

    def _execute(self, body: dict[str, Any]) -> tuple[HTTPStatus, dict[str, Any]]:
        code = body.get("code")
        if not isinstance(code, str):
            return HTTPStatus.OK, {"text": 'Error: python needs {"code": "<program>"}.', "timed_out": False,
                                   "return_code": None}
        limits = self._limits(body.get("timeout_s"), body.get("memory_mb"))
        result = self.run(code, limits, merge_stderr=True)
        if result is None:
            return self._busy()
        text = program_text(result.timed_out, result.return_code, result.stdout, limits.timeout_s,
                            self.max_output_chars)
        return HTTPStatus.OK, {"text": text, "timed_out": result.timed_out, "return_code": result.return_code}

    def _run_code(self, body: dict[str, Any]) -> tuple[HTTPStatus, dict[str, Any]]:
        code, language = body.get("code"), str(body.get("language") or "python")
        if not isinstance(code, str):
            raise BadRequest("code must be a string")
        if language not in LANGUAGES:
            return HTTPStatus.OK, _fusion("SandboxError", f"language {language!r} is not served here (python only)")
        if body.get("fetch_files"):
            return HTTPStatus.OK, _fusion("SandboxError", "fetch_files is not served here")
        stdin = body.get("stdin")
        if stdin is not None and not isinstance(stdin, str):
            raise BadRequest("stdin must be a string or null")
        limits = self._limits(body.get("run_timeout"), body.get("memory_limit_MB"))
        result = self.run(code, limits, stdin, _files(body.get("files")))
        if result is None:
            return self._busy()
        if result.return_code == -1 and result.stdout.startswith("Error: could not start"):
            return HTTPStatus.OK, _fusion("SandboxError", result.stdout)
        run_status = "TimeLimitExceeded" if result.timed_out else "Finished"
        run = {"status": run_status, "execution_time": round(result.seconds, 4),
               "return_code": None if result.timed_out else result.return_code,
               "stdout": result.stdout, "stderr": result.stderr}
        ok = run_status == "Finished" and result.return_code == 0
        return HTTPStatus.OK, _fusion("Success" if ok else "Failed", "", run)


def _fusion(status: str, message: str, run: dict[str, Any] | None = None) -> dict[str, Any]:
    """SandboxFusion's answer (its RunCodeResponse)."""
    return {"status": status, "message": message, "compile_result": None, "run_result": run,
            "executor_pod_name": None, "files": {}}


def _files(files: Any) -> dict[str, bytes]:
    """SandboxFusion's ``files`` (relative path -> base64) as bytes; a path that leaves the directory is refused."""
    if not files:
        return {}
    if not isinstance(files, dict):
        raise BadRequest("files must be an object: relative path -> base64 content")
    out = {}
    for name, data in files.items():
        clean = posixpath.normpath(str(name))
        if clean.startswith(("/", "..")) or clean in (".", "main.py"):
            raise BadRequest(f"files: {name!r} must be a relative path inside the working directory (not main.py)")
        try:
            out[clean] = base64.b64decode(str(data), validate=True)
        except (binascii.Error, ValueError):
            raise BadRequest(f"files: {name!r} is not base64") from None
    return out


def _handler(service: SandboxService, api_key: str) -> type[BaseHTTPRequestHandler]:
    """The run's secret on every route, as the rollout servers check it (servers/hf_server.py)."""
    expected = f"Bearer {api_key}".encode()

    class Handler(BaseHTTPRequestHandler):
        def _authorized(self) -> bool:
            given = (self.headers.get("Authorization") or "").encode("latin-1", "replace")
            if hmac.compare_digest(given, expected):
                return True
            self.close_connection = True  # the body is not read
            self._send(HTTPStatus.UNAUTHORIZED, {"detail": "Unauthorized"})
            return False

        def do_GET(self) -> None:
            if self._authorized():
                self._send(*service.handle("GET", self.path, None))

        def do_POST(self) -> None:
            if not self._authorized():
                return
            length = int(self.headers.get("Content-Length") or 0)
            if length > MAX_BODY_BYTES:
                self.close_connection = True
                self._send(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, {"status": "SandboxError", "message": "body too large"})
                return
            try:
                body = json.loads(self.rfile.read(length)) if length else None
            except ValueError:
                self._send(HTTPStatus.BAD_REQUEST, {"status": "SandboxError", "message": "the body is not JSON"})
                return
            self._send(*service.handle("POST", self.path, body))

        def _send(self, status: HTTPStatus, answer: dict[str, Any]) -> None:
            send_json(self, status, answer)

        def log_message(self, *args: Any) -> None:
            pass

    return Handler


class SandboxServer(ThreadingHTTPServer):
    """The listening service; ``start()`` serves on a thread of this process, ``stop()`` ends it cleanly."""

    daemon_threads = False  # stop() joins the request threads: no program outlives the server
    block_on_close = True

    def __init__(self, address: tuple[str, int], service: SandboxService, api_key: str) -> None:
        super().__init__(address, _handler(service, api_key))
        self.service = service
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> SandboxServer:
        self._thread = threading.Thread(target=self.serve_forever, name="sandbox-service", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._thread is not None:
            self.shutdown()
            self._thread.join()
            self._thread = None
        self.server_close()


def serve(*, host: str = "127.0.0.1", port: int = 0, api_key: str | None = None, **service: Any) -> SandboxServer:
    """The service bound to ``host:port`` (0: a free port), not yet serving (``.start()`` or ``serve_forever``).
    ``api_key``: default the run's secret (``$MEGATRON_RL_SERVER_API_KEY``, generated when unset);
    ``service``: SandboxService's limits."""
    return SandboxServer((host, port), SandboxService(**service), api_key or ensure_server_api_key())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0: any free port (printed as READY <port>)")
    parser.add_argument("--max-concurrency", type=int, default=4, help="programs running at once")
    parser.add_argument("--queue-timeout-s", type=float, default=30.0, help="a request's wait for a slot, then 503")
    parser.add_argument("--filesystem", choices=FILESYSTEMS, default="empty_root")
    parser.add_argument("--allow-network", action="store_true", help="programs share the host's network")
    parser.add_argument("--default-timeout-s", type=float, default=10.0)
    parser.add_argument("--max-timeout-s", type=float, default=60.0)
    parser.add_argument("--default-memory-mb", type=int, default=1024)
    parser.add_argument("--max-memory-mb", type=int, default=4096)
    args = parser.parse_args(argv)
    api_key = os.environ.get(API_KEY_ENV)
    if not api_key:  # never on the command line: other users of the host can read that (ps)
        parser.error(f"set {API_KEY_ENV} (the secret every request must carry as 'Authorization: Bearer ...')")
    server = serve(host=args.host, port=args.port, api_key=api_key, max_concurrency=args.max_concurrency,
                   queue_timeout_s=args.queue_timeout_s, filesystem=args.filesystem,
                   isolate_network=not args.allow_network, default_timeout_s=args.default_timeout_s,
                   max_timeout_s=args.max_timeout_s, default_memory_mb=args.default_memory_mb,
                   max_memory_mb=args.max_memory_mb)
    signal.signal(signal.SIGTERM, _exit_on_signal)
    print(f"READY {server.server_address[1]}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()  # joins the requests in flight


def _exit_on_signal(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt  # out of serve_forever, through main's finally


if __name__ == "__main__":
    main()
