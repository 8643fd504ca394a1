"""free_port: rendezvous and server ports are drawn below the kernel's ephemeral range, where no outgoing
connection of the host can take them between the draw and the bind (a two-process test run once lost a
MASTER_PORT that way: EADDRINUSE in init_process_group).

reserved_port: a preferred port (or the next free one a stride on) held from every other picker of the host
until its user has bound it (CI once started two SGLang engines at once that both picked 24002)."""
from __future__ import annotations

import random
import socket
import subprocess
import sys

import pytest

from megatron_rl.distributed import ports
from megatron_rl.distributed.ports import free_port
from megatron_rl_testing.free_ports import free_base


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


def _draw(monkeypatch, *drawn: int) -> None:
    """free_port's random draws are ``drawn``, in order, from a range that holds them all."""
    draws = iter(drawn)
    monkeypatch.setattr(ports.random, "SystemRandom", lambda: type("Draw", (), {
        "randrange": staticmethod(lambda low, high: next(draws))})())
    monkeypatch.setattr(ports, "_ephemeral_start", lambda: 65000)


def test_a_taken_draw_is_skipped(monkeypatch):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        busy, free = taken.getsockname()[1], free_port()
        _draw(monkeypatch, busy, busy, free)
        assert free_port() == free


def test_without_room_below_the_range_the_kernel_chooses(monkeypatch):
    monkeypatch.setattr(ports, "_ephemeral_start", lambda: ports._PICK_FROM)
    port = free_port()
    assert port > 0
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))


def _base() -> int:
    """A preferred port whose +1 and +1000 neighbours are free too (the tests below use them)."""
    return free_base(1, 1000, 2000)


def test_a_reserved_port_is_skipped_until_its_block_ends():
    base = _base()
    with ports.reserved_port(base, stride=1000) as first:
        assert first == base
        with ports.reserved_port(base, stride=1000) as second:
            assert second == base + 1000  # free, but reserved by the block above: the next one
    with ports.reserved_port(base, stride=1000) as again:
        assert again == base


def test_a_bound_port_is_skipped():
    base = _base()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", base))
        with ports.reserved_port(base, stride=1000) as port:
            assert port == base + 1000


def test_no_free_port_names_the_key_to_change():
    base = _base()
    with ports.reserved_port(base, stride=1000):
        with pytest.raises(RuntimeError, match=rf"no free port among {base} \+ k \* 1000 \(k < 1\); set "
                                               r"rollout\.sglang\.port_base to a free range"):
            with ports.reserved_port(base, stride=1000, attempts=1, what="rollout.sglang.port_base"):
                pass


def test_a_dead_holders_reservation_is_free():
    """The kernel drops a flock with its process: a killed engine's start leaves no stale reservation."""
    base = _base()
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from megatron_rl.distributed import ports\n"
         f"with ports.reserved_port({base}, stride=1000):\n print('held', flush=True); time.sleep(600)"],
        stdout=subprocess.PIPE, text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        with ports.reserved_port(base, stride=1000) as port:
            assert port == base + 1000
    finally:
        holder.kill()
        holder.wait()
    with ports.reserved_port(base, stride=1000) as port:
        assert port == base


def test_free_port_skips_a_reserved_port(monkeypatch):
    base = _base()
    with ports.reserved_port(base, stride=1000) as held:
        _draw(monkeypatch, held, held + 1)
        assert free_port() == held + 1
