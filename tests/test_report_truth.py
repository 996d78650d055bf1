"""The report stays true where the NaN loss comes late, where the step function's own code runs after the update,
where a precursor spiked for one step, and where a loss-only step is the first sign of a failure (issue 20): each
on a small real model recorded with the project's recorder, each sentence checked where it holds and where not."""

from __future__ import annotations

import functools
import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from nanforensics import Recorder
from nanforensics.replay.engine import ReplayOptions, replay_run
from nanforensics.report import ReplayReport, to_json
from nanforensics.rootcause.precursors import PrecursorProbe
from nanforensics.runs.run import Run

import truth_models as tm
from conftest import ROOT, run_cli

LATE = 13  # the step whose batch first looks up the embedding row AdamW(eps=0) made NaN at step 0
PAD_FROM = 7  # the first step whose batch holds the padding token the renormalisation divides by a zero norm
LONG_AT = 6  # the step whose batch is one long packed document


def _one(findings: list[str], needle: str) -> str:
    [found] = [f for f in findings if needle in f]
    return found


def _embedding_run(path: Path, late: int, steps: int) -> Path:
    model = tm.build_regressor()
    tm.record(path, model, tm.adamw_eps0(model), tm.train_step_regress, functools.partial(tm.token_batch, late=late),
              steps, factory=tm.build_regressor)
    return path


