"""The report's verdict sentences on hand-built facts: the headline, where the failure shows, whether the step or its
data is to blame, the loss-only steps and the reproduction, each sentence tied to the facts that make it true and
read for its exact words. Built by hand, not recorded: a replay reaches few of these combinations, and these tests
enumerate them all in milliseconds (tests/test_findings.py checks the same sentences on recorded runs)."""

from __future__ import annotations

import itertools
import math
from dataclasses import replace

import pytest
from nanforensics.report import (
    AmpReport,
    CheckpointComparison,
    CheckpointLoad,
    CpuIdentity,
    DataDefect,
    Event,
    InfSource,
    OperationCulprit,
    OpSite,
    Precursor,
    ReplayReport,
    ReplaySetup,
    SampleAttribution,
    ScalerStep,
    StepRecord,
    TensorMismatch,
)
from nanforensics.rootcause.findings import (
    describe,
    findings,
    first_shown,
    headline,
    narrate,
    operation_sentence,
    reproduction,
    spikes,
    step_not_data,
)
from nanforensics.words import count, numbered

NAN = math.nan
ORIGIN = 5  # the responsible step of every report with an origin here


def step(n: int, logged: float | None = 1.0, replayed: float = 1.0, ulps: int | None = None) -> StepRecord:
    return StepRecord(n, logged, replayed, 0, 10, 0, 20, loss_ulps=ulps)


def event(n: int = ORIGIN, stage: str = "grad", value: str = "nan") -> Event:
    return Event(n, stage, "fc.weight", [1, 2], value, elements_nonfinite=3, tensors_nonfinite=1, dtype="float32")


def report(origin: Event | None = None, *, logged: dict[int, float] | None = None, **facts) -> ReplayReport:
    """A report over steps 2-8: losses logged (1.0 unless ``logged`` says otherwise) and replayed finite, the origin
    ``origin`` (a grad at step 5 by default with verdict nonfinite), reproduced."""
    logged = logged or {}
    spread = [step(n, logged.get(n, 1.0)) for n in range(2, 9)]
    base = dict(verdict="nonfinite" if origin else "clean", responsible_step=origin.step if origin else None,
                responsible_batch=None, first_nonfinite_loss_step=None,
                logged_first_nonfinite_loss_step=next((n for n in sorted(logged) if not math.isfinite(logged[n])), None),
                origin=origin, events=[origin] if origin else [], spread=spread, state_poisoned=False, reproduced=True,
                diverged_at_step=None, fully_nonfinite_step=None, findings=[],
                setup=ReplaySetup("run", 2, 2, 8, "cpu", 1, []))
    return ReplayReport(**{**base, **facts})


def batch_wide(**facts) -> SampleAttribution:
    return SampleAttribution(**{**dict(status="batch_wide", batch_size=8, samples=list(range(8)), sample_leaves={},
                                       passes=9, coupled_groups=[], message="every sample fails alone"), **facts})


# -- step_not_data: the step is blamed exactly when most of the batch fails alone and no data defect explains it --

DEFECT = {"none": [], "at the origin": [DataDefect(ORIGIN, "b.pt", "batch['x']", "nonfinite", 1, [0, 1], "nan")],
          "elsewhere": [DataDefect(ORIGIN - 1, "b.pt", "batch['x']", "nonfinite", 1, [0, 1], "nan")]}


@pytest.mark.parametrize("status, compared_fails, cause, defect", list(itertools.product(
    [None, "batch_wide", "attributed", "coupled"], [None, True, False], [[], ["batch['x']"]], DEFECT)))
def test_the_step_is_blamed_exactly_when_the_batch_fails_wide_with_no_data_defect(status, compared_fails, cause, defect):
    samples = None if status is None else batch_wide(status=status, compared_fails=compared_fails, cause_leaves=cause)
    r = report(event(), samples=samples, data_defects=DEFECT[defect])
    blamed = status == "batch_wide" and compared_fails is not False and not cause and defect != "at the origin"
    assert step_not_data(r) is blamed
    assert headline(r) == (f"step {ORIGIN} failed batch-wide: the step, not its data; logged losses all finite" if blamed
                           else f"responsible step {ORIGIN}; logged losses all finite")


# -- first_shown: the first logged non-finite loss that is not a loss-only step --

@pytest.mark.parametrize("nonfinite, loss_only", [
    (nonfinite, loss_only) for nonfinite in itertools.chain.from_iterable(
        itertools.combinations([3, 4, 6], k) for k in range(4))
    for loss_only in itertools.chain.from_iterable(itertools.combinations(nonfinite, k) for k in range(len(nonfinite) + 1))])
def test_the_failure_shows_at_the_first_logged_nonfinite_loss_that_is_not_loss_only(nonfinite, loss_only):
    r = report(event(), logged={n: NAN for n in nonfinite}, loss_only_steps=list(loss_only))
    shown = next((n for n in nonfinite if n not in loss_only), None)
    assert first_shown(r) == shown
    tail = (f"logged loss first NaN at step {shown}" if shown is not None else
            "logged losses all finite" if not nonfinite else "logged losses non-finite only where the state stayed finite")
    assert headline(r) == f"responsible step {ORIGIN}; {tail}"


def test_a_loss_only_step_logged_past_the_replay_is_no_show():
    """first_shown looks past a loss-only first NaN only among the replayed steps: a later step's NaN shows."""
    r = report(event(), logged={3: NAN, 7: math.inf}, loss_only_steps=[3])
    assert first_shown(r) == 7
    r.spread[-2] = step(7, None)  # step 7's loss not logged: nothing past step 3 shows it
    assert first_shown(r) is None


# -- headline: each verdict's one line --

def test_the_headline_of_each_verdict():
    o = event()
    assert headline(report(o, reproduced=None)) == f"responsible step {ORIGIN}; replayed losses all finite"
    assert headline(report(o, reproduced=None, first_nonfinite_loss_step=6)) == \
        f"responsible step {ORIGIN}; replayed loss first NaN at step 6"
    assert headline(report(o, logged={7: NAN})) == f"responsible step {ORIGIN}; logged loss first NaN at step 7"
    assert headline(report(o, reproduced=None, logged={7: NAN}, first_nonfinite_loss_step=6)) == \
        f"responsible step {ORIGIN}; replayed loss first NaN at step 6"
    supplied = report(verdict="not_reproduced")
    assert headline(supplied) == "steps 2-8 replayed from the supplied batches, all finite: not reproduced"
    assert headline(replace(supplied, loss_only_steps=[3, 6])) == \
        "steps 2-8 replayed from the supplied batches, a non-finite loss only at steps 3, 6: not reproduced"
    assert headline(report(verdict="not_reproduced", logged={7: NAN})) == \
        "logged loss NaN at step 7, not reproduced by the replay"
    assert headline(report(verdict="loss_only", loss_only_steps=[4])) == \
        "non-finite loss at step 4 only: the model's state stayed finite"
    assert headline(report()) == "steps 2-8 replayed, all finite"
    one = report(spread=[step(2)])
    one.setup.last_step = 2
    assert headline(one) == "step 2 replayed, all finite"  # never "steps 2-2"
    assert findings(one)[0].startswith("No non-finite value in any batch, activation, loss, gradient, optimizer state, "
                                       "parameter or buffer over step 2;")
    loaded = CheckpointLoad("c.pt", "torch.save dict", 2, "metadata", "m:batches", None, "name", 4, 0, "none",
                            ["torch"], None, [])
    assert headline(report(loaded=loaded)) == "steps 2-8 replayed from the supplied batches, all finite"


# -- findings: the origin, then where the loss shows the failure, said only where it holds --

GRAD = ("Origin: step 5, grad fc.weight[1, 2] = nan (float32): the forward pass and the loss were finite; the backward pass "
        "made it.")
LATER = ("The loss logged at step 5 was finite{loss}: it is computed before the update. The logged loss first shows NaN at "
         "step {shown}, {n} later; the {inspect}.")
BATCH, STEP = "batch to inspect is step 5's, not step {shown}'s", "step to inspect is step 5, not step {shown}"


def when_shown(r: ReplayReport) -> list[str]:
    """The sentences about the loss beside the origin: the second of the findings where there is one."""
    out = findings(r)
    assert out[0] == GRAD
    return [s for s in out if s.startswith(("The loss at", "The loss logged at", "The logged loss"))]


@pytest.mark.parametrize("shown", [None, 3, 5, 6, 8])
@pytest.mark.parametrize("wide", [False, True])
@pytest.mark.parametrize("logged_at_origin", [None, 1.5, math.inf])
def test_the_logged_loss_is_placed_against_the_origin(shown, wide, logged_at_origin):
    logged = {ORIGIN: NAN if shown == ORIGIN else logged_at_origin} if logged_at_origin is not None or shown == ORIGIN else {}
    if shown is not None:
        logged[shown] = NAN
    samples = batch_wide(compared_fails=True, compared_step=4) if wide else None
    r = report(event(), logged=logged, samples=samples)
    if logged_at_origin is None and shown != ORIGIN:
        r.spread[ORIGIN - 2] = step(ORIGIN, None)
    said = when_shown(r)
    shown = min((n for n, v in logged.items() if not math.isfinite(v)), default=None)  # an inf at the origin shows first
    if shown is None or shown == ORIGIN:
        assert said == []
    elif shown < ORIGIN:
        assert said == ["The logged loss was already non-finite at step 3, before the origin: it reached neither the "
                        "parameters nor the optimizer state."]
    else:
        loss = " (1.5)" if logged_at_origin == 1.5 else ""
        inspect = (STEP if wide else BATCH).format(shown=shown)
        assert said == [LATER.format(loss=loss, shown=shown, n="1 step" if shown == 6 else "3 steps", inspect=inspect)]


