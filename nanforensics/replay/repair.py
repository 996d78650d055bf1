"""Repair: a checkpoint the run can resume from cleanly, written where the user says, never into the run.

Replay names the responsible step t and the last clean checkpoint before it. From that checkpoint the
steps up to t are re-run as recorded, step t is changed — by default its batch is left out (only the
samples known to break it, when sample attribution found them); with ``reset_state`` it runs as
recorded and the poisoned optimizer-state coordinates are zeroed in place — and the state before step
t+1 is written as a checkpoint of the run format. The folder is built under a temporary name and
renamed into place only after a replay of K logged steps, started from the written files, stays finite.
"""

from __future__ import annotations

import dataclasses
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from ..distributed.sessions import open_session
from ..errors import BadInput
from ..outputs import check_outputs, write_output, writing
from ..progress import SILENT, Progress
from ..report import ReplayReport, WhatIfResult, to_json
from ..runs.checkpoint import Checkpoint, save_checkpoint
from ..runs.files import make_build_dir, publish_dir_atomic, write_json_atomic
from ..runs.run import MANIFEST, Run, UserCode
from ..words import span
from .engine import ReplayOptions, replay_run
from .session import pinned_threads, resolve_device
from .whatif import DropBatch, DropSamples, Intervention, ResetState, nonfinite_in, replay_with

REPAIR_SCHEMA = "nanforensics.repair/1"
REPORT_FILE = "repair.json"


@dataclass
class RepairOptions:
    reset_state: bool = False  # run the responsible step and zero its poisoned state, instead of leaving it out
    verify_steps: int = 5      # logged steps replayed from the written checkpoint; all must stay finite
    force: bool = False        # replace a non-empty output folder
    device: str = "auto"
    code_paths: Sequence[Path] = ()
    trust_run_dir: bool = False
    trust_code: bool = False   # call the run's callables even where the trust policy refuses them
    trust_packages: Sequence[str] = ()  # installed distributions the run's code may come from


@dataclass
class RepairReport:
    run: str
    out: str
    written: bool              # False: the repaired run did not stay finite, and nothing was written
    responsible_step: int
    from_checkpoint: int       # the clean checkpoint the steps were re-run from
    resume_step: int           # the written checkpoint holds the state before this step
    checkpoint: str            # the written checkpoint folder (under out)
    change: str                # "drop-batch", "drop-samples=5", "reset-state"
    description: str
    detail: str | None
    changed_step: WhatIfResult  # the changed step, checked
    verification: WhatIfResult  # the replay from the written files
    findings: list[str] = field(default_factory=list)
    schema: str = REPAIR_SCHEMA


class NothingToRepair(Exception):
    """The replay names no responsible step (a clean run, a NaN not reproduced, a non-finite loss only): not bad
    input, so the command exits with the replay's own code, and writes nothing."""

    def __init__(self, diagnosis: ReplayReport) -> None:
        self.diagnosis = diagnosis
        super().__init__(f"the replay found no non-finite value in the model's state (verdict {diagnosis.verdict}): "
                         "nothing to repair")


def _check_out(run_dir: Path, out: Path, opts: RepairOptions) -> None:
    check_outputs([run_dir, *opts.code_paths], {"--out": out}, folders={"--out"})
    if out.is_dir() and any(out.iterdir()) and not opts.force:
        raise BadInput(out, "exists and is not empty; pass --force to replace it")


def _change(diagnosis: ReplayReport, reset_state: bool) -> Intervention:
    if reset_state:
        return ResetState()
    s = diagnosis.samples
    if s is not None and s.status == "attributed" and s.samples:
        return DropSamples("drop-samples=" + ",".join(map(str, s.samples)), s.samples)
    return DropBatch()


