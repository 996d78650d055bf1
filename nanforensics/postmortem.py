"""The post-mortem of a failed job's artifact: every analysis the directory allows, and why not the others.

A CI job that failed with NaN leaves a directory: a run recorded by ``nanforensics.Recorder``, or only a
folder of checkpoints. The post-mortem reads the step log, bisects the checkpoints, replays where the
batches and the user's code are importable here, and maps the spread per tensor. Each analysis that
cannot run says why, and the verdict rests on the ones that did: with a replay it names the step,
without one it brackets it between a clean checkpoint and the first poisoned checkpoint or NaN loss.
"""

from __future__ import annotations

import datetime as _dt
import math
import shlex
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence, TypeVar

from . import __version__
from .checkpoints.bisect import BisectReport, bisect
from .errors import BadInput
from .progress import SILENT, BytesRead, Progress
from .replay import spread
from .replay.engine import ReplayOptions, replay_run
from .replay.spread import SpreadMap
from .report import ReplayReport, Verdict
from .rootcause.findings import describe
from .runs import imports
from .runs.run import MANIFEST, Run, UserCode
from .runs.steplog import LoggedStep, first_nonfinite
from .words import count, numbered, span

POSTMORTEM_SCHEMA = "nanforensics.postmortem/1"
DONE, SKIPPED, FAILED = "done", "skipped", "failed"
STEP_LOG, CHECKPOINTS, REPLAY, TENSOR_SPREAD = "step_log", "checkpoints", "replay", "tensor_spread"
CURVE_POINTS = 2000  # loss curve points kept; longer logs are thinned, keeping the steps around the first NaN
CHECKPOINT_ONLY = ": checkpoint-only analysis"
_T = TypeVar("_T")


@dataclass
class Analysis:
    name: str  # STEP_LOG, CHECKPOINTS, REPLAY or TENSOR_SPREAD
    status: str  # DONE, SKIPPED or FAILED
    detail: str  # what it found, or why it was skipped or failed
    seconds: float | None = None  # how long it took


@dataclass
class StepLogSummary:
    steps_logged: int
    first_step: int
    last_step: int
    first_nonfinite_loss_step: int | None
    curve_steps: list[int]  # the loss curve, thinned to at most CURVE_POINTS points
    curve_losses: list[float]


@dataclass
class Window:
    """Where the origin lies when no replay pinned it: steps ``first``..``last`` (either may be unknown)."""

    first: int | None
    last: int | None
    basis: list[str]  # what each bound rests on


@dataclass
class PostmortemReport:
    verdict: Verdict
    headline: str
    directory: str
    kind: str  # "run": recorded by nanforensics; "checkpoints": a folder of checkpoints only
    responsible_step: int | None
    window: Window | None
    analyses: list[Analysis]
    step_log: StepLogSummary | None
    checkpoints: BisectReport | None
    replay: ReplayReport | None
    tensor_spread: SpreadMap | None
    findings: list[str]
    generator: str = field(default=f"nanforensics {__version__}")
    schema: str = field(default=POSTMORTEM_SCHEMA)
    started: str | None = None  # when the post-mortem began, ISO 8601 with the local UTC offset

    def analysis(self, name: str) -> Analysis:
        return next(a for a in self.analyses if a.name == name)


