"""run_multiprocess: ranks forked from a server that imported torch and Megatron-Core once start in a fraction of
the time spawned ones take, yet each is a fresh process that sees the caller's environment of the moment."""
from __future__ import annotations

import os
import sys

import pytest

from megatron_rl.distributed import run_multiprocess


def _rank_view(name: str) -> dict:
    import torch.distributed as dist

    return {"rank": dist.get_rank(), "env": os.environ.get(name), "pid": os.getpid(),
            "parallel_state_up": "megatron.core.parallel_state" in sys.modules
            and sys.modules["megatron.core.parallel_state"].model_parallel_is_initialized(),
            "megatron_imported": "megatron.core.models.gpt" in sys.modules}


def _set_parallel_state() -> bool:
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    return parallel_state.model_parallel_is_initialized()


def test_ranks_see_the_callers_environment_at_call_time(monkeypatch):
    first = run_multiprocess(_rank_view, 2, "MEGATRON_RL_SPAWN_PROBE")
    monkeypatch.setenv("MEGATRON_RL_SPAWN_PROBE", "second call")
    second = run_multiprocess(_rank_view, 2, "MEGATRON_RL_SPAWN_PROBE")
    assert [r["env"] for r in first] == [None, None]
    assert [r["env"] for r in second] == ["second call", "second call"]
    assert [r["rank"] for r in second] == [0, 1]


def test_each_call_gets_fresh_processes():
    assert run_multiprocess(_set_parallel_state, 2) == [True, True]
    after = run_multiprocess(_rank_view, 2, "HOME")
    assert not any(r["parallel_state_up"] for r in after)  # nothing of the last call's state
    assert os.getpid() not in {r["pid"] for r in after}


def test_ranks_start_from_a_server_that_imported_megatron_already():
    """Nothing here imports Megatron's GPT model, yet the ranks have it: they were forked from the server that
    imported it (a spawned rank imports torch and Megatron-Core itself first, 5-10 s on a 2-core machine)."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("with CUDA the ranks are spawned (a forkserver could hold a CUDA context)")
    assert all(r["megatron_imported"] for r in run_multiprocess(_rank_view, 2, "HOME"))
