"""One JSON answer of a stdlib ``BaseHTTPRequestHandler`` (the HF-engine server's, the sandbox service's and the agent
proxy's routes)."""

from __future__ import annotations

import json
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler
from typing import Any

__all__ = ["send_json"]


def send_json(handler: BaseHTTPRequestHandler, status: HTTPStatus | int, answer: Any) -> None:
    """``answer`` as a JSON body with its length; a 401 says the scheme it wants (Bearer, the run's secret)."""
    data = json.dumps(answer).encode()
    handler.send_response(status)
    if status == HTTPStatus.UNAUTHORIZED:
        handler.send_header("WWW-Authenticate", "Bearer")
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(data)))
    handler.end_headers()
    handler.wfile.write(data)
