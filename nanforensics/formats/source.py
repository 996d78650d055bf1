"""A checkpoint as a list of tensor files, read one tensor at a time: model tensors first, then optimizer state."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from itertools import chain
from pathlib import Path
from typing import Any, Iterator

import torch

from ..errors import BadInput
from ..inputs import SafetensorsFile
from . import dcp, torch_file, zero
from .entries import MODEL, OPTIMIZER, OPTIMIZER_KEYS, Entry, Release, TensorInfo, group_of_key
from .pages import drop_pages

BUFFER_NAMES = frozenset({"running_mean", "running_var", "num_batches_tracked"})  # BatchNorm's, InstanceNorm's


class TensorStream:
    """An opened checkpoint: what it holds, and its tensors one at a time.

    Each tensor comes with ``release(view)``, which hands back the resident pages of a
    contiguous part of it once read (the tensor stays valid: the pages fault back in from the
    page cache). A consumer that releases as it goes and drops each tensor (``del``) before
    asking for the next keeps its resident set near one chunk, whatever the checkpoint's size.
    """

    def __init__(self, entries: list[Entry]) -> None:
        self._entries = entries
        self.infos = [e.info for e in entries]
        self.nbytes = sum(i.nbytes for i in self.infos)

    def tensors(self, start: int = 0) -> Iterator[tuple[TensorInfo, torch.Tensor, Release]]:
        """From the ``start``-th tensor on; the ones before are skipped without being read."""
        for entry in self._entries[start:]:
            tensor = entry.load()
            yield entry.info, tensor, entry.release
            entry.release(tensor)
            del tensor


@dataclass
class CheckpointSource:
    """One checkpoint on disk in any supported format; nothing is read until ``open``.

    ``files`` pairs each tensor file with the group all of its tensors belong to, or None when
    the group comes from the names inside it (an ``optimizer`` key, an optimizer state dict).
    """

    path: Path
    format: str
    files: list[tuple[Path, str | None]]
    meta_step: int | None = None  # the step its own metadata records
    step: int | None = None  # the step it is ordered by
    step_source: str | None = None  # "metadata" or "name"
    run_dir: Path | None = None  # our run directory, when it lies in one
    buffer_names: frozenset[str] | None = None  # the model's buffers, where the checkpoint records them
    param_names: frozenset[str] | None = None  # parameters the optimizer steps, where it records them

    def is_buffer(self, name: str) -> bool | None:
        """Whether model tensor ``name`` is a registered buffer; None when this checkpoint cannot tell.

        Without a recorded list, only names that no parameter takes are recognised: BatchNorm's running statistics.
        """
        if self.buffer_names is not None:
            return name in self.buffer_names
        if self.param_names is not None and name in self.param_names:
            return False
        return True if name.rpartition(".")[2] in BUFFER_NAMES else None
    skipped: list[str] = field(default_factory=list)  # "file: why" for each file beside it left unread

    def open(self) -> TensorStream:
        entries: list[Entry] = []
        for file, group in self.files:
            entries += _entries(file, group)
        entries.sort(key=lambda e: e.info.group != MODEL)  # stable: model first keeps early stopping sound
        return TensorStream(entries)


def _entries(file: Path, group: str | None) -> list[Entry]:
    if file.suffix == ".safetensors":
        return _safetensors_entries(file, group)
    if file.name == dcp.METADATA:  # torch.distributed.checkpoint
        return dcp.dcp_entries(file, group)
    if zero.rank_file(file):  # DeepSpeed ZeRO: the folder's files read together
        return zero.entries(file.parent)
    return _torch_entries(file, group)


def _safetensors_entries(path: Path, group: str | None) -> list[Entry]:
    f = SafetensorsFile(path)
    return [Entry(TensorInfo(e.name, group or group_of_key(e.name), e.dtype, e.shape, e.end - e.start, path),
                   partial(f.read, e), drop_pages) for e in f.entries]


def lightning_parts(obj: Any) -> tuple[dict[str, Any], Any] | None:
    """A Lightning checkpoint's model (``state_dict``) and optimizer state (``optimizer_states``); None for
    any other object. Its other entries are bookkeeping, never parameters: the callbacks' scores (such as
    ModelCheckpoint's ``kth_value = inf``, ``best_model_score``), loop counters, schedulers, hyperparameters."""
    if isinstance(obj, dict) and "pytorch-lightning_version" in obj and isinstance(obj.get("state_dict"), dict):
        return obj["state_dict"], obj.get("optimizer_states", [])
    return None


def _torch_entries(path: Path, group: str | None) -> list[Entry]:
    obj, release = torch_file.load(path)
    parts = lightning_parts(obj)
    tensors = tree_tensors(obj) if parts is None else chain(
        ((name, False, t) for name, _, t in tree_tensors(parts[0])),
        tree_tensors(parts[1], ("optimizer_states",), True))
    entries = []
    try:
        found = list(tensors)
    except RecursionError:
        raise BadInput(path, "its objects nest too deeply to be a checkpoint") from None
    for name, in_optimizer, t in found:
        nbytes = t.numel() * t.element_size() if t.layout == torch.strided else 0
        info = TensorInfo(name, group or (OPTIMIZER if in_optimizer else MODEL), t.dtype, tuple(t.shape), nbytes, path)
        entries.append(Entry(info, partial(_same, t), release))
    return entries


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


def tree_tensors(obj: Any, prefix: tuple[str, ...] = (), in_optimizer: bool = False
                 ) -> Iterator[tuple[str, bool, torch.Tensor]]:
    """Every tensor in nested dicts/lists, dotted name and whether it is optimizer state.

    Optimizer state is what lies under an optimizer-named key or inside a dict shaped like
    ``optimizer.state_dict()``; its per-parameter entries are named by ``param_names`` when the
    optimizer recorded them (torch >= 2.5 with named parameters), else by index.
    """
    if isinstance(obj, torch.Tensor):
        yield ".".join(prefix) or "tensor", in_optimizer, obj
    elif isinstance(obj, dict):
        shaped = isinstance(obj.get("state"), dict) and isinstance(obj.get("param_groups"), list)
        names = _param_names(obj["param_groups"]) if shaped else {}
        for key, value in obj.items():
            inside = in_optimizer or shaped or str(key).lower() in OPTIMIZER_KEYS
            if shaped and key == "state":
                for index, state in value.items():
                    yield from tree_tensors(state, prefix + ("state", str(names.get(index, index))), True)
            else:
                yield from tree_tensors(value, prefix + (str(key),), inside)
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            yield from tree_tensors(value, prefix + (str(i),), in_optimizer)


def _param_names(groups: list[Any]) -> dict[Any, str]:
    names: dict[Any, str] = {}
    for g in groups:
        if isinstance(g, dict) and isinstance(g.get("param_names"), list) and isinstance(g.get("params"), list):
            names.update(zip(g["params"], map(str, g["param_names"])))
    return names
