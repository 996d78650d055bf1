"""Find the first poisoned checkpoint of a run in about log2(n) checkpoint reads.

Non-finite values in parameters, optimizer state and running averages kept as buffers (BatchNorm's
statistics) are absorbing: once there, no later update makes them finite. So along a run's
checkpoints "poisoned" is monotone, and bisection over the step order finds the boundary: the
last (n-1) and first (0) checkpoints are read, then the midpoint of the clean/poisoned pair, at
most ceil(log2 n) + 2 reads in all, each checkpoint read at most once. A read that contradicts
absorption (a clean checkpoint after a poisoned one: a restart, a manual repair) is reported as
non-monotonic history rather than bisected through.
"""

from __future__ import annotations

import math
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Sequence

from ..errors import BadInput
from ..formats import CheckpointSource, Collection, discover
from ..report import ReplayReport
from ..runs.paths import MANIFEST
from ..runs.run import Manifest, batch_gaps
from ..runs.stages import PIPELINE
from .scan import CLEAN, DEFAULT_MARGIN, Progress, ScanReport, ScanVerdict, TensorScan, check_margin, scan_checkpoint

BISECT_SCHEMA = "nanforensics.bisect/1"


@dataclass
class CheckpointRef:
    path: str
    step: int | None


@dataclass
class ScanRecord:
    """One checkpoint read, in the order they were read."""

    index: int  # position in the step order
    path: str
    step: int | None
    verdict: str
    complete: bool
    bytes_read: int
    seconds: float
    format: str = ""  # the layout recognised
    skipped: list[str] = field(default_factory=list)  # "file: why" for each file beside it that was not read
    unsound: int = 0  # soundness findings in its optimizer state (checkpoints.soundness), when read whole


@dataclass
class NonMonotonic:
    poisoned: CheckpointRef
    clean_after: CheckpointRef


@dataclass
class ReplayHint:
    run: str
    from_step: int
    command: str


@dataclass
class BisectReport:
    verdict: Literal["clean", "poisoned", "non_monotonic"]
    mode: str  # "bisect" or "linear"
    targets: list[str]
    order: str  # "metadata" or "name": what the checkpoints were ordered by
    checkpoints: int
    scans: int  # checkpoints read
    max_scans: int  # the bound: ceil(log2 n) + 2 when bisecting, n when linear
    last_clean: CheckpointRef | None
    first_poisoned: CheckpointRef | None
    first_poisoned_verdict: ScanVerdict | None  # the scan verdict: poisoned parameters or optimizer state only
    poisoned_tensors: list[TensorScan]
    non_monotonic: list[NonMonotonic]
    history: list[ScanRecord]
    first_poisoned_scan: ScanReport | None
    replay: ReplayHint | None  # the replay that pins the step, where the run kept that window's batches
    replay_unavailable: str | None  # why there is none: for checkpoints of a run of ours, or with --code
    schema: str = field(default=BISECT_SCHEMA)
    replayed: ReplayReport | None = None  # with --code: the replay from the last clean checkpoint
    skipped: list[str] = field(default_factory=list)  # "path: why" for files in the folders given left unread


def scan_bound(n: int) -> int:
    return math.ceil(math.log2(n)) + 2 if n > 0 else 0


class _Reader:
    """Reads each checkpoint at most once and keeps what it found, in read order."""

    def __init__(self, collection: Collection, full: bool, margin: float, progress: Progress | None) -> None:
        self.checkpoints = collection.checkpoints
        self.full, self.margin, self.progress = full, margin, progress
        self.scans: dict[int, ScanReport] = {}
        self.history: list[ScanRecord] = []

    def poisoned(self, index: int) -> bool:
        if index not in self.scans:
            report = scan_checkpoint(self.checkpoints[index], full=self.full, margin=self.margin, progress=self.progress)
            self.scans[index] = report
            self.history.append(ScanRecord(index, report.path, report.step, report.verdict, report.complete,
                                           report.bytes_read, report.seconds, report.format, report.skipped,
                                           len(report.unsound)))
        return self.scans[index].verdict != CLEAN

    def complete(self, index: int) -> ScanReport:
        """The full scan of a checkpoint read with early stopping: its remaining tensors only."""
        report = self.scans[index]
        if not report.complete:
            report = scan_checkpoint(self.checkpoints[index], full=True, margin=self.margin, progress=self.progress,
                                     resume=report)
            self.scans[index] = report
            record = next(r for r in self.history if r.index == index)
            record.complete, record.bytes_read, record.seconds = True, report.bytes_read, report.seconds
        return report


