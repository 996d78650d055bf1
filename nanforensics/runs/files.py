"""Atomic file writes (the recorder's, and under ``outputs``' checks every report's) and tensors as safetensors bytes.
Files are read through ``nanforensics.inputs``."""

from __future__ import annotations

import functools
import itertools
import json
import os
import shutil
import struct
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

if TYPE_CHECKING:  # imported where tensors are written: the writer of reports starts without torch
    import torch

_counter = itertools.count()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _temporary_name(path: Path) -> Path:
    """Unique per process, thread and call; hidden, so readers listing the folder never take it for data."""
    return path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.{next(_counter)}.tmp")


def write_bytes_atomic(path: Path, data: bytes | Sequence[bytes | memoryview], *, durable: bool = True) -> None:
    """Write under a temporary name in the same folder, then rename: readers never see half a file.

    ``data`` is the file's bytes, or its parts in order (``safetensors_parts``), each written from where it is.

    The file is created with mode 0o666 less the umask, like any file the user writes (mkstemp's 0o600
    would make a run directory unreadable to the CI job that collects it).
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _temporary_name(path)
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        try:
            for part in [data] if isinstance(data, bytes) else data:
                _write_all(fd, part)
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except OSError as e:  # a full disk names the file it could not write, not the temporary one or none
        tmp.unlink(missing_ok=True)
        raise OSError(e.errno, e.strerror or str(e), str(path)) from e
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if durable:
        _fsync_dir(path.parent)


def _write_all(fd: int, part: bytes | memoryview) -> None:
    """``os.write`` until the whole part is written (a write may take less; the GIL is released meanwhile)."""
    view = memoryview(part)
    while view.nbytes:
        view = view[os.write(fd, view):]


def make_build_dir(final: Path) -> Path:
    """A hidden sibling folder to fill before ``publish_dir_atomic`` renames it to ``final``."""
    build = _temporary_name(final)
    build.mkdir(parents=True)
    return build


def json_bytes(obj: Any, *, indent: int | None = 2) -> bytes:
    """A JSON file's bytes as the project writes them (no NaN, which JSON lacks; a newline at the end)."""
    return (json.dumps(obj, indent=indent, allow_nan=False) + "\n").encode()


def write_json_atomic(path: Path, obj: Any, *, durable: bool = True, indent: int | None = 2) -> None:
    write_bytes_atomic(path, json_bytes(obj, indent=indent), durable=durable)


def publish_dir_atomic(build: Path, final: Path) -> None:
    """Rename a fully written folder into place, replacing any older one of that name."""
    _fsync_dir(build)
    if final.exists():
        old = final.with_name(f".{final.name}.old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
        os.replace(build, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(build, final)
    _fsync_dir(final.parent)


def _storable(tensor: torch.Tensor, seen: set[int]) -> torch.Tensor:
    """safetensors refuses views and shared storage; store such tensors as private copies, and a conjugate or
    negative view (a lazy ``.conj()``) as its values: its memory holds them unconjugated."""
    import torch

    t = tensor.detach().resolve_conj().resolve_neg()
    if t.device.type != "cpu":
        t = t.cpu()
    ptr = t.untyped_storage().data_ptr() if t.numel() else 0
    if not t.is_contiguous() or (ptr and ptr in seen) or t.storage_offset() or t.untyped_storage().nbytes() != t.nbytes:
        t = t.clone(memory_format=torch.contiguous_format)
        ptr = t.untyped_storage().data_ptr() if t.numel() else 0
    if ptr:
        seen.add(ptr)
    return t


# safetensors' name of each dtype it stores and torch's, in the order its writer lays tensors out (largest alignment
# first, then its enum's order): a file written here is the one ``safetensors.torch.save`` writes
_SAFETENSORS_DTYPES = (("U64", "uint64"), ("I64", "int64"), ("F64", "float64"), ("C64", "complex64"),
                       ("F32", "float32"), ("U32", "uint32"), ("I32", "int32"), ("BF16", "bfloat16"), ("F16", "float16"),
                       ("U16", "uint16"), ("I16", "int16"), ("F8_E5M2FNUZ", "float8_e5m2fnuz"),
                       ("F8_E4M3FNUZ", "float8_e4m3fnuz"), ("F8_E4M3", "float8_e4m3fn"), ("F8_E5M2", "float8_e5m2"),
                       ("I8", "int8"), ("U8", "uint8"), ("BOOL", "bool"))


@functools.cache
def _dtype_names() -> dict[torch.dtype, str]:
    import torch

    return {getattr(torch, dtype): name for name, dtype in _SAFETENSORS_DTYPES if hasattr(torch, dtype)}


def refuse_unstorable(name: str, dtype: torch.dtype) -> None:
    """A tensor safetensors has no dtype for is refused in one line, naming it."""
    if dtype not in _dtype_names():
        raise ValueError(f"tensor {name!r}: safetensors cannot store dtype {str(dtype).removeprefix('torch.')}")


def safetensors_parts(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> list[bytes | memoryview]:
    """A safetensors file as its header and the tensors' own memory, for ``write_bytes_atomic`` to write in turn.

    ``safetensors.torch.save`` copies every tensor into one bytes object first (a 170 MB checkpoint: 170 MB
    allocated, faulted in and copied, with the GIL held): here the kernel copies each tensor once, from where it is,
    into the file. The bytes are ``save``'s, but for the metadata's keys, which ``save`` writes in an order that varies
    from one process to the next and which are written here sorted (tests/test_files.py holds both). The tensors
    must stay unchanged until written: the recorder's are private snapshots, a checkpoint's are written before the
    loop goes on."""
    import torch

    names = _dtype_names()
    seen: set[int] = set()
    stored = {k: _storable(v, seen) for k, v in tensors.items()}
    rank = {dtype: i for i, dtype in enumerate(names)}
    for k, t in stored.items():
        refuse_unstorable(k, t.dtype)
    order = sorted(stored, key=lambda k: (rank[stored[k].dtype], k))
    header: dict[str, object] = {"__metadata__": dict(sorted(metadata.items()))}
    offset = 0
    for k in order:
        t = stored[k]
        header[k] = {"dtype": names[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)
    return [struct.pack("<Q", len(text)) + text] + [
        memoryview(stored[k].reshape(-1).view(torch.uint8).numpy()) for k in order if stored[k].numel()]
