"""``<role>.optim.override_optimizer_config``: Megatron-Core ``OptimizerConfig`` fields, as verl passes them
(verl/utils/megatron/optimizer.py ``init_megatron_optim_config``: each entry set on the OptimizerConfig it builds).
verl's scripts use it for Megatron's CPU Adam: ``optimizer_cpu_offload=True``, ``optimizer_offload_fraction=1``,
``overlap_cpu_optimizer_d2h_h2d=True``, ``use_precision_aware_optimizer=True``: Adam's state (fp32 master weights,
m, v) lives in host memory and its step runs on the CPU (docs/workers.md, "CPU Adam").

What Megatron-Core 0.16.1 does with them (megatron/core/optimizer/):

- ``optimizer_cpu_offload``: ``__init__.py`` ``_get_megatron_optimizer_based_on_param_groups`` builds a
  ``HybridDeviceOptimizer`` (torch's AdamW, ``fused=True``, on the host share; the GPU Adam on the rest).
  It needs CUDA: ``cpu_offloading/hybrid_optimizer.py`` ``_init_sub_optimizers`` takes
  ``torch.cuda.current_stream()`` (and ``step`` waits on it), which a CPU torch cannot give ("Torch not compiled
  with CUDA enabled"); so a CPU run refuses it. There every tensor already lives in host memory and Adam steps on
  the CPU: what the key asks for is what a CPU run does.
- ``optimizer_offload_fraction``: the share of the GPU parameters (by count, whole tensors in order until the
  share is reached: ``_get_sub_optimizer_param_groups``) whose Adam state goes to the host. Read only there.
- ``overlap_cpu_optimizer_d2h_h2d``: one host optimizer per tensor and side CUDA streams for the copies
  (``torch.cuda.Stream()``). Read only there.
- ``use_precision_aware_optimizer``: asserted to come with ``use_distributed_optimizer`` and Adam
  (``optimizer_config.py`` ``__post_init__``); without CPU offload it needs Transformer Engine's FusedAdam
  (same place). With CPU offload it makes the distributed optimizer keep no fp32 master copy on the GPU
  (``distrib_optimizer.py`` ``_build_model_and_main_param_groups``: ``shard_main_param = None``): the host
  optimizer's own fp32 copy is the master. Without it the GPU keeps the fp32 master shard and the host a copy.

Fields megatron-rl sets from its own keys are refused naming that key; fields it does not pass are refused with
the reason; unknown names with the nearest field.
"""
from __future__ import annotations

import dataclasses
import difflib
import functools
from collections.abc import Mapping
from typing import Any

from megatron_rl.config.access import plain
from megatron_rl.config.errors import ConfigError

__all__ = ["CPU_ADAM_KEYS", "HostAdam", "check_optimizer_overrides", "host_adam", "optimizer_overrides"]

# OptimizerConfig fields built from megatron-rl's keys (relative to the role): name -> the key to use instead
OWNED_FIELDS: dict[str, str] = {
    "lr": "optim.lr",
    "min_lr": "optim.min_lr_ratio (x optim.lr)",
    "weight_decay": "optim.weight_decay",
    "adam_beta1": "optim.betas[0]",
    "adam_beta2": "optim.betas[1]",
    "clip_grad": "optim.clip_grad",
    "bf16": "megatron.params_dtype",
    "fp16": "megatron.params_dtype (fp16 training is not built here)",
    "params_dtype": "megatron.params_dtype",
    "use_distributed_optimizer": "megatron.use_distributed_optimizer",
    "optimizer": "fixed to adam: the optimizer here is AdamW",
    "decoupled_weight_decay": "fixed to true: the optimizer here is AdamW (Megatron's CPU offload asserts it too)",
}