def postmortem(directory: str | Path, progress: Progress = SILENT, trust_code: bool = False,
               code_paths: Sequence[Path] = (), trust_packages: Sequence[str] = ()) -> PostmortemReport:
    """Analyse ``directory`` as far as it allows; ``progress`` hears each analysis as a phase. The run's code is
    imported from ``code_paths`` where it is not importable as it is (``--code-path``), or from the installed
    distributions ``trust_packages`` names (``--trust-package``).

    The run's code is called only within the trust policy (``imports.check_callable``) unless ``trust_code``; a
    callable it refuses leaves a checkpoint-only analysis that says why.
    """
    path = Path(directory)
    if not path.exists():
        raise BadInput(path, "no such directory")
    if not path.is_dir():
        raise BadInput(path, "not a directory: the post-mortem takes a run directory or a folder of checkpoints")
    started = _dt.datetime.now().astimezone().isoformat(timespec="seconds")
    run, not_run = _open_run(path)
    analyses: list[Analysis] = []

    def timed(what: str, analysis: Callable[..., _T], *args: Any) -> _T:
        """Run one analysis, which appends its Analysis, and record how long it took."""
        progress.phase(what, None)
        began = time.perf_counter()
        result = analysis(*args)
        analyses[-1].seconds = round(time.perf_counter() - began, 3)
        return result

    steps = timed("reading the step log", _step_log, run, not_run, analyses)
    # A run whose manifest is unreadable still has its checkpoint folders, which bisect reads without it.
    checkpoints = timed("bisecting the checkpoints", _checkpoints,
                        path / "checkpoints" if run is None and (path / MANIFEST).exists() else path, run, analyses,
                        progress)
    code = ReplayOptions(trust_code=trust_code, code_paths=code_paths, trust_packages=trust_packages)
    replay, advice = timed("replaying", _replay, run, not_run, steps, analyses, progress, code)
    tensor_spread = timed("mapping the spread per tensor", _tensor_spread, run, replay, analyses, code, progress)
    if not any(a.status == DONE for a in analyses):
        raise BadInput(path, "nothing could be analysed: " + "; ".join(f"{a.name}: {a.detail}" for a in analyses))

    summary = _summary(steps) if steps is not None else None
    report = _report(path, analyses, summary, checkpoints, replay, tensor_spread, advice)
    report.started = started
    return report


# ---- the analyses ------------------------------------------------------------------------------


def _open_run(path: Path) -> tuple[Run | None, Analysis]:
    """The run; or None, and the step-log analysis saying why not: skipped (no manifest) or failed (a broken one)."""
    if not (path / MANIFEST).exists():
        return None, Analysis(STEP_LOG, SKIPPED, "not a run recorded by nanforensics (no manifest.json)")
    try:
        return Run(path), Analysis(STEP_LOG, DONE, "")
    except BadInput as e:
        return None, Analysis(STEP_LOG, FAILED, str(e))


def _step_log(run: Run | None, not_run: Analysis, analyses: list[Analysis]) -> list[LoggedStep] | None:
    if run is None:
        analyses.append(not_run)
        return None
    try:
        steps = run.steps
    except BadInput as e:
        analyses.append(Analysis(STEP_LOG, FAILED, str(e)))
        return None
    if not steps:
        analyses.append(Analysis(STEP_LOG, FAILED, "no steps were logged"))
        return None
    first = first_nonfinite(steps)
    found = f"loss first non-finite at step {first}" if first is not None else "every logged loss is finite"
    analyses.append(Analysis(STEP_LOG, DONE, f"{count(len(steps), 'step')} logged ({steps[0].step}-{steps[-1].step}); {found}"))
    return steps


def _checkpoints(path: Path, run: Run | None, analyses: list[Analysis], progress: Progress) -> BisectReport | None:
    if run is not None and not run.checkpoints():
        analyses.append(Analysis(CHECKPOINTS, SKIPPED, "the run kept no checkpoints"))
        return None
    try:
        report = bisect([path], progress=BytesRead(progress))
    except BadInput as e:
        analyses.append(Analysis(CHECKPOINTS, FAILED, str(e)))
        return None
    if report.first_poisoned is None:
        found = "none poisoned"
    else:
        found = f"first poisoned at step {report.first_poisoned.step}" + (
            f", last clean at step {report.last_clean.step}" if report.last_clean else "")
    if report.verdict == "non_monotonic":
        found += "; history not monotonic (a restart or repair?)"
    unread = report.skipped + [f"{h.path}/{name}" for h in report.history for name in h.skipped]
    if unread:  # named, so that a partial read never looks like a clean one
        found += "; not read: " + ", ".join(u.split(": ", 1)[0] for u in unread)
    analyses.append(Analysis(CHECKPOINTS, DONE, f"{count(report.checkpoints, 'checkpoint')}, {report.scans} read; {found}"))
    return report