def bisect(targets: Sequence[str | Path], *, linear: bool = False, full: bool = False,
           margin: float = DEFAULT_MARGIN, progress: Progress | None = None) -> BisectReport:
    """The last clean and first poisoned checkpoint among ``targets`` (run directories, folders, globs, files)."""
    check_margin(margin)
    collection = discover(targets)
    n = len(collection.checkpoints)
    reader = _Reader(collection, full, margin, progress)
    if linear:
        for i in range(n):
            reader.poisoned(i)
    else:
        last_poisoned = reader.poisoned(n - 1)
        # Read the first one too: when it is poisoned and the last is clean, the history is not monotonic.
        if n > 1 and not reader.poisoned(0) and last_poisoned:
            lo, hi = 0, n - 1
            while hi - lo > 1:
                mid = (lo + hi) // 2
                lo, hi = (lo, mid) if reader.poisoned(mid) else (mid, hi)
    return _report(collection, reader, [str(t) for t in targets], linear)


def _report(collection: Collection, reader: _Reader, targets: list[str], linear: bool) -> BisectReport:
    cks = collection.checkpoints
    read = sorted(reader.scans)
    bad = {i for i in read if reader.scans[i].verdict != CLEAN}
    breaks = [NonMonotonic(_ref(cks[a]), _ref(cks[b])) for a, b in zip(read, read[1:]) if a in bad and b not in bad]
    first = min(bad) if bad else None
    if first is None:
        last_clean: int | None = read[-1]
    else:
        last_clean = first - 1 if first - 1 in reader.scans else None
    scan = reader.complete(first) if first is not None else None
    hint, why_not = _replay(cks[last_clean] if last_clean is not None else None, cks[first]) if first is not None \
        else (None, None)
    return BisectReport(
        verdict="non_monotonic" if breaks else "poisoned" if bad else "clean",
        mode="linear" if linear else "bisect", targets=targets, order=collection.order, checkpoints=len(cks),
        scans=len(reader.history), max_scans=len(cks) if linear else scan_bound(len(cks)),
        last_clean=_ref(cks[last_clean]) if last_clean is not None else None,
        first_poisoned=_ref(cks[first]) if first is not None else None,
        first_poisoned_verdict=scan.verdict if scan else None,
        poisoned_tensors=scan.poisoned if scan else [], non_monotonic=breaks, history=reader.history,
        first_poisoned_scan=scan, replay=hint, replay_unavailable=why_not, skipped=collection.skipped)


def _ref(c: CheckpointSource) -> CheckpointRef:
    return CheckpointRef(str(c.path), c.step)


def _replay(clean: CheckpointSource | None, poisoned: CheckpointSource) -> tuple[ReplayHint | None, str | None]:
    """``nanforensics replay`` from the last clean checkpoint, when the run kept the batches up to the poisoned one."""
    if poisoned.run_dir is None:
        return None, None
    if clean is None or clean.run_dir != poisoned.run_dir or clean.step is None or poisoned.step is None:
        return None, "no clean checkpoint of the run precedes the first poisoned one, so there is nothing to replay from"
    run = poisoned.run_dir
    missing = batch_gaps(run, clean.step, poisoned.step)
    if missing:
        spans = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in missing)
        return None, (f"the run kept no batches for steps {spans} (recorded with keep_checkpoints?), "
                      "so the window cannot be replayed")
    command = f"{_launcher(run)}nanforensics replay {shlex.quote(str(run))} --from-step {clean.step}"
    return ReplayHint(str(run), clean.step, command), None


def _launcher(run: Path) -> str:
    """torchrun's command line before a pipeline-parallel run's replay, which one process does not replay."""
    try:
        world = Manifest.read(run / MANIFEST).world
    except BadInput:
        return ""
    return f"torchrun --nproc-per-node {world.world_size} -m " if world is not None and world.kind == PIPELINE else ""


