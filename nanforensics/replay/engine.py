"""Replay a run with per-step checks and name the step, batch and coordinate where NaN began.

``replay`` drives any run a ``StepSource`` and ``StepCode`` describe: ``replay_run`` opens a recorded one,
``replay.unrecorded`` a trainer's own checkpoint with the user's batch function.
"""

from __future__ import annotations

import math
from contextlib import ExitStack
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Collection, Sequence

import torch

from ..checkpoints.scan import CLEAN, scan_checkpoint
from ..checkpoints.soundness import resume_findings, start_soundness
from ..distributed.findings import complete
from ..distributed.findings import findings as rank_findings
from ..distributed.pipeline_replay import replay_pipeline
from ..distributed.sessions import open_session, regrouped
from ..errors import BadInput
from ..finite import value_name
from ..formats import CheckpointSource
from ..formats.discover import open_checkpoint
from ..progress import SILENT, Progress
from ..report import (
    BatchRef,
    CheckpointComparison,
    Event,
    OperationCulprit,
    Precursor,
    ReplayReport,
    ReplaySetup,
    SampleAttribution,
    StepRecord,
)
from ..report import loss_only as is_loss_only
from ..rootcause import DEFAULT_MAX_ABS
from ..rootcause.data import check_batches
from ..rootcause.findings import findings, narrate
from ..rootcause.operations import trace_step
from ..rootcause.precursors import PrecursorProbe
from ..rootcause.samples import attribute_samples, batch_size, sample_hint
from ..runs.batches import data_leaves
from ..runs.checkpoint import Checkpoint
from ..runs.compiled import EAGER_KERNELS
from ..runs.cpu import this_cpu
from ..runs.run import Run, UserCode
from ..runs.source import StartPoint, StepCode, StepSource
from ..runs.stages import PIPELINE
from ..runs.steplog import first_nonfinite
from ..words import span
from . import whatif
from .amp import AmpLog
from .amp import findings as amp_findings
from .monitor import StepMonitor, buffers_total, totals
from .reproduction import LOSS_ULPS, STATE_RTOL, compare_checkpoint, float32_ulps, judge, losses_match
from .session import Session, pinned_threads, resolve_device
from .support import check_supported

PRECURSOR_STEPS = 16  # steps before the event the precursor curves cover at least, where an older checkpoint allows


@dataclass
class ReplayOptions:
    from_step: int | None = None
    device: str = "auto"
    after: int = 1  # steps replayed after the whole model went non-finite
    max_steps: int | None = None
    code_paths: Sequence[Path] = ()
    trust_run_dir: bool = False  # import code that lies inside the run directory
    trust_code: bool = False  # call the run's callables even where the trust policy refuses them (README, Security)
    trust_packages: Sequence[str] = ()  # installed distributions the run's code may come from (--trust-package)
    loss_rtol: float | None = None  # None: 0 on the recording device type, 1e-3 elsewhere (besides loss_ulps)
    loss_ulps: int = LOSS_ULPS  # logged and replayed losses this many float32 ulps apart still match
    explain: bool = True  # operation and sample attribution for the responsible step
    data_max_abs: float = DEFAULT_MAX_ABS  # batch values beyond this magnitude are reported as data defects
    what_if: Sequence[whatif.Intervention] = ()  # each a replay from the checkpoint changing the responsible step
    what_if_steps: int = 5  # steps after the responsible one a what-if must stay finite for
    proof: bool = True  # detect mode skips optimizer state and parameters proven finite (replay/proof.py); False reads all


def _start_checkpoint(run: StepSource, target: int | None, progress: Progress = SILENT) -> StartPoint:
    """The newest checkpoint at or before ``target`` whose parameters and state are all finite."""
    checkpoints = run.checkpoints()
    where = run.checkpoint_folder
    if not checkpoints:
        raise BadInput(where, "the run has no checkpoints")
    candidates = [c for c in checkpoints if target is None or c.step <= target]
    if not candidates:
        raise BadInput(where, f"no checkpoint at or before step {target} (oldest is step {checkpoints[0].step})")
    for c in reversed(candidates):
        progress.phase(f"checking that the checkpoint at step {c.step} is finite", None)
        if _checkpoint_finite(c):
            return c
    raise BadInput(where, f"every checkpoint up to step {candidates[-1].step} already holds non-finite values: the "
                          "origin lies before the oldest one kept (run `nanforensics bisect` on the folder)")


