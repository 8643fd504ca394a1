"""free_port: rendezvous and server ports are drawn below the kernel's ephemeral range, where no outgoing
connection of the host can take them between the draw and the bind (a two-process test run once lost a
MASTER_PORT that way: EADDRINUSE in init_process_group)."""
from __future__ import annotations

import random
import socket

from megatron_rl.distributed import ports
from megatron_rl.distributed.ports import free_port


def test_the_port_is_bindable_and_below_the_ephemeral_range():
    for _ in range(20):
        port = free_port()
        assert ports._PICK_FROM <= port < ports._ephemeral_start()
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))


def test_processes_seeded_alike_still_draw_different_ports():
    random.seed(0)
    first = [free_port() for _ in range(5)]
    random.seed(0)
    assert [free_port() for _ in range(5)] != first


def test_a_taken_draw_is_skipped(monkeypatch):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        busy, free = taken.getsockname()[1], free_port()
        draws = iter([busy, busy, free])
        monkeypatch.setattr(ports.random, "SystemRandom", lambda: type("Draw", (), {
            "randrange": staticmethod(lambda low, high: next(draws))})())
        monkeypatch.setattr(ports, "_ephemeral_start", lambda: 65000)
        assert free_port() == free


def test_without_room_below_the_range_the_kernel_chooses(monkeypatch):
    monkeypatch.setattr(ports, "_ephemeral_start", lambda: ports._PICK_FROM)
    port = free_port()
    assert port > 0
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))

