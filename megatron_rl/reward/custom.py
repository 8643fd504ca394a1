"""Load a user's scorer from a Python file (``reward.custom_reward_function.path`` + ``.name``).

The function keeps verl's signature ``compute_score(data_source, solution_str, ground_truth, extra_info)``
(or the list form for ``reward.reward_manager=batch``). :class:`FileFunction` refers to it by file and
name, so it can be sent to scoring worker processes, which load the file themselves.
"""

from __future__ import annotations

import hashlib
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

__all__ = ["FileFunction", "load_custom_scorer"]

_MODULES: dict[str, ModuleType] = {}  # path -> module, per process


def _load_module(path: str) -> ModuleType:
    if path not in _MODULES:
        name = "megatron_rl_custom_reward_" + hashlib.sha1(path.encode()).hexdigest()[:12]
        spec = importlib.util.spec_from_file_location(name, path)
        if spec is None or spec.loader is None:
            raise ImportError(f"cannot load {path!r} as a Python module")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # lets pickle and dataclasses inside the file resolve the module
        spec.loader.exec_module(module)
        _MODULES[path] = module
    return _MODULES[path]


class FileFunction:
    """A picklable reference to the function ``name`` defined in the Python file ``path``."""

    def __init__(self, path: str, name: str) -> None:
        self.path, self.name = path, name

    def resolve(self) -> Callable[..., Any]:
        return getattr(_load_module(self.path), self.name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.resolve()(*args, **kwargs)

    def __repr__(self) -> str:
        return f"FileFunction({self.path!r}, {self.name!r})"


def load_custom_scorer(path: str, name: str = "compute_score") -> FileFunction:
    """Check that ``path`` defines a callable ``name`` (importing it here) and return a reference to it."""
    resolved = Path(path).expanduser().resolve()
    if not resolved.is_file():
        raise FileNotFoundError(f"reward.custom_reward_function.path={path!r} is not a file")
    try:
        module = _load_module(str(resolved))
    except Exception as e:
        raise ImportError(
            f"reward.custom_reward_function.path={path!r} failed to import: {type(e).__name__}: {e}"
        ) from e
    fn = getattr(module, name, None)
    if not callable(fn):
        public = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_"))
        raise AttributeError(
            f"reward.custom_reward_function.name={name!r} is not a function in {path!r}; it defines: {public}"
        )
    return FileFunction(str(resolved), name)
