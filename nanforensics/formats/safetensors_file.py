"""A safetensors reader that maps one tensor at a time, so a scan's memory is one tensor, not the file.

``safe_open`` (and ``TensorFile`` over it) maps the whole file for the life of the handle: a
scan that touches every tensor ends with the whole checkpoint in its resident set (measured:
peak RSS = file size on a 2 GB file). Here each tensor gets its own read-only map, which goes
away with the tensor. The header is checked against the file's size first, so a truncated file
is a ``BadInput`` naming the tensor that runs past its end, never a bus error.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import struct
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import BadInput, shown
from ..runs.files import nesting_exceeds, open_input

_MAX_HEADER = 100 << 20  # the safetensors format's own limit
_LIMIT = 1 << 63
_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "C64": torch.complex64,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U64": torch.uint64, "U32": torch.uint32, "U16": torch.uint16, "U8": torch.uint8, "BOOL": torch.bool,
}


@dataclass(frozen=True)
class Entry:
    """One tensor of the file: absolute byte range [start, end)."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    end: int


class SafetensorsFile:
    """Header parsed and validated on open; tensors mapped on demand by ``read``."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            with open_input(path) as f:
                size = os.fstat(f.fileno()).st_size
                head = f.read(8)
                if len(head) < 8:
                    raise BadInput(path, f"truncated: {size} bytes, too short for a safetensors header")
                (n,) = struct.unpack("<Q", head)
                if n > _MAX_HEADER:
                    raise BadInput(path, f"not a safetensors file (header length {n})")
                if 8 + n > size:
                    raise BadInput(path, f"truncated: the header needs {8 + n} bytes, the file has {size}")
                raw = f.read(n)
        except OSError as e:
            raise BadInput(path, f"cannot read ({e.strerror or e})") from None
        try:
            header = json.loads(raw)
        except RecursionError:
            raise BadInput(path, "not a safetensors file (its header is JSON nested too deeply)") from None
        except ValueError:  # not JSON, not text, an integer of thousands of digits
            raise BadInput(path, "not a safetensors file (its header is not JSON)") from None
        if not isinstance(header, dict):
            raise BadInput(path, "not a safetensors file (its header is not a JSON object)")
        meta = header.pop("__metadata__", None) or {}
        if not isinstance(meta, dict) or nesting_exceeds(meta, 1):
            raise BadInput(path, "malformed safetensors header (__metadata__ is not an object of strings)")
        self.metadata: dict[str, str] = {str(k): str(v) for k, v in meta.items()}
        base, data_size = 8 + n, size - 8 - n
        self.entries = sorted((self._entry(name, spec, base, data_size) for name, spec in header.items()),
                              key=lambda e: e.start)

    def _entry(self, name: str, spec: object, base: int, data_size: int) -> Entry:
        try:
            dtype_name, shape, (begin, end) = spec["dtype"], spec["shape"], spec["data_offsets"]  # type: ignore[index]
            shape = tuple(shape)
        except (KeyError, TypeError, ValueError):
            raise BadInput(self.path, f"malformed safetensors header entry for tensor {name!r}") from None
        for field, values in (("shape", shape), ("data_offsets", (begin, end))):
            if not all(type(n) is int and 0 <= n < _LIMIT for n in values):  # not 1e400, nor 2.5
                raise BadInput(self.path, f"tensor {name!r}: {field} {shown(list(values))} is not a list of integers "
                                          "from 0 to 2^63-1")
        dtype = _DTYPES.get(dtype_name) if isinstance(dtype_name, str) else None
        if dtype is None:
            raise BadInput(self.path, f"tensor {name!r} has dtype {shown(dtype_name)}, which this nanforensics cannot "
                                      "read")
        if min(shape, default=0) < 0 or not 0 <= begin <= end:
            raise BadInput(self.path, f"malformed safetensors header entry for tensor {name!r}")
        if end > data_size:
            raise BadInput(self.path, f"truncated: tensor {name!r} ends at data byte {end}, "
                                      f"the file holds {data_size} data bytes")
        expected = math.prod(shape) * dtype.itemsize
        if end - begin != expected:
            raise BadInput(self.path, f"tensor {name!r} spans {end - begin} bytes, its shape {list(shape)} "
                                      f"of {dtype_name} needs {expected}")
        return Entry(name, dtype, shape, base + begin, base + end)

    def read(self, entry: Entry) -> torch.Tensor:
        """The tensor over a private read-only map of its bytes: unmapped when the tensor is freed.

        Read-only, so torch's warning about non-writable buffers is silenced: nothing here writes.
        """
        if entry.end == entry.start:
            return torch.empty(entry.shape, dtype=entry.dtype)
        offset = entry.start - entry.start % mmap.ALLOCATIONGRANULARITY
        try:
            with open(self.path, "rb") as f:
                if os.fstat(f.fileno()).st_size < entry.end:
                    raise BadInput(self.path, f"truncated while being read: tensor {entry.name!r} is past its end")
                region = mmap.mmap(f.fileno(), entry.end - offset, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ,
                                   offset=offset)
        except OSError as e:
            raise BadInput(self.path, f"cannot map tensor {entry.name!r} ({e.strerror or e})") from None
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The given buffer is not writable")
            flat = torch.frombuffer(region, dtype=entry.dtype, count=math.prod(entry.shape),
                                    offset=entry.start - offset)
        return flat.view(entry.shape)
