"""Ports for rendezvous and servers that bind them seconds after they are picked."""
from __future__ import annotations

import random
import socket

__all__ = ["free_port"]

_PICK_FROM = 20000  # above Ray's worker ports (10002-19999) and the usual service ports
_TRIES = 64


def _ephemeral_start() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port of ``host`` that was free a moment ago, drawn at random below the kernel's ephemeral range.

    Its user binds it seconds later (a TCPStore once torch is imported, a server once it has loaded). A port
    the kernel chose (binding port 0) is one it hands out again meanwhile to any outgoing connection of the
    host; below that range only another picker like this one could take it, and the draw (from the system's
    entropy, so processes seeded alike still differ) makes that unlikely. The kernel's choice is the fallback.
    """
    draw = random.SystemRandom()
    high = _ephemeral_start()
    for _ in range(_TRIES if high > _PICK_FROM + 1 else 0):
        port = draw.randrange(_PICK_FROM, high)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]
