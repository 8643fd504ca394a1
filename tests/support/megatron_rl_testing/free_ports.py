"""A preferred port for tests of ``reserved_port``, whose stride neighbours are free too."""
from __future__ import annotations

from megatron_rl.distributed import ports


def free_base(*offsets: int) -> int:
    """A port ``p`` with ``p + offset`` free on 127.0.0.1 for every offset (the ports a test's
    ``reserved_port`` calls may take)."""
    while True:
        base = ports.free_port()
        if base + max(offsets) < 65536 and all(ports._bindable(base + d, "127.0.0.1") for d in offsets):
            return base
