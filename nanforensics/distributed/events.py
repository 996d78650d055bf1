"""Which rank an event belongs to, and one ordered list of events out of every rank's."""

from __future__ import annotations

from typing import Iterable

import torch

from ..report import STAGES, Event
from ..runs.layout import DDP, SHARED_STAGES, World


def rows(model: torch.nn.Module) -> dict[str, int]:
    """Each parameter's length along dimension 0, the dimension FSDP2 shards."""
    return {name: (p.shape[0] if p.ndim else 0) for name, p in model.named_parameters(remove_duplicate=False)}


def tag(events: list[Event], rank: int, world: World, lengths: dict[str, int], shared: bool,
        own: bool = False) -> list[Event]:
    """One rank's events: batch, activations, loss and local gradients as that rank's own.

    The values every rank shares after the collective: in the emulation (only where ``shared``: one pass reports
    those) as no rank's under DDP or on a mesh, or as the rank whose FSDP2 shard holds the coordinate. At world size
    (``own``) each rank checked its own shard of sharded state, so it keeps those events as its own; of a shard held
    by several ranks (replicated along a mesh dimension, or not sharded at all), one copy speaks, the one at
    coordinate 0 along those dimensions (rank 0 under DDP)."""
    out = []
    for e in events:
        if e.stage in SHARED_STAGES:
            if own and world.kind != DDP:
                if world.mesh is not None and not world.mesh.holds(rank, e.tensor):
                    continue
                e.rank = rank
            elif not shared:
                continue
            else:
                e.rank = world.shard_owner(lengths.get(e.tensor, 0), e.index) if world.mesh is None else None
        else:
            e.rank = rank
        out.append(e)
    return out


def merge(events: Iterable[Event]) -> list[Event]:
    """Stage order first (an earlier stage is the cause), then the order the checks met them in (every rank checks
    the same tensors in the same order: a rank whose own value turned non-finite in an earlier module made it first),
    then rank, as a single process orders its events."""
    return sorted(events, key=lambda e: (STAGES.index(e.stage), e.order or 0, -1 if e.rank is None else e.rank,
                                         e.state_key or ""))