def test_a_nonfinite_loss_the_scaler_caught_before_the_origin_is_said_to_be_caught():
    caught = AmpReport("float16", "float32", True, [], [event(3, "grad", "inf")], None)
    r = report(event(), logged={3: math.inf}, amp=caught)
    assert when_shown(r) == ["The logged loss was already non-finite at step 3, before the origin: an overflow the "
                             "scaler caught, skipping that step with the state intact."]
    r.amp = replace(caught, caught=[event(4, "grad", "inf")])  # caught at another step: not this loss
    assert when_shown(r)[0].endswith("it reached neither the parameters nor the optimizer state.")


@pytest.mark.parametrize("nonfinite", [(), (4,), (4, 7), (5, 6), (7, 8)])
@pytest.mark.parametrize("wide", [False, True])
@pytest.mark.parametrize("replayed_at_origin", [1.625, math.inf])
def test_with_no_loss_logged_the_replayed_loss_is_placed_against_the_origin(nonfinite, wide, replayed_at_origin):
    """A NaN loss before the origin is a loss-only step's (said apart), never where the failure shows."""
    r = report(event(), reproduced=None, loss_only_steps=[n for n in nonfinite if n < ORIGIN],
               samples=batch_wide(compared_fails=True, compared_step=4) if wide else None)
    r.spread = [step(n, None, NAN if n in nonfinite else replayed_at_origin if n == ORIGIN else 1.0) for n in range(2, 9)]
    r.first_nonfinite_loss_step = next((s.step for s in r.spread if not math.isfinite(s.replayed_loss)), None)
    said = when_shown(r)
    shown = next((n for n in nonfinite if n > ORIGIN), None)
    if shown is None or ORIGIN in nonfinite or replayed_at_origin == math.inf:
        assert said == []
        return
    inspect = (STEP if wide else BATCH).format(shown=shown)
    n = count(shown - ORIGIN, "step")
    assert said == [f"The loss at step 5 was finite in the replay (1.625): it is computed before the update. It first "
                    f"shows NaN at step {shown}, {n} later, where a training log shows it too; the {inspect}."]
    r.reproduced = True  # losses were logged (all finite): the logged ones place it, not the replay's
    assert when_shown(r) == []


def test_no_origin_said_each_way():
    assert findings(report(verdict="not_reproduced", logged={7: NAN}))[0] == (
        "The logged loss was non-finite at step 7, but the replay found no non-finite value: the failure did not "
        "reproduce here.")
    clean = ("No non-finite value in any batch, activation, loss, gradient, optimizer state, parameter or buffer over "
             "steps 2-8")
    assert findings(report())[0] == clean + "; steps before 2 were not replayed (`--from-step 0` replays from the start)."
    r = report()
    r.setup.first_step = 0
    assert findings(r)[0] == clean.replace("2-8", "0-8") + "."
    assert not any(s.startswith("No non-finite value") for s in findings(report(loss_only_steps=[4])))
    r = report(fully_nonfinite_step=7)
    assert "Every parameter is non-finite by step 7." in findings(r)
    assert not any(s.startswith("Every parameter") for s in findings(report()))


# -- loss-only steps: harmless where healthy steps follow, the first sign where the origin follows with none between --

MEAN = (" Such a loss typically comes from a batch with no valid target: a mean over zero elements is 0/0 = NaN while its "
        "gradient is zero (cross_entropy when every label is ignore_index, -100).")
OVERFLOW = (" An infinite loss with finite gradients is an overflow of large finite values{largest}: the loss reduced them "
            "past its dtype's largest value, while each gradient, its share of the reduction, stayed finite.")


def loss_only_report(origin: int | None, steps: list[int], values: dict[int, float] | None = None) -> ReplayReport:
    """Steps 2-8: the loss-only ``steps`` (NaN unless ``values`` says), the origin at step ``origin`` and the steps
    after it non-finite, every other step healthy."""
    values = values or {}
    r = report(event(origin) if origin is not None else None, loss_only_steps=steps)
    r.spread = [step(n, 1.0, values.get(n, NAN) if n in steps else NAN if origin is not None and n > origin else 1.0)
                for n in range(2, 9)]
    return r


def subsets(items: list[int]) -> list[list[int]]:
    return [list(c) for k in range(len(items) + 1) for c in itertools.combinations(items, k)]


@pytest.mark.parametrize("origin", [None, 6])
def test_each_loss_only_step_is_harmless_unseen_or_the_first_sign_by_the_steps_after_it(origin):
    for steps in subsets([2, 3, 4, 5] if origin else [2, 3, 4, 5, 6, 7, 8]):
        r = loss_only_report(origin, steps)
        healthy = [n for n in range(2, 9) if n not in steps and (origin is None or n < origin)]
        signs = [s for s in steps if origin and not any(s < h < origin for h in healthy)]
        unseen = [s for s in steps if s not in signs and not any(h > s for h in healthy)]
        harmless = [s for s in steps if s not in signs + unseen]
        said = []
        for group in (harmless, unseen, signs):
            if not group:
                continue
            before = " before the origin" if origin else ""
            head = (f"The loss was NaN at {numbered('step', group)}{before}, but no gradient, parameter, optimizer-state or "
                    "buffer value was")
            if group is harmless:
                upto = max(n for n in range(group[-1], 9) if all(m in healthy + steps for m in range(group[-1], n + 1)))
                said.append(f"{head}: the non-finite loss never reached the model, so training could continue (the "
                            f"replayed steps after it stayed finite through step {upto}).{MEAN}")
            elif group is unseen:
                said.append(f"{head}; the replay holds no healthy step after it (it ended at step 8), so it does not show "
                            f"whether training could continue.{MEAN}")
            else:
                said.append(f"{head}, yet the replay does not show training continuing: the origin follows at step 6 with "
                            f"no healthy step between, so the non-finite loss was the first sign of that failure.{MEAN}")
        assert [s for s in findings(r) if s.startswith("The loss was")] == said, steps


def test_a_harmless_loss_only_step_followed_by_a_step_with_an_event_names_the_healthy_step_after():
    """The step right after a harmless loss-only step is not healthy (an overflow the scaler caught): the sentence
    names the healthy step that makes it harmless, never "stayed finite through" the loss-only step itself."""
    r = loss_only_report(None, [3])
    r.events = [event(4)]
    said = [s for s in findings(r) if s.startswith("The loss was")]
    assert said == ["The loss was NaN at step 3, but no gradient, parameter, optimizer-state or buffer value was: the "
                    "non-finite loss never reached the model, so training could continue (the replay was healthy again "
                    f"at step 5).{MEAN}"], said


def test_an_infinite_loss_is_an_overflow_and_names_the_largest_activation_where_every_one_is_known():
    r = loss_only_report(6, [4, 5], {4: math.inf, 5: -math.inf})
    head = ("The loss was -inf or inf at steps 4, 5 before the origin, but no gradient, parameter, optimizer-state or buffer "
            "value was, yet the replay does not show training continuing: the origin follows at step 6 with no healthy "
            "step between, so the non-finite loss was the first sign of that failure.")
    assert [s for s in findings(r) if s.startswith("The loss was")] == [head + OVERFLOW.format(largest="")]
    seen = [Precursor(n, None, None, None, {}, a, "float32", None) for n, a in ((3, 1e30), (4, 2.5e38), (5, 1e38), (7, 9e99))]
    r.precursors = seen
    largest = " (the largest activation at steps 4, 5 was 2.5e+38)"
    assert [s for s in findings(r) if s.startswith("The loss was")] == [head + OVERFLOW.format(largest=largest)]
    r.precursors = [*seen[:2], replace(seen[2], activation_max_abs=math.inf)]  # one not finite: no largest is named
    assert [s for s in findings(r) if s.startswith("The loss was")] == [head + OVERFLOW.format(largest="")]
    r.precursors = [replace(p, activation_max_abs=None) for p in seen]  # none known: none named
    assert [s for s in findings(r) if s.startswith("The loss was")] == [head + OVERFLOW.format(largest="")]
    r = loss_only_report(6, [4, 5], {4: math.inf})  # one of them NaN: the mean over no target
    assert [s for s in findings(r) if s.startswith("The loss was")][0].startswith("The loss was NaN or inf at steps 4, 5")
    assert [s for s in findings(r) if s.startswith("The loss was")][0].endswith(MEAN)


# -- reproduction: reproduced or not, and on what evidence: a recorded checkpoint's state, or the losses alone --

def compared(n: int = 6, exact: bool = True, first_mismatch: TensorMismatch | None = None, **facts) -> CheckpointComparison:
    facts = {"mismatched_tensors": 0 if exact else 2, "values": 1000, **facts}
    return CheckpointComparison(n, f"checkpoints/step_{n}", 12, exact, first_mismatch=first_mismatch, **facts)


UNREADABLE = CheckpointComparison(6, "checkpoints/step_6", 0, False, 0, None, error="not a zip file")  # as replay makes it


@pytest.mark.parametrize("ulps, losses", [(None, "no finite loss to compare"), (0, "losses identical"),
                                          (1, "losses within 1 ulp"), (12, "losses within 12 ulp")])
