"""Name -> function registries, so a config string picks an implementation and users can add their own."""

from __future__ import annotations

from enum import Enum
from typing import Any, Callable, Generic, Iterator, Mapping, TypeVar

F = TypeVar("F", bound=Callable)


def key_name(name: Any) -> str:
    """A registry key from a str or an Enum member (verl's ``AdvantageEstimator.GRPO``)."""
    if isinstance(name, Enum):
        name = name.value
    return name


class Registry(Generic[F]):
    """Functions registered by name; an unknown name is an error that lists the known ones.

    ``kind`` and ``config_key`` only shape the error messages (e.g. "advantage estimator",
    "algorithm.adv_estimator"), so the user learns which setting to fix. Names may be given as
    strings or as Enum members (their value is the key). ``view()`` is a live read-only mapping,
    what verl exposes as ``ADV_ESTIMATOR_REGISTRY`` / ``POLICY_LOSS_REGISTRY``.
    """

    def __init__(self, kind: str, config_key: str) -> None:
        self._kind = kind
        self._config_key = config_key
        self._entries: dict[str, F] = {}

    def register(self, name: Any) -> Callable[[F], F]:
        name = key_name(name)
        if not isinstance(name, str) or not name:
            raise ValueError(f"a {self._kind} needs a non-empty string name, got {name!r}")

        def decorator(fn: F) -> F:
            existing = self._entries.get(name)
            # Re-registering the same function (a module reload) is harmless; silently replacing a
            # different one would change what a config means, so it is refused.
            if existing is not None and existing is not fn:
                raise ValueError(
                    f"{self._kind} {name!r} is already registered to "
                    f"{existing.__module__}.{existing.__qualname__}; "
                    "choose another name"
                )
            self._entries[name] = fn
            return fn

        return decorator

    def get(self, name: Any) -> F:
        try:
            return self._entries[key_name(name)]
        except (KeyError, TypeError):
            raise ValueError(
                f"unknown {self._kind} {key_name(name)!r} ({self._config_key}); known: {self.names()}"
            ) from None

    def __contains__(self, name: Any) -> bool:
        return key_name(name) in self._entries

    def names(self) -> list[str]:
        return list(self._entries)

    def view(self) -> "RegistryView[F]":
        return RegistryView(self._entries)


class RegistryView(Mapping[str, F]):
    """Read-only live view of a registry's entries (register through the decorator, not by assignment)."""

    def __init__(self, entries: dict[str, F]) -> None:
        self._entries = entries

    def __getitem__(self, key: Any) -> F:
        return self._entries[key_name(key)]

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: Any) -> bool:
        return key_name(key) in self._entries

    def __repr__(self) -> str:
        return f"RegistryView({list(self._entries)})"