def _precursor_start(run: StepSource, checkpoint: StartPoint, step: int) -> StartPoint:
    """Where the rewind re-runs from: the start checkpoint, or an older finite one (with its batches kept) when
    the start leaves fewer than PRECURSOR_STEPS steps before ``step``, since a drift into overflow shows over
    tens of steps. The newest old enough, else the oldest there is."""
    if step - checkpoint.step >= PRECURSOR_STEPS:
        return checkpoint
    earlier = [c for c in run.checkpoints() if c.step < checkpoint.step]
    enough = [c for c in earlier if c.step <= step - PRECURSOR_STEPS]
    for c in enough[-1:] or earlier[:1]:
        if all(run.batch_origin(s) is not None for s in range(c.step, checkpoint.step)) and _checkpoint_finite(c):
            return c
    return checkpoint


def _opened(c: StartPoint) -> CheckpointSource:
    """The checkpoint's reader: the one a checkpoint nobody recorded was opened with to read its step (not opened
    twice), else one opened from its path."""
    return getattr(c, "source", None) or open_checkpoint(c.path)


def _checkpoint_finite(c: StartPoint) -> bool:
    """Streamed, one tensor at a time, stopping at the first non-finite one (soundness is checked on the one chosen);
    a recorded checkpoint's gradients of parameters no optimizer holds too, which the next step starts from."""
    if scan_checkpoint(_opened(c), soundness=False).verdict != CLEAN:
        return False
    loose = c.loose_grads(c.meta()) if isinstance(c, Checkpoint) else {}
    return all(bool(torch.isfinite(grad).all()) for grad in loose.values())


def replay_run(run_dir: str | Path, options: ReplayOptions | None = None,
               progress: Progress = SILENT) -> ReplayReport:
    """Replay a recorded run from the last clean checkpoint before the first non-finite logged loss (or
    ``from_step``)."""
    opts = options or ReplayOptions()
    run = Run(run_dir)
    if not run.steps:
        raise BadInput(run.path / "steps.jsonl", "no steps were logged")
    resolve_device(opts.device)  # a bad --device is refused before any of the user's code is imported
    return replay(run, UserCode.load(run, opts.code_paths, opts.trust_run_dir, opts.trust_code,
                                     opts.trust_packages), opts, progress)


