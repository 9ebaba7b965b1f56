"""A tiny name -> class registry: every plug-in family of saopd is one.

Config files name a variant (``filter: sa_opd``); the registry maps that name to the class whose
dataclass fields are its hyperparameters. A miss lists the valid names, and unknown keyword
arguments are reported by name, so a typo in a config never fails deep inside a constructor.
Families described by records or functions rather than classes (the benchmarks and graders of
:mod:`saopd.eval`, the DVC stages) register the object itself with :meth:`Registry.add`; ``get``
then returns it. A plug-in that lives in a layer above its registry's (the testbeds' model
wrappers) is declared by module with :meth:`Registry.declare` and imported on first ``get``.

The registries, and the class or record each maps names to:

- :data:`saopd.filters.base.FILTERS`: token filters (:class:`~saopd.filters.base.TokenFilter`;
  ``filter.name``);
- :data:`saopd.objectives.base.OBJECTIVES`: objectives
  (:class:`~saopd.objectives.base.Objective`; ``objective.name``);
- :data:`saopd.rollout.registry.ENGINES`: rollout engines (``rollout.engine``);
- :data:`saopd.scoring.registry.SCORERS`: teacher-scoring backends
  (``teacher_scoring.backend``);
- :data:`saopd.prompts.sources.PROMPT_SOURCES`: training prompt sources (``data.source``);
- :data:`saopd.models.factory.MODEL_WRAPPERS`: wrappers of a built model, by the model config's
  block (``model.planted``, ``model.tic``);
- :data:`saopd.eval.benchmarks.BENCHMARKS`: benchmark records
  (:class:`~saopd.eval.benchmarks.Benchmark`; ``benchmarks=[...]``);
- :data:`saopd.eval.graders.GRADERS`: grader functions, by a benchmark's ``grader``;
- :data:`saopd.stages.common.STAGES`: the DVC pipeline's stages (``python -m saopd.stages``).
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """Maps config names to classes of one family (``kind`` is used in error messages)."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._classes: dict[str, type[T]] = {}
        self._declared: dict[str, str] = {}  # name -> module that registers it when imported

    def register(self, name: str) -> Callable[[type[T]], type[T]]:
        def decorator(cls: type[T]) -> type[T]:
            if name in self._classes:
                raise ValueError(f"{self.kind} {name!r} is registered twice")
            declared = self._declared.get(name)
            if declared is not None and declared != cls.__module__:
                raise ValueError(f"{self.kind} {name!r} is declared in {declared}, not in "
                                 f"{cls.__module__}")
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

    def declare(self, name: str, module: str) -> None:
        """Name a plug-in that ``module`` registers when imported, without importing it: the
        first :meth:`get` of ``name`` imports ``module`` (a plug-in in a layer above this
        registry's, loaded only when a config asks for it). Raises ``ValueError`` when ``name``
        is already registered or declared."""
        if name in self._classes or name in self._declared:
            raise ValueError(f"{self.kind} {name!r} is registered twice")
        self._declared[name] = module

    def get(self, name: str) -> type[T]:
        if name not in self._classes and name in self._declared:
            module = self._declared[name]
            importlib.import_module(module)
            if name not in self._classes:
                raise ValueError(f"{self.kind} {name!r}: importing {module} did not register it")
        try:
            return self._classes[name]
        except KeyError:
            raise ValueError(
                f"unknown {self.kind} {name!r}; allowed: {', '.join(self.names())}"
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
        """Every registered or declared name, sorted."""
        return sorted({*self._classes, *self._declared})

    def __contains__(self, name: object) -> bool:
        return name in self._classes or name in self._declared

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())
