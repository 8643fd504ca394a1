"""The run's secret on every route of a vLLM server (docs/rollout.md, "vLLM servers"): an ASGI middleware that
``server_command`` installs with vLLM's own ``--middleware`` flag, not a fork of vLLM.

vLLM 0.32 checks its API key on ``/v1``, ``/v2``, ``/inference`` and ``/cohere`` only, and never on OPTIONS
(vllm/entrypoints/serve/middleware/authenticate.py:11 and :48-59); the dev routes the run's servers need
(``VLLM_SERVER_DEV_MODE=1``: ``/collective_rpc``, ``/pause``, ``/sleep``, ``/reset_prefix_cache``, ...,
vllm/entrypoints/launchers/api_server/routers.py:40-47) took no key, so any local user drove them on 127.0.0.1.
This one wants ``Authorization: Bearer $VLLM_API_KEY`` on every path, method and websocket; anything else gets
401 before the route or the body is looked at. vLLM adds a ``--middleware`` class last, so it runs first
(vllm/entrypoints/serve/middleware/register.py:65-69; Starlette wraps the last added outermost).

Imported by vLLM's API server process: the standard library only.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from typing import Any, Awaitable, Callable

__all__ = ["KEY_ENV", "MIDDLEWARE", "RunSecretMiddleware"]

KEY_ENV = "VLLM_API_KEY"  # the run's secret as the vLLM launch spec gives it (the variable vLLM reads for /v1)
MIDDLEWARE = "megatron_rl.servers.route_auth.RunSecretMiddleware"
_REFUSAL = json.dumps({"detail": "Unauthorized"}).encode()


class RunSecretMiddleware:
    """Pass a request on only with the run's secret; built by Starlette with the app alone (``--middleware``),
    so the secret comes from the server's environment. A server without one refuses to start."""

    def __init__(self, app: Callable[..., Awaitable[None]]) -> None:
        key = os.environ.get(KEY_ENV)
        if not key:
            raise RuntimeError(f"{MIDDLEWARE} needs the run's secret in ${KEY_ENV}: without it every route of this "
                               "vLLM server would be open to any local user")
        self.app = app
        self._expected = hashlib.sha256(f"Bearer {key}".encode()).digest()

    def _authorized(self, scope: dict[str, Any]) -> bool:
        given = next((value for name, value in scope.get("headers", ()) if name.lower() == b"authorization"), b"")
        return hmac.compare_digest(hashlib.sha256(given).digest(), self._expected)

    async def __call__(self, scope: dict[str, Any], receive: Callable, send: Callable) -> None:
        if scope["type"] not in ("http", "websocket") or self._authorized(scope):
            await self.app(scope, receive, send)  # lifespan events carry no request
        elif scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})  # policy violation, before the handshake
        else:
            await send({"type": "http.response.start", "status": 401,
                        "headers": [(b"content-type", b"application/json"), (b"www-authenticate", b"Bearer"),
                                    (b"content-length", str(len(_REFUSAL)).encode())]})
            await send({"type": "http.response.body", "body": _REFUSAL})
