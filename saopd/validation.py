"""The one module of argument checks (config schema, engines, the tensor layer).

Every failure is a ``ValueError`` that names the parameter (``owner.name`` when an owner is
given: the config group or the class), the value it got and what is allowed. Torch-free at
import time: the tensor checks only read attributes of the tensors they are given.
"""

from __future__ import annotations

import math
from typing import Any

__all__ = [
    "check_choice",
    "check_float_tensor",
    "check_fraction",
    "check_int",
    "check_number",
    "check_positive",
    "check_same_shape",
]


def _where(owner: str) -> str:
    return f"{owner}." if owner else ""


def check_fraction(name: str, value: float, *, owner: str = "") -> float:
    """``value`` must be a finite float in [0, 1]."""
    where = _where(owner)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{where}{name} must be a number in [0, 1], got {value!r}")
    if not math.isfinite(value) or not 0.0 <= value <= 1.0:
        raise ValueError(f"{where}{name} must be in [0, 1], got {value!r}")
    return float(value)


def check_positive(name: str, value: float, *, owner: str = "", allow_zero: bool = False) -> float:
    """``value`` must be a finite number > 0 (>= 0 with ``allow_zero``)."""
    where = _where(owner)
    bound = ">= 0" if allow_zero else "> 0"
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{where}{name} must be a finite number {bound}, got {value!r}")
    if value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"{where}{name} must be {bound}, got {value!r}")
    return float(value)


def check_number(name: str, value: Any, *, low: float, high: float | None = None,
                 owner: str = "", allow_none: bool = False) -> float | None:
    """``value`` must be a finite number in ``(low, high]`` (``> low`` without ``high``)."""
    if value is None and allow_none:
        return None
    ok = (not isinstance(value, bool) and isinstance(value, (int, float))
          and math.isfinite(value) and value > low and (high is None or value <= high))
    if not ok:
        rng = f"in ({low}, {high}]" if high is not None else f"> {low}"
        none = "null or " if allow_none else ""
        raise ValueError(f"{_where(owner)}{name} must be {none}a number {rng}, got {value!r}")
    return float(value)


def check_int(name: str, value: Any, *, owner: str = "", minimum: int = 1,
              allow_none: bool = False) -> int | None:
    """``value`` must be an int (not a bool) >= ``minimum`` (or None with ``allow_none``)."""
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        none = "null or " if allow_none else ""
        raise ValueError(f"{_where(owner)}{name} must be {none}an int >= {minimum}, "
                         f"got {value!r}")
    return value


def check_choice(name: str, value: Any, allowed: tuple[Any, ...], *, owner: str = "") -> Any:
    """``value`` must be one of ``allowed``."""
    if value not in allowed:
        raise ValueError(f"{_where(owner)}{name} must be one of {list(allowed)}, got {value!r}")
    return value


def check_same_shape(name: str, tensor: Any, shape: tuple[int, ...], ref: str) -> None:
    """``tensor`` (a ``torch.Tensor``) must have ``shape`` (the shape of ``ref``)."""
    if tensor.shape != shape:
        raise ValueError(f"{name} has shape {tuple(tensor.shape)} but {ref} has {tuple(shape)}")


def check_float_tensor(name: str, tensor: Any) -> None:
    """``tensor`` must be a floating-point ``torch.Tensor``."""
    if not _is_tensor(tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if not tensor.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor, got dtype {tensor.dtype}")


def _is_tensor(value: Any) -> bool:
    """A ``torch.Tensor`` (or subclass such as ``nn.Parameter``), without importing torch."""
    return any(c.__module__.startswith("torch") and c.__name__ == "Tensor"
               for c in type(value).__mro__)
