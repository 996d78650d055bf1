"""Checkpoints written by ``torch.distributed.checkpoint`` (DCP: FSDP's sharded format), read one tensor at a time.

A DCP checkpoint is a folder: ``.metadata`` (a pickle of the layout: every tensor's dtype, size and
chunks, and where each chunk's bytes lie) and ``__<rank>_<n>.distcp`` files holding each chunk as a
``torch.save`` blob at an offset. The metadata pickle is read by an unpickler that constructs only the
layout classes DCP itself writes, and refuses anything else, so a doctored ``.metadata`` runs nothing;
chunks are loaded with ``weights_only=True``, like every PyTorch file here. A tensor sharded over
ranks is assembled from its chunks, so a scan sees whole tensors with global coordinates, and memory
stays one tensor (plus one chunk) at a time.
"""

from __future__ import annotations

import io
import math
import os
import pickle
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Iterable

import torch

from ..errors import BadInput, shown
from ..inputs import check_tensors, claiming, open_input, read_input, shape_problem
from . import torch_file
from .entries import MODEL, OPTIMIZER, OPTIMIZER_KEYS, Entry, TensorInfo, group_of_key
from .pickles import check_pickle, check_torch_file

METADATA = ".metadata"
_LAYOUT_MODULE = "torch.distributed.checkpoint.metadata"
_ALLOWED = {
    *((_LAYOUT_MODULE, n) for n in ("Metadata", "MetadataIndex", "TensorStorageMetadata", "BytesStorageMetadata",
                                     "ChunkStorageMetadata", "TensorProperties", "StorageMeta",
                                     "_MEM_FORMAT_ENCODING")),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.distributed.checkpoint.filesystem", "_StoragePrefix"),
    ("torch", "Size"), ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
    *(("pathlib", n) for n in ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath")),
}


class _LayoutUnpickler(pickle.Unpickler):
    """Constructs DCP's layout dataclasses, torch sizes and dtypes; refuses every other global."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name}")


@dataclass(frozen=True)
class _Chunk:
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    file: Path
    start: int
    length: int


@dataclass(frozen=True)
class _Tensor:
    fqn: str
    path: tuple[Any, ...]  # where it sat in the saved (nested) state dict
    dtype: torch.dtype
    size: tuple[int, ...]
    chunks: tuple[_Chunk, ...]


class Layout:
    """A DCP checkpoint's ``.metadata``, checked against the files it names."""

    def __init__(self, metadata: Path) -> None:
        self.folder = metadata.parent
        try:
            data = read_input(metadata)
            check_pickle(data, 0, metadata)  # before the unpickler runs
            md = _LayoutUnpickler(io.BytesIO(data)).load()
        except BadInput:
            raise
        except OSError as e:
            raise BadInput(metadata, f"cannot read ({e.strerror or e})") from None
        except pickle.UnpicklingError as e:
            raise BadInput(metadata, f"refused, not loaded: it asks for {e}, which the metadata of "
                                     "torch.distributed.checkpoint never holds") from None
        except Exception as e:  # a truncated or corrupt pickle fails in many ways
            raise BadInput(metadata, f"not a readable torch.distributed.checkpoint metadata file "
                                     f"({e.__class__.__name__}: {e})") from None
        self.path = metadata
        try:
            self.items: dict[str, Any] = dict(md.state_dict_metadata)
            storage = {(i.fqn, tuple(i.offset or ())): s for i, s in dict(md.storage_data).items()}
            nested: dict[str, tuple[Any, ...]] = dict(md.planner_data or {})
            odd = next((fqn for fqn, p in nested.items() if not (isinstance(p, (tuple, list)) and
                                                                 all(isinstance(k, (str, int)) for k in p))), None)
            if odd is not None:
                raise BadInput(metadata, f"the planner's path of {shown(odd)} is not a sequence of keys and indices")
            self.tensors = [self._tensor(fqn, item, storage, nested.get(fqn, (fqn,)))
                            for fqn, item in self.items.items() if hasattr(item, "chunks")]
        except (AttributeError, TypeError, ValueError) as e:
            raise BadInput(metadata, f"not the metadata of a torch.distributed.checkpoint ({_short(e)})") from None
        self.storage = storage
        self.nested = nested

    def _tensor(self, fqn: str, item: Any, storage: dict[tuple[str, tuple[int, ...]], Any],
                path: tuple[Any, ...]) -> _Tensor:
        chunks = []
        for c in item.chunks:
            info = storage.get((fqn, tuple(c.offsets)))
            if info is None:
                raise BadInput(self.path, f"tensor {fqn!r}: no storage recorded for its chunk at {list(c.offsets)}")
            chunks.append(_Chunk(tuple(c.offsets), tuple(c.sizes), self._file(fqn, info), info.offset, info.length))
        t = _Tensor(fqn, tuple(path), item.properties.dtype, tuple(item.size), tuple(chunks))
        problem = _tiling_problem(t)
        if problem is not None:
            raise BadInput(self.path, f"tensor {fqn!r}: {problem}: not read")
        return t

    def _file(self, fqn: str, info: Any) -> Path:
        if getattr(info, "transform_descriptors", None):
            raise BadInput(self.path, f"tensor {fqn!r} is stored through {list(info.transform_descriptors)} "
                                      "(a storage extension such as compression), which this nanforensics cannot read")
        name = Path(str(info.relative_path))
        if name.is_absolute() or ".." in name.parts:
            raise BadInput(self.path, f"tensor {fqn!r} names {name}, outside the checkpoint folder")
        return self.folder / name

    def read_bytes_item(self, fqn: str) -> Any:
        """A non-tensor entry (an int step, a hyperparameter), loaded weights-only."""
        info = self.storage.get((fqn, ()))
        if info is None:
            raise BadInput(self.path, f"entry {fqn!r} has no recorded storage")
        file = self._file(fqn, info)
        with _Blob(file, info.offset, info.length, fqn) as f:
            return _load(f, file, fqn)


def values(metadata: Path, keys: Iterable[str]) -> dict[str, Any]:
    """The top-level non-tensor entries among ``keys`` (``step``, ``global_step``), for ordering checkpoints."""
    layout = Layout(metadata)
    return {k: layout.read_bytes_item(k) for k in keys if k in layout.items and not hasattr(layout.items[k], "chunks")}


def _tiling_problem(t: _Tensor) -> str | None:
    """Why the chunks do not lay out the tensor exactly once, before anything is allocated for it: a chunk outside
    it, chunks that overlap or leave holes (read as they are, a hole would be uninitialised memory called clean),
    or a chunk whose blob is too small to hold it (a size declared far beyond the bytes on disk)."""
    problem = shape_problem(t.size, t.dtype.itemsize)
    if problem is not None:
        return problem
    for c in t.chunks:
        if len(c.offsets) != len(t.size) or len(c.sizes) != len(t.size) or \
                any(o < 0 or s < 0 or o + s > n for o, s, n in zip(c.offsets, c.sizes, t.size)):
            return f"its chunk at {list(c.offsets)} of size {list(c.sizes)} lies outside its size {list(t.size)}"
        if c.length < math.prod(c.sizes) * t.dtype.itemsize:
            return (f"its chunk at {list(c.offsets)} claims {math.prod(c.sizes) * t.dtype.itemsize} bytes, its blob "
                    f"holds {c.length}")
    boxes = [(c.offsets, tuple(o + s for o, s in zip(c.offsets, c.sizes))) for c in t.chunks if math.prod(c.sizes)]
    problem = _overlap(boxes, len(t.size))
    if problem is not None:
        return problem
    covered = sum(math.prod(c.sizes) for c in t.chunks)
    if covered != math.prod(t.size):
        return f"its chunks cover {covered} of its {math.prod(t.size)} elements, leaving holes"
    return None


MAX_SWEEP = 1_000_000  # pairs of chunks compared for a layout that is not a grid (every sharding DCP writes is one)


def _overlap(boxes: list[tuple[tuple[int, ...], tuple[int, ...]]], ndim: int) -> str | None:
    """Two boxes (chunks) that overlap, said, in time linear in their number (and a sort): where each dimension's
    distinct intervals are disjoint (a grid, as every sharding lays chunks out), two boxes overlap only when equal.
    Chunks laid out otherwise are swept along the first dimension, up to ``MAX_SWEEP`` pairs compared."""
    if all(_disjoint({(lo[d], hi[d]) for lo, hi in boxes}) for d in range(ndim)):
        seen: set[tuple[tuple[int, ...], tuple[int, ...]]] = set()
        for box in boxes:
            if box in seen:
                return f"its chunks at {list(box[0])} and {list(box[0])} overlap"
            seen.add(box)
        return None
    boxes = sorted(boxes)
    budget = MAX_SWEEP
    for i, (lo, hi) in enumerate(boxes):  # a sweep along the first dimension
        for lo2, hi2 in boxes[i + 1:]:
            if lo2[:1] >= hi[:1]:
                break
            budget -= 1
            if budget < 0:
                return (f"its {len(boxes)} chunks are not laid out as a grid, and checking that they do not overlap "
                        f"takes more than {MAX_SWEEP} comparisons")
            if all(a < d and c < b for a, b, c, d in zip(lo, hi, lo2, hi2)):
                return f"its chunks at {list(lo)} and {list(lo2)} overlap"
    return None


def _disjoint(intervals: set[tuple[int, int]]) -> bool:
    ordered = sorted(intervals)
    return all(b[0] >= a[1] for a, b in zip(ordered, ordered[1:]))


def dcp_entries(metadata: Path, group: str | None) -> list[Entry]:
    layout = Layout(metadata)
    shaped = _PathTree(layout.nested.values())
    out = []
    for t in layout.tensors:
        nbytes = math.prod(t.size) * t.dtype.itemsize
        info = TensorInfo(t.fqn, group or _group(t, shaped), t.dtype, t.size, nbytes, metadata)
        out.append(Entry(info, partial(assemble, t), _drop))
    return out


def _drop(tensor: torch.Tensor) -> None:
    """Assembled tensors are private copies: their memory goes with them."""


class _PathTree:
    """The planner's paths of the saved state dict as a tree (one node per prefix, found by a dict lookup per key,
    never built as a tuple: a path of 300,000 keys has 300,000 prefixes), marking the prefixes that hold an
    ``optimizer.state_dict()`` (``state`` and ``param_groups`` both under them)."""

    def __init__(self, paths: Iterable[tuple[Any, ...]]) -> None:
        self._children: dict[tuple[int, Any], int] = {}
        state, groups = set(), set()
        for path in paths:
            node = 0
            for key in path:
                (state if key == "state" else groups if key == "param_groups" else set()).add(node)
                node = self._children.setdefault((node, key), len(self._children) + 1)
        self.optimizers = state & groups

    def in_optimizer_state(self, path: tuple[Any, ...]) -> bool:
        """Whether ``path`` goes through an optimizer's ``state``."""
        node: int | None = 0
        for key in path:
            if node in self.optimizers and key == "state":
                return True
            node = self._children.get((node, key))
            if node is None:
                return False
        return False


def _group(t: _Tensor, paths: _PathTree) -> str:
    if any(str(k).lower() in OPTIMIZER_KEYS for k in t.path[:-1]):
        return OPTIMIZER
    if paths.in_optimizer_state(t.path):
        return OPTIMIZER
    return group_of_key(t.fqn) if t.path == (t.fqn,) else MODEL


def assemble(t: _Tensor) -> torch.Tensor:
    """The whole tensor: its only chunk as loaded, or its chunks copied into place."""
    if len(t.chunks) == 1 and t.chunks[0].sizes == t.size:
        return _chunk(t, t.chunks[0])
    with claiming(t.chunks[0].file if t.chunks else Path(t.fqn), f"tensor {t.fqn!r}",
                  math.prod(t.size) * t.dtype.itemsize):
        out = torch.empty(t.size, dtype=t.dtype)  # every element written: the layout tiles it (_tiling_problem)
    for c in t.chunks:
        view = out
        for dim, (o, s) in enumerate(zip(c.offsets, c.sizes)):
            view = view.narrow(dim, o, s)
        view.copy_(_chunk(t, c))
    return out


def _chunk(t: _Tensor, c: _Chunk) -> torch.Tensor:
    with _Blob(c.file, c.start, c.length, t.fqn) as f:
        value = _load(f, c.file, t.fqn)
    if not isinstance(value, torch.Tensor) or tuple(value.shape) != c.sizes or value.dtype != t.dtype:
        got = f"{value.dtype} {list(value.shape)}" if isinstance(value, torch.Tensor) else type(value).__name__
        raise BadInput(c.file, f"tensor {t.fqn!r}: the chunk at {list(c.offsets)} holds {got}, the metadata says "
                               f"{t.dtype} {list(c.sizes)}")
    return value


class _Window(io.RawIOBase):
    """Bytes [start, start + length) of a file, seekable, as ``torch.load`` wants: no copy of the whole blob."""

    def __init__(self, f: io.BufferedReader, start: int, length: int) -> None:
        self._f, self._start, self._length, self._pos = f, start, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self._pos, os.SEEK_END: self._length}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, buffer: Any) -> int:
        n = max(0, min(len(buffer), self._length - self._pos))
        self._f.seek(self._start + self._pos)
        got = self._f.readinto(memoryview(buffer)[:n])
        self._pos += got
        return got


