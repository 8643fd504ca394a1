"""``verl.base_config.BaseConfig``: verl's config dataclasses read like a mapping (``cfg.get(key)``,
``cfg[key]``, ``dict(cfg)``) and their fields are set once (``_mutable_fields`` excepted)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import FrozenInstanceError, fields
from typing import Any, ClassVar

__all__ = ["BaseConfig"]


class BaseConfig(Mapping):
    """Mix into a dataclass; megatron-rl's loss functions read configs through this mapping view too."""

    _mutable_fields: ClassVar[set[str]] = set()

    def __setattr__(self, name: str, value: Any) -> None:
        # __init__ sets each field once; later writes are refused like verl's frozen configs
        if name in self.__dict__ and name not in type(self)._mutable_fields:
            raise FrozenInstanceError(f"Field '{name}' of {type(self).__name__} is frozen and cannot be modified")
        super().__setattr__(name, value)

    def get(self, key: str, default: Any = None) -> Any:
        return getattr(self, key, default)

    def __getitem__(self, key: str) -> Any:
        if not hasattr(self, key):
            raise KeyError(f"{type(self).__name__} has no key {key!r}")
        return getattr(self, key)

    def __iter__(self) -> Iterator[str]:
        return (f.name for f in fields(self))  # type: ignore[arg-type]

    def __len__(self) -> int:
        return len(fields(self))  # type: ignore[arg-type]