def test_reproduced_says_on_what_evidence(ulps, losses):
    def said(*checkpoints: CheckpointComparison) -> str:
        return reproduction(report(checkpoints_compared=list(checkpoints), loss_max_ulps=ulps))

    assert said() == f"reproduced as far as losses show ({losses}; no recorded checkpoint in the replayed window)"
    assert said(UNREADABLE) == said()  # a checkpoint that could not be read decides nothing
    assert said(compared(4), compared(6)) == \
        f"reproduced (parameters, optimizer state and buffers bit-exact at step 6; {losses})"
    assert said(compared(6), compared(7, exact=False, tolerance=1e-3, first_mismatch=MISMATCH)) == \
        f"reproduced (parameters, optimizer state and buffers bit-exact at step 6; {losses})"  # the last that matched
    assert said(compared(nan_matched=7)) == (f"reproduced (parameters, optimizer state and buffers equal at step 6: 7 "
                                             f"of its 1,000 values NaN in both, the others bit-exact; {losses})")
    assert said(compared(values=12345, nan_matched=1234)).startswith(
        "reproduced (parameters, optimizer state and buffers equal at step 6: 1,234 of its 12,345 values NaN in both")
    for rounded, max_ulps, by in ((30, 4, "4 ulps"), (1, 1, "1 ulp"), (2, None, "0 ulps")):
        assert said(compared(exact=False, tolerance=1e-3, rounded=rounded, max_ulps=max_ulps)) == (
            f"reproduced within tolerance (parameters, optimizer state and buffers at step 6 within rtol 0.001: "
            f"{rounded} of its 1,000 values differ, by up to {by}, the others bit-exact; {losses})")
    r = report(reproduced=None, checkpoints_compared=[compared()], loss_max_ulps=ulps)
    assert reproduction(r) == ("cannot be judged: there are no logged losses and no recorded checkpoints to compare the "
                               "replay with")


MISMATCH = TensorMismatch("fc.weight", "parameter", [1, 2], "0.5", "0.25", 5, 3)


def test_not_reproduced_names_where_the_state_or_the_losses_diverged():
    r = report(reproduced=False, diverged_at_step=6,
               checkpoints_compared=[compared(4), compared(6, exact=False, first_mismatch=MISMATCH)])
    assert reproduction(r) == ("not reproduced: the state diverged by step 6: fc.weight[1, 2] is 0.5 in the checkpoint "
                               "of step 6, 0.25 in the replay, 3 ulp apart (5 values differ, in 2 tensors)")
    whole = replace(MISMATCH, index=[], recorded="float32[4, 8]", replayed="missing", elements=1, ulps=None)
    r.checkpoints_compared[1] = compared(6, exact=False, first_mismatch=whole, mismatched_tensors=1)
    assert reproduction(r) == ("not reproduced: the state diverged by step 6: fc.weight is float32[4, 8] in the checkpoint "
                               "of step 6, missing in the replay (1 value differs, in 1 tensor)")
    r.checkpoints_compared[1] = compared(7, exact=False, first_mismatch=MISMATCH)  # not at the diverged step: the losses
    for logged, replayed, ulps, words in ((1.25, 1.5, 3, "logged 1.25, replayed 1.5, 3 ulp apart"),
                                          (None, NAN, None, "logged -, replayed NaN"),
                                          (math.inf, -math.inf, None, "logged inf, replayed -inf"),
                                          (0.1, 0.30000000000000004, None, "logged 0.1, replayed 0.3")):
        r.spread[6 - 2] = step(6, logged, replayed, ulps)
        assert reproduction(r) == f"not reproduced: losses diverge from step 6 ({words})"
    sentences = findings(r)
    assert ("Not reproduced: losses diverge from step 6 (logged 0.1, replayed 0.3). The replay is not an exact copy of "
            "the run: non-deterministic kernels, another device or thread count, a loop that draws random numbers "
            "between steps, or files changed after recording.") in sentences


def test_the_reproduction_sentence_in_the_findings():
    unjudged = ("No losses were logged and no recorded checkpoint lies in the replayed window: whether the replay "
                "reproduces the run cannot be judged")
    assert findings(report(event(), reproduced=None))[-1] == unjudged + "."
    assert findings(report(reproduced=None))[-1] == unjudged + (
        "; it stays finite over steps 2-8, so a failure of the run within them is not reproduced from the supplied "
        "batches.")

    def losses(ulps: int | None, *checkpoints: CheckpointComparison, backend: str | None = None) -> list[str]:
        r = report(event(), loss_max_ulps=ulps, checkpoints_compared=list(checkpoints))
        r.setup.compiled = backend
        return [s for s in findings(r) if s.startswith("Replayed losses differ")]

    assert losses(None) == losses(0) == losses(0, compared(exact=False, tolerance=1e-3)) == []
    head = "Replayed losses differ from the logged ones by up to {} float32 ulp: "
    assert losses(8, compared(4), compared(6)) == [head.format(8) + (
        "the state is bit-exact at step 6, so that is the loss's own rounding (its reduction summed in another order), "
        "not a divergence.")]
    assert losses(9, compared(6)) == [head.format(9) + (
        "more than rounding, yet the state is bit-exact at step 6: the logged losses were not computed as the replay "
        "computes them (logged from another computation, or edited).")]
    unconfirmed = "; no recorded checkpoint in the replayed window confirms the state."
    rounding = "few enough to be the loss's own rounding (its reduction summed in another order)"
    assert losses(8) == [head.format(8) + rounding + unconfirmed]
    assert losses(1, UNREADABLE) == [head.format(1) + rounding + unconfirmed]
    close = compared(exact=False, tolerance=1e-3, rounded=3, max_ulps=2)
    assert losses(8, compared(4, exact=False, tolerance=1e-3, rounded=3, max_ulps=2), close) == [
        head.format(8) + rounding + "; the state matches the recorded one within tolerance at step 6."]
    for backend in (None, "eager", "aot_eager"):
        assert losses(9, backend=backend) == [
            head.format(9) + "within the tolerance for a replay on another device type or CPU" + unconfirmed]
    assert losses(9, backend="inductor") == [head.format(9) + (
        "within the tolerance for an eager replay of a run compiled with kernels of its own") + unconfirmed]


# -- the other sentences of a report with no origin, a window cut short, a checkpoint the recorder did not write --

def test_nothing_reached_names_the_overflows_the_scaler_caught():
    def caught(*steps: int) -> AmpReport:
        return AmpReport("float16", "float32", True, [], [event(n, "grad", "inf") for n in steps], None)

    r = report(amp=caught(4, 6, 4))
    assert findings(r)[0] == ("No non-finite value reached the optimizer state or the parameters over steps 2-8: the "
                              "non-finite values met at steps 4, 6 were overflows the scaler caught.")
    r = report(amp=caught(6, 4), logged={4: math.inf})
    assert findings(r)[0] == ("No non-finite value reached the optimizer state or the parameters over steps 2-8: the "
                              "non-finite values met at steps 4, 6 were overflows the scaler caught (the non-finite loss "
                              "logged at step 4 among them).")
    r = report(amp=caught(6), logged={4: math.inf})  # a logged NaN the scaler did not catch: not among them
    assert findings(r)[0].endswith("the non-finite values met at step 6 were overflows the scaler caught.")
    assert findings(report(amp=caught()))[0].startswith("No non-finite value in any batch, activation, loss")


@pytest.mark.parametrize("first", [0, 1, 2])
@pytest.mark.parametrize("loaded", [False, True])
def test_the_steps_before_the_window_are_said_unreplayed_only_where_there_are_some(first, loaded):
    r = report(loaded=LOADED if loaded else None)
    r.setup.first_step = first
    unreplayed = f"; steps before {first} were not replayed (`--from-step 0` replays from the start)"
    assert findings(r)[0] == ("No non-finite value in any batch, activation, loss, gradient, optimizer state, parameter "
                              f"or buffer over steps {first}-8{unreplayed if first and not loaded else ''}.")


@pytest.mark.parametrize("shown", [None, 7, 8, 9, 12])
def test_a_replay_that_ended_before_the_loss_shows_nan_says_its_window_is_shorter(shown):
    r = report(event(), logged={shown: NAN} if shown is not None else {})
    r.logged_first_nonfinite_loss_step = shown  # logged past the replay's last step (8) too
    window = [s for s in findings(r) if s.startswith("The replay ended")]
    assert window == ([] if shown is None or shown <= 8 else [
        f"The replay ended at step 8, before the logged loss first shows NaN (step {shown}): the replayed loss, the "
        "optimizer state and the reproduction are judged over steps 2-8 only."])


@pytest.mark.parametrize("logged", [False, True])
def test_an_origin_step_missing_from_the_spread_gives_no_loss_value(logged):
    r = report(event(), reproduced=True if logged else None, logged={7: NAN} if logged else {})
    if not logged:
        r.spread = [step(n, None, NAN if n >= 7 else 1.0) for n in range(2, 9)]
    r.spread = [s for s in r.spread if s.step != ORIGIN]
    said = when_shown(r)
    assert said[0].startswith("The loss logged at step 5 was finite: it" if logged else
                              "The loss at step 5 was finite in the replay: it"), said


LOADED = CheckpointLoad("c.pt", "torch.save dict", 2, "metadata", "m:batches", None, "name", 4, 0, "none", ["torch"], None, [])
FIRST = "The checkpoint is taken as the state before step 2 (from {}): m:batches(2) is the first batch replayed{}."
AFTER = "; a loop that saved it after running step 2 needs --from-step 3"
BY_ORDER = ("Optimizer state was matched to the parameters by order, as torch's load_state_dict does: the checkpoint "
            "records no parameter names. Every group's size and every state tensor's shape agree; {}.")
RNG = "The torch RNG state was not restored{}: every pass of the replay starts from seed 0. "


