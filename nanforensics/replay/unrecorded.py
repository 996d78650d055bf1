"""Replays of runs nobody recorded: from one of the trainer's checkpoints with the user's batch function, and
after ``bisect`` has found the last clean checkpoint among them."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Mapping, Sequence

from ..checkpoints.bisect import BisectReport, bisect
from ..checkpoints.scan import DEFAULT_MARGIN
from ..checkpoints.scan import Progress as BytesProgress
from ..errors import BadInput
from ..progress import SILENT, Progress
from ..report import ReplayReport
from ..rootcause.findings import narrate
from ..runs.unrecorded import open_unrecorded, user_checkpoint
from .engine import ReplayOptions, replay
from .session import resolve_device

DEFAULT_MAX_STEPS = 100  # nothing logged says where an unrecorded run ends


def replay_checkpoint(checkpoint: str | Path, code: str, names: Mapping[str, str | None] | None = None,
                      options: ReplayOptions | None = None, progress: Progress = SILENT, *,
                      step_from: str = "--from-step") -> ReplayReport:
    """Replay from ``checkpoint`` with the callables of ``code`` (see ``runs.unrecorded.open_unrecorded``).

    ``options.from_step`` is the checkpoint's step where given (``step_from`` says what it rests on), and
    ``options.max_steps`` defaults to ``DEFAULT_MAX_STEPS``.
    """
    opts = options or ReplayOptions()
    resolve_device(opts.device)  # a bad --device is refused before any of the user's code is imported
    start = user_checkpoint(checkpoint, opts.from_step, step_from)
    run, user = open_unrecorded(start, code, names, search_paths=opts.code_paths,
                                trust_checkpoint=opts.trust_run_dir, trust_code=opts.trust_code,
                                trust_packages=opts.trust_packages)
    return replay(run, user, dataclasses.replace(opts, from_step=None, max_steps=opts.max_steps or DEFAULT_MAX_STEPS),
                  progress)


def bisect_and_replay(targets: Sequence[str | Path], code: str, names: Mapping[str, str | None] | None = None,
                      options: ReplayOptions | None = None, *, linear: bool = False, full: bool = False,
                      margin: float = DEFAULT_MARGIN, scan_progress: BytesProgress | None = None,
                      progress: Progress = SILENT) -> BisectReport:
    """Bisect the checkpoints, then replay from the last clean one: up to a step past the first poisoned one,
    or ``options.max_steps`` when none is poisoned. ``report.replayed`` holds the replay, or
    ``report.replay_unavailable`` says why there is none."""
    opts = options or ReplayOptions()
    report = bisect(targets, linear=linear, full=full, margin=margin, progress=scan_progress)
    recorded = next((h.path for h in report.history if (Path(h.path).parent.parent / "manifest.json").is_file()), None)
    if recorded is not None:
        raise BadInput(recorded, "is a checkpoint of a run recorded by nanforensics: bisect it with --replay, which "
                                 "replays the run's own batches")
    clean, poisoned = report.last_clean, report.first_poisoned
    if report.verdict == "non_monotonic":
        report.replay_unavailable = "the checkpoints' history is not monotonic, so no clean one bounds the origin"
    elif clean is None or clean.step is None:
        report.replay_unavailable = "no clean checkpoint precedes the first poisoned one, so there is nothing to " \
                                    "replay from"
    else:
        # through a step past the poisoned checkpoint: the loss of the responsible step is still finite
        steps = poisoned.step - clean.step + 2 if poisoned is not None and poisoned.step is not None else opts.max_steps
        report.replayed = replay_checkpoint(clean.path, code, names,
                                            dataclasses.replace(opts, from_step=clean.step, max_steps=steps),
                                            progress, step_from=report.order)
        r = report.replayed
        if poisoned is not None and r.origin is None:  # clean, or a non-finite loss only: not the poisoning
            r.verdict = "not_reproduced"
            state = "stays finite" if not r.loss_only_steps else \
                "keeps the parameters, optimizer state and buffers finite"
            r.findings.insert(0, f"The checkpoint at step {poisoned.step} holds non-finite values, but the replay from "
                                 f"the clean one at step {clean.step} {state} through step {r.setup.last_step}: "
                                 "not reproduced from the supplied batches.")
            narrate(r)
    return report
