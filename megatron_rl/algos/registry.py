"""Name -> function registries, so a config string picks an implementation and users can add their own."""

from __future__ import annotations

from enum import Enum
from typing import Any, Callable, Generic, Iterator, MutableMapping, Optional, TypeVar

F = TypeVar("F", bound=Callable)


def key_name(name: Any) -> str:
    """A registry key from a str or an Enum member (verl's ``AdvantageEstimator.GRPO``)."""
    if isinstance(name, Enum):
        name = name.value
    return name


class Registry(MutableMapping[str, F], Generic[F]):
    """Functions registered by name; an unknown name is an error that lists the known ones.

    ``kind`` and ``config_key`` only shape the error messages (e.g. "advantage estimator",
    "algorithm.adv_estimator"), so the user learns which setting to fix. Names may be given as
    strings or as Enum members (their value is the key).

    The registry is a mutable mapping, as verl's ``ADV_ESTIMATOR_REGISTRY`` / ``POLICY_LOSS_REGISTRY``
    dicts are: ``reg[name] = fn`` replaces, ``del reg[name]`` and ``clear()`` remove. Each entry can
    carry metadata (an estimator's traits): given at ``register``, else ``describe(fn)`` computes it,
    so an entry added by plain assignment is described like a decorated one.
    """

    def __init__(self, kind: str, config_key: str, describe: Optional[Callable[[F], Any]] = None) -> None:
        self._kind = kind
        self._config_key = config_key
        self._describe = describe
        self._entries: dict[str, F] = {}
        self._meta: dict[str, Any] = {}

    def _checked_name(self, name: Any) -> str:
        name = key_name(name)
        if not isinstance(name, str) or not name:
            raise ValueError(f"a {self._kind} needs a non-empty string name, got {name!r}")
        return name

    def register(self, name: Any, meta: Any = None) -> Callable[[F], F]:
        """Decorator. Re-registering the same function (a module reload) is harmless; a different
        function under a taken name is refused (verl does the same for estimators)."""
        name = self._checked_name(name)

        def decorator(fn: F) -> F:
            existing = self._entries.get(name)
            if existing is not None and existing is not fn:
                raise ValueError(
                    f"{self._kind} {name!r} is already registered to "
                    f"{getattr(existing, '__module__', '?')}.{getattr(existing, '__qualname__', existing)!s}; "
                    "choose another name"
                )
            self.assign(name, fn, meta)
            return fn

        return decorator

    def assign(self, name: Any, fn: F, meta: Any = None) -> None:
        """Add or replace ``name`` (verl's ``register_policy_loss`` and dict assignment)."""
        if not callable(fn):
            raise ValueError(f"{self._kind} {key_name(name)!r} must be callable, got {type(fn).__name__}")
        name = self._checked_name(name)
        self._entries[name] = fn
        self._meta[name] = meta if meta is not None or self._describe is None else self._describe(fn)

    def lookup(self, name: Any) -> F:
        """The function for ``name``; unknown -> ValueError naming the config key and the known names
        (``get`` keeps dict semantics: None on a miss)."""
        try:
            return self._entries[key_name(name)]
        except (KeyError, TypeError):
            raise ValueError(
                f"unknown {self._kind} {key_name(name)!r} ({self._config_key}); known: {self.names()}"
            ) from None

    def meta(self, name: Any) -> Any:
        self.lookup(name)
        return self._meta[key_name(name)]

    def names(self) -> list[str]:
        return list(self._entries)

    # MutableMapping: verl code reads, writes and clears these registries as dicts.
    def __getitem__(self, key: Any) -> F:
        return self._entries[key_name(key)]

    def __setitem__(self, key: Any, fn: F) -> None:
        self.assign(key, fn)

    def __delitem__(self, key: Any) -> None:
        del self._entries[key_name(key)]
        self._meta.pop(key_name(key), None)

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: Any) -> bool:
        try:
            return key_name(key) in self._entries
        except TypeError:
            return False

    def __repr__(self) -> str:
        return f"Registry({self._kind!r}, {list(self._entries)})"
