"""Ways to read a checkpoint's bytes for a scan, side by side: issue 25's candidates against the reader kept.

    python bench/bench_scan_readers.py [--gib 1] [--rounds 3] [--threads 1]

A float32 file in the page cache (written, then read once), scanned with one ``aminmax`` a chunk by: a private
read-only map, each chunk's pages handed back after (what ``inputs.py`` and ``formats/pages.py``
do), with chunks of 32 and 128 MB, with ``MADV_WILLNEED`` or ``MADV_POPULATE_READ`` on the next chunk, with
``MAP_POPULATE``; ``readinto`` into one reused buffer of 8, 32 and 128 MB; against a ``sum`` and an ``aminmax`` over
the same number of bytes already in memory. Printed per way: best wall and best CPU (user + system of this
process) throughput over the rounds; on a loaded machine the CPU figure is the one to compare.
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch

_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
DONTNEED, WILLNEED, POPULATE_READ = 4, 3, 22  # linux/mman.h


def mapped(path: Path, size: int, chunk: int, advice: int | None = None, populate: bool = False) -> None:
    with open(path, "rb") as f:
        flags = mmap.MAP_PRIVATE | (getattr(mmap, "MAP_POPULATE", 0) if populate else 0)
        m = mmap.mmap(f.fileno(), size, flags=flags, prot=mmap.PROT_READ)
        t = torch.frombuffer(m, dtype=torch.float32)
        base, n = t.data_ptr(), chunk // 4
        for s in range(0, t.numel(), n):
            if advice is not None and s + n < t.numel():
                _libc.madvise(base + (s + n) * 4, min(chunk, size - (s + n) * 4), advice)
            mn, mx = torch.aminmax(t[s:s + n])
            mn.item(), mx.item()
            _libc.madvise(base + s * 4, chunk, DONTNEED)
        del t
        m.close()


def read_into(path: Path, chunk: int) -> None:
    buf = bytearray(chunk)
    t = torch.frombuffer(buf, dtype=torch.float32)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            mn, mx = torch.aminmax(t[:n // 4])
            mn.item(), mx.item()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    size = int(args.gib * 2**30) // (128 << 20) * (128 << 20)
    memory = torch.randn(size // 4)
    MB = 1 << 20
    with tempfile.TemporaryDirectory(prefix="nf-bench-readers-") as tmp:
        path = Path(tmp) / "f.bin"
        memory.numpy().tofile(path)
        with open(path, "rb") as f:
            while f.read(64 * MB):
                pass
        ways: dict[str, Callable[[], None]] = {
            "sum, in memory": lambda: memory.sum().item(),
            "aminmax, in memory": lambda: [v.item() for v in torch.aminmax(memory)],
            "map, 32 MB chunks (kept)": lambda: mapped(path, size, 32 * MB),
            "map, 128 MB chunks": lambda: mapped(path, size, 128 * MB),
            "map, WILLNEED on the next chunk": lambda: mapped(path, size, 32 * MB, WILLNEED),
            "map, POPULATE_READ on the next": lambda: mapped(path, size, 32 * MB, POPULATE_READ),
            "map, MAP_POPULATE": lambda: mapped(path, size, 32 * MB, populate=True),
            "readinto, 8 MB buffer": lambda: read_into(path, 8 * MB),
            "readinto, 32 MB buffer": lambda: read_into(path, 32 * MB),
            "readinto, 128 MB buffer": lambda: read_into(path, 128 * MB)}
        best = {k: (float("inf"), float("inf")) for k in ways}
        for _ in range(args.rounds):
            for name, way in ways.items():
                wall, cpu = time.perf_counter(), time.process_time()
                way()
                wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
                best[name] = (min(best[name][0], wall), min(best[name][1], cpu))
    reference = size / best["sum, in memory"][1]
    print(f"{size / 2**30:.2f} GiB float32, {args.threads} thread(s), best of {args.rounds} rounds; "
          f"load average {os.getloadavg()[0]:.1f}")
    for name, (wall, cpu) in best.items():
        print(f"  {name:<34}{size / wall / 1e9:7.1f} GB/s wall {size / cpu / 1e9:7.1f} GB/s CPU "
              f"({size / cpu / reference:.2f} of the sum's)")


if __name__ == "__main__":
    main()
