"""Scan one checkpoint: every tensor's finiteness, first bad coordinate and headroom, and a verdict.

One ``aminmax`` pass per tensor (``chunks.walk``, in chunks whose pages are handed back as
soon as they are read, so the resident set stays near one chunk, the next chunk asked for from the
disk while one is reduced) gives both the verdict and
max |x|; the exact count and the first coordinate are computed only for tensors found bad.
A parameter's optimizer state is read in the same pass as its soundness checks: its tensors are held until all
have come, then read together, once (docs/performance.md).
The verdict ranks parameters, then buffers, then optimizer state. Model tensors (parameters and
buffers) are read before optimizer state, so a scan that stops early still gives the right
verdict: it stops at the first non-finite parameter, or once the model is read when only a
buffer or a state tensor was bad.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Literal, Protocol, get_args

import torch

from .. import finite
from ..errors import BadInput
from ..formats import MODEL, OPTIMIZER, CheckpointSource, TensorInfo
from ..formats.entries import Release
from ..report import Unsound
from .chunks import walk
from .soundness import Checker, Soundness

SCAN_SCHEMA = "nanforensics.scan/1"
DEFAULT_MARGIN = 1000.0
# POISONED_BUFFERS: the parameters finite, a registered buffer (BatchNorm statistics) not
ScanVerdict = Literal["clean", "poisoned_parameters", "poisoned_optimizer_state", "poisoned_buffers"]
CLEAN, POISONED_PARAMETERS, POISONED_STATE, POISONED_BUFFERS = get_args(ScanVerdict)
RECORDED, BY_NAME = "recorded", "by_name"  # how buffers are told from parameters
_SPARSE = (torch.sparse_coo, torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc)
_NO_AMINMAX = {getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
                                           "float8_e8m0fnu") if hasattr(torch, n)}


class Progress(Protocol):
    """Where bytes-read progress goes (a terminal bar); the library never draws."""

    def start(self, label: str, total_bytes: int) -> None: ...

    def advance(self, nbytes: int) -> None: ...


@dataclass
class TensorScan:
    name: str
    group: str  # "model" or "optimizer"
    dtype: str
    shape: list[int]
    checked: bool  # floating point and complex tensors; integer and bool tensors cannot be non-finite
    nonfinite: int
    first_nonfinite: finite.Located | None
    max_abs: float | None  # largest finite |x|; None when no value is finite
    dtype_max: float | None  # the dtype's largest finite value
    near_limit: bool  # max_abs within the margin's factor of dtype_max
    buffer: bool | None = None  # a model tensor that is a registered buffer; None: unknown, or optimizer state


@dataclass
class GroupSummary:
    tensors: int
    bytes: int
    read: int
    nonfinite_tensors: int
    nonfinite_values: int
    near_limit: int


@dataclass
class ScanReport:
    path: str
    format: str  # the layout recognised: nanforensics, pytorch, lightning, safetensors, safetensors-sharded, accelerate, dcp,
    # deepspeed-zero
    step: int | None
    step_source: str | None  # "metadata" or "name"
    verdict: ScanVerdict
    complete: bool  # False: stopped at the first non-finite tensor
    margin: float
    groups: dict[str, GroupSummary]
    tensors: list[TensorScan]
    bytes_read: int
    bytes_total: int
    seconds: float
    schema: str = field(default=SCAN_SCHEMA)
    # RECORDED: the checkpoint lists its buffers; BY_NAME: only BatchNorm's statistics are recognised as buffers,
    # and another model tensor may be either
    buffer_split: str = BY_NAME
    skipped: list[str] = field(default_factory=list)  # "file: why" for each file beside it that was not read
    # finite but unsound optimizer state (checkpoints.soundness), and how it was checked (None: not checked, the scan
    # stopped early at a non-finite tensor)
    unsound: list[Unsound] = field(default_factory=list)
    soundness: Soundness | None = None

    @property
    def poisoned(self) -> list[TensorScan]:
        return [t for t in self.tensors if t.nonfinite]


def check_margin(margin: float) -> None:
    if not margin >= 1:
        raise BadInput("--margin", f"{margin} is not a factor of at least 1")


def scan_checkpoint(source: CheckpointSource, *, full: bool = False, margin: float = DEFAULT_MARGIN,
                    progress: Progress | None = None, resume: ScanReport | None = None,
                    soundness: bool = True) -> ScanReport:
    """Read the checkpoint's tensors one at a time; stop at the first non-finite one unless ``full``.

    ``resume`` continues a scan of the same checkpoint that stopped early, reading only the
    tensors after the ones it already holds. ``soundness`` checks the optimizer state beyond finiteness as it
    streams by (checkpoints.soundness), when the scan reads all of it.
    """
    check_margin(margin)
    started = time.perf_counter()
    stream = source.open()
    results = _InOrder(list(resume.tensors) if resume else [], resume.bytes_read if resume else 0, source, progress,
                       full)
    if progress:
        # resumed: the tensors after the ones an early-stopping read already checked
        progress.start(f"the rest of {source.path.name}" if resume else source.path.name, stream.nbytes)
        progress.advance(results.bytes_read)
    checker = Checker(source, stream.infos) if soundness and resume is None else None
    for info, tensor, release in stream.tensors(len(results.done)):
        results.waiting.append(_Waiting(info, tensor, release))
        state = checker.feed(info, tensor, release) if checker is not None and info.group == OPTIMIZER else None
        if state is not None:  # the parameter's state is complete: read once, for both checks
            held = [(results.held(i), extremes) for i, extremes in state.read()]
            for w, extremes in held:
                w.check(margin, extremes)
            state.conclude(not any(w.result and w.result.nonfinite for w, _ in held))
        elif checker is None or info.group != OPTIMIZER:
            results.waiting[-1].check(margin, None)
        del tensor  # unmaps it before the next one is mapped (a held one stays mapped until read)
        if results.flush():
            break
    else:  # state whose parameter never completed (a name given twice) is read alone, as any tensor
        for w in results.waiting:
            w.check(margin, None)
        results.flush()
    bytes_read, results = results.bytes_read, results.done
    seconds = time.perf_counter() - started + (resume.seconds if resume else 0.0)
    complete = len(results) == len(stream.infos)
    sound = checker.finish() if checker is not None and complete else resume.soundness if resume else None
    unsound = checker.unsound if checker is not None and complete else resume.unsound if resume else []
    return ScanReport(path=str(source.path), format=source.format, step=source.step, step_source=source.step_source,
                      verdict=_verdict(results), complete=complete, margin=margin,
                      groups=_groups(stream.infos, results), tensors=results, bytes_read=bytes_read,
                      bytes_total=stream.nbytes, seconds=seconds, skipped=list(source.skipped),
                      buffer_split=RECORDED if source.buffer_names is not None else BY_NAME, unsound=unsound,
                      soundness=sound)


@dataclass
class _Waiting:
    """A tensor the stream gave, until its result is known."""

    info: TensorInfo
    tensor: torch.Tensor | None
    release: Release
    result: TensorScan | None = None

    def check(self, margin: float, extremes: tuple[float, float] | None) -> None:
        if self.result is None and self.tensor is not None:
            self.result = _check(self.info, self.tensor, self.release, margin, extremes)
            self.tensor = None  # unmapped once nothing else holds it


@dataclass
class _InOrder:
    """The results in the stream's order, though optimizer state waits for the rest of its parameter's; and whether
    a scan that is not ``full`` may stop there."""

    done: list[TensorScan]
    bytes_read: int
    source: CheckpointSource
    progress: Progress | None
    full: bool
    waiting: list[_Waiting] = field(default_factory=list)

    def held(self, info: TensorInfo) -> _Waiting:
        return next(w for w in self.waiting if w.info is info)

    def flush(self) -> bool:
        """Move the results known at the front; True once the verdict is settled and the scan may stop."""
        while self.waiting and self.waiting[0].result is not None:
            w = self.waiting.pop(0)
            result = w.result
            assert result is not None
            if result.group == MODEL:
                result.buffer = self.source.is_buffer(result.name)
            self.done.append(result)
            self.bytes_read += w.info.nbytes
            if self.progress:
                self.progress.advance(w.info.nbytes)
            if not self.full and _settled(self.done):
                return True
        return False


def _widened(t: torch.Tensor) -> torch.Tensor:
    return t.float() if t.dtype in _NO_AMINMAX else t  # exact: every fp8 value is a float32


def _check(info: TensorInfo, tensor: torch.Tensor, release: Release, margin: float,
           extremes: tuple[float, float] | None) -> TensorScan:
    """``extremes``: min and max where the soundness checks' pass read them already."""
    base = {"name": info.name, "group": info.group, "dtype": str(info.dtype).removeprefix("torch."),
            "shape": list(info.shape)}
    coordinates = None
    if tensor.layout != torch.strided:  # a sparse tensor's stored values are what can be non-finite
        tensor, coordinates = _sparse_values(info, tensor)
        release = _keep
    if not finite.checkable(tensor):
        return TensorScan(**base, checked=False, nonfinite=0, first_nonfinite=None, max_abs=None, dtype_max=None,
                          near_limit=False)
    lo, hi = extremes or walk([tensor], [release])[0]
    if math.isfinite(lo) and math.isfinite(hi):
        count, first, peak = 0, None, max(abs(lo), abs(hi))
    else:  # a NaN or an infinity: count, locate, and the largest finite |x| where one is left
        t = _widened(tensor)
        count = finite.count_nonfinite(t)
        first = finite.locate(t) if count else None
        peak = finite.max_abs(t) if count < t.numel() * (2 if t.is_complex() else 1) else None
    if first is not None and coordinates is not None:  # from the position among the values to the coordinate
        first = finite.Located(coordinates[:, first.index[0]].tolist() + first.index[1:], first.value)
    limit = torch.finfo(tensor.dtype).max
    return TensorScan(**base, checked=True, nonfinite=count, first_nonfinite=first, max_abs=peak, dtype_max=limit,
                      near_limit=peak is not None and peak * margin >= limit)


