"""Learning-rate schedule from ``OptimConfig``, on Megatron's ``OptimizerParamScheduler``.

Units are trainer steps: the scheduler advances once per ``update_actor``/``update_critic`` call (as
verl's Megatron workers do), whatever the number of mini-batches in it.

* ``constant``: linear warm-up from 0 over ``lr_warmup_steps``, then ``lr``.
* ``cosine``: the same warm-up, then cosine decay to ``lr * min_lr_ratio`` at ``total_training_steps``.
"""

from __future__ import annotations

from typing import Any

from megatron_rl.config.schema import OptimConfig

LR_SCHEDULERS = ("constant", "cosine")


def check_optim_config(optim: OptimConfig, prefix: str, run_steps: int | None = None, *,
                       before_start: bool = False) -> None:
    """Raise ValueError naming ``<prefix>.<key>`` for settings the schedule cannot follow: the rule the engine runs
    when it builds the schedule and validation runs before launch (plan/validate.py, ``before_start=True``).
    ``run_steps``: the run's step count (trainer.total_training_steps), used where ``total_training_steps`` is -1
    because the trainer fills it in at start; before the start without it (null: counted from the data) the cosine
    schedule's length is not checked here."""
    if optim.lr_scheduler not in LR_SCHEDULERS:
        raise ValueError(
            f"{prefix}.lr_scheduler={str(optim.lr_scheduler)!r} is unknown; known: {list(LR_SCHEDULERS)}"
        )
    if not optim.lr > 0:
        raise ValueError(f"{prefix}.lr must be > 0, got {optim.lr}")
    if not 0.0 <= optim.min_lr_ratio <= 1.0:
        raise ValueError(f"{prefix}.min_lr_ratio must be in [0, 1], got {optim.min_lr_ratio}")
    if optim.lr_warmup_steps < 0:
        raise ValueError(f"{prefix}.lr_warmup_steps must be >= 0, got {optim.lr_warmup_steps}")
    total = optim.total_training_steps
    filled = total == -1 and run_steps is not None
    total = run_steps if filled else total
    unknown = before_start and total == -1
    if optim.lr_scheduler == "cosine" and not unknown and total <= optim.lr_warmup_steps:
        raise ValueError(
            f"{prefix}.lr_scheduler=cosine needs {prefix}.total_training_steps > lr_warmup_steps; got "
            f"total_training_steps={total}{' (trainer.total_training_steps)' if filled else ''}, "
            f"lr_warmup_steps={optim.lr_warmup_steps}{' (-1: the trainer did not fill it in)' if total == -1 else ''}"
        )


def build_lr_scheduler(optimizer: Any, optim: OptimConfig, prefix: str) -> Any:
    """An ``OptimizerParamScheduler`` driving ``optimizer``'s learning rate and weight decay."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    check_optim_config(optim, prefix)
    warmup = optim.lr_warmup_steps
    # Megatron needs decay steps > warm-up steps even for a constant schedule, which never decays.
    decay_steps = optim.total_training_steps if optim.lr_scheduler == "cosine" else warmup + 1
    return OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if warmup > 0 else optim.lr,
        max_lr=optim.lr,
        min_lr=optim.lr * optim.min_lr_ratio,
        lr_warmup_steps=warmup,
        lr_decay_steps=decay_steps,
        # a plain str: the scheduler's state goes into checkpoints, which torch.load(weights_only) reads back
        lr_decay_style=str(optim.lr_scheduler),
        start_wd=optim.weight_decay,
        end_wd=optim.weight_decay,
        wd_incr_steps=1,
        wd_incr_style="constant",
        use_checkpoint_opt_param_scheduler=True,
    )
