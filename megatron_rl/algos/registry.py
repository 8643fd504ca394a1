"""Name -> function registries, so a config string picks an implementation and users can add their own."""

from __future__ import annotations

from typing import Callable, Generic, TypeVar

F = TypeVar("F", bound=Callable)


class Registry(Generic[F]):
    """Functions registered by name; an unknown name is an error that lists the known ones.

    ``kind`` and ``config_key`` only shape the error messages (e.g. "advantage estimator",
    "algorithm.adv_estimator"), so the user learns which setting to fix.
    """

    def __init__(self, kind: str, config_key: str) -> None:
        self._kind = kind
        self._config_key = config_key
        self._entries: dict[str, F] = {}

    def register(self, name: str) -> Callable[[F], F]:
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

    def get(self, name: str) -> F:
        try:
            return self._entries[name]
        except KeyError:
            raise ValueError(
                f"unknown {self._kind} {name!r} ({self._config_key}); known: {self.names()}"
            ) from None

    def names(self) -> list[str]:
        return list(self._entries)
