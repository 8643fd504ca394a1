"""The first check of an engine's pass-through arguments (``rollout.engine_kwargs.<engine>``), the same for every
engine: a name megatron-rl sets itself is refused with the rollout key to use, a name the engine does not have with
its nearest real name."""
from __future__ import annotations

import difflib
from collections.abc import Collection, Mapping


def name_problem(name: str, key: str, known: Collection[str], owned: Mapping[str, str], what: str) -> str | None:
    """Why ``key.name`` cannot be passed (``what``: what a known name is, e.g. "a vLLM engine argument"), or None."""
    if name in owned:
        return f"{key}.{name} is set by megatron-rl: {owned[name]}"
    if name not in known:
        close = difflib.get_close_matches(name, sorted(known), n=1)
        return f"{key}.{name} is not {what}{f' (did you mean {close[0]}?)' if close else ''}"
    return None
