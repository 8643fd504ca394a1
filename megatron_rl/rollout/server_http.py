"""One HTTP rollout server, as every engine's client speaks to it: JSON in, JSON out, the run's secret on every
request (``server_key.server_api_key``), one timeout per request, and errors that name the engine, the URL, the
route and the server's own message (a timeout also names the key that sets it). SGLang's and the HF-engine
servers' client (``sglang.server_transport.ServerHTTP``) and vLLM's (``vllm.server.VLLMServerHTTP``) are this
class with their engine's name, error type and route checks."""
from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

from megatron_rl.rollout.server_key import server_api_key

__all__ = ["REQUEST_TIMEOUT_KEY", "SERVER_URLS_KEY", "ServerHTTPBase", "check_reachable"]

REQUEST_TIMEOUT_KEY = "actor_rollout_ref.rollout.sglang.request_timeout_s"  # bounds one HTTP request, any engine
SERVER_URLS_KEY = "actor_rollout_ref.rollout.server_urls"


class ServerHTTPBase:
    """One server at ``url``; ``timeout_s`` bounds each request (None waits). Subclasses name their ``engine``
    and ``error`` (raised for every failure) and may check a route's body before it is sent (``checked_body``)."""

    engine = "rollout"
    error: type[Exception] = RuntimeError
    json_only = False  # an answer that is not JSON: returned as text, or (True) an error

    def __init__(self, url: str, timeout_s: float | None, headers: dict[str, str] | None = None,
                 send_secret: bool = True) -> None:
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        secret = {"Authorization": f"Bearer {key}"} if send_secret and (key := server_api_key()) else {}
        self._auth = {**(headers or {}), **secret}  # extra headers (a tool service's), the run's secret over them

    def checked_body(self, route: str, body: dict[str, Any]) -> dict[str, Any]:
        return body

    def request(self, route: str, body: dict[str, Any] | None = None, method: str = "POST") -> Any:
        """The answer of ``route``: parsed JSON, the text where it is not JSON, None when empty."""
        data = None if body is None else json.dumps(self.checked_body(route, body)).encode()
        req = urllib.request.Request(self.url + route, data=data, method=method,
                                     headers={"Content-Type": "application/json", **self._auth})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace")[:500]
            raise self.error(f"{self.engine} {self.url}{route} answered {exc.code}: {detail}") from exc
        except OSError as exc:  # URLError, ConnectionError, TimeoutError
            if isinstance(exc, TimeoutError) or isinstance(getattr(exc, "reason", None), TimeoutError):
                raise self.error(f"{self.engine} server {self.url}{route} gave no answer within {self.timeout_s:g} s: "
                                 f"raise {REQUEST_TIMEOUT_KEY} (null waits)") from exc
            raise self.error(f"{self.engine} server {self.url}{route} unreachable: {exc}") from exc
        if not raw:
            return None
        try:
            return json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            if self.json_only:
                raise self.error(f"{self.engine} {self.url}{route} answered with no JSON: "
                                 f"{raw[:200].decode(errors='replace')!r}") from exc
            return raw.decode(errors="replace")


def check_reachable(servers: list[ServerHTTPBase], route: str) -> None:
    """Each server answers ``route`` (GET) at all: the first request a run's client makes of servers started
    elsewhere, made by preflight too (rollout/engines.py, EngineSpec.check_here), so a URL nothing listens at is
    refused before launch rather than when trainer rank 0 builds its engine under Ray. An HTTP error is an answer
    (the client's own request checks what it says); a connection refused, a name that does not resolve or no
    answer within the server's timeout is refused with a ValueError naming the key, each URL and the engine."""
    problems = []
    for server in servers:
        try:
            server.request(route, method="GET")
        except server.error as err:
            if not isinstance(err.__cause__, urllib.error.HTTPError):
                problems.append(str(err))
    if problems:
        raise ValueError(f"{SERVER_URLS_KEY}: {'; '.join(problems)}. Start the servers before the run (they are "
                         f"started elsewhere), or fix {SERVER_URLS_KEY}")
