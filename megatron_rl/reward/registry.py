"""Scorer registry: ``data_source`` -> the function that scores a response for it.

A per-sample scorer has verl's signature
``fn(data_source, solution_str, ground_truth, extra_info) -> float | dict`` (a dict carries ``"score"``
plus per-sample extras such as ``"acc"``). A batched scorer takes the same arguments as lists
(``data_sources, solution_strs, ground_truths, extra_infos``) and returns a list of the same length.

Scorers run in worker processes, so they must be importable module-level functions (or
``functools.partial`` objects of one); their modules register them on import.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["Scorer", "get_scorer", "register_scorer", "registered_data_sources"]


@dataclass(frozen=True)
class Scorer:
    fn: Callable[..., Any]
    batched: bool = False

    @property
    def name(self) -> str:
        fn = getattr(self.fn, "func", self.fn)  # functools.partial: name the wrapped function
        return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


_SCORERS: dict[str, Scorer] = {}


def register_scorer(*data_sources: str, batched: bool = False) -> Callable[[Callable], Callable]:
    """Decorator: ``@register_scorer("openai/gsm8k", "gsm8k")`` makes ``fn`` score those data sources."""
    if not data_sources or not all(isinstance(d, str) and d for d in data_sources):
        raise ValueError(
            f"register_scorer needs one or more non-empty data_source names, got {data_sources!r}"
        )

    def register(fn: Callable) -> Callable:
        scorer = Scorer(fn, batched)
        for data_source in data_sources:
            known = _SCORERS.get(data_source)
            # The same function registering again (its module imported twice, e.g. as __main__) is harmless.
            if known is not None and known.name != scorer.name:
                raise ValueError(
                    f"data_source {data_source!r} already has the scorer {known.name}; "
                    f"refusing to replace it with {scorer.name}"
                )
            _SCORERS[data_source] = scorer
        return fn

    return register


def get_scorer(data_source: str) -> Scorer:
    try:
        return _SCORERS[data_source]
    except KeyError:
        raise ValueError(
            f"no scorer registered for data_source {data_source!r}; registered: "
            f"{registered_data_sources()}. Register one with megatron_rl.reward.register_scorer or "
            f"set reward.custom_reward_function.path"
        ) from None


def registered_data_sources() -> list[str]:
    return sorted(_SCORERS)