@pytest.mark.parametrize("facts, said", [
    ({}, [FIRST.format("its metadata", AFTER)]),
    ({"step_from": "trainer_state.json"}, [FIRST.format("the steps trainer_state.json counts", "")]),
    ({"step_from": "name", "model_prefix_stripped": "module."},
     [FIRST.format("its name", AFTER),
      "Model keys were saved with the prefix 'module.' (a wrapper), removed to match the model by name."]),
    ({"step_from": "--from-step", "optimizer_matched": "order", "same_shape_params": 2},
     [FIRST.format("--from-step", AFTER), BY_ORDER.format(
         "2 of 4 parameters share their shape with another of their group, so the optimizer must list those in the "
         "order training did: a different order among them goes unnoticed")]),
    ({"step_from": "a guess", "optimizer_matched": "order", "step": 7},
     [FIRST.format("a guess", AFTER).replace("2", "7").replace("3", "8"),
      BY_ORDER.format("no two parameters of a group share a shape")]),
    ({"scheduler": "unused"},
     [FIRST.format("its metadata", AFTER),
      "The checkpoint holds an LR scheduler's state, but no scheduler factory was named (--scheduler): the learning "
      "rate stays at the checkpoint's value, where training followed its schedule."]),
    ({"scheduler": "restored", "rng_restored": [], "rng_missing": "none saved"},
     [FIRST.format("its metadata", AFTER), RNG.format(" (none saved)") + (
         "The model has no dropout module, so this matters only where the step function draws random numbers.")]),
    ({"rng_restored": ["python", "numpy"], "random_modules": ["drop", "enc.drop"]},
     [FIRST.format("its metadata", AFTER), RNG.format("") + (
         "The model's dropout (drop, enc.drop) draws its masks from it, so they differ from training's: the replayed "
         "steps are not the run's, and a failure that needs particular masks may not reproduce.")]),
])
def test_each_choice_made_loading_a_checkpoint_the_recorder_did_not_write_is_said(facts, said):
    loaded = replace(LOADED, **facts)
    assert findings(report(event(), loaded=loaded))[-len(said):] == said
    assert findings(report(loaded=loaded))[-len(said):] == said
    assert not any(s.startswith("The checkpoint is taken") for s in findings(report(event())))


def test_the_parameter_update_or_the_code_after_it_is_named_as_the_cause_where_the_trace_says():
    from nanforensics.report import OperationCulprit, OpSite

    def culprit(phase: str, source: str | None = "train.py:12 in step") -> OperationCulprit:
        return OperationCulprit(OpSite("aten::mul_.Tensor", phase, None, source, ["float32"], [["1", "2"]], ["float32"]),
                                "nan", [0])

    def cause(stage: str, op: OperationCulprit | None) -> str:
        return findings(report(event(stage=stage), operation=op))[0].split("(float32): ")[1]

    assert cause("param", culprit("optimizer")) == ("gradients and optimizer state were finite; the parameter update "
                                                    "itself (optimizer.step()) produced it.")
    after = ("gradients and optimizer state were finite; the step function's own code produced it after the update: "
             "aten::mul_.Tensor{}, which ran after optimizer.step() returned.")
    assert cause("param", culprit("after_update")) == after.format(" at train.py:12 in step")
    assert cause("param", culprit("after_update", None)) == after.format("")
    for phase in ("forward", "before_update", None):
        assert cause("param", culprit(phase) if phase else None) == (
            "gradients and optimizer state were finite; the parameter was non-finite once the step returned: "
            "optimizer.step() or the step function's own code after it produced it.")
    assert cause("grad", culprit("optimizer")) == "the forward pass and the loss were finite; the backward pass made it."


@pytest.mark.parametrize("origin", [None, 6])
def test_the_root_cause_is_said_once_after_the_loss_only_steps_where_there_is_no_origin(origin):
    r = loss_only_report(origin, [4, 5])
    r.samples = replace(batch_wide(), status="attributed", samples=[3], message="sample 3 of 8 has no valid target")
    said = findings(r)
    cause = "Samples: sample 3 of 8 has no valid target."
    assert said.count(cause) == 1
    loss_only = next(i for i, s in enumerate(said) if s.startswith("The loss was NaN at steps 4, 5"))
    assert (said.index(cause) > loss_only) is (origin is None)
    assert said[0] == GRAD.replace("step 5", "step 6") if origin else said[0] == said[loss_only]  # the first of them


# -- what the optimizer state and the buffers hold once non-finite, and what follows from it --

def state(n: int, key: str, value: str = "inf", values: int = 3, tensors: int = 2) -> Event:
    return Event(n, "optimizer_state", "fc.weight", [0], value, state_key=key, elements_nonfinite=values,
                 tensors_nonfinite=tensors, dtype="float32")


def param(n: int) -> Event:
    return Event(n, "param", "fc.weight", [0], "nan", elements_nonfinite=1, tensors_nonfinite=1)


FROZEN = ("Where v is inf, Adam's update m/(sqrt(v)+eps) is 0: those coordinates are frozen, they stop learning rather "
          "than turn NaN, and stay frozen while the inf lasts (beta2*inf = inf). Zeroing their state (--what-if "
          "reset-state) lets them learn again.")
SKIP = ("Skipping the step after optimizer.step() has written the state would not have saved the run: skip before the "
        "state is written (check the gradients first, as GradScaler does), or repair or reset the state.")
STAYED, TURNED = "the parameters stayed finite through step 8", "the parameters turned non-finite at step 6"


def moments(step: int, **values: float) -> Precursor:
    return Precursor(step, None, None, None, values, None, None, None)


@pytest.mark.parametrize("events, precursors, said", [
    ([], [], []),
    ([state(5, "exp_avg_sq")], [], [f"From step 5 the optimizer state holds infinities in exp_avg_sq (3 values in 2 "
                                     f"tensors); {STAYED}. {FROZEN}"]),
    ([state(5, "exp_avg_sq", values=1, tensors=1), state(6, "exp_avg")], [moments(5, exp_avg=1.0, exp_avg_sq=math.inf)],
     [f"From step 5 the optimizer state holds infinities in exp_avg_sq (1 value in 1 tensor), while exp_avg stayed "
      f"finite; {STAYED}. {FROZEN}"]),
    ([state(5, "exp_avg_sq"), param(6)], [], [f"From step 5 the optimizer state holds infinities in exp_avg_sq (3 values "
                                              f"in 2 tensors); {TURNED}. An infinity in the state persists (beta*inf = "
                                              f"inf).", SKIP]),
    ([state(5, "exp_avg_sq"), state(5, "exp_avg", values=1, tensors=1)], [],
     [f"From step 5 the optimizer state holds infinities in exp_avg (1 value in 1 tensor) and exp_avg_sq (3 values in 2 "
      f"tensors); {STAYED}. Adam's update m/(sqrt(v)+eps) is inf/inf = NaN there, and the infinities persist (beta*inf "
      "= inf)."]),
    ([state(5, "exp_avg_sq", "nan"), state(5, "exp_avg"), param(6)], [],
     [f"From step 5 the optimizer state holds NaN in exp_avg_sq (3 values in 2 tensors); infinities in exp_avg (3 values "
      f"in 2 tensors); {TURNED}. NaN in the state is absorbing: beta*NaN stays NaN, and no later gradient repairs it.",
      SKIP]),
    ([state(5, "exp_avg_sq", "nan"), state(5, "exp_avg", "nan")], [moments(5, exp_avg=math.inf, exp_avg_sq=math.nan)],
     [f"From step 5 the optimizer state holds NaN in exp_avg_sq (3 values in 2 tensors); infinities in exp_avg (3 values "
      f"in 2 tensors); {STAYED}. NaN in the state is absorbing: beta*NaN stays NaN, and no later gradient repairs it."]),
    ([state(5, "exp_avg_sq", "nan")], [moments(4, exp_avg_sq=math.inf), moments(5, exp_avg_sq=2.0)],  # finite: the event
     [f"From step 5 the optimizer state holds NaN in exp_avg_sq (3 values in 2 tensors); {STAYED}. NaN in the state is "
      "absorbing: beta*NaN stays NaN, and no later gradient repairs it."]),
    ([param(4), Event(5, "grad", "fc.weight", [0], "nan"), state(5, "momentum_buffer")], [],
     ["From step 5 the optimizer state holds infinities in momentum_buffer (3 values in 2 tensors); the parameters were "
      "non-finite from step 4, before it: the state took the non-finite values from them through that step's gradients, "
      "a consequence rather than the origin."]),
    ([param(4), state(5, "momentum_buffer"), Event(6, "grad", "fc.weight", [0], "nan")], [],
     ["From step 5 the optimizer state holds infinities in momentum_buffer (3 values in 2 tensors); the parameters were "
      "non-finite from step 4, before it: the state took the non-finite values from them, a consequence rather than the "
      "origin."]),
    ([state(5, "momentum_buffer"), state(5, "exp_avg_sq")], [],
     [f"From step 5 the optimizer state holds infinities in exp_avg_sq (3 values in 2 tensors) and momentum_buffer (3 "
      f"values in 2 tensors); {STAYED}. An infinity in the state persists (beta*inf = inf)."]),
    ([state(5, "max_exp_avg_sq"), state(5, "exp_avg_sq")], [],
     [f"From step 5 the optimizer state holds infinities in exp_avg_sq (3 values in 2 tensors) and max_exp_avg_sq (3 "
      f"values in 2 tensors); {STAYED}. {FROZEN}"]),
    ([state(5, "exp_avg_sq"), param(5)], [],  # the parameters at the same step: not before it
     ["From step 5 the optimizer state holds infinities in exp_avg_sq (3 values in 2 tensors); the parameters turned "
      "non-finite at step 5. An infinity in the state persists (beta*inf = inf).", SKIP]),
    ([state(5, "exp_avg_sq")], [moments(5, exp_avg=1.0, max_exp_avg_sq=2.0, exp_avg_sq=math.inf)],
     [f"From step 5 the optimizer state holds infinities in exp_avg_sq (3 values in 2 tensors), while exp_avg, "
      f"max_exp_avg_sq stayed finite; {STAYED}. {FROZEN}"]),
    ([state(5, "square_avg")], [], [f"From step 5 the optimizer state holds infinities in square_avg (3 values in 2 "
                                     f"tensors); {STAYED}. An infinity in the state persists (beta*inf = inf)."]),
])
def test_what_the_optimizer_state_holds_and_what_follows(events, precursors, said):
    r = report(event(), precursors=precursors)
    r.events = events  # the origin among them or not: what the state sentence reads is the events
    assert [s for s in findings(r) if s.startswith(("From step", "Skipping"))] == said


