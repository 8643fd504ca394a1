"""Ports for rendezvous and servers that bind them seconds after they are picked."""
from __future__ import annotations

import contextlib
import fcntl
import os
import random
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path

__all__ = ["free_port", "reserved_port"]

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
    entropy, so processes seeded alike still differ) makes that unlikely; a port ``reserved_port`` holds is
    skipped, bound or not. The kernel's choice is the fallback.
    """
    draw = random.SystemRandom()
    high = _ephemeral_start()
    for _ in range(_TRIES if high > _PICK_FROM + 1 else 0):
        port = draw.randrange(_PICK_FROM, high)
        if _bindable(port, host) and not _reserved_elsewhere(port):
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _bindable(port: int, *hosts: str) -> bool:
    for host in hosts:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((host, port))
            except OSError:
                return False
    return True


def _reservations() -> Path:
    """One folder of lock files a host's processes share (sticky and world-writable, like /tmp itself)."""
    folder = Path(tempfile.gettempdir()) / "megatron-rl-ports"
    if not folder.is_dir():
        folder.mkdir(exist_ok=True)
        with contextlib.suppress(OSError):  # another user made it first: theirs is already shared
            folder.chmod(0o1777)
    return folder


def _reserve(port: int) -> int | None:
    """An fd holding ``port``'s lock, or None when another process of this host holds it."""
    try:
        fd = os.open(_reservations() / f"{port}.lock", os.O_RDWR | os.O_CREAT, 0o666)
    except OSError:
        return None  # a lock file another user made unreadable to us: theirs
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


def _reserved_elsewhere(port: int) -> bool:
    """Whether another process holds ``port`` with reserved_port (free now, bound by its holder soon)."""
    if not (_reservations() / f"{port}.lock").exists():
        return False
    fd = _reserve(port)
    if fd is None:
        return True
    os.close(fd)
    return False


@contextlib.contextmanager
def reserved_port(
    preferred: int, *, stride: int, attempts: int = 64, what: str = "the port"
) -> Iterator[int]:
    """``preferred`` if free, else ``preferred + k * stride`` for the first free k, kept from every other
    picker of this host until the block ends: bind it inside the block.

    A check-then-bind pick alone races: two engines started at once on one host (two jobs, or two test
    processes) both find the same port free and the later bind fails (EADDRINUSE). The lock (``flock``, freed
    by the kernel if the process dies) closes that gap among this module's callers; the bind check keeps
    ports anything else holds. ``what`` names the config key to change when no port is left.
    """
    for k in range(attempts):
        port = preferred + k * stride
        if port >= 65536:
            break
        fd = _reserve(port)
        if fd is None:
            continue
        try:
            if _bindable(port, "127.0.0.1", "0.0.0.0"):
                yield port
                return
        finally:
            os.close(fd)
    raise RuntimeError(
        f"no free port among {preferred} + k * {stride} (k < {attempts}); set {what} to a free range"
    )
