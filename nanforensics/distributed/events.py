"""Which rank an event belongs to, and one ordered list of events out of every rank's."""

from __future__ import annotations

from typing import Iterable

import torch

from ..report import STAGES, Event
from .layout import SHARED_STAGES, World


def rows(model: torch.nn.Module) -> dict[str, int]:
    """Each parameter's length along dimension 0, the dimension FSDP2 shards."""
    return {name: (p.shape[0] if p.ndim else 0) for name, p in model.named_parameters(remove_duplicate=False)}


def tag(events: list[Event], rank: int, world: World, lengths: dict[str, int], shared: bool) -> list[Event]:
    """One rank's events: batch, activations, loss and local gradients as that rank's own; the values every rank
    shares after the collective (only where ``shared``: one rank reports those) as no rank's under DDP, or as the
    rank whose FSDP2 shard holds the coordinate."""
    out = []
    for e in events:
        if e.stage in SHARED_STAGES:
            if not shared:
                continue
            e.rank = world.shard_owner(lengths.get(e.tensor, 0), e.index)
        else:
            e.rank = rank
        out.append(e)
    return out


def merge(events: Iterable[Event]) -> list[Event]:
    """Stage order first (an earlier stage is the cause), then rank, as a single process orders its events."""
    return sorted(events, key=lambda e: (STAGES.index(e.stage), -1 if e.rank is None else e.rank, e.state_key or ""))