def buffer(n: int, name: str = "bn.running_var", tensors: int = 1) -> Event:
    return Event(n, "buffer", name, [0], "inf", elements_nonfinite=1, tensors_nonfinite=tensors)


PERSISTS = "A buffer persists from step to step like optimizer state, so the run carries it on."
RUNNING = ("These are BatchNorm running statistics: {}in training mode BatchNorm normalises with each batch's own "
           "statistics; in eval mode (evaluation, inference) it normalises with the running ones, which keep a non-finite "
           "value ((1-momentum)*inf = inf). Reset them (reset_running_stats()) or re-estimate them on clean batches.")


@pytest.mark.parametrize("events, nonfinite_loss, said", [
    ([buffer(5)], None, [f"Buffer bn.running_var holds non-finite values from step 5; {STAYED}. {PERSISTS}",
                         RUNNING.format("the replayed losses stayed finite through step 8, since ")]),
    ([buffer(5, "bn.running_mean", 3), param(6)], 7,
     [f"Buffer bn.running_mean and 2 other buffers hold non-finite values from step 5; {TURNED}. {PERSISTS}",
      RUNNING.format("")]),
    ([buffer(5, "ema.shadow", 2), param(6)], 4,  # a NaN loss before the buffer's step does not count
     [f"Buffer ema.shadow and 1 other buffer hold non-finite values from step 5; {TURNED}. {PERSISTS}"]),
    ([buffer(5, "ema.shadow"), buffer(6, "bn.running_var")], None,
     [f"Buffer ema.shadow holds non-finite values from step 5; {STAYED}. {PERSISTS}"]),
    ([param(4), buffer(5, "ema.shadow", 2)], None,
     ["Buffer ema.shadow and 1 other buffer went non-finite at step 5, after the parameters (step 4): a consequence, "
      "not the origin."]),
    ([param(5), buffer(5, "bn.running_var")], 8,
     ["Buffer bn.running_var holds non-finite values from step 5; the parameters turned non-finite at step 5. "
      f"{PERSISTS}", RUNNING.format("")]),
    ([buffer(5, "bn.running_varx")], None, [f"Buffer bn.running_varx holds non-finite values from step 5; {STAYED}. "
                                            f"{PERSISTS}"]),
    ([buffer(5)], 5, [f"Buffer bn.running_var holds non-finite values from step 5; {STAYED}. {PERSISTS}",
                      RUNNING.format("")]),  # the buffer's own step's loss counts
])
def test_what_a_nonfinite_buffer_means(events, nonfinite_loss, said):
    r = report(event())
    r.events = [*r.events, *events]
    if nonfinite_loss is not None:
        r.spread[nonfinite_loss - 2].replayed_loss = NAN
    assert [s for s in findings(r) if s.startswith(("Buffer", "These are"))] == said


# -- an origin the forward did not read at once; a replay compared within a tolerance, and why --

UNREAD = ("{} went {} at step 3, but no module output and no loss held a non-finite value at {}: the forward "
          "first carries it at step {}, the first step whose forward reads a non-finite value ({}){}.")


@pytest.mark.parametrize("stage", ["param", "optimizer_state", "buffer", "grad", "forward"])
@pytest.mark.parametrize("carried", [None, 4, 5, 6])
@pytest.mark.parametrize("value", ["nan", "-inf"])
def test_an_origin_the_forward_reads_only_steps_later_says_so(stage, carried, value):
    o = Event(3, stage, "emb.weight", [7, 0], value, state_key="exp_avg" if stage == "optimizer_state" else None)
    later = [Event(3, "forward", "emb", [0], "nan"), Event(4, "grad", "emb.weight", [0], "nan")]
    if carried is not None:
        later += [Event(carried, "loss" if carried == 5 else "forward", "loss" if carried == 5 else "emb", [0, 1], "inf"),
                  Event(carried + 1, "forward", "head", [0], "nan")]
    for shown, tail in ((None, ""), (carried, "; the logged loss first shows NaN there too"),
                        (7, "; the logged loss first shows NaN at step 7")):
        r = report(o, logged={shown: NAN} if shown else {})
        r.events = [o, *later]
        said = [s for s in findings(r) if " went " in s and "no module output" in s]
        if stage in ("grad", "forward") or carried is None or carried == 4:
            assert said == []
            continue
        what = {"param": "Param emb.weight[7, 0]", "buffer": "Buffer emb.weight[7, 0]",
                "optimizer_state": "Optimizer_state exp_avg of emb.weight[7, 0]"}[stage]
        where = "loss[0, 1] = inf" if carried == 5 else "forward emb[0, 1] = inf"
        unread = "step 4" if carried == 5 else f"steps 4-{carried - 1}"  # never "steps 4-4"
        assert said == [UNREAD.format(what, "NaN" if value == "nan" else value, unread, carried, where, tail)]


CPU = CpuIdentity("AMD EPYC", "AVX2", "x86_64")
OTHER_CPU = CpuIdentity("", "AVX512", "x86_64")


def within(n: int = 6, tolerance: float = 1e-3, **facts) -> CheckpointComparison:
    return compared(n, exact=False, tolerance=tolerance, **facts)


@pytest.mark.parametrize("recorded", [CPU, None])
def test_a_state_compared_within_a_tolerance_names_the_two_cpus(recorded):
    def said(*checkpoints: CheckpointComparison, backend: str | None = None, replay: CpuIdentity = OTHER_CPU) -> list[str]:
        r = report(event(), checkpoints_compared=list(checkpoints))
        r.setup.recorded_cpu, r.setup.replay_cpu, r.setup.compiled = recorded, replay, backend
        return [s for s in findings(r) if s.startswith("Recorded on")]

    named = ("AMD EPYC (x86_64, capability AVX2)" if recorded else
             "an unknown CPU (the run's manifest does not name it)")
    line = (f"Recorded on {named}, replayed on an unnamed CPU (x86_64, capability AVX512): kernels "
            f"{'' if recorded else 'may '}sum in another order, so the state is compared within a tolerance (rtol {{}}) "
            "rather than bit for bit; {}.")
    assert said() == said(compared()) == said(replace(UNREADABLE, tolerance=1e-3)) == []
    assert said(within(rounded=2, max_ulps=5), within(7, 0.01, rounded=1, max_ulps=9)) == \
        [line.format("0.001", "differences up to 9 ulps")]
    assert said(within(max_ulps=1)) == [line.format("0.001", "differences up to 1 ulp")]
    assert said(within()) == [line.format("0.001", "every value compared is bit-exact all the same")]
    assert said(within(), backend="inductor", replay=OTHER_CPU) == [line.format("0.001", "every value compared is "
                                                                                "bit-exact all the same")]
    assert said(within(), backend="inductor", replay=recorded) == []  # the compiled kernels are the reason, said apart
    assert said(within(), backend="eager", replay=recorded) == [line.replace("replayed on an unnamed CPU (x86_64, "
                                                                             "capability AVX512)", f"replayed on {named}")
                                                                .format("0.001", "every value compared is bit-exact all "
                                                                        "the same")]


def test_a_run_trained_compiled_says_how_its_state_is_compared():
    def said(backend: str | None, *checkpoints: CheckpointComparison) -> list[str]:
        r = report(event(), checkpoints_compared=list(checkpoints))
        r.setup.compiled = backend
        return [s for s in findings(r) if s.startswith("The run trained under torch.compile")]

    head = ("The run trained under torch.compile (backend {0}); the replay ran the module it compiled eagerly, where its "
            "hooks see every module's output and every operation. ")
    eager = head + "{0} runs the kernels eager mode runs{1}: {2}."
    own = head + ("{0} generates kernels of its own, which may round otherwise than eager mode's, so the state is "
                  "compared within rtol {1}: {2}.")
    assert said(None, within()) == []
    none = "no recorded checkpoint in the replayed window was compared"
    assert said("eager") == [eager.format("eager", ", so the state is compared bit for bit", none)]
    assert said("aot_eager", UNREADABLE) == [eager.format("aot_eager", ", so the state is compared bit for bit", none)]
    assert said("eager", compared(4), compared()) == [eager.format("eager", ", so the state is compared bit for bit",
                                                                   "it is bit-exact at step 6")]
    assert said("eager", within(rounded=1)) == [eager.format("eager", "", "it matches within rtol 0.001 at step 6")]
    assert said("inductor") == [own.format("inductor", "0.001", none)]
    assert said("inductor", within(7, 0.01, rounded=1), UNREADABLE) == [
        own.format("inductor", "0.01", "it matches within rtol 0.01 at step 7")]
    assert said("inductor", within(first_mismatch=MISMATCH)) == [own.format("inductor", "0.001", "it differs at step 6")]


# -- a batch-wide failure: its data, what the batch carries, or the state the run had reached, and the drift --

def drifting(*steps: int, lr: float = 0.01, factor: float = 1.0) -> list[Precursor]:
    """Precursors at ``steps``: the learning rate multiplied by ``factor`` each step, the rest flat."""
    return [Precursor(n, 1.0, 1.0, 0.5, {}, 10.0, "bfloat16", 0.25, lr * factor ** i) for i, n in enumerate(steps)]


STEP_HEAD = ("Step 5, not its data, is responsible: most of its batch fails sample by sample, so the cause is the state "
             "the run had reached (its learning rate, its loss scale, or weights grown over many steps), and {}")


