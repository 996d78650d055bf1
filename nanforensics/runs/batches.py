"""A batch (tensor or nested tuple/list/dict of tensors and JSON leaves) <-> one safetensors file."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from ..errors import BadInput, shown
from ..inputs import MAX_NESTING, TensorFile, nesting_exceeds, parse_json
from .files import safetensors_parts

BATCH_FORMAT = "nanforensics.batch/1"
# An optimizer step made of several micro-batches (gradient accumulation) is recorded as one batch, a dict whose
# MICRO_BATCHES entry lists them in the order the loop ran them; the step function loops over them as it did.
MICRO_BATCHES = "micro_batches"


def encode(batch: Any) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Split a batch into its tensors and a JSON tree that says where each one goes."""
    tensors: dict[str, torch.Tensor] = {}

    def walk(node: Any, where: str) -> dict[str, Any]:
        if isinstance(node, torch.Tensor):
            if node.layout != torch.strided:
                raise TypeError(f"batch{where}: a {str(node.layout).removeprefix('torch.')} tensor cannot be "
                                "recorded; pass it dense (.to_dense())")
            if node.is_meta:
                raise TypeError(f"batch{where}: a tensor on the meta device holds no values to record")
            key = str(len(tensors))
            tensors[key] = node
            return {"tensor": key}
        if isinstance(node, tuple):
            return {"tuple": [walk(v, f"{where}[{i}]") for i, v in enumerate(node)]}
        if isinstance(node, list):
            return {"list": [walk(v, f"{where}[{i}]") for i, v in enumerate(node)]}
        if isinstance(node, dict):
            if not all(isinstance(k, str) for k in node):
                raise TypeError(f"batch{where}: dict keys must be strings to be recorded")
            return {"dict": [[k, walk(v, f"{where}[{k!r}]")] for k, v in node.items()]}
        try:
            json.dumps(node, allow_nan=False)
        except (TypeError, ValueError):
            raise TypeError(f"batch{where}: {type(node).__name__} is neither a tensor nor JSON data") from None
        return {"json": node}

    tree = walk(batch, "")
    if nesting_exceeds(tree):
        raise TypeError(f"batch nests too deeply to be recorded (more than {MAX_NESTING} levels as JSON)")
    return tensors, tree


def decode(tree: Any, tensors: dict[str, torch.Tensor], used: set[str] | None = None) -> Any:
    """The batch ``encode`` split; each tensor is referenced once, as ``encode`` writes it, so a tree cannot make one
    small tensor into a batch of 200,000 (each a copy on the replay device)."""
    used = set() if used is None else used
    if not isinstance(tree, dict) or len(tree) != 1:
        raise ValueError(f"malformed batch tree node {tree!r:.60}")
    (kind, value), = tree.items()
    if kind == "tensor":
        if value in used:
            raise ValueError(f"tensor {value!r:.20} is referenced more than once")
        used.add(value)
        return tensors[value]
    if kind == "tuple":
        return tuple(decode(v, tensors, used) for v in value)
    if kind == "list":
        return [decode(v, tensors, used) for v in value]
    if kind == "dict":
        return {k: decode(v, tensors, used) for k, v in value}
    if kind == "json":
        return value
    raise ValueError(f"unknown batch tree node kind {kind!r}")


