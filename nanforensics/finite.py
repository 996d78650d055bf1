"""Fast finiteness checks and locating the first bad coordinate.

Measured on these machines (../shared/notes/finiteness-checks.md): ``aminmax`` runs near
memory bandwidth and NaN propagates into it, while ``isfinite`` allocates a mask and is ten
times slower. So detection is ``aminmax`` per tensor with the verdicts kept on the device
(one host sync per batch of tensors); masks are built only inside a chunk known to be bad.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Sequence

import torch

_CHUNK = 1 << 20


def checkable(t: object) -> bool:
    return isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex()) and t.numel() > 0


def extremes(t: torch.Tensor) -> torch.Tensor:
    """min and max as a 2-vector, on t's device; non-finite iff t holds a non-finite value."""
    t = t.detach()
    if t.is_complex():
        t = torch.view_as_real(t)
    if t.element_size() == 1:  # fp8: aminmax has no CPU kernel for it
        t = t.float()
    mn, mx = torch.aminmax(t)
    return torch.stack((mn, mx)).double()  # float32 would read a finite float64 past 3.4e38 as inf


def verdicts(extremes_list: Sequence[torch.Tensor]) -> list[bool]:
    """Finite-or-not for many ``extremes`` results with one host sync per device."""
    by_device: dict[torch.device, list[int]] = {}
    for i, e in enumerate(extremes_list):
        by_device.setdefault(e.device, []).append(i)
    flags = [True] * len(extremes_list)
    for indices in by_device.values():
        ok = torch.isfinite(torch.stack([extremes_list[i] for i in indices])).all(dim=1).tolist()
        for i, good in zip(indices, ok):
            flags[i] = good
    return flags


def all_finite_flags(tensors: Sequence[torch.Tensor]) -> list[bool]:
    """One verdict per tensor with a single host sync."""
    return verdicts([extremes(t) for t in tensors])


def is_finite(t: torch.Tensor) -> bool:
    return all_finite_flags([t])[0]


@dataclass(frozen=True)
class Located:
    """The first non-finite coordinate of a tensor (row-major order) and its value."""

    index: list[int]
    value: str  # "nan", "inf" or "-inf"


def encode_float(x: float) -> float | str:
    """JSON has no NaN or infinity; they are written as the strings "nan", "inf", "-inf"."""
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    return x


def decode_float(x: float | int | str) -> float:
    if isinstance(x, str):
        if x not in ("nan", "inf", "-inf"):
            raise ValueError(f"bad number {x!r}")
        return float(x)
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        raise ValueError(f"bad number {x!r}")
    return float(x)


def value_name(x: float) -> str:
    return str(encode_float(x))


def locate(t: torch.Tensor) -> Located | None:
    """Scan in chunks with aminmax; build a mask only for the first chunk that is bad."""
    flat = t.detach().reshape(-1)
    if flat.is_complex():
        flat = torch.view_as_real(flat).reshape(-1)
        shape, scale = list(t.shape) + [2], 2
    else:
        shape, scale = list(t.shape), 1
    for start in range(0, flat.numel(), _CHUNK):
        chunk = flat[start:start + _CHUNK]
        if all_finite_flags([chunk])[0]:
            continue
        offset = int(torch.argmax((~torch.isfinite(chunk)).to(torch.uint8)))
        flat_index = start + offset
        index = list(_unravel(flat_index, shape))
        if scale == 2:
            index = index[:-1]
        return Located(index, value_name(float(flat[flat_index])))
    return None


def _unravel(flat_index: int, shape: Sequence[int]) -> Iterable[int]:
    out = []
    for dim in reversed(shape):
        out.append(flat_index % dim)
        flat_index //= dim
    return reversed(out)


def count_nonfinite(t: torch.Tensor) -> int:
    """Exact count; only called for tensors already known to be bad, or for reports."""
    t = t.detach()
    if t.is_complex():
        t = torch.view_as_real(t)
    if all_finite_flags([t])[0]:
        return 0
    return int((~torch.isfinite(t)).sum())


def max_abs(t: torch.Tensor) -> float:
    """Largest finite |x|, for headroom against the dtype's limit."""
    t = t.detach()
    if t.is_complex():
        t = torch.view_as_real(t)
    mn, mx = torch.aminmax(t)
    if torch.isfinite(mn) and torch.isfinite(mx):
        return max(abs(float(mn)), abs(float(mx)))
    finite = t[torch.isfinite(t)]
    return float(finite.abs().max()) if finite.numel() else 0.0