@pytest.mark.parametrize("compared_fails", [True, None])
def test_the_step_not_its_data_and_the_drift_before_it(compared_fails):
    other = ("the batch of step 4, run from the same state, fails too" if compared_fails else
             "another batch would most likely fail the same way")

    def said(precursors: list[Precursor]) -> list[str]:
        r = report(event(), samples=batch_wide(compared_fails=compared_fails, compared_step=4), precursors=precursors)
        return [s for s in findings(r) if s.startswith("Step 5")]

    assert said([]) == said(drifting(4, 5, 6, factor=100)[1:]) == [
        STEP_HEAD.format(other) + "; the replay holds no earlier steps to show a drift."]
    assert said(drifting(3, 4, factor=3)) == [STEP_HEAD.format(other) + "; no precursor rose 10-fold over steps 3-4."]
    assert said(drifting(2, 3, 4, 5, factor=100 ** 0.5)) == [
        STEP_HEAD.format(other) + ". Over steps 2-4 this rose: the learning rate from 0.01 to 1."]
    assert said(drifting(3, 4, 5, factor=10)) == [
        STEP_HEAD.format(other) + ". Over steps 3-4 this rose: the learning rate from 0.01 to 0.1."]
    grown = [replace(p, grad_norm=10.0 ** i, update_max_abs=0.5 * 20 ** i, activation_headroom=0.01 * 10 ** i)
             for i, p in enumerate(drifting(2, 3, 4, factor=4))]
    assert said(grown) == [STEP_HEAD.format(other) + (
        ". Over steps 2-4 these rose: the learning rate from 0.01 to 0.16, the gradient norm from 1 to 100, the largest "
        "parameter update from 0.5 to 200 and the largest activation from 0.01 to 1 of bfloat16's largest value.")]


def test_a_batch_wide_failure_through_the_batchs_own_tensors_or_its_data_or_what_its_samples_share():
    def said(**facts) -> list[str]:
        samples = batch_wide(**{"compared_fails": True, "compared_step": 4, **facts.pop("samples", {})})
        return [s for s in findings(report(event(), samples=samples, **facts)) if s.startswith(("Step 5", "Most of"))]

    assert said(samples={"cause_leaves": ["batch['mask']"]}) == [
        "Step 5's batch fails as a whole through its per-batch tensor batch['mask'] (kept whole when the batch was "
        "split): with step 4's in its place the same samples, from the same state, stay finite; it is the cause, not "
        "particular samples nor the state the run had reached."]
    assert said(samples={"cause_leaves": ["batch['mask']", "batch['scale']"]}) == [
        "Step 5's batch fails as a whole through its per-batch tensors batch['mask'], batch['scale'] (kept whole when "
        "the batch was split): with step 4's in their place the same samples, from the same state, stay finite; they "
        "are the cause, not particular samples nor the state the run had reached."]
    assert said(data_defects=DEFECT["at the origin"]) == [
        "Most of step 5's batch fails sample by sample, and that batch holds data defects (see Data): the batch as a "
        "whole is bad data, not particular samples of it."]
    passed = ("Most of step 5's batch fails sample by sample, yet the batch of step 4, run from the same state, stays "
              "finite: the state the run had reached does not make every batch fail, so what this batch's samples share "
              "(a sequence length or padding, a setting the batch carries) is part of the cause, not particular samples.")
    assert said(samples={"compared_fails": False}) == said(samples={"compared_fails": False},
                                                           precursors=drifting(4, 5, factor=100)) == [passed]
    assert said(samples={"compared_fails": False}, precursors=drifting(2, 3, 4, factor=10)) == [
        passed + " Over steps 2-4 before it this rose: the learning rate from 0.01 to 1."]
    assert said(samples={"compared_fails": False}, precursors=drifting(3, 4, factor=9.9)) == [passed]
    assert said(samples={"status": "attributed"}) == []
    assert not any(s.startswith(("Step", "Most of")) for s in findings(report(samples=batch_wide(compared_step=4))))


def test_a_coupled_failure_after_a_drift_names_the_drift():
    def said(precursors: list[Precursor], **facts) -> list[str]:
        samples = batch_wide(status="coupled", coupled_groups=[[1, 2], [5, 6]])
        return [s for s in findings(report(event(), samples=samples, precursors=precursors, **facts))
                if s.startswith("Step 5's batch holds")]

    assert said(drifting(3, 4, 5, factor=10)) == [
        "Step 5's batch holds no data defect and its failure needs samples together ([1, 2], [5, 6]); over steps 3-4 "
        "before it this rose: the learning rate from 0.01 to 0.1."]
    assert said(drifting(3, 4, factor=9)) == said(drifting(4, 5, factor=100)) == []
    assert said(drifting(3, 4, factor=10), data_defects=DEFECT["at the origin"]) == []
    assert said(drifting(3, 4, factor=10), data_defects=DEFECT["elsewhere"]) != []


# -- gradient clipping: what it did, or would have done, with the step's non-finite gradient --

def grad(value: str, stage: str = "grad", values: int = 4, nan: int = 0, tensors: int = 1, rewritten: int = 0,
         index: tuple[int, ...] = (1, 2), tensor: str = "fc.weight") -> Event:
    return Event(ORIGIN, stage, tensor, list(index), value, elements_nonfinite=values, tensors_nonfinite=tensors,
                 nan_elements=nan, rewritten=rewritten)


def opt(value: str, **facts) -> Event:
    return grad(value, "optimizer_grad", **facts)


NAN_NORM = ("Gradient clipping would not have rescued this: the total gradient norm is NaN, so the clip factor max_norm/NaN "
            "is NaN, and clipping makes every gradient NaN.")
INF_NORM = ("Gradient clipping would not have rescued this: the total gradient norm is inf, so the clip factor "
            "max_norm/inf is 0, and {} = NaN.")
TURNED_NAN = ("The step function turned the {0} gradient into NaN before optimizer.step(): that is what gradient clipping "
              "does to an infinity (total norm inf, clip factor max_norm/inf = 0, and {1} = NaN), so clipping cannot "
              "rescue it.")
SPREAD = ("Clipping spread it: backward left {} ({} NaN) in {}; the step function then rewrote {} before "
          "optimizer.step(), which saw {} ({} NaN) in {}. A total-norm clip (clip_grad_norm_) scales every gradient by "
          "one factor, max_norm/total norm: {}, and every gradient it scaled became NaN.")
NOT_FINITE, NAN_FACTOR = "the factor was not finite", "a NaN gradient makes the total norm NaN, and so the factor max_norm/NaN"


@pytest.mark.parametrize("events, norm, origin, said", [
    ([], None, "forward", []),  # no gradient went non-finite
    ([grad("nan", nan=4)], None, "grad", [NAN_NORM]),
    ([grad("nan", nan=4)], None, "forward", []),  # the gradients only carry the forward's NaN
    ([grad("inf")], None, "grad", [INF_NORM.format("0*inf")]),
    ([grad("-inf")], None, "forward", [INF_NORM.format("0*(-inf)")]),
    ([grad("inf")], math.nan, "grad", [NAN_NORM]),
    ([grad("nan")], math.inf, "grad", [INF_NORM.format("0*inf")]),
    ([grad("inf")], 3.0, "grad", []),  # a finite norm measured: clipping would have scaled it
    ([grad("inf"), opt("inf")], None, "grad", [INF_NORM.format("0*inf")]),
    ([grad("inf"), opt("-inf")], None, "grad", []),  # the step function changed the gradients
    ([grad("nan"), opt("inf")], None, "grad", []),
    ([grad("inf"), opt("nan", nan=4)], None, "grad", [TURNED_NAN.format("inf", "0*inf")]),  # the same coordinate
    ([grad("-inf"), opt("nan", nan=4, index=(0, 0))], None, "grad", []),  # another coordinate, nothing rewritten
    ([grad("-inf"), opt("nan", nan=4, tensor="fc.bias")], None, "grad", []),
    ([grad("-inf"), opt("nan", nan=1, rewritten=1, index=(0, 0))], None, "grad", [TURNED_NAN.format("-inf", "0*(-inf)")]),
    ([grad("-inf", nan=1), opt("nan", nan=1, rewritten=1, index=(0, 0))], None, "grad", []),  # no more NaN than before
    ([grad("inf"), opt("nan", values=10, nan=10, tensors=3, rewritten=3)], None, "grad",
     [SPREAD.format("4 non-finite gradient values", 0, "1 tensor", "3 gradient tensors", "10 non-finite values", 10,
                    "3 tensors", NOT_FINITE)]),
    ([grad("nan", values=1, nan=1), opt("nan", values=2, nan=2, tensors=1, rewritten=1)], None, "grad",
     [SPREAD.format("1 non-finite gradient value", 1, "1 tensor", "1 gradient tensor", "2 non-finite values", 2,
                    "1 tensor", NAN_FACTOR)]),
    ([grad("nan", values=1000, nan=1000), opt("nan", values=2000, nan=1500, tensors=3, rewritten=3)], None, "grad",
     [SPREAD.format("1,000 non-finite gradient values", "1,000", "1 tensor", "3 gradient tensors",
                    "2,000 non-finite values", "1,500", "3 tensors", NAN_FACTOR)]),
    ([grad("nan", nan=4), opt("nan", values=4, nan=4, rewritten=3)], None, "grad", [NAN_NORM]),  # no more values
    ([grad("nan", nan=2), opt("nan", values=8, nan=2, rewritten=3)], None, "grad", [NAN_NORM]),  # no more NaN
    ([grad("nan", nan=2), opt("nan", values=8, nan=4, rewritten=0)], None, "grad", [NAN_NORM]),  # nothing rewritten
    ([grad("nan", nan=4), grad("inf", index=(9, 9))], None, "grad", [NAN_NORM]),  # the first gradient event decides
])
def test_what_clipping_does_with_the_steps_nonfinite_gradient(events, norm, origin, said):
    r = report(Event(ORIGIN, origin, "fc.weight", [1, 2], "nan"),
               precursors=[Precursor(ORIGIN - 1, 1.0, None, None, {}, None, None, None),
                           Precursor(ORIGIN, norm, None, None, {}, None, None, None)] if norm is not None else [])
    r.events = [r.origin, *events] if origin != "grad" else events or [r.origin]
    r.events += [replace(e, step=ORIGIN + 1, value="inf") for e in events]  # the next step's do not count
    assert [s for s in findings(r) if "lipping" in s] == said


