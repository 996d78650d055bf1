"""Total conversions of numbers read from files: every value becomes a float (or None, not a number), never an
exception.

A checkpoint's hyperparameters and step counts are untrusted input (issue 32): an ``lr`` of ``10**400`` makes
``float()`` raise ``OverflowError``, betas of ``(0.5, 2.0)`` make ``math.sqrt(1 - b2)`` raise ``math domain error``.
Every reader of optimizer hyperparameters (the soundness checks, the replay's proof, the guard) takes its numbers
through ``real`` and does its arithmetic with ``root``, so an out-of-domain value reaches the range checks, which
make it a finding, instead of the catch-all.
"""

from __future__ import annotations

import math
from typing import Any

import torch


def real(value: Any) -> float | None:
    """``value`` as a float: a Python int or float, or a one-element real tensor; an int beyond float's range is
    ``±inf`` (too large for a float, which is what the range checks then say). None for anything else (bools,
    strings, complex numbers, containers, tensors of more than one element)."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.is_complex() or value.dtype == torch.bool:
            return None
        value = value.reshape(()).item()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    if isinstance(value, int):
        try:
            return float(value)
        except OverflowError:
            return math.inf if value > 0 else -math.inf
    return float(value)


def is_count(value: Any) -> bool:
    """A Python int read from a file as a size, a count or a dimension: not a bool, which Python counts as an int
    (a shape of ``[True]`` passes ``isinstance(d, int)`` and then ``Tensor.view`` raises TypeError)."""
    return isinstance(value, int) and not isinstance(value, bool)


def unrepresentable(value: Any) -> bool:
    """An int no float holds (``10**400``): torch's arithmetic raises ``OverflowError`` on it."""
    return is_count(value) and math.isinf(real(value) or 0.0)


def spoken(value: int) -> str:
    """An int too large for a float, in words that need no conversion of it to text (Python refuses beyond 4300
    digits): ``about 1e400``."""
    return f"{'-' if value < 0 else ''}about 1e{math.floor(math.log10(abs(value)))}"  # log10 takes any int


def root(x: float) -> float:
    """The square root, NaN below 0 (``math.sqrt`` raises there)."""
    return math.sqrt(x) if x >= 0 else math.nan


def pair(value: Any) -> tuple[float, float] | None:
    """Two numbers (betas), or None where ``value`` is not a list or tuple of two numbers."""
    if isinstance(value, (list, tuple)) and len(value) == 2:
        a, b = real(value[0]), real(value[1])
        if a is not None and b is not None:
            return a, b
    return None
