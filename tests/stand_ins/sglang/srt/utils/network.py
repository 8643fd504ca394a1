"""Stand-in of the port helpers of ``sglang.srt.utils.network`` (0.5.23 behaviour, own code)."""

from __future__ import annotations

import random
import socket

__all__ = ["get_free_port", "get_free_port_below_ephemeral", "try_bind_socket"]


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def try_bind_socket(host: str, port: int) -> socket.socket:
    """Bind (IPv4, no SO_REUSEADDR) and return the socket; OSError when the port is taken."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


def get_free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


def get_free_port_below_ephemeral(low: int = 22000, high: int = 29999, attempts: int = 64) -> int:
    """A port that is free NOW, drawn with the global ``random`` module below the ephemeral range.

    As in 0.5.23 the port is only test-bound and released: the scheduler binds it later, so two
    processes with the same ``random`` state pick the same port and the later binder fails (EADDRINUSE).
    """
    high = min(high, _ephemeral_low() - 1)
    if high - low + 1 < attempts:
        return get_free_port()
    for port in random.sample(range(low, high + 1), attempts):
        try:
            try_bind_socket("0.0.0.0", port).close()
            return port
        except OSError:
            continue
    return get_free_port()