# OptimizerConfig fields passed to Megatron as given: name -> (type check, what it must be)
_BOOL = (lambda v: isinstance(v, bool), "true or false")
PASSED_FIELDS: dict[str, tuple[Any, str]] = {
    "optimizer_cpu_offload": _BOOL,
    "optimizer_offload_fraction": (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)
                                   and 0.0 <= v <= 1.0, "a number in [0, 1]"),
    "overlap_cpu_optimizer_d2h_h2d": _BOOL,
    "use_precision_aware_optimizer": _BOOL,
    "use_torch_optimizer_for_cpu_offload": _BOOL,
    "pin_cpu_grads": _BOOL,
    "pin_cpu_params": _BOOL,
    "store_param_remainders": _BOOL,
    "adam_eps": (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0, "a number > 0"),
    "apply_wd_to_qk_layernorm": _BOOL,
    "log_num_zeros_in_grad": _BOOL,
}

# Megatron's fields megatron-rl does not pass, with the reason (others: the generic one below)
NOT_PASSED: dict[str, str] = {
    **{name: "one learning-rate schedule (optim.lr_scheduler) drives every parameter here"
       for name in ("decoupled_lr", "decoupled_min_lr")},
    **{name: "optimizer state below fp32 is not built here: gradients are reduced in fp32 and the planner counts "
             "fp32 master weights, m and v" for name in ("main_grads_dtype", "main_params_dtype", "exp_avg_dtype",
                                                         "exp_avg_sq_dtype")},
    **{name: "FP8 training is not built here" for name in ("fp8_recipe", "reuse_grad_buf_for_mxfp8_param_ag")},
    **{name: "the engine's DDP does not overlap the parameter all-gather, and Megatron needs both to agree"
       for name in ("overlap_param_gather", "overlap_param_gather_with_optimizer_step")},
    **{name: "loss scaling is for fp16 training, which is not built here (bf16 or fp32)"
       for name in ("loss_scale", "initial_loss_scale", "min_loss_scale", "loss_scale_window", "hysteresis")},
}
_NOT_PASSED_OTHER = ("the optimizer here is AdamW, so SGD's and Muon's settings and Megatron's timers and config "
                     "dumps are not passed")

# the keys verl's scripts pass for Megatron's CPU Adam
CPU_ADAM_KEYS = ("optimizer_cpu_offload", "optimizer_offload_fraction", "overlap_cpu_optimizer_d2h_h2d",
                 "use_precision_aware_optimizer")
# why optimizer_cpu_offload (and so overlap_cpu_optimizer_d2h_h2d, which needs it) is refused on a CPU run
_NEEDS_CUDA = ("Megatron's HybridDeviceOptimizer takes CUDA streams (megatron/core/optimizer/cpu_offloading/"
               "hybrid_optimizer.py, _init_sub_optimizers: torch.cuda.current_stream()) and offloads only CUDA "
               "parameters")


@functools.lru_cache(maxsize=1)
def optimizer_config_fields() -> frozenset[str]:
    """The fields of the installed Megatron-Core's OptimizerConfig (0.16.1)."""
    from megatron.core.optimizer.optimizer_config import OptimizerConfig

    return frozenset(f.name for f in dataclasses.fields(OptimizerConfig) if not f.name.startswith("_"))


def _megatron_default(name: str) -> Any:
    """The installed OptimizerConfig's default of field ``name`` (verl's test scripts write the defaults out)."""
    from megatron.core.optimizer.optimizer_config import OptimizerConfig

    return next(f.default for f in dataclasses.fields(OptimizerConfig) if f.name == name)


def _name_problem(name: str, value: Any, key: str) -> str | None:
    if name in OWNED_FIELDS:
        return f"{key}.{name} is set by megatron-rl: use {OWNED_FIELDS[name]}"
    known = optimizer_config_fields()
    if name not in known:
        close = difflib.get_close_matches(name, sorted(known), n=1)
        return (f"{key}.{name} is not a Megatron-Core OptimizerConfig field"
                f"{f' (did you mean {close[0]}?)' if close else ''}")
    if name not in PASSED_FIELDS:
        return f"{key}.{name} is not passed to Megatron here: {NOT_PASSED.get(name, _NOT_PASSED_OTHER)}"
    check, what = PASSED_FIELDS[name]
    return None if check(value) else f"{key}.{name}={value!r} must be {what}"


