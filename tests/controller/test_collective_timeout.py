"""The workers' collectives wait as long as the longest call may take (controller/deadlines.py
collective_timeout_s): before, every process group timed out after 10 minutes whatever the deadlines said, so a rank
waiting in a collective for one still inside a 70B load (init_timeout_s 3600 s) or a save (save_timeout_s 1800 s)
was killed first, and verl's nccl_timeout=7200 only lengthened the driver's deadline."""

from __future__ import annotations

from datetime import timedelta

import pytest

from megatron_rl.config import ConfigError, load_config, typed_config
from megatron_rl.controller.deadlines import call_deadlines, collective_timeout_s
from megatron_rl.plan.validate import validate


def test_the_longest_call_deadline_by_default_and_the_key_when_set():
    cfg = typed_config(load_config(overrides=["+experiment=grpo_70b"]))
    longest = max(seconds for seconds, _ in call_deadlines(cfg).values())
    assert collective_timeout_s(cfg) == longest >= 3600.0  # init_timeout_s at least
    set_ = typed_config(load_config(overrides=["+experiment=grpo_70b", "ray_init.collective_timeout_s=7200"]))
    assert collective_timeout_s(set_) == 7200.0


@pytest.mark.parametrize("key", ["collective_timeout_s", "save_timeout_s", "timeout_s"])
def test_a_deadline_of_zero_is_refused_by_validation(key):
    with pytest.raises(ConfigError, match=rf"ray_init.{key}=0(\.0)? must be > 0 seconds"):
        validate(load_config(overrides=[f"ray_init.{key}=0"]))


def test_the_workers_process_groups_get_it(monkeypatch):
    """setup_parallel_state (every Megatron role's init_model) hands the timeout to torch.distributed and to
    Megatron's groups (distributed_timeout_minutes)."""
    from megatron_rl.config.schema import MegatronParallelConfig
    from megatron_rl.workers import hybrid

    seen = {}
    monkeypatch.setattr(hybrid, "init_distributed", lambda timeout: seen.setdefault("pg", timeout))
    monkeypatch.setattr(hybrid, "init_model_parallel", lambda **kw: seen.setdefault("megatron", kw["timeout_minutes"]))
    from megatron.core import parallel_state

    monkeypatch.setattr(parallel_state, "model_parallel_is_initialized", lambda: False)
    hybrid.setup_parallel_state(MegatronParallelConfig(), 7200.0)
    assert seen == {"pg": timedelta(seconds=7200), "megatron": 120}
