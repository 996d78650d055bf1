"""Mixed precision on CPU: scaler and scheduler recorded and replayed bit-exactly, the scaler reported as a
control loop, its caught overflows kept apart from the failure that reaches the optimizer state."""

from __future__ import annotations

import pytest
import torch
from nanforensics import Recorder
from nanforensics.replay.engine import ReplayOptions, replay_run
from nanforensics.replay.session import Session
from nanforensics.runs.checkpoint import Checkpoint, save_checkpoint
from nanforensics.runs.run import Run, UserCode

import scenarios
from conftest import DEFECT_STEP, run_cli, tree_digest


def _replay(run):
    before = tree_digest(run)
    report = replay_run(run, ReplayOptions(device="cpu", explain=False))
    assert tree_digest(run) == before
    return report


def test_scaler_that_catches_every_overflow_is_clean(runs, tmp_path):
    run, md = runs["fp16_scaler_catches"], tmp_path / "report.md"
    before = tree_digest(run)
    result = run_cli("replay", run, "--json", "-", "--markdown", md)
    assert tree_digest(run) == before
    assert result.code == 0, result.stderr
    r = result.json()
    # the nano-unit sample overflowed the fp16 forward: its logged loss is NaN, and the replay says why that is fine
    assert r["logged_first_nonfinite_loss_step"] == DEFECT_STEP
    assert (r["verdict"], r["events"], r["state_poisoned"], r["reproduced"]) == ("clean", [], False, True)
    amp = r["amp"]
    assert (amp["autocast"], amp["scaler"], amp["state_poisoned_by"]) == ("float16", True, None)
    steps = {s["step"]: s for s in amp["steps"]}
    assert sorted(steps) == list(range(10, 24))  # every replayed step, from checkpoint 10
    ordered = [steps[k] for k in sorted(steps)]
    assert all(a["next_scale"] == b["scale"] for a, b in zip(ordered, ordered[1:]))  # one control loop
    skipped = [s["step"] for s in ordered if s["skipped"]]
    assert skipped == [e["step"] for e in amp["caught"]] and DEFECT_STEP in skipped
    assert all(steps[s]["caught"] and steps[s]["adjustment"] == "backoff" for s in skipped)
    # a forward overflow (an activation past 65504) told apart from one only the scaled backward hit
    assert steps[DEFECT_STEP]["overflow"] == "forward"
    assert [s["overflow"] for s in ordered if s["skipped"] and s["step"] != DEFECT_STEP] == ["backward"]
    assert any(s["adjustment"] == "growth" for s in ordered)
    assert any("caught 2 overflows" in f and "65504" in f and "each step was skipped" in f for f in r["findings"])
    # the caught NaN loss is not called "no non-finite value" (tests/test_findings.py has the clean run's sentence)
    assert r["findings"][0] == (f"No non-finite value reached the optimizer state or the parameters over steps "
                                f"10-23: the non-finite values met at steps 14, {DEFECT_STEP} were overflows the "
                                f"scaler caught (the non-finite loss logged at step {DEFECT_STEP} among them).")
    assert any(f.endswith("backed off at steps 14, 17, grew at steps 13, 22.") for f in r["findings"])
    text = md.read_text()
    assert "### Mixed precision" in text and f"| {DEFECT_STEP} | " in text and "caught: state intact" in text
    # the nano-unit sample is a data defect in the JSON, and the view renders it from the report
    [d] = [d for d in r["data_defects"] if d["step"] == DEFECT_STEP]
    assert d["kind"] == "extreme" and (f"`step {DEFECT_STEP}  batch['x'][{scenarios.DEFECT_SAMPLE}, 0] = {d['value']}  "
                                       f"extreme ({d['count']} such values)`") in text


