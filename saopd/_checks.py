"""Argument checks shared by the tensor layer: every failure is a ``ValueError`` that names the
parameter, the value it got and what is allowed."""

from __future__ import annotations

import math

import torch


def check_fraction(name: str, value: float, *, owner: str = "") -> float:
    """``value`` must be a finite float in [0, 1]."""
    where = f"{owner}." if owner else ""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{where}{name} must be a number in [0, 1], got {value!r}")
    if not math.isfinite(value) or not 0.0 <= value <= 1.0:
        raise ValueError(f"{where}{name} must be in [0, 1], got {value!r}")
    return float(value)


def check_positive(name: str, value: float, *, owner: str = "", allow_zero: bool = False) -> float:
    where = f"{owner}." if owner else ""
    bound = ">= 0" if allow_zero else "> 0"
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{where}{name} must be a finite number {bound}, got {value!r}")
    if value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"{where}{name} must be {bound}, got {value!r}")
    return float(value)


def check_choice(name: str, value: str, allowed: tuple[str, ...], *, owner: str = "") -> str:
    where = f"{owner}." if owner else ""
    if value not in allowed:
        raise ValueError(f"{where}{name} must be one of {list(allowed)}, got {value!r}")
    return value


def check_same_shape(name: str, tensor: torch.Tensor, shape: torch.Size, ref: str) -> None:
    if tensor.shape != shape:
        raise ValueError(f"{name} has shape {tuple(tensor.shape)} but {ref} has {tuple(shape)}")


def check_float_tensor(name: str, tensor: torch.Tensor) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if not tensor.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor, got dtype {tensor.dtype}")
