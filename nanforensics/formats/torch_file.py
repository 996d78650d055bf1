"""PyTorch pickles (.pt/.pth), loaded with ``weights_only=True`` only: a pickle that needs more is refused, never run.

Zip-format files are memory-mapped (``mmap=True``): tensors are views of one private map of the
whole file, so ``release`` hands a tensor's pages back once they have been read, keeping the
resident set near one chunk. Legacy (pre-1.6) files cannot be mapped and are read whole.
"""

from __future__ import annotations

import os
import pickle
import re
import warnings
from contextlib import nullcontext
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

import torch

from ..errors import BadInput
from ..inputs import check_tensors, claiming, one_line, open_input
from .pages import drop_pages, span
from .pickles import check_torch_file

_ZIP_MAGIC = b"PK\x03\x04"
# torch.serialization.safe_globals with (stand-in, "module.Name") pairs: a global built as another class than its name's
_NAMED_STAND_INS = torch.torch_version.TorchVersion(torch.__version__) >= (2, 6)


def _brief(e: BaseException, limit: int = 200) -> str:
    """torch.load's messages run to paragraphs; the error line keeps their start."""
    text = one_line(e)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _refusal(message: str) -> str:
    """What the pickle asked for that weights_only loading would not give it."""
    m = re.search(r"GLOBAL ([\w.]+)", message)
    if m:
        return f"it imports {m.group(1)}"
    line = next((ln.strip() for ln in message.splitlines() if "Unsupported" in ln or "unsupported" in ln), "")
    return line[:160] or "it needs more than tensors and plain containers"


class Refused(BadInput):
    """A pickle that weights-only loading will not read; ``reason`` says what it asked for."""

    def __init__(self, path: Path, reason: str) -> None:
        self.reason = reason
        super().__init__(path, f"refused, not loaded: {reason}, and weights_only loading runs nothing but tensors "
                               "and plain containers (convert the file to safetensors where you trust it)")


def weights_only(source: Any, mmap: bool = False, allowed: Mapping[str, Callable[..., Any]] | None = None) -> Any:
    """``torch.load(source, weights_only=True)`` on the CPU, the one call of it: torch's warnings about what it reads
    (a pickle protocol it did not write, sparse CSR in beta) are not the user's, and would break the one-line error
    (README, Security: the invariants). ``allowed``: globals a layout's own files name (DeepSpeed's loss scaler), each
    by its full name and the inert stand-in this tool builds in its place: the named class is never imported."""
    stand_ins = torch.serialization.safe_globals([(f, n) for n, f in allowed.items()]) if allowed else nullcontext()
    with warnings.catch_warnings(), stand_ins:
        warnings.filterwarnings("ignore", message=".*pickle protocol")
        warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta")
        return torch.load(source, map_location="cpu", weights_only=True, mmap=mmap)


def load(path: Path, allowed: Mapping[str, Callable[..., Any]] | None = None) -> tuple[Any, Callable[[torch.Tensor], None]]:
    """The unpickled object and a ``release(view)`` that drops the pages of a part of a tensor already read;
    ``allowed``: stand-ins for globals beyond weights-only loading's own (``weights_only``)."""
    if allowed and not _NAMED_STAND_INS:
        raise BadInput(path, f"reading it needs torch >= 2.6, whose weights-only loader builds stand-ins for the objects "
                             f"it holds (such as {next(iter(allowed))}); this is torch {torch.__version__}")
    try:
        with open_input(path) as f:
            magic = f.read(4)
            f.seek(0)
            check_torch_file(f, path)  # before any unpickler runs: how deep it nests, how much it expands to
    except OSError as e:
        raise BadInput(path, f"cannot read ({e.strerror or e})") from None
    if not magic:
        raise BadInput(path, "empty file, not a PyTorch checkpoint")
    mapped = magic == _ZIP_MAGIC
    try:
        with claiming(path, "the file", os.stat(path).st_size):
            obj = weights_only(path, mmap=mapped, allowed=allowed)
    except BadInput:
        raise
    except pickle.UnpicklingError as e:
        if "Weights only load failed" in str(e):
            raise Refused(path, _refusal(str(e))) from None
        raise BadInput(path, f"not a readable PyTorch checkpoint ({_brief(e)})") from None
    except Exception as e:  # noqa: BLE001 -- torch.load reports damage with many exception types
        raise BadInput(path, f"not a readable PyTorch checkpoint ({_brief(e)})") from None
    check_tensors(obj, path)
    return obj, (_PageRelease(path) if mapped else _keep)


def _keep(tensor: torch.Tensor) -> None:
    """Tensors of a file read whole: their memory goes when the object does."""


class _PageRelease:
    """Drop the pages of a (part of a) tensor that lies in this file's own private map.

    Views elsewhere (a tensor built while unpickling, a copy) are left alone: dropping
    anonymous pages would zero them.
    """

    def __init__(self, path: Path) -> None:
        self._ranges = list(_file_maps(path))

    def __call__(self, view: torch.Tensor) -> None:
        if view.layout != torch.strided or not view.is_contiguous() or view.numel() == 0:
            return
        lo, hi = span(view)
        if any(start <= lo and hi <= end for start, end in self._ranges):
            drop_pages(view)


def _file_maps(path: Path) -> Iterator[tuple[int, int]]:
    target = os.path.realpath(path)
    try:
        with open("/proc/self/maps") as f:
            lines = f.readlines()
    except OSError:
        return
    for line in lines:
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5].rstrip("\n") == target:
            start, end = fields[0].split("-")
            yield int(start, 16), int(end, 16)

