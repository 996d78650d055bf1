"""Tensors of a model sharded by FSDP2 (DTensors), as the checks and the checkpoint loader need them.

``torch.distributed.tensor`` is not imported here: a DTensor can only exist once it has been, so a process that never
sharded anything pays nothing for these checks.
"""

from __future__ import annotations

import sys
from typing import Any

import torch


def is_dtensor(t: Any) -> bool:
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)


def whole(t: Any) -> Any:
    """A sharded tensor gathered whole (a collective: every rank checks the same tensors in the same order), so that
    coordinates and counts are the tensor's own, whichever rank holds them; anything else as it is."""
    return t.full_tensor() if is_dtensor(t) else t


def shard_like(full: torch.Tensor, target: Any) -> torch.Tensor:
    """``full`` as this rank's shard of it, laid out like ``target`` when that is a DTensor of the same shape: every
    rank read the whole tensor from the checkpoint, so each takes its own part without communicating."""
    if not is_dtensor(target) or is_dtensor(full) or tuple(full.shape) != tuple(target.shape):
        return full
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(full.to(target.device), target.device_mesh, target.placements, src_data_rank=None)