class _Blob:
    """A window on one blob of a ``.distcp`` file, its bounds checked against the file's size."""

    def __init__(self, file: Path, start: int, length: int, fqn: str) -> None:
        self.file, self.start, self.length, self.fqn = file, start, length, fqn

    def __enter__(self) -> io.BufferedReader:
        if not self.file.exists():
            raise BadInput(self.file, f"is missing (it holds {self.fqn!r})")
        self._f = open_input(self.file)
        size = os.fstat(self._f.fileno()).st_size
        if self.start < 0 or self.length < 0 or self.start + self.length > size:
            self._f.close()
            raise BadInput(self.file, f"truncated: {self.fqn!r} lies at bytes {self.start}-{self.start + self.length}, "
                                      f"the file has {size}")
        return io.BufferedReader(_Window(self._f, self.start, self.length))

    def __exit__(self, *exc: object) -> None:
        self._f.close()


def _load(f: io.BufferedReader, file: Path, fqn: str) -> Any:
    check_torch_file(f, file)
    try:
        value = torch_file.weights_only(f)
    except pickle.UnpicklingError as e:
        if "Weights only load failed" in str(e):
            raise BadInput(file, f"refused, not loaded: {fqn!r} needs more than tensors and plain values, and "
                                 "weights_only loading runs nothing else") from None
        raise BadInput(file, f"{fqn!r} is not a readable torch.save blob ({_short(e)})") from None
    except Exception as e:
        raise BadInput(file, f"{fqn!r} is not a readable torch.save blob ({_short(e)})") from None
    check_tensors(value, file)
    return value


def _short(e: BaseException) -> str:
    text = " ".join(str(e).split()) or e.__class__.__name__
    return text[:200]