def repair_run(run_dir: str | Path, out: str | Path, options: RepairOptions | None = None,
               progress: Progress = SILENT) -> RepairReport:
    """Diagnose, re-run with the responsible step changed, verify from the written files, publish."""
    opts = options or RepairOptions()
    run, out = Run(run_dir), Path(out)
    _check_out(run.path, out, opts)
    diagnosis = replay_run(run.path, ReplayOptions(device=opts.device, code_paths=opts.code_paths,
                                                   trust_run_dir=opts.trust_run_dir, trust_code=opts.trust_code,
                                                   trust_packages=opts.trust_packages),
                           progress=progress)
    t = diagnosis.responsible_step
    if t is None:
        raise NothingToRepair(diagnosis)
    change = _change(diagnosis, opts.reset_state)
    checkpoint = next(c for c in run.checkpoints() if c.step == diagnosis.setup.from_checkpoint)
    device = resolve_device(opts.device)
    code = UserCode.load(run, opts.code_paths, opts.trust_run_dir, opts.trust_code, opts.trust_packages)
    last = min(t + opts.verify_steps, run.steps[-1].step)
    with writing("--out", out):
        build = make_build_dir(out)
    try:
        with pinned_threads(run.manifest.num_threads if device.type == "cpu" else None):
            with open_session(run, code, checkpoint, device).focused(diagnosis.origin.rank) as session:
                assert session is not None  # one process: it explains, and repairs
                progress.phase(f"repairing: {span(checkpoint.step, t - 1)} re-run, step {t} with {change.spec}",
                               None)
                session.advance_to(t)
                changed = replay_with(session, change, t)
                with writing("--out", out):
                    write_json_atomic(build / MANIFEST, run.manifest.raw)
                    written = save_checkpoint(build / "checkpoints", t + 1, session.model, session.optimizer,
                                              scaler=session.scaler, scheduler=session.scheduler,
                                              rank_rng=getattr(session, "rank_rng", None))
            progress.phase(f"verifying: the written checkpoint loaded afresh, {span(t + 1, last)} replayed", None)
            resumed = open_session(run, code, Checkpoint(written, t + 1), device)  # through the format, from disk
            loaded_bad = nonfinite_in(resumed, None)
            verification = dataclasses.replace(
                replay_with(resumed, None, last), intervention="resume",
                description="the written checkpoint loaded into a fresh model, the logged steps after it replayed")
        if loaded_bad is not None:
            verification = dataclasses.replace(verification, finite=False, first_nonfinite_step=t + 1,
                                               first_nonfinite=loaded_bad)
        report = RepairReport(str(run.path), str(out), changed.finite and verification.finite, t, checkpoint.step,
                              t + 1, str(out / "checkpoints" / written.name), change.spec, change.description,
                              changed.detail, changed, verification)
        report.findings = findings(report)
        if report.written:
            with writing("--out", out):
                write_output(build / REPORT_FILE, to_json(report))
                publish_dir_atomic(build, out)
    finally:
        shutil.rmtree(build, ignore_errors=True)  # gone once published; a failed or refused build is removed
    return report


def findings(r: RepairReport) -> list[str]:
    before = (f"{span(r.from_checkpoint, r.responsible_step - 1)} re-run as recorded from checkpoint "
              f"{r.from_checkpoint}" if r.from_checkpoint < r.responsible_step - 1 else
              f"step {r.from_checkpoint} re-run as recorded from checkpoint {r.from_checkpoint}"
              if r.from_checkpoint == r.responsible_step - 1 else
              f"no step re-run before it: the checkpoint at step {r.from_checkpoint} holds the state before it")
    out = [f"Step {r.responsible_step} changed: {r.description}" + (f" ({r.detail})" if r.detail else "") +
           f"; {before}."]
    v = r.verification
    if not r.changed_step.finite:
        out.append(f"Not written: after the change, step {r.responsible_step} still leaves "
                   f"{r.changed_step.first_nonfinite} non-finite.")
    elif not v.finite:
        out.append(f"Not written: resumed from the repaired state, the run goes non-finite at step "
                   f"{v.first_nonfinite_step} ({v.first_nonfinite}); another defect lies ahead, repair from there.")
    elif v.losses:
        out.append(f"Verified: the written checkpoint, loaded into a fresh model, replays logged steps "
                   f"{v.step}-{v.last_step} with finite loss, parameters and optimizer state.")
    else:
        out.append(f"Verified the written state only: no logged step after {r.responsible_step} to replay.")
    if r.written:
        out.append(f"Resume at step {r.resume_step} from {r.checkpoint}: it loads with nanforensics "
                   "(Checkpoint.load_into) and with plain torch + safetensors (docs/repair.md).")
    return out