def replay(run: StepSource, code: StepCode, opts: ReplayOptions, progress: Progress = SILENT) -> ReplayReport:
    """Replay ``run`` with ``code`` from the last clean checkpoint before the first non-finite logged loss (or
    ``opts.from_step``), through the run's last step or ``opts.max_steps``."""
    logged = {s.step: s.loss for s in run.steps}
    logged_first = first_nonfinite(run.steps)
    if opts.from_step is not None and run.last_step is not None and opts.from_step > run.last_step:
        raise BadInput("--from-step", f"step {opts.from_step} lies past the run's last logged step, {run.last_step}")
    device = resolve_device(opts.device)
    target = opts.from_step if opts.from_step is not None else (logged_first if logged_first is not None else run.last_step)
    if run.world is not None and run.world.kind == PIPELINE:  # one stage per rank, a replay of its own
        return replay_pipeline(run, code, lambda: _start_checkpoint(run, target, progress), device, opts, progress)
    checkpoint = _start_checkpoint(run, target, progress)
    bound = checkpoint.step + opts.max_steps - 1 if opts.max_steps is not None else None
    last = min((s for s in (run.last_step, bound) if s is not None), default=None)
    if last is None:
        raise BadInput("--max-steps", "the run logged no steps, so nothing says where it ends: give --max-steps")
    if run.steps and run.steps[0].step > checkpoint.step:  # the window is then the log's steps, never a gap's range
        raise BadInput(run.path, f"its step log starts at step {run.steps[0].step}, after the start checkpoint (step "
                       f"{checkpoint.step}): the steps between were never logged")
    logged_nan = [s.step for s in run.steps if s.step >= checkpoint.step and not math.isfinite(s.loss)]
    # on another kind of CPU than the run's (or one the run does not name), kernels sum in another order: the state
    # and the losses are compared within a tolerance, as on another device type
    here = this_cpu() if device.type == "cpu" else None
    other_cpu = here is not None and str(run.device or "cpu").split(":")[0] == "cpu" and run.cpu != here
    # so does a run on a DeviceMesh emulated on one process (sessions.regrouped), and a run compiled with a backend of
    # its own kernels (inductor), replayed eagerly: rounded otherwise, compared so too
    fused = run.compiled is not None and run.compiled not in EAGER_KERNELS
    inexact = other_cpu or regrouped(run) or fused
    state_rtol = STATE_RTOL if inexact else 0.0
    rtol = opts.loss_rtol if opts.loss_rtol is not None else (
        0.0 if device.type == str(run.device or "cpu").split(":")[0] and not inexact else 1e-3)

    # Logged batches are checked over the whole window before replaying; batches a function computes (no logged
    # end, a --max-steps bound) where the replay ran them, not up to a bound the failure may lie far before.
    if run.last_step is not None:
        progress.phase(f"checking the batches of {span(checkpoint.step, last)}", None)
    data_defects = check_batches(run, range(checkpoint.step, last + 1), opts.data_max_abs) \
        if run.last_step is not None else []
    stop = _expected_stop(logged_nan, last, opts.after)

    with pinned_threads(run.num_threads if device.type == "cpu" else None) as threads:
        r = open_session(run, code, checkpoint, device)
        check_supported(run.path, r.optimizer)  # before any step
        # the start checkpoint's optimizer state beyond finiteness: an origin on what it flags is explained by it
        unsound = start_soundness(_opened(checkpoint), r.model, r.optimizer)
        amp = AmpLog()
        params_total, state_total = totals(r.optimizer)
        buffers_all = buffers_total(r.model)
        # the recorded checkpoints past the start, to compare with; a run nobody recorded has only its start
        later = {c.step: c for c in run.checkpoints() if c.step > checkpoint.step}
        compared: dict[int, CheckpointComparison] = {}
        loss_only: list[int] = []
        loss_events: dict[int, Event] = {}  # the loss of each loss-only step, explained when nothing else is
        events: list[Event] = []
        spread: list[StepRecord] = []
        precursors: list[Precursor] = []
        located_from: int | None = None
        # The state before the step about to run, and before the first loss-only step, kept in memory: a flagged
        # step re-runs from there in locate mode, and root cause starts from there, instead of replaying from the
        # checkpoint again. The precursor probe rides along from the start for the same reason.
        kept: dict[int, dict] = {}
        hooks, monitor, probe = _watched(r, opts.proof)
        progress.phase(f"replaying {span(checkpoint.step, stop)}", stop - checkpoint.step + 1)
        first = checkpoint.step  # of the phase under way, for its count
        try:
            while r.step <= last:
                step = r.step
                if located_from is None:
                    kept = {s: v for s, v in kept.items() if s in loss_only[:1]}
                    kept[step] = r.snapshot()
                # a step whose overflow the scaler caught returns no events: they are kept aside in amp
                loss, step_events = amp.run_step(r, monitor, located_from is not None)
                # a recorded checkpoint passed: the state bit for bit (across CPUs within a tolerance), until one
                # differs (the later ones would too)
                if r.step in later and r.step not in compared and all(c.matched or c.error for c in compared.values()):
                    compared[r.step] = compare_checkpoint(r.model, r.optimizer, later[r.step], state_rtol)
                stages = {e.stage for e in step_events}
                if located_from is None and is_loss_only(stages):
                    loss_only.append(step)  # nothing non-finite reached gradients or state: not an origin
                    # detect mode leaves the value unread; the loss is a scalar, its value the replayed loss
                    loss_events.setdefault(step, replace(
                        next(e for e in step_events if e.stage == "loss"), value=value_name(loss)))
                    step_events = []
                precursors.append(probe.take(step))
                if step_events and located_from is None:
                    # Detect mode flagged this step: rewind and re-run it in locate mode, so the values
                    # are read before anything later in the step changes them: from the state kept before it,
                    # or, where the precursors should start at an older checkpoint, from there with the probe (an
                    # older checkpoint does not lead to an unsound start's state: it was not made by the steps).
                    precursors.pop()  # taken again in locate mode
                    start = checkpoint if unsound else _precursor_start(run, checkpoint, step)
                    if start.step == checkpoint.step:
                        r.restore(kept[step])
                    else:
                        hooks.close()
                        kept.clear()
                        precursors.clear()
                        r = open_session(run, code, start, device)
                        progress.phase(f"locating: re-running {span(r.step, step - 1)} with precursor probes",
                                       step - r.step)
                        with PrecursorProbe(r.model, r.optimizer) as warmup:
                            first = r.step
                            while r.step < step:
                                r.run_step()
                                precursors.append(warmup.take(r.step - 1))
                                progress.update(r.step - first)
                        kept = {step: r.snapshot()}  # root cause starts here too
                        hooks, monitor, probe = _watched(r, opts.proof)
                    stop = stop if stop >= step else last
                    progress.phase(f"locating: {span(step, stop)}, reading each first non-finite value",
                                   stop - step + 1, at_most=True)
                    first = step
                    located_from = step
                    continue
                events += step_events
                p_bad = sum(e.elements_nonfinite for e in step_events if e.stage == "param")
                s_bad = sum(e.elements_nonfinite for e in step_events if e.stage == "optimizer_state")
                # each rank of a distributed run reports its own copy of the buffers: the copy that holds the most
                b_bad = max((sum(e.elements_nonfinite for e in step_events if e.stage == "buffer" and e.rank == rank)
                             for rank in {e.rank for e in step_events}), default=0)
                state_total = max(state_total, totals(r.optimizer)[1])  # lazily created state
                logged_loss = logged.get(step)
                spread.append(StepRecord(step, logged_loss, loss, p_bad, params_total, s_bad, state_total, b_bad,
                                         buffers_all, float32_ulps(logged_loss, loss) if logged_loss is not None
                                         else None))
                chain_done = located_from is not None and step >= _horizon(events, spread, logged_nan) + opts.after
                pending = next((s for s in logged_nan if s not in loss_only and s not in amp.caught), None)
                # the logged NaN did not reproduce; no point replaying the rest
                unreproduced = located_from is None and pending is not None and step >= pending + opts.after
                if step > stop:  # the log did not tell where the replay ends: up to the window's end
                    stop = last
                progress.update(step - first + 1, step - first + 1 if chain_done or unreproduced else stop - first + 1)
                if chain_done or unreproduced:
                    break
        finally:
            hooks.close()
        if located_from is None:
            precursors = []  # no origin: nothing the curves lead up to
        if run.last_step is None:
            data_defects = check_batches(run, [s.step for s in spread], opts.data_max_abs)
        # Without an origin, a loss-only step is still worth explaining: which op made the loss non-finite, from
        # which samples (a batch with no valid target, typically).
        explained = events[0] if events else loss_events[loss_only[0]] if loss_only else None
        operation, samples = _explain(r, explained, kept.get(explained.step), progress, not events) \
            if explained is not None and opts.explain else (None, None)
        # whether resetting the flagged state would have saved the run is replayed too
        by_order = code.loaded is not None and code.loaded.optimizer_matched == "order"
        resumed, resettable = resume_findings(unsound, events[0] if events else None, checkpoint.step, r.model,
                                              r.optimizer, by_order)
        changes = list(opts.what_if)
        if resettable and not any(isinstance(c, whatif.ResetState) for c in changes):
            changes.append(whatif.ResetState())
        what_if = whatif.what_if_replays(run, code, checkpoint, device, events[0].step, changes,
                                         opts.what_if_steps, events[0].rank, progress) \
            if events and changes else []

    report = _report(run, checkpoint, device, threads, code, events, spread, logged_first, rtol, amp.caught,
                     logged_nan=logged_nan, loss_only=loss_only, compared=[compared[s] for s in sorted(compared)],
                     max_ulps=opts.loss_ulps)
    report.amp, report.what_if = amp.report(r.model, events), what_if
    report.setup.loss_rtol = rtol or None
    report.data_defects, report.precursors, report.operation, report.samples, report.loaded = (
        data_defects, precursors, operation, samples, code.loaded)
    if run.world is not None:
        complete(report, run, r, lambda logged, replayed: losses_match(logged, replayed, rtol, opts.loss_ulps))
    report.unsound = unsound
    report.findings = (findings(report) + rank_findings(report) + amp_findings(report.amp) + resumed
                       + whatif.findings(report.what_if, requested=bool(changes)))
    return narrate(report)


