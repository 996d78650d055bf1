"""What-if replays: each change to the responsible step, replayed from the checkpoint, with its known outcome."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from nanforensics import BadInput
from nanforensics.replay import whatif
from nanforensics.replay.engine import ReplayOptions, replay_run
from nanforensics.replay.session import pinned_threads
from nanforensics.report import to_json
from nanforensics.runs.run import Run, UserCode

import scenarios
from conftest import DEFECT_STEP, assert_one_line_error, run_cli, tree_digest

SEED_SAMPLE = Path(__file__).resolve().parent.parent / "sample_runs" / "seed_adam"
ALL = ["skip", "skip-after-moments", "clip=1", "reset-state", "lr=1e-4", f"drop-samples={scenarios.DEFECT_SAMPLE}",
       "drop-batch"]


def _what_if(run: Path, *specs: str) -> dict[str, dict]:
    before = tree_digest(run)
    report = replay_run(run, ReplayOptions(device="cpu", explain=False, what_if=[whatif.parse(s) for s in specs]))
    assert tree_digest(run) == before
    return {w.intervention: vars(w) for w in report.what_if}


def test_every_what_if_on_the_seed_case_through_the_cli(runs):
    run = runs["adam_near_zero"]
    before = tree_digest(run)
    result = run_cli("replay", run, "--json", "-", "--no-explain", *[a for s in ALL for a in ("--what-if", s)])
    assert tree_digest(run) == before
    assert result.code == 1, result.stderr
    r = result.json()
    w = {x["intervention"]: x for x in r["what_if"]}
    assert list(w) == ["none", *ALL]
    assert all((x["step"], x["last_step"]) == (DEFECT_STEP, DEFECT_STEP + 5) for x in w.values())
    finite = {name for name, x in w.items() if x["finite"]}
    assert finite == {"skip", "reset-state", f"drop-samples={scenarios.DEFECT_SAMPLE}", "drop-batch"}
    # as recorded, and with the guard that acts after the moments: each replay's origin is the gradient at step t
    for name in ("none", "skip-after-moments", "clip=1", "lr=1e-4"):
        assert (w[name]["first_nonfinite_step"], w[name]["first_nonfinite"]) == (DEFECT_STEP, "grad features.gain")
    assert w["none"]["first_nonfinite_loss_step"] == DEFECT_STEP + 1
    assert w["skip-after-moments"]["first_nonfinite_loss_step"] == DEFECT_STEP + 2  # parameters restored, once
    assert "clipping made 1 infinite gradient value NaN" in w["clip=1"]["detail"]
    assert w["reset-state"]["detail"] == "zeroed the optimizer state of 1 coordinate, put back 1 parameter value"
    assert w["drop-batch"]["losses"][0] is None and all(x == x for x in w["drop-batch"]["losses"][1:])
    assert any(f.startswith(f"What-if at step {DEFECT_STEP}") for f in r["findings"])
    # the findings of this run, each the case that occurred (tests/test_findings.py has the other cases)
    [state] = [f for f in r["findings"] if f.startswith(f"From step {DEFECT_STEP} the optimizer state holds")]
    assert "infinities in exp_avg (1 value in 1 tensor) and exp_avg_sq (1 value in 1 tensor)" in state
    assert f"the parameters turned non-finite at step {DEFECT_STEP}" in state and "inf/inf = NaN" in state
    assert "frozen" not in state
    assert any(f.startswith("Skipping the step after optimizer.step() has written the state would not have saved")
               for f in r["findings"])
    assert any("NaN at step 18, 1 step later;" in f for f in r["findings"])  # not "1 step(s)"
    assert "Gradient clipping would not have rescued this: the total gradient norm is inf, so the clip factor " \
           "max_norm/inf is 0, and 0*(-inf) = NaN." in r["findings"]
    assert w["clip=1"]["detail"].startswith("total gradient norm inf: the clip factor 1/inf is 0, and 0*inf = NaN, "
                                            "so clipping made 1 infinite gradient value NaN and zeroed the other ")


def test_seed_sample_skip_survives_skip_after_moments_and_clip_do_not():
    w = _what_if(SEED_SAMPLE, "skip", "skip-after-moments", "clip=1")
    assert (w["none"]["step"], w["none"]["finite"]) == (27, False)
    assert w["skip"]["finite"] is True and w["skip"]["losses"][-1] == w["skip"]["losses"][-1]
    assert w["skip-after-moments"]["finite"] is False and w["skip-after-moments"]["first_nonfinite_step"] == 27
    assert w["clip=1"]["finite"] is False and w["clip=1"]["detail"].startswith("total gradient norm inf")


def test_clip_bounds_a_large_finite_gradient(runs):
    w = _what_if(runs["fp16_adam_state_overflow"], "clip=1")
    assert (w["none"]["finite"], w["none"]["first_nonfinite"]) == (False, "optimizer_state exp_avg_sq of head.weight")
    assert w["clip=1"]["finite"] is True
    norm = float(w["clip=1"]["detail"].split()[3].rstrip(","))
    assert 1e3 < norm < 65504 and w["clip=1"]["detail"].endswith("scaled down to 1")


def test_what_ifs_share_nothing(runs):
    run = Run(runs["adam_near_zero"])
    code, checkpoint = UserCode.load(run), run.checkpoints()[1]
    with pinned_threads(run.manifest.num_threads):
        a = whatif.what_if_replays(run, code, checkpoint, torch.device("cpu"), DEFECT_STEP,
                                   [whatif.parse("skip-after-moments"), whatif.parse("skip")], 3)
        b = whatif.what_if_replays(run, code, checkpoint, torch.device("cpu"), DEFECT_STEP,
                                   [whatif.parse("skip"), whatif.parse("skip-after-moments")], 3)
    assert to_json(a) == to_json([b[0], b[2], b[1]])  # NaN losses compare equal as JSON text


@pytest.mark.parametrize("spec, problem", [
    ("clip", "cannot read"), ("clip=-1", "positive"), ("clip=nan", "positive"), ("lr=x", "not a number"),
    ("drop-samples=a,b", "positions"), ("drop-samples=-1", "start at 0"), ("skip=3", "cannot read"),
])
def test_unreadable_interventions(spec, problem):
    with pytest.raises(BadInput, match=problem) as e:
        whatif.parse(spec)
    assert e.value.where == "--what-if"


def test_bad_what_if_is_a_one_line_error(runs):
    assert_one_line_error(run_cli("replay", runs["adam_near_zero"], "--what-if", "rewind"), "--what-if", "rewind")


def test_what_ifs_need_a_responsible_step(runs):
    report = replay_run(runs["clean"], ReplayOptions(device="cpu", what_if=[whatif.parse("skip")]))
    assert report.verdict == "clean" and report.what_if == []
    assert report.findings[-1].startswith("What-if replays not run")
