"""Atomic file writes (the recorder's, and under ``outputs``' checks every report's) and tensors as safetensors bytes.
Files are read through ``nanforensics.inputs``."""

from __future__ import annotations

import itertools
import json
import os
import shutil
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

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


def write_bytes_atomic(path: Path, data: bytes, *, durable: bool = True) -> None:
    """Write under a temporary name in the same folder, then rename: readers never see half a file.

    The file is created with mode 0o666 less the umask, like any file the user writes (mkstemp's 0o600
    would make a run directory unreadable to the CI job that collects it).
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _temporary_name(path)
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:  # a full disk names the file it could not write, not the temporary one or none
        tmp.unlink(missing_ok=True)
        raise OSError(e.errno, e.strerror or str(e), str(path)) from e
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if durable:
        _fsync_dir(path.parent)


def make_build_dir(final: Path) -> Path:
    """A hidden sibling folder to fill before ``publish_dir_atomic`` renames it to ``final``."""
    build = _temporary_name(final)
    build.mkdir(parents=True)
    return build


def write_json_atomic(path: Path, obj: Any, *, durable: bool = True, indent: int | None = 2) -> None:
    write_bytes_atomic(path, (json.dumps(obj, indent=indent, allow_nan=False) + "\n").encode(), durable=durable)


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
    """safetensors refuses views and shared storage; store such tensors as private copies."""
    import torch

    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    ptr = t.untyped_storage().data_ptr() if t.numel() else 0
    if not t.is_contiguous() or (ptr and ptr in seen) or t.storage_offset() or t.untyped_storage().nbytes() != t.nbytes:
        t = t.clone(memory_format=torch.contiguous_format)
        ptr = t.untyped_storage().data_ptr() if t.numel() else 0
    if ptr:
        seen.add(ptr)
    return t


def tensors_to_bytes(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> bytes:
    from safetensors.torch import save

    seen: set[int] = set()
    return save({k: _storable(v, seen) for k, v in tensors.items()}, metadata=metadata)