def check_optimizer_overrides(overrides: Mapping[str, Any] | None, key: str, *, on_cpu: bool,
                              distributed_optimizer: bool) -> dict[str, Any]:
    """``overrides`` (the mapping at config key ``key``, e.g. ``actor_rollout_ref.actor.optim.override_optimizer_
    config``) as plain values, or a ConfigError naming every key it refuses. ``on_cpu``: a CPU run (no CUDA);
    ``distributed_optimizer``: the role's ``megatron.use_distributed_optimizer``."""
    overrides = dict(plain(overrides) or {})
    role = key.rsplit(".optim.", 1)[0]
    problems = [p for name in sorted(overrides) if (p := _name_problem(name, overrides[name], key))]
    if problems:
        raise ConfigError("; ".join(problems))
    offload = overrides.get("optimizer_cpu_offload", False)
    for name in ("optimizer_offload_fraction", "overlap_cpu_optimizer_d2h_h2d", "use_torch_optimizer_for_cpu_offload",
                 "pin_cpu_grads", "pin_cpu_params"):
        if name in overrides and not offload and overrides[name] != _megatron_default(name):  # its default: says nothing
            problems.append(f"{key}.{name}={overrides[name]!r} has no effect without {key}.optimizer_cpu_offload=true "
                            "(Megatron reads it only for its CPU-offloaded optimizer); set both or drop it")
    if on_cpu and offload:  # (its companions are refused above without it)
        given = ", ".join(name for name in CPU_ADAM_KEYS if name in overrides)
        problems.append(f"{key}.optimizer_cpu_offload=true cannot run on CPU (trainer.device=cpu, or auto without "
                        f"CUDA): {_NEEDS_CUDA}. On CPU Adam's state is in host memory and its step runs on the CPU "
                        f"already: drop {key}.{{{given}}}")
    if overrides.get("use_precision_aware_optimizer") and not distributed_optimizer:
        problems.append(f"{key}.use_precision_aware_optimizer=true needs {role}.megatron.use_distributed_optimizer="
                        "true (Megatron-Core asserts it: optimizer_config.py __post_init__)"
                        + (", which a CPU run does not have (it needs Transformer Engine or Apex); drop the key"
                           if on_cpu else ""))
    if problems:
        raise ConfigError("; ".join(problems))
    return overrides


def optimizer_overrides(optim: Any, key: str, *, on_cpu: bool, distributed_optimizer: bool) -> dict[str, Any]:
    """The checked ``optim.override_optimizer_config`` of a role's OptimConfig (``key``: the role's ``optim``
    key), ready to set on Megatron's OptimizerConfig."""
    return check_optimizer_overrides(getattr(optim, "override_optimizer_config", None) or {},
                                     f"{key}.override_optimizer_config", on_cpu=on_cpu,
                                     distributed_optimizer=distributed_optimizer)


@dataclasses.dataclass(frozen=True)
class HostAdam:
    """Where Megatron's CPU Adam puts a role's Adam state: ``fraction`` of it in host memory (0: none); with
    ``master_on_host`` false (no precision-aware optimizer) the fp32 master weights also stay on the GPU."""

    fraction: float = 0.0
    master_on_host: bool = True

    def gpu_bytes(self, optimizer: float, master: float) -> float:
        """GPU bytes of Adam state ``optimizer`` (master weights ``master`` of it, m and v the rest)."""
        if self.master_on_host:
            return optimizer * (1.0 - self.fraction)
        return master + (optimizer - master) * (1.0 - self.fraction)

    def label(self) -> str:
        """What the plan's optimizer row says ('' without CPU offload)."""
        if self.fraction <= 0:
            return ""
        share = f"{self.fraction:.0%}"
        if self.master_on_host:
            return f"; CPU Adam: {share} in host memory"
        return f"; CPU Adam: {share} of m, v in host memory, fp32 master weights here"


def host_adam(optim: Any) -> HostAdam:
    """The HostAdam of a role's OptimConfig (no check: validation has run)."""
    overrides = plain(getattr(optim, "override_optimizer_config", None) or {}) or {}
    if not overrides.get("optimizer_cpu_offload"):
        return HostAdam()
    return HostAdam(float(overrides.get("optimizer_offload_fraction", 0.0)),
                    bool(overrides.get("use_precision_aware_optimizer", False)))