def _settled(results: list[TensorScan]) -> bool:
    """Whether no tensor after these could change the verdict (model tensors come first)."""
    last = results[-1]
    if last.group != MODEL:
        return any(r.nonfinite for r in results)
    return bool(last.nonfinite) and last.buffer is not True


def _sparse_values(info: TensorInfo, tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A sparse tensor's stored values and the coordinates of each (COO indices, one column per value); a layout
    that holds its values otherwise is refused rather than passed over as clean."""
    if tensor.layout not in _SPARSE:
        raise BadInput(info.file, f"tensor {info.name!r} has layout {str(tensor.layout).removeprefix('torch.')}, "
                                  "which this nanforensics cannot check")
    coo = tensor if tensor.layout == torch.sparse_coo else tensor.to_sparse_coo()
    return coo._values(), coo._indices()


def _keep(view: torch.Tensor) -> None:
    """Sparse values are not pages of the file's map: nothing to hand back."""


def _verdict(results: list[TensorScan]) -> str:
    bad = [r for r in results if r.nonfinite]
    if any(r.group == MODEL and r.buffer is not True for r in bad):  # a tensor not known to be a buffer counts
        return POISONED_PARAMETERS
    if any(r.group == MODEL for r in bad):
        return POISONED_BUFFERS
    return POISONED_STATE if any(r.group == OPTIMIZER for r in bad) else CLEAN


def _groups(infos: list[TensorInfo], results: list[TensorScan]) -> dict[str, GroupSummary]:
    out: dict[str, GroupSummary] = {}
    for info in infos:
        g = out.setdefault(info.group, GroupSummary(0, 0, 0, 0, 0, 0))
        g.tensors += 1
        g.bytes += info.nbytes
    for r in results:
        g = out[r.group]
        g.read += 1
        g.nonfinite_tensors += bool(r.nonfinite)
        g.nonfinite_values += r.nonfinite
        g.near_limit += r.near_limit
    return out
