"""``compute_advantage``: run the configured estimator on a DataProto and store its outputs."""

from __future__ import annotations

import inspect
from typing import Any

import torch

from megatron_rl.algos.config_view import AlgoConfigLike
from megatron_rl.algos.estimators import get_adv_estimator
from megatron_rl.protocol import DataProto

_MISSING = object()


def compute_advantage(
    data: DataProto,
    adv_estimator: str,
    gamma: float = 1.0,
    lam: float = 1.0,
    num_repeat: int = 1,
    norm_adv_by_std_in_grpo: bool = True,
    config: AlgoConfigLike = None,
    **estimator_kwargs: Any,
) -> DataProto:
    """Write ``batch["advantages"]`` and ``batch["returns"]`` from the estimator named ``adv_estimator``.

    The estimator gets each of its parameters by name, from the first source that has it:
    the options (gamma, lam, num_repeat, norm_adv_by_std_in_grpo, config, and any extra keyword
    given here), then ``index`` = ``non_tensor_batch["uid"]``, then any ``batch`` tensor of that name
    (token_level_rewards, response_mask, values, reward_baselines, ...). A parameter with a default
    that no source has keeps its default; a required one is an error naming the missing field.
    An estimator taking ``**kwargs`` also receives every option. ``num_repeat`` (samples per prompt)
    is used by no built-in estimator, as in verl; it reaches custom ones that declare it. Returns
    ``data`` (modified in place, as verl does).
    """
    fn = get_adv_estimator(adv_estimator)
    options = dict(
        gamma=gamma,
        lam=lam,
        num_repeat=num_repeat,
        norm_adv_by_std_in_grpo=norm_adv_by_std_in_grpo,
        config=config,
        **estimator_kwargs,
    )
    kwargs = _bind_arguments(fn, adv_estimator, data, options)
    advantages, returns = fn(**kwargs)
    expected = tuple(data.batch["token_level_rewards"].shape) if "token_level_rewards" in data.batch else None
    for name, value in (("advantages", advantages), ("returns", returns)):
        if not isinstance(value, torch.Tensor) or (expected is not None and tuple(value.shape) != expected):
            seen = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise ValueError(
                f"adv_estimator {adv_estimator!r} returned {name} of shape {seen}, expected {expected}"
            )
    data.batch["advantages"] = advantages
    data.batch["returns"] = returns
    return data


def _bind_arguments(fn: Any, name: str, data: DataProto, options: dict[str, Any]) -> dict[str, Any]:
    params = inspect.signature(fn).parameters.values()
    kwargs: dict[str, Any] = {}
    for param in params:
        if param.kind is inspect.Parameter.VAR_KEYWORD:
            kwargs.update({k: v for k, v in options.items() if k not in kwargs})
            continue
        if param.kind is inspect.Parameter.VAR_POSITIONAL:
            continue
        value = _lookup(param.name, data, options)
        if value is not _MISSING:
            kwargs[param.name] = value
        elif param.default is inspect.Parameter.empty:
            field = 'non_tensor_batch["uid"]' if param.name == "index" else f'batch["{param.name}"]'
            raise ValueError(
                f"adv_estimator {name!r} needs {field}, which the DataProto lacks; it has "
                f"batch={sorted(data.batch.keys())} non_tensor_batch={sorted(data.non_tensor_batch)}"
            )
    return kwargs


def _lookup(param: str, data: DataProto, options: dict[str, Any]) -> Any:
    if param in options:
        return options[param]
    if param == "index":
        return data.non_tensor_batch.get("uid", _MISSING)
    return data.batch.get(param, _MISSING)
