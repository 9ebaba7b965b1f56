"""A tiny name -> class registry shared by filters and objectives.

Config files name a variant (``filter: sa_opd``); the registry maps that name to the class whose
dataclass fields are its hyperparameters. A miss lists the valid names, and unknown keyword
arguments are reported by name, so a typo in a config never fails deep inside a constructor.
Families described by records rather than classes (the benchmarks of :mod:`saopd.eval`) register
the record itself with :meth:`Registry.add`; ``get`` then returns that record.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """Maps config names to classes of one family (``kind`` is used in error messages)."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._classes: dict[str, type[T]] = {}

    def register(self, name: str) -> Callable[[type[T]], type[T]]:
        def decorator(cls: type[T]) -> type[T]:
            if name in self._classes:
                raise ValueError(f"{self.kind} {name!r} is registered twice")
            self._classes[name] = cls
            cls.name = name  # type: ignore[attr-defined]
            return cls

        return decorator

    def add(self, name: str, obj: Any) -> None:
        """Register ``obj`` itself (a record, not a class) under ``name``; ``get`` returns it.

        Raises ``ValueError`` when ``name`` is already registered."""
        if name in self._classes:
            raise ValueError(f"{self.kind} {name!r} is registered twice")
        self._classes[name] = obj

    def get(self, name: str) -> type[T]:
        try:
            return self._classes[name]
        except KeyError:
            raise ValueError(
                f"unknown {self.kind} {name!r}; allowed: {', '.join(sorted(self._classes))}"
            ) from None

    def build(self, name: str, **kwargs: Any) -> T:
        """Instantiate ``name`` with ``kwargs``; unknown keys raise ``ValueError`` naming them."""
        cls = self.get(name)
        if dataclasses.is_dataclass(cls):
            allowed = {f.name for f in dataclasses.fields(cls) if f.init}
            unknown = sorted(set(kwargs) - allowed)
            if unknown:
                raise ValueError(
                    f"{self.kind} {name!r} got unknown parameter(s) {unknown}; "
                    f"allowed: {sorted(allowed)}"
                )
        return cls(**kwargs)

    def from_config(self, params: Mapping[str, Any]) -> T:
        """Instantiate from a config mapping: its ``name`` plus that class's parameters
        (``filter: {name: sa_opd, p1: 0.2, ...}``); errors as :meth:`build`."""
        params = dict(params)
        if "name" not in params:
            raise ValueError(f"a {self.kind} config needs a 'name' (one of "
                             f"{', '.join(self.names())}); got keys {sorted(params)}")
        return self.build(params.pop("name"), **params)

    def names(self) -> list[str]:
        return sorted(self._classes)

    def __contains__(self, name: object) -> bool:
        return name in self._classes

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())
