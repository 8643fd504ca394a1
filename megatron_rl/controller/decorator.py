"""``@register``: how a worker method is called across the ranks of a worker group.

The decorator only attaches a ``MethodSpec`` to the function; the worker runs unchanged under
torchrun, and ``RayWorkerGroup`` reads the spec to split the arguments, pick the ranks that run and
combine their results.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

__all__ = ["Dispatch", "Execute", "MethodSpec", "register", "method_spec", "registered_methods"]

_SPEC_ATTR = "__megatron_rl_method_spec__"

F = TypeVar("F", bound=Callable[..., Any])


class Dispatch(enum.Enum):
    """How the driver's arguments reach the ranks and how their results come back."""

    ONE_TO_ALL = "one_to_all"  # same arguments to every rank; list of results by rank
    ALL_TO_ALL = "all_to_all"  # every argument is a list with one item per rank; list of results by rank
    RANK_ZERO = "rank_zero"  # same arguments to every rank (collectives need them all); rank 0's result
    DP_COMPUTE_PROTO = "dp_compute_proto"  # every rank is a DP rank: DataProto split, results concatenated
    MEGATRON_COMPUTE_PROTO = "megatron_compute_proto"  # one shard per DP group, collected from its last stage
    ROLLOUT_COMPUTE_PROTO = "rollout_compute_proto"  # one shard per rollout engine replica, run by its leader only


class Execute(enum.Enum):
    """Which ranks run the method."""

    ALL = "all"
    RANK_ZERO = "rank_zero"  # only rank 0 runs (no collectives inside); its result is returned


# Execute.RANK_ZERO makes sense only where rank 0 needs no peer's data and no peer's result.
_RANK_ZERO_COMPATIBLE = {Dispatch.ONE_TO_ALL, Dispatch.RANK_ZERO}


@dataclass(frozen=True)
class MethodSpec:
    dispatch_mode: Dispatch
    execute_mode: Execute
    blocking: bool


def register(
    dispatch_mode: Dispatch = Dispatch.ONE_TO_ALL,
    execute_mode: Execute = Execute.ALL,
    blocking: bool = True,
) -> Callable[[F], F]:
    """Mark a worker method as callable from the driver through a worker group.

    ``blocking=False`` makes the group call return a ``PendingCall`` (call ``.get()``) instead of the
    result; every registered method also has ``.async_(...)`` for that.
    """
    if not isinstance(dispatch_mode, Dispatch):
        raise TypeError(f"register: dispatch_mode must be a Dispatch member, got {dispatch_mode!r}")
    if not isinstance(execute_mode, Execute):
        raise TypeError(f"register: execute_mode must be an Execute member, got {execute_mode!r}")
    if execute_mode is Execute.RANK_ZERO and dispatch_mode not in _RANK_ZERO_COMPATIBLE:
        raise ValueError(
            f"register: execute_mode=RANK_ZERO cannot be combined with {dispatch_mode.name}; "
            f"it needs one of {sorted(m.name for m in _RANK_ZERO_COMPATIBLE)}"
        )
    spec = MethodSpec(dispatch_mode, execute_mode, blocking)

    def decorate(fn: F) -> F:
        if not callable(fn):
            raise TypeError(f"register must decorate a function, got {fn!r}")
        setattr(fn, _SPEC_ATTR, spec)
        return fn

    return decorate


def method_spec(fn: Any) -> MethodSpec | None:
    """The spec ``@register`` attached to ``fn``, or None for a plain method."""
    return getattr(fn, _SPEC_ATTR, None)


def attach_spec(fn: F, spec: MethodSpec) -> F:
    """Give a wrapper the same spec as the method it forwards to (colocated routing)."""
    setattr(fn, _SPEC_ATTR, spec)
    return fn


def registered_methods(cls: type) -> dict[str, MethodSpec]:
    """Every ``@register``-ed method of ``cls`` (inherited ones included), by name."""
    out = {}
    for name in dir(cls):
        spec = method_spec(getattr(cls, name, None))
        if spec is not None:
            out[name] = spec
    return out