# -- the operation that made the origin's value, each clause read off the culprit's facts; an event in words --

LOG = OpSite("aten::log", "forward", "enc.norm", "model.py:12 in forward", ["float32"], [["-1", "2"]], ["float32"])
MASK = OpSite("aten::masked_fill", "before_update", "attn", "train.py:40 in step", ["float32"], [["0", "1"]], ["float32"])
SOFTMAX = OpSite("aten::softmax", "forward", "attn", None, ["float32"], [["-inf", "3"], ["inf", "inf"]], ["float32"])


@pytest.mark.parametrize("culprit, said", [
    (OperationCulprit(LOG, "nan", [0, 3]),
     "Operation: forward aten::log in module `enc.norm` (model.py:12 in forward) produced nan at [0, 3] from finite inputs "
     "[-1, 2]."),
    (OperationCulprit(OpSite("aten::div", "backward", None, None, ["float32"] * 2, [["0", "0"], ["1", "inf"]], ["float32"],
                             [["nan", "nan"], ["0", "1"]]), "nan", [1], autograd_node="DivBackward0", forward=LOG,
                      inputs_at_index=[["0", "0"], None, ["-inf", "-inf"], ["1", "2"]], traced_from="grad w[1] = nan",
                      path=["aten::div", "aten::mul", "aten::sum"]),
     "Operation: aten::div in the backward of aten::log in module `enc.norm` (model.py:12 in forward), autograd node "
     "DivBackward0, produced nan at [1] from inputs holding inf ([0, 0], [1, inf]); the input elements that coordinate "
     "was computed from ranged over [0, 0], (not shown), [-inf, -inf] (all -inf), [1, 2]; its outputs ranged over "
     "[nan, nan], [0, 1]; the forward op's inputs ranged over [-1, 2]. Traced back from grad w[1] = nan: aten::sum <- "
     "aten::mul <- aten::div."),
    (OperationCulprit(OpSite("aten::mul", "backward", "fc", None, ["float32"], [["nan", "1"]], ["float32"]), "nan", [0],
                      inputs_at_index=[None], traced_from="grad w[0] = nan"),
     "Operation: backward aten::mul in module `fc` produced nan at [0] from inputs holding nan ([nan, 1])."),
    (OperationCulprit(SOFTMAX, "nan", [2, 2], inf_source=InfSource("constant", MASK, "attn.mask"),
                      nan_site=OpSite("aten::mul", "backward", "attn", None, ["float32"], [["nan", "1"]], ["float32"]),
                      nan_node="MulBackward0"),
     "Operation: forward aten::softmax in module `attn` produced nan at [2, 2] from inputs holding inf and -inf ([-inf, 3], "
     "[inf, inf]). The -inf and inf in its inputs was not computed: the step function's own code before "
     "optimizer.step(), aten::masked_fill in module `attn` (train.py:40 in step) wrote it as a constant (a mask), and "
     "attn.mask held it before the step, so this operation, where it became NaN, is the cause. NaN arose in the backward "
     "pass, at backward aten::mul in module `attn`, autograd node MulBackward0, from inputs holding nan ([nan, 1])."),
    (OperationCulprit(replace(SOFTMAX, input_ranges=[["0", "inf"]]), "nan", [0],
                      inf_source=InfSource("constant", MASK, None),
                      nan_site=OpSite("aten::sub", "forward", None, None, [], [], ["float32"])),
     "Operation: forward aten::softmax in module `attn` produced nan at [0] from inputs holding inf ([0, inf]). The inf "
     "in its inputs was not computed: the step function's own code before optimizer.step(), aten::masked_fill in module "
     "`attn` (train.py:40 in step) wrote it as a constant (a mask), so this operation, where it became NaN, is the cause. "
     "NaN arose downstream of it, at forward aten::sub outside any module from no floating-point inputs."),
    (OperationCulprit(OpSite("aten::exp", "after_update", None, None, [], [], ["float32"]), "nan", [0],
                      inf_source=InfSource("held", None, None)),
     "Operation: the step function's own code after optimizer.step(), aten::exp outside any module produced nan at [0] "
     "from no floating-point inputs. The ±inf in its inputs was not computed in this step: a tensor from before the step "
     "already held it, so this operation, where it became NaN, is the cause."),
    (OperationCulprit(replace(LOG, phase="backward"), "nan", [1], inf_source=InfSource("held", None, "emb.weight"),
                      nan_site=replace(LOG, phase="backward"), nan_node="LogBackward0", path=["aten::log"]),
     "Operation: backward aten::log in module `enc.norm` (model.py:12 in forward) produced nan at [1] from finite inputs "
     "[-1, 2]. The ±inf in its inputs was not computed in this step: emb.weight already held it, so this operation, where "
     "it became NaN, is the cause. NaN arose downstream of it, at backward aten::log in module `enc.norm` (model.py:12 in "
     "forward), autograd node LogBackward0, from finite inputs [-1, 2]."),
])
def test_the_operation_sentence_reads_each_clause_off_the_culprit(culprit, said):
    assert operation_sentence(culprit) == said
    assert said in findings(report(event(), operation=culprit))


@pytest.mark.parametrize("facts, said", [
    ({}, "grad fc.weight[1, 2] = nan"),
    ({"stage": "optimizer_state", "state_key": "exp_avg", "optimizer": "disc", "rank": 1, "value": "inf"},
     "optimizer_state exp_avg of fc.weight[1, 2] = inf (optimizer disc) on rank 1"),
    ({"stage": "loss", "tensor": "loss", "index": [], "value": ""}, "loss"),
    ({"stage": "loss", "tensor": "loss", "index": [0], "rank": 0}, "loss[0] = nan on rank 0"),
    ({"stage": "forward", "tensor": "blocks.0", "index": [], "value": "-inf", "optimizer": "gen"},
     "forward blocks.0 = -inf (optimizer gen)"),
])
def test_an_event_in_words(facts, said):
    e = replace(event(), **facts)
    assert describe(e) == said
    assert narrate(report(e)).origin.text == said  # the views' name for it, set once


def test_the_data_defect_and_the_samples_are_said_for_the_responsible_step_only():
    defects = [DataDefect(5, "batches/step_5.safetensors", "batch['x']", "nonfinite", 1, [0, 3], "nan"),
               DataDefect(4, "batches/step_4.safetensors", "batch['x']", "extreme", 12, [2, 0], "1e+30"),
               DataDefect(5, "batches/step_5.safetensors", "batch['y']", "subnormal", 3, [7], "1e-40")]
    samples = batch_wide(status="attributed", samples=[3], sample_leaves={"batch['ids']": ["a7", "b2"], "batch['f']": [1]},
                         message="sample 3 of 8 fails alone")
    said = findings(report(event(), data_defects=defects, samples=samples))
    assert [s for s in said if s.startswith(("Data:", "Samples:"))] == [
        "Data: the batch of step 5 holds a non-finite value, batch['x'][0, 3] = nan (1 such value in "
        "batches/step_5.safetensors).",
        "Data: the batch of step 5 holds a subnormal value, batch['y'][7] = 1e-40 (3 such values in "
        "batches/step_5.safetensors).",
        "Samples: sample 3 of 8 fails alone (batch['ids'] = ['a7', 'b2']; batch['f'] = [1])."]
    no_origin = report(loss_only_steps=[4], data_defects=defects, samples=replace(samples, sample_leaves={}))
    assert [s for s in findings(no_origin) if s.startswith(("Data:", "Samples:"))] == [
        "Data: the batch of step 5 holds a non-finite value, batch['x'][0, 3] = nan (1 such value in "
        "batches/step_5.safetensors).",
        "Data: the batch of step 4 holds an extreme value, batch['x'][2, 0] = 1e+30 (12 such values in "
        "batches/step_4.safetensors).",
        "Data: the batch of step 5 holds a subnormal value, batch['y'][7] = 1e-40 (3 such values in "
        "batches/step_5.safetensors).",
        "Samples: sample 3 of 8 fails alone."]


# -- one-step spikes before the origin: a jump of JUMP times both neighbours that came and went --

SPIKE = ("At step {0}, {1} before the origin, {2}, and fell back at step {3}: a one-step spike, which a comparison of "
         "the window's first and last steps does not show.")


def flat(*steps: int) -> list[Precursor]:
    return [Precursor(n, 1.0, None, 0.1, {}, None, None, None, 0.01) for n in steps]


@pytest.mark.parametrize("at, value, said", [
    (4, 1.0, "the learning rate jumped to 1, 100 times its value at the steps either side (at most 0.01)"),
    (4, 0.99, None),  # 99 times: no spike
    (2, 5.0, None), (7, 5.0, None),  # the window's first step has no step before it; the origin's step is not before it
    (5, 5.0, "the learning rate jumped to 5, 500 times its value at the steps either side (at most 0.01)"),
    (4, math.inf, None), (4, None, None),
])
def test_a_one_step_spike_of_a_precursor_is_named(at, value, said):
    precursors = flat(*range(2, 9))
    precursors[at - 2] = replace(precursors[at - 2], learning_rate=value)
    r = report(Event(7, "grad", "w", [0], "nan"), precursors=precursors)
    spoken = [s for s in findings(r) if "one-step spike" in s]
    assert spoken == ([SPIKE.format(at, count(7 - at, "step"), said, at + 1)] if said else [])


def test_a_spike_needs_both_neighbours_known_finite_and_positive():
    for neighbour in (None, math.inf, math.nan, 0.0, -1.0):
        precursors = flat(*range(2, 9))
        precursors[4 - 2] = replace(precursors[4 - 2], grad_norm=1000.0)
        precursors[5 - 2] = replace(precursors[5 - 2], grad_norm=neighbour)
        assert spikes(report(Event(7, "grad", "w", [0], "nan"), precursors=precursors)) == {}
    assert spikes(report(precursors=flat(2, 3, 4))) == {}  # no origin: nothing to lead up to
    precursors = flat(2, 3, 5, 6)  # step 4 missing: step 3 and step 5 each lack a neighbour
    precursors[1] = replace(precursors[1], update_max_abs=100.0)
    assert spikes(report(Event(7, "grad", "w", [0], "nan"), precursors=precursors)) == {}