def _replay(run: Run | None, not_run: Analysis, steps: list[LoggedStep] | None, analyses: list[Analysis],
            progress: Progress, code: ReplayOptions) -> tuple[ReplayReport | None, list[str]]:
    """The replay, or None; and what would make it possible when it is the user's code that is missing here.
    ``code``: the replay's options, which carry where the user let the run's code come from."""
    if run is None:
        analyses.append(Analysis(REPLAY, SKIPPED, not_run.detail + CHECKPOINT_ONLY))
        return None, []
    if steps is None:
        analyses.append(Analysis(REPLAY, SKIPPED, "the step log is unusable, so there is nothing to replay against"))
        return None, []
    missing = _unimportable(run, code)
    if missing:
        analyses.append(Analysis(REPLAY, SKIPPED, missing + CHECKPOINT_ONLY))
        return None, [f"To pin the step, run the post-mortem where the training code is importable (the training "
                      f"repository's root), or give its folder: `nanforensics postmortem {shlex.quote(str(run.path))} "
                      "--code-path DIR`."]
    try:
        report = replay_run(run.path, code, progress)
    except BadInput as e:
        analyses.append(Analysis(REPLAY, FAILED, str(e)))
        return None, []
    s = report.setup
    found = {"nonfinite": f"responsible step {report.responsible_step}",
             "clean": "no non-finite value",
             "not_reproduced": "the logged NaN did not reproduce",
             "loss_only": f"a non-finite loss only, at {numbered('step', report.loss_only_steps)}: "
                          "gradients, parameters, optimizer state and buffers stayed finite"}[report.verdict]
    analyses.append(Analysis(REPLAY, DONE, f"{span(s.first_step, s.last_step)} from the checkpoint at step "
                                           f"{s.from_checkpoint} on {s.device}; {found}"))
    return report, []


def _unimportable(run: Run, code: ReplayOptions) -> str | None:
    """Which of the run's callables cannot be imported here, or is refused by the trust policy, and why; None when
    all of them can be."""
    for role, spec in run.manifest.callables():
        try:
            imports.load_callable(role, spec, where=run.path / MANIFEST, search_paths=code.code_paths,
                                  forbidden=run.path, trust_code=code.trust_code, trust_packages=code.trust_packages)
        except BadInput as e:  # the problem usually starts with the spec itself: say it once
            problem = e.problem.removeprefix(f"{role} ").removeprefix(f"{spec!r} ")
            return f"{role} `{spec}` {problem}" if problem != e.problem else f"{role} `{spec}`: {problem}"
    return None


def _tensor_spread(run: Run | None, replay: ReplayReport | None, analyses: list[Analysis], code: ReplayOptions,
                   progress: Progress) -> SpreadMap | None:
    if run is None or replay is None:
        analyses.append(Analysis(TENSOR_SPREAD, SKIPPED, "needs a replay"))
        return None
    if replay.responsible_step is None:
        analyses.append(Analysis(TENSOR_SPREAD, SKIPPED, "the replay found no non-finite value in the model's state to map"))
        return None
    try:
        m = spread.trace(run, UserCode.load(run, code.code_paths, trust_code=code.trust_code,
                                              trust_packages=code.trust_packages), replay, progress)
    except BadInput as e:
        analyses.append(Analysis(TENSOR_SPREAD, FAILED, str(e)))
        return None
    differs = spread.disagreement(m, replay)
    detail = f"{count(len(m.rows), 'parameter')} over {span(m.steps[0], m.steps[-1])}"
    if differs is not None:
        detail += f"; the re-run's counts differ from the replay's from step {differs} (non-deterministic kernels?)"
    analyses.append(Analysis(TENSOR_SPREAD, DONE, detail))
    return m


# ---- conclusions -------------------------------------------------------------------------------


def _summary(steps: list[LoggedStep]) -> StepLogSummary:
    first = first_nonfinite(steps)
    keep = range(len(steps))
    if len(steps) > CURVE_POINTS:
        stride = math.ceil(len(steps) / (CURVE_POINTS - 8))
        around = next((i for i, s in enumerate(steps) if s.step == first), len(steps) - 1)
        keep = sorted({*range(0, len(steps), stride), *range(max(0, around - 3), min(len(steps), around + 4)),
                       len(steps) - 1})
    return StepLogSummary(len(steps), steps[0].step, steps[-1].step, first,
                          [steps[i].step for i in keep], [steps[i].loss for i in keep])


