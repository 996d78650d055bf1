"""Data-level checks of a run's batches, before any replay: a NaN in the input file is a data defect,
not a training failure, and a subnormal or huge reading is the usual seed of one."""

from __future__ import annotations

from typing import Iterable

import torch

from .. import finite
from ..report import DataDefect
from ..runs.batches import leaves
from ..runs.source import StepSource
from . import DEFAULT_MAX_ABS


def _first(mask: torch.Tensor) -> list[int]:
    flat = int(torch.argmax(mask.reshape(-1).to(torch.uint8)))
    return [int(i) for i in torch.unravel_index(torch.tensor(flat), mask.shape)]


def check_tensor(t: torch.Tensor, max_abs: float) -> Iterable[tuple[str, int, list[int], str]]:
    """(kind, count, first index, its value) for each kind of defect the tensor has."""
    t = t.detach()
    if t.is_complex():
        t = torch.view_as_real(t)
    if not finite.is_finite(t):
        bad = ~torch.isfinite(t)
        where = finite.locate(t)
        assert where is not None
        yield "nonfinite", int(bad.sum()), where.index, where.value
    magnitude = t.abs()
    extreme = torch.isfinite(t) & (magnitude > max_abs)
    if bool(extreme.any()):
        index = _first(extreme)
        yield "extreme", int(extreme.sum()), index, repr(float(t[tuple(index)]))
    subnormal = (magnitude > 0) & (magnitude < torch.finfo(t.dtype).tiny)
    if bool(subnormal.any()):
        index = _first(subnormal)
        yield "subnormal", int(subnormal.sum()), index, repr(float(t[tuple(index)]))


def check_batches(run: StepSource, steps: Iterable[int], max_abs: float = DEFAULT_MAX_ABS) -> list[DataDefect]:
    """Every floating-point tensor of the batches of ``steps``; a missing batch is the replay's error, not ours."""
    defects: list[DataDefect] = []
    for step in steps:
        for rank in range(run.world.data_ranks) if run.world is not None else [None]:  # each data rank's shard
            origin = run.batch_origin(step, rank)
            if origin is None:
                continue
            lead = run.world.lead(rank) if run.world is not None and rank is not None else None  # the rank recording it
            for name, leaf in leaves(run.batch(step, rank)):
                if finite.checkable(leaf):
                    for kind, count, index, value in check_tensor(leaf, max_abs):
                        defects.append(DataDefect(step, origin, name, kind, count, index, value, lead))
    return defects