def _watched(r: Session, proof: bool) -> tuple[ExitStack, StepMonitor, PrecursorProbe]:
    """The hooks each replayed step runs under, closed together: the monitor (``proof``: detect mode skips reading what
    the update's proof shows finite) and the precursor probe."""
    hooks = ExitStack()
    return hooks, hooks.enter_context(StepMonitor(r.model, r.optimizer, prove=proof)), hooks.enter_context(
        PrecursorProbe(r.model, r.optimizer))


def _explain(session: Session, origin: Event, before: dict | None = None, progress: Progress = SILENT,
             no_origin: bool = False) -> tuple[OperationCulprit | None, SampleAttribution | None]:
    """Root cause inside the responsible step: which operation made the origin's value, then which samples (group
    testing, starting from the sample the origin's or that operation's coordinates point at); in a distributed run,
    inside the shard of the origin's rank (None on a rank that leaves the explaining to another). ``before``: the
    session's state before the origin's step, where the replay kept it; ``no_origin``: ``origin`` is the loss of a
    loss-only step (a subset fails by a non-finite loss alone), not an origin (by anything but that)."""
    with session.focused(origin.rank) as focused:
        if focused is None:
            return None, None
        if before is not None and focused is session:
            focused.restore(before)
        else:
            focused.reset()
            if focused.step < origin.step:
                progress.phase(f"re-running {span(focused.step, origin.step - 1)} to the responsible one", None)
            focused.advance_to(origin.step)
            before = focused.snapshot()
        progress.phase(f"tracing the operation behind {origin.stage} at step {origin.step}", None)
        operation = trace_step(focused.model, focused.optimizer, lambda: focused.traced_pass(origin), origin)
        focused.restore(before)  # the traced pass stepped the optimizer
        # the operation's output may say which sample it is: then group testing (above ALONE_UP_TO) starts from it
        samples = attribute_samples(focused, sample_hint(focused.batch(origin.step), origin, operation), progress,
                                    no_origin)
    return operation, samples