def _window(checkpoints: BisectReport | None, summary: StepLogSummary | None) -> Window | None:
    first, last, basis = None, None, []
    if checkpoints is not None and checkpoints.verdict == "poisoned":
        if checkpoints.first_poisoned.step is not None:
            last = checkpoints.first_poisoned.step - 1
            basis.append(f"the checkpoint at step {checkpoints.first_poisoned.step} already holds non-finite values")
        if checkpoints.last_clean is not None and checkpoints.last_clean.step is not None:
            first = checkpoints.last_clean.step
            basis.append(f"the checkpoint at step {first} is clean")
    elif checkpoints is not None and checkpoints.verdict == "clean" and checkpoints.last_clean.step is not None:
        first = checkpoints.last_clean.step
        basis.append(f"the last checkpoint, at step {first}, is clean")
    nan_loss = summary.first_nonfinite_loss_step if summary else None
    if nan_loss is not None and (last is None or nan_loss < last):
        last = nan_loss
        basis.append(f"the logged loss is non-finite at step {nan_loss}")
    return Window(first, last, basis) if basis else None


def where(w: Window) -> str:
    """``in steps 10-18``, ``at or before step 18`` or ``at or after step 10``."""
    if w.first is not None and w.last is not None:
        return f"in {span(w.first, w.last)}"
    return f"at or before step {w.last}" if w.last is not None else f"at or after step {w.first}"


def _report(path: Path, analyses: list[Analysis], summary: StepLogSummary | None,
            checkpoints: BisectReport | None, replay: ReplayReport | None, tensor_spread: SpreadMap | None,
            advice: list[str]) -> PostmortemReport:
    nan_loss = summary.first_nonfinite_loss_step if summary else None
    poisoned = checkpoints is not None and checkpoints.first_poisoned is not None
    window = None
    findings: list[str] = []
    if replay is not None and replay.verdict == "nonfinite":
        verdict, responsible = "nonfinite", replay.responsible_step
        shown = f"; the logged loss first shows it at step {nan_loss}" if nan_loss is not None else ""
        headline = f"non-finite values began at step {responsible}: {describe(replay.origin)}{shown}"
    elif poisoned or (nan_loss is not None and (replay is None or replay.verdict not in ("not_reproduced",
                                                                                        "loss_only"))):
        verdict, responsible, window = "nonfinite", None, _window(checkpoints, summary)
        if window is not None:
            headline = f"non-finite values began {where(window)}, not pinned by a replay"
            findings.append(f"The origin lies {where(window)}: " + "; ".join(window.basis) + ".")
        else:
            headline = "the checkpoints hold non-finite values, but their history is not monotonic (a restart or " \
                       "a repair?), so they do not bracket the origin"
    elif replay is not None and replay.verdict == "not_reproduced":
        verdict, responsible = "not_reproduced", None
        clean = ", nor do the checkpoints hold any" if checkpoints is not None else ""
        headline = f"the logged loss is non-finite at step {nan_loss}, but the replay does not reproduce it{clean}"
    elif replay is not None and replay.verdict == "loss_only":
        verdict, responsible = "loss_only", None
        headline = (f"the loss was non-finite at {numbered('step', replay.loss_only_steps)} only: every "
                    "gradient, parameter, optimizer-state and buffer value stayed finite, so training could go on")
    else:
        verdict, responsible = "clean", None
        looked = [a.name.replace("_", " ") for a in analyses if a.status == DONE and a.name != TENSOR_SPREAD]
        headline = f"no non-finite value found ({', '.join(looked)})"
    if replay is not None and replay.verdict in ("not_reproduced", "loss_only") and poisoned:
        what = "did not reproduce the logged NaN" if replay.verdict == "not_reproduced" else \
            "found a non-finite loss only"
        findings.append(f"The replay {what}, yet the checkpoints hold non-finite values: the replay is not an exact "
                        "copy of the run (see its findings).")
    kind = "run" if (path / MANIFEST).exists() else "checkpoints"
    if verdict != "clean" and replay is None:  # what would pin the step
        hint = [f"To pin the step: `{checkpoints.replay.command}`."] if checkpoints and checkpoints.replay else \
            [f"To pin the step, replay the checkpoints with the training script, when it can give the batch of any "
             f"step again: `nanforensics bisect {shlex.quote(str(path))} --code train.py` (docs/unrecorded.md)."] \
            if kind == "checkpoints" and checkpoints and checkpoints.verdict == "poisoned" and checkpoints.last_clean \
            else []
        findings += advice or hint
    return PostmortemReport(verdict=verdict, headline=headline, directory=str(path), kind=kind,
                            responsible_step=responsible, window=window, analyses=analyses, step_log=summary,
                            checkpoints=checkpoints, replay=replay, tensor_spread=tensor_spread, findings=findings)
