"""The property: the replay of a generated program's recorded run agrees with the reference monitor on step, stage,
tensor, coordinate, operation, phase, verdict and samples, or refuses the run before replaying any step.

Samples (``samples_claim``, the one place they are compared) are held to what the report claims. Judged
``each_alone`` (every batch of up to ALONE_UP_TO samples, and a larger one where halving showed coupling), the
samples named are exactly those the reference finds failing alone. Judged ``group_testing`` (halving, above the
limit), every sample named is one the reference names (no false accusation), and one the reference names that the
replay does not is allowed only when the message carries the caveat that such a sample may go unnamed (``CAVEAT``).
A batch-wide verdict needs more than half the samples failing alone, whichever way it was judged."""

from __future__ import annotations

import shutil
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nanforensics.errors import BadInput
from nanforensics.replay.engine import ReplayOptions, replay_run
from nanforensics.replay.support import Unsupported
from nanforensics.rootcause.samples import ALONE_UP_TO

from . import programs
from .reference import Reference, reference


@dataclass
class Outcome:
    seed: int
    axes: dict[str, str]
    kind: str  # agree | refused | unrecordable | disagree
    reason: str = ""  # the refusal's feature, or the disagreement's class; for an agreement, the verdict agreed on
    details: list[str] = field(default_factory=list)


UPDATE = ("optimizer_state", "param", "buffer")  # stages the update writes


def _op(name: str | None) -> str | None:
    """``aten::div.Tensor`` -> ``aten::div``: the reference names the op, not its overload."""
    return None if name is None else name.split(".")[0]


def compare(ref: Reference, report: Any) -> list[tuple[str, str]]:
    """Each field the replay's report and the reference disagree on: (class, detail)."""
    out: list[tuple[str, str]] = []
    if report.verdict != ref.verdict:
        return [("verdict", f"replay {report.verdict}, reference {ref.verdict}")]
    if report.loss_only_steps != ref.loss_only_steps:
        out.append(("loss_only_steps", f"replay {report.loss_only_steps}, reference {ref.loss_only_steps}"))
    o, r = report.origin, ref.origin
    if r is not None and o is not None:
        for name in ("step", "stage", "tensor", "index", "value", "state_key"):
            if getattr(o, name) != getattr(r, name):
                out.append((f"origin.{name}", f"replay {getattr(o, name)!r}, reference {getattr(r, name)!r}"))
                if name in ("step", "stage"):
                    return out  # the rest follows from a different event
    explained = r is None or r.stage != "batch"  # a value in the batch was made by no op of the step
    if explained and ref.verdict != "clean":
        site = report.operation.site if report.operation is not None else None
        if _op(site.op if site else None) != ref.op:
            out.append(("operation", f"replay {site.op if site else None}, reference {ref.op}"))
        elif site is not None and site.phase != ref.phase:
            out.append(("phase", f"replay {site.phase}, reference {ref.phase}"))
    if ref.verdict != "clean":
        out += _samples(ref, report.samples)
    return out


# what a report judged by group testing says it may miss (rootcause/samples.py, judged_text): the only licence for a
# sample the reference names and the replay does not
CAVEAT = ("a sample that fails alone but passes among others, as a loss averaged over the batch allows, may go unnamed: "
          f"only a batch of up to {ALONE_UP_TO} samples has each sample run alone")


def samples_claim(ref: Reference, samples: Any) -> str | None:
    """How the replay's samples hold against the reference's: "exact", "caveat" (group testing named some of the
    samples that fail alone, none other, and said it may miss some), or None where they do not hold (the module's
    docstring). attributed and coupled name the samples that fail alone; batch_wide means more than half do;
    not_reproduced (the whole step run again stays finite: the update failed, not a sample) that the origin lies in the
    update and that no sample fails alone apart from the others: all of them or none."""
    alone = ref.samples
    if samples.status == "batch_wide":
        return "exact" if ref.batch_size is not None and len(alone) > ref.batch_size / 2 else None
    if samples.status == "not_reproduced":
        ok = ref.origin is not None and ref.origin.stage in UPDATE and len(alone) in (0, ref.batch_size)
        return "exact" if ok else None
    if samples.status not in ("attributed", "coupled"):
        return None
    named = sorted(samples.samples)
    if named == alone:
        return "exact"
    trusted = samples.judged == "group_testing" and CAVEAT in samples.message
    return "caveat" if trusted and named and set(named) < set(alone) else None


def _samples(ref: Reference, samples: Any) -> list[tuple[str, str]]:
    if samples is None:
        return [("samples", "replay made no sample attribution")]
    if samples_claim(ref, samples) is not None:
        return []
    return [(f"samples.{samples.status}", f"replay {samples.status} {samples.samples} ({samples.judged}), reference "
                                          f"alone {ref.samples} of {ref.batch_size}")]


def _refused_what(e: Unsupported, axes: dict[str, str]) -> str:
    """The axis value a refusal is about, for the tally by reason."""
    return axes["optimizer"] if e.feature == "optimizer" else e.feature


def check(seed: int, folder: Path, large: bool = False) -> Outcome:
    """Draw, write, record, replay and compare program ``seed`` (``large``: its large batch, see ``programs.draw``) in
    ``folder`` (its run removed afterwards)."""
    program = programs.draw(seed, large)
    module = programs.materialise(program, folder)
    run_dir = folder / f"run_{program.name}"
    shutil.rmtree(run_dir, ignore_errors=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            programs.record(module, run_dir, program.axes["checkpoints"])
        except Exception as e:  # the recorder's own refusal (two optimizers): nothing to replay
            return Outcome(seed, program.axes, "unrecordable", f"{type(e).__name__}: {str(e).splitlines()[0][:90]}")
        try:
            ref = reference(module, programs.extras, programs.STEPS)
            try:
                report = replay_run(run_dir, ReplayOptions(code_paths=[folder]))
            except Unsupported as e:
                return Outcome(seed, program.axes, "refused", f"{e.feature}: {_refused_what(e, program.axes)}", [str(e)])
            except BadInput as e:
                return Outcome(seed, program.axes, "disagree", "bad input", [str(e)])
            except Exception as e:
                return Outcome(seed, program.axes, "disagree", f"replay raised {type(e).__name__}", [str(e)[:300]])
        finally:
            shutil.rmtree(run_dir, ignore_errors=True)
    wrong = compare(ref, report)
    if not wrong:  # tallied by how the samples were judged, and apart where group testing's caveat licensed a miss
        samples = report.samples if ref.verdict != "clean" else None
        judged = f", samples {samples.status} judged {samples.judged}" if samples is not None and samples.judged else ""
        caveat = " (missed some, caveat given)" if samples is not None and samples_claim(ref, samples) == "caveat" else ""
        return Outcome(seed, program.axes, "agree", ref.verdict + judged + caveat)
    return Outcome(seed, program.axes, "disagree", wrong[0][0], [d for _, d in wrong])
