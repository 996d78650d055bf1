"""Reading tensors once, chunk by chunk: each tensor's extremes, and whatever else wants the same chunk while it is hot.

A parameter's optimizer state (Adam's two moments) is checked twice: finite (the scan) and sound (soundness). Read
apart, the moments' pages were faulted in, handed back and faulted in again: two thirds of a checkpoint's bytes read
twice. Read here, the tensors of one parameter go in lockstep, and the soundness screen sees each chunk between its
reduction and the release of its pages (docs/performance.md).
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import torch

from .. import finite
from ..formats.entries import Release
from ..formats.pages import read_ahead

CHUNK_BYTES = 32 << 20  # 32 and 128 MB read alike (bench_scan_readers.py); 128 MB put the peak RSS past its bound

# (the chunks' first index, the chunks in the tensors' order, each chunk's minimum, NaN where it holds a NaN)
OnChunk = Callable[[int, list[torch.Tensor], list[float]], None]


def walk(tensors: Sequence[torch.Tensor], releases: Sequence[Release], on_chunk: OnChunk | None = None
         ) -> list[tuple[float, float]]:
    """min and max of each of these tensors of one size (NaN, NaN for one holding a NaN), read in lockstep chunks of
    ``CHUNK_BYTES`` in all: the next chunk asked for from the disk while one is reduced, each chunk's pages released
    once read. Without ``on_chunk`` a NaN ends the pass (the scan
    then counts and locates); with it every chunk is read. A non-contiguous tensor is flattened into a copy: nothing
    of it to release or to read ahead."""
    flats = [t.reshape(-1) for t in tensors]
    contiguous = [t.is_contiguous() for t in tensors]
    n = flats[0].numel()
    # CHUNK_BYTES in all; beside the checks, counted as float32 where narrower, what they widen a chunk into (so the
    # resident set stays within a few chunks whatever the dtypes)
    sizes = [f.element_size() if on_chunk is None else max(f.element_size(), 4) for f in flats]
    step = max(1, CHUNK_BYTES // sum(sizes))
    lo, hi = [math.inf] * len(flats), [-math.inf] * len(flats)
    for start in range(0, n, step):
        chunks = [f[start:start + step] for f in flats]
        for f, ahead in zip(flats, contiguous):
            if ahead:
                read_ahead(f[start + step:start + 2 * step])
        minima = []
        for i, chunk in enumerate(chunks):
            mn, mx = (v.item() for v in finite.min_max(chunk))  # a CPU reduction has finished: read it at once
            minima.append(mn)
            nan = math.isnan(lo[i]) or math.isnan(mn) or math.isnan(mx)
            lo[i], hi[i] = (math.nan, math.nan) if nan else (min(lo[i], mn), max(hi[i], mx))
        if on_chunk is not None:
            on_chunk(start, chunks, minima)
        for chunk, release, own in zip(chunks, releases, contiguous):
            if own:
                release(chunk)
        if on_chunk is None and all(math.isnan(x) for x in lo):
            break
    return list(zip(lo, hi))