def test_every_precursor_that_jumped_at_a_step_and_the_loss_scale_are_named_together():
    precursors = flat(*range(2, 9))
    precursors[4 - 2] = replace(precursors[4 - 2], learning_rate=1.0, grad_norm=100.0, update_max_abs=10.0)
    scaler = [ScalerStep(n, 2.0 ** (20 if n == 3 else 10), None, "hold", False, None, False) for n in range(2, 8)]
    r = report(Event(6, "grad", "w", [0], "nan"), precursors=precursors,
               amp=AmpReport("float16", "float32", True, scaler, [], None))
    assert [s for s in findings(r) if "one-step spike" in s] == [
        SPIKE.format(3, "3 steps", "the loss scale jumped to 1.05e+06, 1.02e+03 times its value at the steps either side "
                                   "(at most 1.02e+03)", 4),
        SPIKE.format(4, "2 steps", "the learning rate jumped to 1, 100 times its value at the steps either side (at most "
                                   "0.01) and the gradient norm jumped to 100, 100 times its value at the steps either side "
                                   "(at most 1) and the largest parameter update jumped to 10, 100 times its value at the "
                                   "steps either side (at most 0.1)", 5)]
    r.amp = AmpReport("float16", "float32", False, scaler, [], None)  # no scaler: its scale is no precursor
    assert len([s for s in findings(r) if "one-step spike" in s]) == 1


# -- the cause by the origin's stage; what counts as a rise; a later step's state is not the first step's --

@pytest.mark.parametrize("stage, tensor, cause", [
    ("batch", "batch['x']", "the batch itself holds a non-finite value: a data defect, before any computation"),
    ("forward", "blocks.0", "in the forward pass, module blocks.0's output is the first module output to hold it"),
    ("loss", "loss", "every module output was finite but the loss computation produced it"),
    ("optimizer_grad", "fc.weight", "the gradients were finite after backward; the step function made them non-finite "
                                    "before optimizer.step()"),
    ("buffer", "encoder.bn.running_var", "gradients, optimizer state and parameters were finite, but a registered buffer "
                                         "was not: buffers are updated outside the optimizer (BatchNorm updates its "
                                         "running statistics in the training forward, from each batch's own statistics)"),
    ("buffer", "ema.running_total", "gradients, optimizer state and parameters were finite, but a registered buffer was "
                                    "not: buffers are updated outside the optimizer"),
])
def test_the_cause_said_for_each_stage_of_the_origin(stage, tensor, cause):
    o = Event(ORIGIN, stage, tensor, [0], "inf", dtype="float32")
    assert findings(report(o))[0] == f"Origin: step 5, {describe(o)} (float32): {cause}."


def test_a_nested_batchnorm_buffer_is_a_running_statistic():
    r = report(event())
    r.events = [event(), buffer(6, "encoder.layers.0.bn.running_mean")]
    assert [s for s in findings(r) if s.startswith("These are BatchNorm")] == [
        RUNNING.format("the replayed losses stayed finite through step 8, since ")]


@pytest.mark.parametrize("values, said", [
    ([0.0, 0.001, 0.01], "the learning rate from 0.001 to 0.01"),  # a warmup from 0: the first positive value
    ([-1.0, 0.001, 0.01], "the learning rate from 0.001 to 0.01"),
    ([0.001, None, 0.01], "the learning rate from 0.001 to 0.01"),  # not measured at a step
    ([0.001, 0.01, math.inf], "the learning rate from 0.001 to 0.01"),  # an infinite or NaN one is no value
    ([0.001, 0.01, math.nan], "the learning rate from 0.001 to 0.01"),
    ([0.0, 0.0, 5.0], None), ([None, None, 5.0], None),
])
def test_a_rise_is_between_the_first_and_last_positive_finite_values(values, said):
    precursors = [replace(p, learning_rate=v) for p, v in zip(drifting(2, 3, 4), values)]
    r = report(event(), samples=batch_wide(compared_fails=True, compared_step=4), precursors=precursors)
    text = [s for s in findings(r) if s.startswith("Step 5")][0]
    assert text.endswith(f". Over steps 2-4 this rose: {said}." if said else "; no precursor rose 10-fold over steps 2-4.")


def test_the_largest_activation_is_a_fraction_of_the_last_steps_dtype():
    precursors = [replace(p, activation_headroom=h, activation_dtype=d) for p, h, d in
                  zip(drifting(1, 2, 3, 4), (0.001, 0.01, 0.02, 0.5), ("float32", "float16", "float32", "bfloat16"))]
    r = report(event(), samples=batch_wide(status="coupled", coupled_groups=[[0, 1]]), precursors=precursors)
    assert [s for s in findings(r) if s.startswith("Step 5's batch holds")] == [
        "Step 5's batch holds no data defect and its failure needs samples together ([0, 1]); over steps 1-4 before it "
        "this rose: the largest activation from 0.001 to 0.5 of bfloat16's largest value."]
    precursors = [replace(p, grad_norm=n) for p, n in zip(precursors, (1.0, 2.0, 5.0, 50.0))]
    r.precursors = precursors
    assert [s for s in findings(r) if s.startswith("Step 5's batch holds")] == [
        "Step 5's batch holds no data defect and its failure needs samples together ([0, 1]); over steps 1-4 before it "
        "these rose: the gradient norm from 1 to 50 and the largest activation from 0.001 to 0.5 of bfloat16's largest "
        "value."]


def test_the_first_steps_state_is_judged_by_its_own_events_not_a_later_steps():
    r = report(event())
    r.events = [state(5, "exp_avg_sq"), Event(5, "grad", "fc.weight", [0], "nan"), state(7, "exp_avg_sq", "nan")]
    assert [s for s in findings(r) if s.startswith("From step")] == [
        f"From step 5 the optimizer state holds infinities in exp_avg_sq (3 values in 2 tensors); {STAYED}. {FROZEN}"]


def test_narrate_names_every_event_the_views_show():
    """Each event of the report, the origin (a separate object once a saved report is read back), and the overflows
    the scaler caught and the one that poisoned its state get their words; the headline and the reproduction too."""
    caught, poisoned = Event(3, "grad", "fc.bias", [1], "inf"), Event(6, "optimizer_state", "fc.bias", [1], "nan",
                                                                     state_key="exp_avg_sq")
    for amp in (None, AmpReport("float16", "float32", True, [], [caught], None),
                AmpReport("float16", "float32", True, [], [caught], poisoned)):
        r = report(replace(event()), amp=amp)  # the origin a copy of events[0], not the same object
        r.events = [event(), param(6)]
        narrate(r)
        assert [e.text for e in r.events] == ["grad fc.weight[1, 2] = nan", "param fc.weight[0] = nan"]
        assert r.origin.text == "grad fc.weight[1, 2] = nan"
        if amp is not None:
            assert caught.text == "grad fc.bias[1] = inf"
        if amp is not None and amp.state_poisoned_by is not None:
            assert poisoned.text == "optimizer_state exp_avg_sq of fc.bias[1] = nan"
        assert (r.headline, r.reproduction) == (headline(r), reproduction(r))
    r = narrate(report())  # no origin, no scaler
    assert r.headline == "steps 2-8 replayed, all finite" and r.spread_map is not None


@pytest.mark.parametrize("ranges, said", [
    ([["-inf", "3"]], "[-inf, 3]"), ([["nan", "nan"]], "[nan, nan] (all nan)"), ([["inf", "inf"]], "[inf, inf] (all inf)"),
    ([["1", "1"]], "[1, 1]"), ([["nan", "inf"]], "[nan, inf]"),
])
def test_the_input_elements_at_the_coordinate_are_all_one_value_only_where_both_ends_are(ranges, said):
    sentence = operation_sentence(OperationCulprit(LOG, "nan", [0], inputs_at_index=ranges))
    assert f"; the input elements that coordinate was computed from ranged over {said}." in sentence


def test_the_outputs_are_said_only_where_there_are_several():
    one = replace(LOG, output_ranges=[["nan", "1"]])
    assert "its outputs ranged" not in operation_sentence(OperationCulprit(one, "nan", [0]))
    two = replace(LOG, output_ranges=[["nan", "1"], ["0", "0"]])
    assert "; its outputs ranged over [nan, 1], [0, 0]." in operation_sentence(OperationCulprit(two, "nan", [0]))


def test_a_loss_only_step_the_spread_does_not_hold_is_said_non_finite():
    r = loss_only_report(None, [3, 5])
    r.spread = [x for x in r.spread if x.step != 3]
    assert [x for x in findings(r) if x.startswith("The loss was")][0].startswith(
        "The loss was NaN at steps 3, 5, but no gradient")
    r.spread = [x for x in r.spread if x.step != 5]
    assert [x for x in findings(r) if x.startswith("The loss was")][0].startswith(
        "The loss was non-finite at steps 3, 5, but no gradient")


def test_the_last_of_three_checkpoints_is_the_one_named():
    exact = [compared(n) for n in (2, 4, 6)]
    r = report(event(), loss_max_ulps=3, checkpoints_compared=exact)
    assert [x for x in findings(r) if x.startswith("Replayed losses")][0].endswith(
        "the state is bit-exact at step 6, so that is the loss's own rounding (its reduction summed in another order), "
        "not a divergence.")
    r.checkpoints_compared = [within(n, rounded=1) for n in (2, 4, 6)]
    assert [x for x in findings(r) if x.startswith("Replayed losses")][0].endswith(
        "; the state matches the recorded one within tolerance at step 6.")