def snapshot(batch: Any) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The batch's structure and private CPU copies of its tensors: what a background writer may keep while
    the training loop reuses or mutates the originals. Refuses what cannot be recorded, here and now.

    A batch on a CUDA device is copied without waiting for the step (``_arriving``)."""
    tensors, tree = encode(batch)
    cuda = next((t.device for t in tensors.values() if t.is_cuda), None)
    if cuda is not None:
        return _arriving(tensors, cuda), tree
    return {k: t.detach().to("cpu", copy=True, memory_format=torch.contiguous_format) for k, t in tensors.items()}, tree


class Arriving(dict[str, torch.Tensor]):
    """Host copies a side stream is still making: ``encoded`` waits for ``ready`` before it reads them."""

    def __init__(self, tensors: dict[str, torch.Tensor], ready: torch.cuda.Event) -> None:
        super().__init__(tensors)
        self.ready = ready


@functools.cache
def _side_stream(device: torch.device) -> torch.cuda.Stream:
    return torch.cuda.Stream(device)


def _arriving(tensors: dict[str, torch.Tensor], device: torch.device) -> Arriving:
    """``device``'s tensors copied into pinned host memory on a side stream, once the kernels queued before (the
    step's) are done; the training thread queues the copies and goes on, the writer thread waits for them. Unchecked
    on a device in the session that wrote it: bench/gpu_check.py checks it where one is lent. A tensor on another
    device is copied as on the CPU."""
    stream = _side_stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    copies = {}
    with torch.cuda.stream(stream):
        for k, t in tensors.items():
            t = t.detach()
            if t.device != device:
                copies[k] = t.to("cpu", copy=True, memory_format=torch.contiguous_format)
                continue
            copies[k] = torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record(stream)
    # what the loop queues next (a step writing the batch in place, its memory freed and reused) waits on the
    # device for the copies, as it would after a blocking copy; the training thread does not
    torch.cuda.current_stream(device).wait_event(ready)
    return Arriving(copies, ready)


def encoded(step: int, tensors: dict[str, torch.Tensor], tree: dict[str, Any]) -> list[bytes | memoryview]:
    """A batch file's parts, for ``write_bytes_atomic`` (files.safetensors_parts)."""
    if isinstance(tensors, Arriving):
        tensors.ready.synchronize()
    return safetensors_parts(tensors, {"format": BATCH_FORMAT, "step": str(step), "tree": json.dumps(tree)})


def read_batch(path: Path) -> Any:
    f = TensorFile(path)
    meta = f.metadata()
    if meta.get("format") != BATCH_FORMAT:
        raise BadInput(path, f"not a nanforensics batch file (format {meta.get('format')!r})")
    if "tree" not in meta:
        raise BadInput(path, "batch structure is malformed (no tree in its metadata)")
    tree = parse_json(meta["tree"], path, "metadata 'tree'")
    try:
        return decode(tree, f.load_all())
    except ValueError as e:  # decode's own words, with at most 60 escaped characters of the tree
        raise BadInput(path, f"batch structure is malformed: {e}") from None
    except (KeyError, TypeError) as e:
        raise BadInput(path, f"batch structure is malformed ({shown(e)})") from None


def _walk(batch: Any, path: str, whole: Callable[[Any], bool]) -> Iterator[tuple[str, Any]]:
    if whole(batch) or not isinstance(batch, (list, tuple, dict)):
        yield path, batch
    elif isinstance(batch, dict):
        for k, v in batch.items():
            yield from _walk(v, f"{path}[{k!r}]", whole)
    else:
        for i, v in enumerate(batch):
            yield from _walk(v, f"{path}[{i}]", whole)


def leaves(batch: Any, path: str = "batch") -> Iterator[tuple[str, Any]]:
    """Every leaf with a readable path such as ``batch['x'][0]``."""
    return _walk(batch, path, lambda node: False)


def has_tensor(node: Any) -> bool:
    return any(isinstance(leaf, torch.Tensor) for _, leaf in leaves(node))


def per_sample(node: Any, size: int) -> bool:
    """A tensor-free list or tuple of ``size`` items: one item per sample (ids, file names, per-sample dicts)."""
    return isinstance(node, (list, tuple)) and len(node) == size and not has_tensor(node)


def _holds_per_sample(node: Any, size: int) -> bool:
    return any(per_sample(v, size) for _, v in _walk(node, "", lambda n: per_sample(n, size)))


def data_leaves(batch: Any, path: str = "batch", size: int | None = None) -> Iterator[tuple[str, Any]]:
    """The largest tensor-free parts of a batch (sample ids, file names), each whole, by path.

    With the batch ``size``, a part that holds per-sample lists deeper down (``batch['meta']['ids']``) is
    opened down to them, so that each per-sample list is a leaf of its own, at any depth.
    """
    def whole(node: Any) -> bool:
        return not has_tensor(node) and (size is None or per_sample(node, size) or not _holds_per_sample(node, size))

    return ((p, v) for p, v in _walk(batch, path, whole) if not has_tensor(v))


def map_tensors(batch: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, tuple):
        return tuple(map_tensors(v, fn) for v in batch)
    if isinstance(batch, list):
        return [map_tensors(v, fn) for v in batch]
    if isinstance(batch, dict):
        return {k: map_tensors(v, fn) for k, v in batch.items()}
    return batch


def micro_batches(batch: Any) -> list[Any] | None:
    """The micro-batches of an optimizer step recorded as several; None for a batch that is not."""
    parts = batch.get(MICRO_BATCHES) if isinstance(batch, dict) else None
    return parts if isinstance(parts, list) and parts else None
