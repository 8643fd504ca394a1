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

__all__ = ["Scorer", "get_scorer", "register_scorer", "registered_data_sources", "EXTERNAL_SERVICE_SOURCES"]


@dataclass(frozen=True)
class Scorer:
    fn: Callable[..., Any]
    batched: bool = False
    # runs code: the reward manager passes it reward.sandbox_fusion's settings as keywords (sandbox_fusion_url,
    # memory_limit_mb, max_concurrent, continuous, run_timeout_s, max_tests), as verl's default_compute_score
    # gets sandbox_fusion_url and memory_limit_mb (reward/code_execution.py)
    sandbox: bool = False

    @property
    def name(self) -> str:
        fn = getattr(self.fn, "func", self.fn)  # functools.partial: name the wrapped function
        return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


_SCORERS: dict[str, Scorer] = {}
_PREFIX_SCORERS: dict[str, Scorer] = {}  # data_source prefix -> scorer (verl routes "aime*" by prefix)

# verl's default_compute_score sources that need a service megatron-rl does not run (none since the code sources
# got reward/code_execution.py); a source here without a scorer is refused by name, with what it needs.
EXTERNAL_SERVICE_SOURCES: dict[str, str] = {}


def register_scorer(
    *data_sources: str, batched: bool = False, prefixes: tuple[str, ...] = (), sandbox: bool = False
) -> Callable[[Callable], Callable]:
    """Decorator: ``@register_scorer("openai/gsm8k", "gsm8k")`` makes ``fn`` score those data sources;
    ``prefixes=("aime",)`` also every data_source starting with one (an exact name wins); ``sandbox``: ``fn`` takes
    the run's code-sandbox settings (``Scorer.sandbox``)."""
    if not (data_sources or prefixes) or not all(isinstance(d, str) and d for d in (*data_sources, *prefixes)):
        raise ValueError(
            f"register_scorer needs one or more non-empty data_source names, got {data_sources!r}"
        )

    def register(fn: Callable) -> Callable:
        scorer = Scorer(fn, batched, sandbox)
        for data_source in data_sources:
            known = _SCORERS.get(data_source)
            # The same function registering again (its module imported twice, e.g. as __main__) is harmless.
            if known is not None and known.name != scorer.name:
                raise ValueError(
                    f"data_source {data_source!r} already has the scorer {known.name}; "
                    f"refusing to replace it with {scorer.name}"
                )
            _SCORERS[data_source] = scorer
        for prefix in prefixes:
            known = _PREFIX_SCORERS.get(prefix)
            if known is not None and known.name != scorer.name:
                raise ValueError(f"data_source prefix {prefix!r} already has the scorer {known.name}")
            _PREFIX_SCORERS[prefix] = scorer
        return fn

    return register


def get_scorer(data_source: str) -> Scorer:
    try:
        return _SCORERS[data_source]
    except KeyError:
        for prefix in sorted(_PREFIX_SCORERS, key=len, reverse=True):
            if isinstance(data_source, str) and data_source.startswith(prefix):
                return _PREFIX_SCORERS[prefix]
        if data_source in EXTERNAL_SERVICE_SOURCES:
            raise ValueError(
                f"data_source {data_source!r} needs {EXTERNAL_SERVICE_SOURCES[data_source]}, which megatron-rl "
                "does not provide: register a scorer for it (megatron_rl.reward.register_scorer) or set "
                "reward.custom_reward_function.path"
            ) from None
        raise ValueError(
            f"no scorer registered for data_source {data_source!r}; registered: "
            f"{registered_data_sources()}. Register one with megatron_rl.reward.register_scorer or "
            f"set reward.custom_reward_function.path"
        ) from None


def registered_data_sources() -> list[str]:
    return sorted(_SCORERS) + sorted(f"{p}*" for p in _PREFIX_SCORERS)


def has_scorer(data_source: str) -> bool:
    """True when ``get_scorer(data_source)`` would return a scorer (exact name or prefix)."""
    try:
        get_scorer(data_source)
    except ValueError:
        return False
    return True


def missing_scorer_reason(data_source: str) -> str | None:
    """None when the data_source can be scored, else why not (an external service it needs, or no scorer)."""
    if has_scorer(data_source):
        return None
    return EXTERNAL_SERVICE_SOURCES.get(data_source, "no scorer registered")
