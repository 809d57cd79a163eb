"""Argument checks shared by the network model: each error names the argument and its range."""

from __future__ import annotations

import math

import numpy as np


def positive(name: str, value: float) -> float:
    """``value`` as a float, or a ValueError unless it is a finite number > 0."""
    if isinstance(value, bool) or not (
            isinstance(value, (int, float, np.integer, np.floating)) and value > 0):
        raise ValueError(f"{name} must be a number > 0, got {value!r}.")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite and > 0, got {value!r}.")
    return float(value)


def non_negative(name: str, value: float) -> float:
    """``value`` as a float, or a ValueError unless it is a finite number >= 0."""
    if isinstance(value, bool) or not (
            isinstance(value, (int, float, np.integer, np.floating)) and value >= 0):
        raise ValueError(f"{name} must be a number >= 0, got {value!r}.")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite and >= 0, got {value!r}.")
    return float(value)


def finite(name: str, value: float) -> float:
    """``value`` as a float, or a ValueError unless it is a finite real number (not a bool)."""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)) \
            or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}.")
    return float(value)


def int_at_least(name: str, value: int, low: int) -> int:
    """``value`` as an int, or a ValueError unless it is an integer >= ``low``."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}.")
    return int(value)


def power_of_two(name: str, value: int) -> int:
    """``value`` as an int, or a ValueError unless it is a power of two >= 2."""
    value = int_at_least(name, value, 2)
    if value & (value - 1):
        raise ValueError(f"{name} must be a power of two >= 2, got {value}.")
    return value


def groups_divide(name: str, num_replicas: int, group_size: int) -> None:
    """A ValueError unless ``group_size`` >= 2 divides ``num_replicas``."""
    int_at_least("group_size", group_size, 2)
    if num_replicas % group_size:
        raise ValueError(
            f"{name} must be a multiple of group_size={group_size} (>= {group_size}), "
            f"got {num_replicas}."
        )


def num_params(value: float) -> int:
    """A parameter count as an int, or a ValueError unless it is a whole number >= 1."""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise ValueError(f"num_params must be a whole number >= 1, got {value!r}.")
    if not (math.isfinite(value) and value >= 1 and float(value).is_integer()):
        raise ValueError(f"num_params must be a whole number >= 1, got {value!r}.")
    return int(value)