@pytest.fixture(scope="module")
def late_nan(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _embedding_run(tmp_path_factory.mktemp("late") / "run", LATE, LATE + 2)


@pytest.fixture(scope="module")
def reports(tmp_path_factory: pytest.TempPathFactory) -> dict[str, ReplayReport]:
    """One replay per run, as the library gives it (the CLI's JSON is this report serialised)."""
    root = tmp_path_factory.mktemp("truth")
    runs: dict[str, Path] = {"next_step": _embedding_run(root / "next_step", 1, 4)}
    model = tm.build_regressor(padding_idx=0)
    tm.record(root / "renorm", model, tm.adam(model), tm.train_step_renormalised,
              functools.partial(tm.token_batch, pad_from=PAD_FROM), PAD_FROM + 3, factory=tm.build_regressor,
              model_kwargs={"padding_idx": 0})
    runs["renorm"] = root / "renorm"
    for name, scheduler, steps in (("spike", tm.one_step_spike, tm.SPIKE_STEP + 4), ("doubling", tm.doubling, 22)):
        model = tm.build_mlp()
        tm.record(root / name, model, tm.adam_mlp(model), tm.train_step_scheduled, tm.regression_batch, steps,
                  factory=tm.build_mlp, scheduler=scheduler)
        runs[name] = root / name
    for name, defect in (("rnn_long", "long"), ("rnn_no_labels", "no_labels")):
        model = tm.build_rnn_lm()
        tm.record(root / name, model, tm.sgd_momentum(model), tm.train_step_lm,
                  lambda s, d=defect: tm.lm_batch(s, d if s == LONG_AT else None), LONG_AT + 3,
                  factory=tm.build_rnn_lm)
        runs[name] = root / name
    return {name: replay_run(path, ReplayOptions(device="cpu")) for name, path in runs.items()}


# -- 1. the replay runs through the run's own NaN loss ----------------------------------------------------------

def test_a_nan_row_unread_for_many_steps_is_replayed_up_to_the_logged_nan_loss(late_nan, tmp_path):
    out = tmp_path / "r.json"
    result = run_cli("replay", late_nan, "--json", out, "--no-explain")
    assert result.code == 1, result.stderr
    r = json.loads(out.read_text())
    assert (r["responsible_step"], r["origin"]["stage"], r["origin"]["tensor"], r["origin"]["value"]) == (
        0, "param", "emb.weight", "nan")
    assert r["origin"]["index"][0] >= tm.USED  # a row no batch looked up: its gradient was exactly zero
    assert r["logged_first_nonfinite_loss_step"] == r["first_nonfinite_loss_step"] == LATE
    assert r["setup"]["last_step"] >= LATE and r["state_poisoned"] and r["reproduced"]
    state = [e for e in r["events"] if e["stage"] == "optimizer_state"]
    assert min(e["step"] for e in state) == LATE  # the state took the NaN when the row was first used
    assert not any(e["stage"] in ("forward", "loss") for e in r["events"] if e["step"] < LATE)
    sentence = _one(r["findings"], "went NaN at step 0")
    assert sentence.startswith(f"Param emb.weight[{r['origin']['index'][0]}, 0] went NaN at step 0, but no module "
                               f"output and no loss held a non-finite value at steps 1-{LATE - 1}: the forward first "
                               f"carries it at step {LATE}")
    assert "forward emb[" in sentence and "the logged loss first shows NaN there too" in sentence
    # without the operation trace, which code wrote the parameter is not known: both are said
    assert "optimizer.step() or the step function's own code after it produced it" in r["findings"][0]
    assert any(f.startswith(f"From step {LATE} the optimizer state holds NaN") and "a consequence rather than the "
               "origin" in f for f in r["findings"]), r["findings"]
    assert not any("ended at step" in f for f in r["findings"])


def test_max_steps_still_bounds_the_replay_and_the_report_says_what_it_missed(late_nan, tmp_path):
    out = tmp_path / "r.json"
    result = run_cli("replay", late_nan, "--json", out, "--max-steps", "5", "--no-explain")
    assert result.code == 1, result.stderr
    r = json.loads(out.read_text())
    assert (r["setup"]["last_step"], r["first_nonfinite_loss_step"], r["state_poisoned"]) == (4, None, False)
    assert _one(r["findings"], "The replay ended").startswith(
        f"The replay ended at step 4, before the logged loss first shows NaN (step {LATE}): the replayed loss, the "
        "optimizer state and the reproduction are judged over steps 0-4 only.")
    assert not any("the forward first carries it" in f for f in r["findings"])


def test_a_nan_row_read_at_the_next_step_needs_no_unread_sentence(reports):
    r = reports["next_step"]
    assert (r.responsible_step, r.origin.stage, r.first_nonfinite_loss_step) == (0, "param", 1)
    assert not any("went NaN at step 0, but no module output" in f for f in r.findings), r.findings
    assert not any("ended at step" in f for f in r.findings)


# -- 2. the step function's own code after optimizer.step() is its own phase --------------------------------------

def test_renormalising_rows_after_the_update_is_named_as_the_users_code_after_it(reports):
    r = reports["renorm"]
    data = json.loads(to_json(r))
    assert (data["responsible_step"], data["origin"]["stage"], data["origin"]["tensor"], data["origin"]["index"][0]) \
        == (PAD_FROM, "param", "emb.weight", 0)
    site = data["operation"]["site"]
    assert (site["phase"], site["op"], site["module"]) == ("after_update", "aten::div.Tensor", None)
    line = next(i for i, text in enumerate(Path(tm.__file__).read_text().splitlines(), 1)
                if "w[rows] / w[rows].norm" in text)
    assert site["source"] == f"tests/truth_models.py:{line} in train_step_renormalised"
    assert r.findings[0] == (
        f"Origin: step {PAD_FROM}, param emb.weight[0, 0] = nan (float32): gradients and optimizer state were finite; "
        f"the step function's own code produced it after the update: aten::div.Tensor at {site['source']}, which ran "
        "after optimizer.step() returned.")
    assert _one(r.findings, "Operation:").startswith("Operation: the step function's own code after optimizer.step(), "
                                                     "aten::div.Tensor outside any module")
    assert not any("the parameter update itself" in f for f in r.findings)


def test_an_update_that_makes_the_nan_itself_is_named_as_the_optimizer(reports):
    r = reports["next_step"]
    assert r.operation.site.phase == "optimizer"
    assert "the parameter update itself (optimizer.step()) produced it" in r.findings[0]
    assert not any("after optimizer.step()" in f for f in r.findings if f.startswith(("Origin", "Operation")))


# -- 3. precursors: a one-step spike; norms that do not overflow in the tool ----------------------------------

def test_a_learning_rate_that_spiked_for_one_step_is_named_with_its_step(reports):
    r = reports["spike"]
    assert r.origin is not None and r.origin.step > tm.SPIKE_STEP
    lr = {p.step: p.learning_rate for p in r.precursors}
    assert (lr[tm.SPIKE_STEP - 1], lr[tm.SPIKE_STEP], lr[tm.SPIKE_STEP + 1]) == pytest.approx((0.05, 5e4, 0.05))
    gap = r.origin.step - tm.SPIKE_STEP
    sentence = _one(r.findings, "one-step spike")
    assert sentence.startswith(f"At step {tm.SPIKE_STEP}, {gap} step{'s' * (gap != 1)} before the origin, the "
                               "learning rate jumped to 5e+04, 1e+06 times its value at the steps either side (at "
                               "most 0.05)")
    assert f"fell back at step {tm.SPIKE_STEP + 1}" in sentence


def test_a_learning_rate_that_rose_step_by_step_is_no_spike(reports):
    r = reports["doubling"]
    assert r.origin is not None
    lr = [p.learning_rate for p in r.precursors if p.step < r.origin.step]
    assert lr[-1] >= 100 * lr[0]  # it rose far, but never a hundredfold in one step
    assert not any("spike" in f for f in r.findings), r.findings


@settings(max_examples=25, deadline=None)
@given(st.lists(st.floats(min_value=1e-10, max_value=3e38), min_size=1, max_size=4))
def test_the_gradient_norm_of_finite_gradients_is_finite_and_exact(magnitudes):
    """float32 squares overflow past 1.8e19: a norm of finite gradients must still come out finite and right."""
    model = torch.nn.Linear(len(magnitudes), 1, bias=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    model.weight.grad = torch.tensor([magnitudes], dtype=torch.float32)
    with PrecursorProbe(model, optimizer) as probe:
        optimizer.step()
        p = probe.take(0)
    exact = math.sqrt(math.fsum(float(torch.tensor(m, dtype=torch.float32)) ** 2 for m in magnitudes))
    assert math.isfinite(p.grad_norm) and p.grad_norm == pytest.approx(exact, rel=1e-6)


def test_the_recurrent_lms_gradient_norm_past_float32s_square_reads_finite(reports):
    r = reports["rnn_long"]
    norm = next(p.grad_norm for p in r.precursors if p.step == LONG_AT)
    assert 1.8e19 < norm < 3.4e38  # its square overflows float32; the norm itself does not
    assert json.loads(to_json(r))["precursors"][LONG_AT]["grad_norm"] == norm
    assert "the gradient norm from" in _one(r.findings, "these rose") and "to inf" not in _one(r.findings, "these rose")


# -- 4. a loss-only step is harmless only where the steps after it are -----------------------------------------

def test_a_loss_that_overflows_a_step_before_the_state_is_the_first_sign(reports):
    r = reports["rnn_long"]
    data = json.loads(to_json(r))
    assert (data["loss_only_steps"], data["responsible_step"], data["logged_first_nonfinite_loss_step"]) == (
        [LONG_AT], LONG_AT + 1, LONG_AT)
    assert data["spread"][LONG_AT]["replayed_loss"] == "inf" and data["origin"]["stage"] == "forward"
    sentence = _one(r.findings, f"at step {LONG_AT} before the origin")
    assert sentence.startswith(f"The loss was inf at step {LONG_AT} before the origin, but no gradient, parameter, "
                               "optimizer-state or buffer value was, yet the replay does not show training continuing: "
                               f"the origin follows at step {LONG_AT + 1} with no healthy step between, so the "
                               "non-finite loss was the first sign of that failure. An infinite loss with finite "
                               "gradients is an overflow of large finite values (the largest activation at step")
    assert "could continue" not in sentence and "no valid target" not in sentence


def test_a_loss_only_step_with_healthy_steps_after_it_could_continue(reports):
    r = reports["rnn_no_labels"]
    assert (r.verdict, r.loss_only_steps, r.origin) == ("loss_only", [LONG_AT], None)
    sentence = _one(r.findings, f"at step {LONG_AT}")
    assert sentence.startswith(f"The loss was NaN at step {LONG_AT}, but no gradient, parameter, optimizer-state or "
                               "buffer value was: the non-finite loss never reached the model, so training could "
                               f"continue (the replayed steps after it stayed finite through step {LONG_AT + 2}).")
    assert "first sign" not in sentence and "no valid target" in sentence


# -- 5. gradient accumulation in a plain loop ------------------------------------------------------------------

ACCUM_DEFECT = 5  # the step whose micro-batch 1, sample 2 holds a corrupt target


@pytest.fixture(scope="module")
def accum_script(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The manual's gradient-accumulation script (docs/recording.md), as a user would save it."""
    block = (ROOT / "docs" / "recording.md").read_text().split("```python\n# train_accum.py")[1].split("```")[0]
    folder = tmp_path_factory.mktemp("accum")
    (folder / "train_accum.py").write_text("# train_accum.py" + block)
    return folder


def test_the_manual_accumulation_script_records_and_replays(accum_script):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    subprocess.run([sys.executable, "train_accum.py"], cwd=accum_script, env=env, check=True, timeout=300)
    run = accum_script / "runs" / "accum"
    recorded = Run(run).batch(3)
    assert [sorted(m) for m in recorded["micro_batches"]] == [["ids", "x", "y"]] * 2
    result = run_cli("replay", run, "--json", "-", cwd=accum_script)
    assert result.code == 0, result.stderr
    assert result.json()["verdict"] == "clean"


def test_the_responsible_batch_of_an_accumulated_step_is_the_optimizer_step(accum_script, tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("train_accum", accum_script / "train_accum.py")
    script = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "train_accum", script)  # importable by name, as the recorder stores it
    spec.loader.exec_module(script)
    torch.manual_seed(0)
    model = script.build_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    run = tmp_path / "run"
    with Recorder(run, model, optimizer, model_factory=script.build_model, step_fn=script.train_step,
                  checkpoint_every=10) as rec:
        for step in range(ACCUM_DEFECT + 2):
            batch = {"micro_batches": [script.make_micro_batch(step, k) for k in range(2)]}
            if step == ACCUM_DEFECT:
                batch["micro_batches"][1]["y"][2] = 1e30  # a corrupt target: its squared error overflows
            rec.log(step, batch, script.train_step(model, optimizer, batch))
    r = json.loads(to_json(replay_run(run, ReplayOptions(device="cpu", code_paths=[accum_script]))))
    assert r["responsible_step"] == r["responsible_batch"]["step"] == ACCUM_DEFECT
    assert r["responsible_batch"]["file"].endswith(f"step_{ACCUM_DEFECT:08d}.safetensors")
    s = r["samples"]
    assert (s["status"], s["batch_size"], s["samples"], s["micro_batch_samples"]) == ("attributed", 8, [6], [[1, 2]])
    assert s["sample_leaves"] == {"batch['micro_batches'][1]['ids']": [f"s{ACCUM_DEFECT}-m1-2"]}
    assert "sample 6 (micro-batch 1, sample 2) of 8" in s["message"]


# -- clipping is claimed only where one gradient coordinate went from inf to NaN -------------------------------

def test_backward_nans_in_another_tensor_are_not_called_clipping(tmp_path, monkeypatch):
    """A diffusion loss weighted by 1/sigma_t^2 meets t = 0 (examples/failures): backward itself makes most
    gradients NaN, the first in backward order is inf, the first in the optimizer's order another tensor's NaN. No
    clipping ran, and the report must not say that the step function turned the inf into NaN."""
    monkeypatch.syspath_prepend(str(ROOT / "examples" / "failures"))
    import diffusion_snr as d

    d.record(str(tmp_path / "run"), steps=d.DEFECT_STEP + 2)
    r = replay_run(tmp_path / "run", ReplayOptions(device="cpu", explain=False))
    at = {e.stage: e for e in r.events if e.step == d.DEFECT_STEP}
    assert (r.responsible_step, r.origin.stage, at["grad"].value, at["optimizer_grad"].value) == (
        d.DEFECT_STEP, "loss", "inf", "nan")
    assert at["grad"].tensor != at["optimizer_grad"].tensor
    assert not any("turned the inf gradient into NaN" in f for f in r.findings), r.findings


# -- "the step, not its data": tested with another batch from the same state -----------------------------------

def test_a_batch_wide_failure_another_batch_survives_is_blamed_on_what_the_batch_shares(tmp_path, monkeypatch):
    """A Mamba-style scan in log space (examples/failures): one long document pads the whole batch to 400 tokens, so
    every sample fails alone; the batch before, run from the same state, does not. Not "the state the run reached"."""
    monkeypatch.syspath_prepend(str(ROOT / "examples" / "failures"))
    import selective_scan as m

    m.record(str(tmp_path / "run"), steps=m.DEFECT_STEP + 2)
    r = replay_run(tmp_path / "run", ReplayOptions(device="cpu"))
    s = json.loads(to_json(r))["samples"]
    assert (r.responsible_step, s["status"], s["compared_step"], s["compared_fails"]) == (
        m.DEFECT_STEP, "batch_wide", m.DEFECT_STEP - 1, False)
    assert _one(r.findings, "fails sample by sample") == (
        f"Most of step {m.DEFECT_STEP}'s batch fails sample by sample, yet the batch of step {m.DEFECT_STEP - 1}, run "
        "from the same state, stays finite: the state the run had reached does not make every batch fail, so what this "
        "batch's samples share (a sequence length or padding, a setting the batch carries) is part of the cause, not "
        "particular samples.")
    assert not any("not its data, is responsible" in f for f in r.findings)


def test_a_batch_wide_failure_another_batch_shares_is_blamed_on_the_state(reports):
    r = reports["rnn_long"]
    assert (r.samples.status, r.samples.compared_step, r.samples.compared_fails) == ("batch_wide", LONG_AT, True)
    assert _one(r.findings, "not its data, is responsible").startswith(
        f"Step {LONG_AT + 1}, not its data, is responsible: most of its batch fails sample by sample, so the cause is "
        "the state the run had reached (its learning rate, its loss scale, or weights grown over many steps), and the "
        f"batch of step {LONG_AT}, run from the same state, fails too.")