def test_fp16_without_scaler_poisons_the_state_from_the_backward(runs):
    r = _replay(runs["fp16_backward_overflow"])
    assert (r.verdict, r.responsible_step, r.reproduced) == ("nonfinite", DEFECT_STEP, True)
    assert r.origin.stage == "grad" and r.state_poisoned
    assert r.amp is not None and (r.amp.autocast, r.amp.scaler, r.amp.caught) == ("float16", False, [])
    assert (r.amp.state_poisoned_by.step, r.amp.state_poisoned_by.stage) == (DEFECT_STEP, "optimizer_state")
    step = next(s for s in r.amp.steps if s.step == DEFECT_STEP)
    assert (step.overflow, step.skipped, step.caught) == ("backward", False, False)
    assert any("backward overflow: the forward and the loss stayed within float16" in f and "No GradScaler" in f
               for f in r.findings)


def test_fp16_forward_overflow_is_told_apart(runs):
    r = _replay(runs["fp16_activation_overflow"])
    step = next(s for s in r.amp.steps if s.step == DEFECT_STEP)
    assert step.overflow == "forward" and r.origin.stage == "forward" and r.origin.dtype == "float16"
    assert any("forward overflow: an activation past float16's largest value, 65504" in f for f in r.findings)


def test_bf16_autocast_replays_bit_exact(runs):
    r = _replay(runs["bf16_near_zero"])
    assert (r.verdict, r.responsible_step, r.reproduced, r.amp.autocast) == ("nonfinite", DEFECT_STEP, True, "bfloat16")
    assert all(s.logged_loss == s.replayed_loss for s in r.spread if s.logged_loss == s.logged_loss)  # not NaN
    assert (r.origin.tensor, r.origin.index) == ("features.gain", [scenarios.DEFECT_FEATURE])


def test_half_precision_model_overflows_adams_second_moment(runs):
    r = _replay(runs["fp16_adam_state_overflow"])
    assert (r.amp.param_dtype, r.amp.autocast) == ("float16", None)
    assert (r.origin.stage, r.origin.state_key, r.origin.value) == ("optimizer_state", "exp_avg_sq", "inf")
    assert r.amp.state_poisoned_by == r.origin


def test_scaler_and_scheduler_state_restored_at_a_checkpoint(runs):
    run = Run(runs["fp16_scaler_catches"])
    assert run.manifest.raw["scaler"] == {"enabled": True}
    assert run.manifest.raw["scheduler"] == {"factory": "scenarios:cosine_lr"}
    checkpoint = run.checkpoints()[1]
    meta = checkpoint.meta()
    session = Session(run, UserCode.load(run), checkpoint, torch.device("cpu"))
    assert session.scaler.get_scale() == meta["scaler"]["scale"] and session.scaler.get_scale() != 2.0 ** 24
    # the schedule waits on the steps the scaler skipped (train_step_amp), so it lags the step count
    assert session.scheduler.last_epoch == meta["scheduler"]["last_epoch"] < checkpoint.step
    assert [g["lr"] for g in session.optimizer.param_groups] == session.scheduler.get_last_lr() == \
        meta["scheduler"]["_last_lr"]


def test_scheduler_state_with_inf_and_tensors_round_trips(tmp_path):
    model = scenarios.build_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer)  # best = inf until a first value
    plateau.window = torch.tensor([0.5, float("nan")])                # a tensor in the state_dict
    folder = save_checkpoint(tmp_path, 3, model, optimizer, scheduler=plateau)
    assert (folder / "extras.safetensors").exists()
    fresh = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, patience=99)
    Checkpoint(folder, 3).load_into(model, optimizer, scheduler=fresh)
    assert fresh.best == float("inf") and fresh.patience == 10
    assert torch.equal(fresh.window.nan_to_num(), torch.tensor([0.5, 0.0]))


def test_scheduler_needs_its_factory(tmp_path):
    model = scenarios.build_model()
    optimizer = torch.optim.Adam(model.parameters())
    with pytest.raises(ValueError, match="scheduler_factory"):
        Recorder(tmp_path / "r", model, optimizer, model_factory=scenarios.build_model, step_fn=scenarios.train_step,
                 scheduler=scenarios.cosine_lr(optimizer))
