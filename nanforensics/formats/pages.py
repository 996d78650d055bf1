"""Handing a memory-mapped tensor's pages back once read, so a scan's resident set stays near one chunk, and asking
for the next chunk's pages ahead of the read.

A scan touches every page of a checkpoint exactly once. On a file-backed private map that
nothing writes, MADV_DONTNEED only forgets page-table entries: the kernel faults the pages back
in from the page cache if they are read again, so the tensor stays valid. On anonymous memory it
would zero them, so callers pass only views of file maps.
"""

from __future__ import annotations

import ctypes
import mmap
from typing import Callable

import torch

_MADV_DONTNEED = getattr(mmap, "MADV_DONTNEED", None)
_MADV_WILLNEED = getattr(mmap, "MADV_WILLNEED", None)


def _libc_madvise() -> Callable[[int, int, int], int] | None:
    if _MADV_DONTNEED is None or _MADV_WILLNEED is None:
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


_madvise = _libc_madvise()


def span(view: torch.Tensor) -> tuple[int, int]:
    """The page-aligned address range covering a contiguous view."""
    page = mmap.PAGESIZE
    lo, hi = view.data_ptr(), view.data_ptr() + view.numel() * view.element_size()
    return lo - lo % page, hi + (-hi) % page


def drop_pages(view: torch.Tensor) -> None:
    """Forget the resident pages under ``view``, a contiguous view of a read-only file map."""
    if _madvise is None or view.numel() == 0 or not view.is_contiguous():
        return
    lo, hi = span(view)
    _madvise(lo, hi - lo, _MADV_DONTNEED)


def read_ahead(view: torch.Tensor) -> None:
    """Ask the kernel to start reading the pages under ``view`` from disk now (``MADV_WILLNEED``), so that they
    arrive while the chunk before is reduced: from a cold page cache the disk and the reduction overlap. On pages
    already cached it only looks them up."""
    if _madvise is None or view.numel() == 0 or not view.is_contiguous():
        return
    lo, hi = span(view)
    _madvise(lo, hi - lo, _MADV_WILLNEED)
