"""rollout.name=sglang: the settings SGLang would refuse when it starts, refused before anything starts, naming our
keys. ``check_config`` runs in validation (plan/validate.py, also under ``--dry-run``); it does not import sglang."""
from __future__ import annotations

from megatron_rl.config.access import plain
from megatron_rl.config.errors import require
from megatron_rl.config.schema import PPOTrainerConfig
from megatron_rl.rollout.sglang.server_args import ROLLOUT, check_engine_kwargs

__all__ = ["check_config"]


def check_config(cfg: PPOTrainerConfig) -> None:
    """rollout.engine_kwargs.sglang: only SGLang's own ServerArgs that megatron-rl does not set itself, with values
    SGLang takes, and only where they reach an engine (colocated: the ``sglang.Engine`` each replica builds)."""
    rollout = cfg.actor_rollout_ref.rollout
    kwargs = plain(rollout.engine_kwargs.sglang)
    if not kwargs:
        return
    key = f"{ROLLOUT}.engine_kwargs.sglang"
    require(rollout.mode != "server",
            f"{key}={kwargs} cannot reach SGLang servers started elsewhere ({ROLLOUT}.server_urls): start them with "
            "those arguments and drop the key, or use rollout.mode=colocated")
    check_engine_kwargs(kwargs, int(rollout.tensor_model_parallel_size), key)
