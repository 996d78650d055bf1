"""Scan one checkpoint: every tensor's finiteness, first bad coordinate and headroom, and a verdict.

One ``aminmax`` pass per tensor (``finite.extremes``, in chunks whose pages are handed back as
soon as they are read, so the resident set stays near one chunk) gives both the verdict and
max |x|; the exact count and the first coordinate are computed only for tensors found bad.
Model tensors are read before optimizer state, so stopping at the first non-finite tensor still
gives the right verdict: a bad model tensor means poisoned parameters, a bad state tensor after
a clean model means poisoned state only.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Protocol

import torch

from .. import finite
from ..errors import BadInput
from ..formats import MODEL, OPTIMIZER, CheckpointSource, TensorInfo
from ..formats.source import Release

SCAN_SCHEMA = "nanforensics.scan/1"
DEFAULT_MARGIN = 1000.0
CHUNK_BYTES = 32 << 20
CLEAN, POISONED_PARAMETERS, POISONED_STATE = "clean", "poisoned_parameters", "poisoned_optimizer_state"
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
    format: str  # the layout recognised: nanforensics, pytorch, lightning, safetensors, safetensors-sharded, accelerate, dcp
    step: int | None
    step_source: str | None  # "metadata" or "name"
    verdict: str  # CLEAN, POISONED_PARAMETERS or POISONED_STATE
    complete: bool  # False: stopped at the first non-finite tensor
    margin: float
    groups: dict[str, GroupSummary]
    tensors: list[TensorScan]
    bytes_read: int
    bytes_total: int
    seconds: float
    schema: str = field(default=SCAN_SCHEMA)
    skipped: list[str] = field(default_factory=list)  # "file: why" for each file beside it that was not read

    @property
    def poisoned(self) -> list[TensorScan]:
        return [t for t in self.tensors if t.nonfinite]


def check_margin(margin: float) -> None:
    if not margin >= 1:
        raise BadInput("--margin", f"{margin} is not a factor of at least 1")


def scan_checkpoint(source: CheckpointSource, *, full: bool = False, margin: float = DEFAULT_MARGIN,
                    progress: Progress | None = None, resume: ScanReport | None = None) -> ScanReport:
    """Read the checkpoint's tensors one at a time; stop at the first non-finite one unless ``full``.

    ``resume`` continues a scan of the same checkpoint that stopped early, reading only the
    tensors after the ones it already holds.
    """
    check_margin(margin)
    started = time.perf_counter()
    stream = source.open()
    results = list(resume.tensors) if resume else []
    bytes_read = resume.bytes_read if resume else 0
    if progress:
        progress.start(source.path.name, stream.nbytes)
        progress.advance(bytes_read)
    for info, tensor, release in stream.tensors(len(results)):
        result = _check(info, tensor, release, margin)
        del tensor  # unmaps it before the next one is mapped
        results.append(result)
        bytes_read += info.nbytes
        if progress:
            progress.advance(info.nbytes)
        if result.nonfinite and not full:
            break
    seconds = time.perf_counter() - started + (resume.seconds if resume else 0.0)
    return ScanReport(path=str(source.path), format=source.format, step=source.step, step_source=source.step_source,
                      verdict=_verdict(results), complete=len(results) == len(stream.infos), margin=margin,
                      groups=_groups(stream.infos, results), tensors=results, bytes_read=bytes_read,
                      bytes_total=stream.nbytes, seconds=seconds, skipped=list(source.skipped))


def _widened(t: torch.Tensor) -> torch.Tensor:
    return t.float() if t.dtype in _NO_AMINMAX else t  # exact: every fp8 value is a float32


def _extremes(tensor: torch.Tensor, release: Release) -> tuple[float, float]:
    """min and max (NaN if any) chunk by chunk, each chunk's pages released once read.

    A non-contiguous tensor is flattened into a copy: nothing of it to release.
    """
    contiguous = tensor.is_contiguous()
    flat = tensor.reshape(-1)
    step = max(1, CHUNK_BYTES // tensor.element_size())
    parts = []
    for start in range(0, flat.numel(), step):
        chunk = flat[start:start + step]
        parts.append(finite.extremes(_widened(chunk)))
        if contiguous:
            release(chunk)
    both = torch.stack(parts)
    return float(both[:, 0].min()), float(both[:, 1].max())


def _check(info: TensorInfo, tensor: torch.Tensor, release: Release, margin: float) -> TensorScan:
    base = {"name": info.name, "group": info.group, "dtype": str(info.dtype).removeprefix("torch."),
            "shape": list(info.shape)}
    if tensor.layout != torch.strided or not finite.checkable(tensor):
        return TensorScan(**base, checked=False, nonfinite=0, first_nonfinite=None, max_abs=None, dtype_max=None,
                          near_limit=False)
    lo, hi = _extremes(tensor, release)
    if math.isfinite(lo) and math.isfinite(hi):
        count, first, peak = 0, None, max(abs(lo), abs(hi))
    else:  # extremes are float32: a float64 beyond its range reads inf here, so count before locating
        t = _widened(tensor)
        count = finite.count_nonfinite(t)
        first = finite.locate(t) if count else None
        peak = finite.max_abs(t) if count < t.numel() * (2 if t.is_complex() else 1) else None
    limit = torch.finfo(tensor.dtype).max
    return TensorScan(**base, checked=True, nonfinite=count, first_nonfinite=first, max_abs=peak, dtype_max=limit,
                      near_limit=peak is not None and peak * margin >= limit)


def _verdict(results: list[TensorScan]) -> str:
    bad = {r.group for r in results if r.nonfinite}
    return POISONED_PARAMETERS if MODEL in bad else POISONED_STATE if OPTIMIZER in bad else CLEAN


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
