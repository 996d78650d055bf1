"""Atomic file writes, the one way input files are opened and parsed, and safetensors I/O shared by the recorder
and the readers."""

from __future__ import annotations

import itertools
import json
import os
import shutil
import threading
from pathlib import Path
from typing import Any, BinaryIO, Iterator

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save

from ..errors import BadInput
from .paths import not_regular

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
    seen: set[int] = set()
    return save({k: _storable(v, seen) for k, v in tensors.items()}, metadata=metadata)


def open_input(path: Path) -> BinaryIO:
    """The one way an input file is opened: a FIFO, socket or device in its place is refused at once, never read
    (a read from a FIFO waits for a writer that never comes)."""
    try:
        problem = not_regular(os.stat(path).st_mode)  # before any open: opening some devices acts on them
        if problem is None:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
            problem = not_regular(os.fstat(fd).st_mode)  # replaced since the stat
            if problem is not None:
                os.close(fd)
    except FileNotFoundError:
        raise BadInput(path, "file is missing") from None
    except OSError as e:
        raise BadInput(path, f"cannot read ({e.strerror or e})") from None
    if problem is not None:
        raise BadInput(path, problem)
    os.set_blocking(fd, True)
    return os.fdopen(fd, "rb")


def read_input(path: Path) -> bytes:
    with open_input(path) as f:
        try:
            return f.read()
        except OSError as e:
            raise BadInput(path, f"cannot read ({e.strerror or e})") from None


MAX_NESTING = 100  # no file this tool reads nests deeper; past it, recursive readers and writers would crash


def nesting_exceeds(obj: Any, limit: int = MAX_NESTING) -> bool:
    """Whether JSON data nests deeper than ``limit`` containers (iterative: deep data cannot crash the check)."""
    stack = [(obj, 1)] if isinstance(obj, (dict, list)) else []
    while stack:
        node, depth = stack.pop()
        if depth > limit:
            return True
        stack += [(c, depth + 1) for c in (node.values() if isinstance(node, dict) else node) if isinstance(c, (dict, list))]
    return False


def parse_json(data: bytes | str, where: Path, what: str = "") -> Any:
    """JSON input parsed, or a ``BadInput`` naming ``where`` (and ``what`` in it): malformed, an integer too long
    to convert, or nested deeper than ``MAX_NESTING``."""
    field = f"{what}: " if what else ""
    try:
        obj = json.loads(data)
    except json.JSONDecodeError as e:
        raise BadInput(where, f"{field}not valid JSON ({e.msg} at line {e.lineno})") from None
    except RecursionError:
        raise BadInput(where, f"{field}JSON nested too deeply (more than {MAX_NESTING} levels)") from None
    except (ValueError, UnicodeDecodeError) as e:  # an integer of thousands of digits, bytes that are not text
        raise BadInput(where, f"{field}not valid JSON ({one_line(e)[:120]})") from None
    if nesting_exceeds(obj):
        raise BadInput(where, f"{field}JSON nested too deeply (more than {MAX_NESTING} levels)")
    return obj


def load_json(path: Path) -> Any:
    return parse_json(read_input(path), path)


class TensorFile:
    """A safetensors file opened lazily: tensors are memory-mapped and read one at a time."""

    def __init__(self, path: Path) -> None:
        # The header checked first: safe_open calls a truncated file "incomplete metadata" and an unreadable
        # one "No such file"; SafetensorsFile names the problem and the tensor. Imported here: formats reads runs.
        from ..formats.safetensors_file import SafetensorsFile

        self.path = path
        SafetensorsFile(path)
        try:
            self._handle = safe_open(str(path), framework="pt", device="cpu")
        except (SafetensorError, OSError, ValueError) as e:
            raise BadInput(path, f"not a readable safetensors file ({one_line(e)})") from None

    def keys(self) -> list[str]:
        return list(self._handle.keys())

    def metadata(self) -> dict[str, str]:
        return dict(self._handle.metadata() or {})

    def get(self, key: str) -> torch.Tensor:
        try:
            return self._handle.get_tensor(key)
        except (SafetensorError, OSError, ValueError, RuntimeError) as e:
            raise BadInput(self.path, f"tensor {key!r} is unreadable ({one_line(e)})") from None

    def items(self) -> Iterator[tuple[str, torch.Tensor]]:
        for key in self.keys():
            yield key, self.get(key)

    def load_all(self) -> dict[str, torch.Tensor]:
        return dict(self.items())


def one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or e.__class__.__name__
