"""Tensors of a model sharded by FSDP2 (DTensors), as the checks and the checkpoint loader need them.

``torch.distributed.tensor`` is not imported here: a DTensor can only exist once it has been, so a process that never
sharded anything pays nothing for these checks.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import torch


def is_dtensor(t: Any) -> bool:
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)


def local_part(t: Any) -> tuple[Any, list[int] | None]:
    """This rank's shard of a DTensor and where it lies in the whole tensor (the offset of its first element, per
    dimension), so that a coordinate in the shard is turned into the DTensor's own; anything else as it is, None.
    Nothing is communicated: each rank checks its own values, before any collective reads them."""
    if not is_dtensor(t):
        return t, None
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    _, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    return t.to_local(), list(offset)


def speaks_for(t: Any) -> bool:
    """Whether this rank's shard of a DTensor is the copy that speaks for it: coordinate 0 on every mesh dimension
    its placements replicate it on (the ranks there hold the same values, at the same whole-tensor coordinates);
    anything but a DTensor is this rank's own. Nothing is communicated."""
    if not is_dtensor(t):
        return True
    mesh = t.device_mesh
    return all(mesh.get_local_rank(i) == 0 for i, placement in enumerate(t.placements) if placement.is_replicate())


def whole(t: Any) -> Any:
    """A sharded tensor gathered whole (a collective: every rank checks the same tensors in the same order), so that
    coordinates and counts are the tensor's own, whichever rank holds them; anything else as it is."""
    if not is_dtensor(t):
        return t
    # a parameter sharded on two mesh dimensions (FSDP2 over tensor parallelism) is gathered in two steps, which torch
    # warns about on every rank: said once in the documentation, not on every check
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    return t.full_tensor()


def shard_like(full: torch.Tensor, target: Any) -> torch.Tensor:
    """``full`` as this rank's shard of it, laid out like ``target`` when that is a DTensor of the same shape: every
    rank read the whole tensor from the checkpoint, so each takes its own part without communicating."""
    if not is_dtensor(target) or is_dtensor(full) or tuple(full.shape) != tuple(target.shape):
        return full
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(full.to(target.device), target.device_mesh, target.placements, src_data_rank=None)
