"""What every checkpoint format yields: named tensors, each told as model or optimizer state, loaded on demand."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

MODEL, OPTIMIZER = "model", "optimizer"
OPTIMIZER_KEYS = frozenset({"optimizer", "optimizers", "optim", "optimizer_state", "optimizer_states",
                             "optimizer_state_dict", "optim_state", "opt_state"})


@dataclass(frozen=True)
class TensorInfo:
    name: str
    group: str  # MODEL or OPTIMIZER
    dtype: torch.dtype
    shape: tuple[int, ...]
    nbytes: int
    file: Path


Release = Callable[[torch.Tensor], None]


@dataclass(frozen=True)
class Entry:
    info: TensorInfo
    load: Callable[[], torch.Tensor]
    release: Release


def group_of_key(key: str) -> str:
    """A flat key (safetensors) belongs to the optimizer when its first component says so."""
    return OPTIMIZER if re.split(r"[./]", key, maxsplit=1)[0].lower() in OPTIMIZER_KEYS else MODEL