def _expected_stop(logged_nan: Sequence[int], last: int, after: int) -> int:
    """Where the replay stops at the latest, as far as the log tells: ``after`` steps past the step after the first
    logged NaN loss (the chain is complete there at the latest, or the NaN did not reproduce); else the window's
    end. A guess the progress total revises when the replay runs past it."""
    return min(last, logged_nan[0] + 1 + after) if logged_nan else last


def _horizon(events: list[Event], spread: list[StepRecord], logged_nan: Sequence[int]) -> int:
    """The step the chain is complete at: the whole model non-finite, else a step past the NaN loss; never before
    the run's own first non-finite logged loss from the origin on, so that every field (the replayed NaN loss, the
    optimizer state, the reproduction) is judged over the window the user is looking at, however many steps a
    NaN parameter waits unread before a loss shows it."""
    origin = events[0].step
    full = next((s.step for s in spread if s.params_nonfinite == s.params_total), None)
    if full is None:
        nan_loss = next((s.step for s in spread if not math.isfinite(s.replayed_loss)), origin)
        full = max(nan_loss, origin) + 1
    return max(full, next((s for s in logged_nan if s >= origin), full))


def _report(run: StepSource, checkpoint: StartPoint, device: torch.device, threads: int, code: StepCode,
            events: list[Event], spread: list[StepRecord], logged_first: int | None, rtol: float,
            caught: Collection[int] = (), *, logged_nan: Collection[int] = (), loss_only: Sequence[int] = (),
            compared: Sequence[CheckpointComparison] = (), max_ulps: int = LOSS_ULPS) -> ReplayReport:
    origin = events[0] if events else None
    diverged = judge(spread, list(compared), rtol, max_ulps)
    # nothing to judge by: no logged loss in the window and no recorded checkpoint passed (a run nobody recorded)
    judged = any(s.logged_loss is not None for s in spread) or any(c.error is None for c in compared)
    replayed_first = next((s.step for s in spread if not math.isfinite(s.replayed_loss)), None)
    full = next((s.step for s in spread if s.params_total and s.params_nonfinite == s.params_total), None)
    if origin is not None:
        verdict = "nonfinite"
    elif logged_nan and (diverged is not None or not {*caught, *loss_only}.issuperset(logged_nan)):
        verdict = "not_reproduced"  # unless each logged NaN was replayed as a caught overflow or a loss-only step
    elif loss_only:
        verdict = "loss_only"
    else:
        verdict = "clean"
    batch_ref = None
    if origin is not None and run.world is None:  # a distributed run's is a shard, or every rank's: see complete()
        batch = run.batch(origin.step)
        batch_ref = BatchRef(origin.step, run.batch_origin(origin.step) or "",
                             dict(data_leaves(batch, size=batch_size(batch))))
    setup = ReplaySetup(str(run.path), checkpoint.step, spread[0].step if spread else checkpoint.step,
                        spread[-1].step if spread else checkpoint.step, str(device), threads, code.imported,
                        **({"recorded_cpu": run.cpu, "replay_cpu": this_cpu()} if device.type == "cpu" else {}),
                        compiled=run.compiled)
    report = ReplayReport(
        verdict=verdict, responsible_step=origin.step if origin else None, responsible_batch=batch_ref,
        first_nonfinite_loss_step=replayed_first, logged_first_nonfinite_loss_step=logged_first, origin=origin,
        events=events, spread=spread, state_poisoned=any(e.stage == "optimizer_state" for e in events),
        reproduced=diverged is None if judged else None, diverged_at_step=diverged, fully_nonfinite_step=full,
        findings=[], setup=setup, loss_only_steps=list(loss_only), checkpoints_compared=list(compared),
        loss_max_ulps=max((s.loss_ulps for s in spread if s.loss_ulps is not None), default=None))
    return report
