"""A short collective timeout for exactly the window a test is about, so a loaded machine's stalls elsewhere
(gloo rendezvous, a first weight sync) do not reach it."""
from __future__ import annotations

import contextlib
from datetime import timedelta
from types import ModuleType
from typing import Iterator

import torch.distributed as dist

#: the collective timeout of the ranks (run_multiprocess's pg_timeout_s), and the short one of the window
PG_TIMEOUT_S, WAIT_TIMEOUT_S = 120, 3


@contextlib.contextmanager
def short_timeout_while_waiting(module: ModuleType, *, from_now: bool = False) -> Iterator[None]:
    """The default group's collectives time out after WAIT_TIMEOUT_S from ``module``'s ``new_host_group``
    (``from_now``: from entering this context) until every rank has reached its ``wait_for_all``: a rank that
    waits for the slow step there (the bug these tests catch) fails. The collectives before and after keep
    PG_TIMEOUT_S, which no stall of a loaded machine reaches. Uses torch's private ``_set_pg_timeout`` and
    ``_get_default_store`` (torch 2.13)."""
    from torch.distributed.distributed_c10d import _get_default_store, _set_pg_timeout

    make, wait = module.new_host_group, module.wait_for_all
    if from_now:
        _set_pg_timeout(timedelta(seconds=WAIT_TIMEOUT_S))

    def new_host_group(*args, **kwargs):
        if not from_now:
            _set_pg_timeout(timedelta(seconds=WAIT_TIMEOUT_S))
        return make(*args, **kwargs)

    def wait_for_all(*args, **kwargs):
        _get_default_store().add("arrived", 1)
        wait(*args, **kwargs)
        if _get_default_store().add("arrived", 0) == dist.get_world_size():  # it did wait for every rank
            _set_pg_timeout(timedelta(seconds=PG_TIMEOUT_S))

    module.new_host_group, module.wait_for_all = new_host_group, wait_for_all
    try:
        yield
    finally:
        module.new_host_group, module.wait_for_all = make, wait
