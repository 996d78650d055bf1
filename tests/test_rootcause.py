"""Root cause inside the responsible step: operation, samples, data, precursors — each scenario from a real
forward/backward with its known answer."""

from __future__ import annotations

import math

import pytest
import torch
from nanforensics.replay.engine import ReplayOptions, replay_run
from nanforensics.replay.session import Session, pinned_threads
from nanforensics.report import ReplayReport
from nanforensics.runs.run import Run, UserCode

import scenarios
from conftest import DEFECT_STEP, run_cli

S, F = scenarios.DEFECT_SAMPLE, scenarios.DEFECT_FEATURE


@pytest.fixture(scope="module")
def reports(runs) -> dict[str, ReplayReport]:
    names = ["adam_near_zero", "masked_log_zero", "logcosh_overflow", "fp16_activation_overflow", "nan_in_data",
             "batchnorm_near_zero", "adam_state_overflow"]
    return {n: replay_run(runs[n], ReplayOptions(device="cpu")) for n in names}


def _session_before_defect(run_dir) -> Session:
    run = Run(run_dir)
    session = Session(run, UserCode.load(run), run.checkpoints()[1], torch.device("cpu"))
    session.advance_to(DEFECT_STEP)
    return session


@pytest.mark.filterwarnings("ignore:Anomaly Detection")
def test_backward_only_inf_is_traced_to_the_forward_op_and_module(reports, runs):
    op = reports["adam_near_zero"].operation
    assert op is not None
    assert (op.site.op, op.site.phase, op.autograd_node) == ("aten::div.Tensor", "backward", "LogBackward0")
    assert op.output_value in ("inf", "-inf") and op.output_index == [S, F]
    assert op.forward is not None and op.forward.op == "torch.log" and op.forward.module == "features"
    assert "scenarios.py" in op.forward.source and "in forward" in op.forward.source
    assert float(op.forward.input_ranges[0][0]) < 1e-44  # the near-zero reading that log's backward divides by
    # detect_anomaly on the same step: it checks backward outputs for NaN only, and this gradient is -inf,
    # so it names nothing; the step completes and the NaN appears later, in Adam's update.
    session = _session_before_defect(runs["adam_near_zero"])
    with pinned_threads(2), torch.autograd.detect_anomaly(check_nan=True):
        session.run_step()
    assert torch.isnan(session.model.features.gain).any()


@pytest.mark.filterwarnings("ignore")  # anomaly mode prints the forward traceback as a warning
def test_masked_log_of_zero_names_the_log_where_detect_anomaly_names_only_its_backward(reports, runs):
    r = reports["masked_log_zero"]
    assert (r.origin.stage, r.origin.tensor, r.origin.index, r.origin.value) == ("grad", "features.gain", [F], "nan")
    op = r.operation
    # torch.where hides log(0) = -inf from the forward outputs; its gradient is 0/0 = NaN
    assert (op.site.op, op.site.phase, op.site.module) == ("aten::log.default", "forward", "features")
    assert op.output_value == "-inf" and op.output_index == [S, F]
    assert op.site.input_ranges[0][0] == "0"
    session = _session_before_defect(runs["masked_log_zero"])
    with pytest.raises(Exception) as caught, pinned_threads(2), torch.autograd.detect_anomaly(check_nan=True):
        session.call_step(session.batch(DEFECT_STEP))
    message = str(caught.value)
    assert "LogBackward0" in message and "features" not in message  # the op, no module: ours names both


def test_exp_overflow_in_a_custom_loss_outside_any_module(reports):
    r = reports["logcosh_overflow"]
    assert r.origin.stage == "loss"
    op = r.operation
    assert (op.site.op, op.site.phase, op.site.module, op.output_value) == ("aten::cosh.default", "forward", None, "inf")
    assert "train_step_logcosh" in op.site.source
    assert float(op.site.input_ranges[0][1]) > 89  # cosh overflows fp32 past 89


def test_fp16_activation_overflow_under_autocast(reports):
    r = reports["fp16_activation_overflow"]
    assert (r.origin.stage, r.origin.tensor) == ("forward", "act")
    op = r.operation
    assert (op.site.op, op.site.module, op.site.output_dtypes, op.output_value) == (
        "aten::pow.Tensor_Scalar", "act", ["float16"], "inf")
    assert op.output_index[0] == S
    assert 255 < float(op.site.input_ranges[0][1]) < 65504  # finite in fp16, its square is not
    headroom = [p.activation_headroom for p in r.precursors if p.step == DEFECT_STEP - 1][0]
    assert headroom is not None and headroom < 1  # the step before was still inside fp16's range


def test_nan_in_input_data_is_a_data_defect(reports):
    r = reports["nan_in_data"]
    [defect] = [d for d in r.data_defects if d.kind == "nonfinite"]
    assert (defect.step, defect.tensor, defect.index, defect.value) == (DEFECT_STEP, "batch['x']", [S, F], "nan")
    assert defect.file.endswith(f"step_{DEFECT_STEP:08d}.safetensors")
    assert r.operation is None  # no operation made it: it was in the data
    assert r.samples.samples == [S]
    assert any(f.startswith("Data: the batch of step 17 holds a non-finite value") for f in r.findings)


def test_one_bad_sample_among_64_in_logarithmic_passes(reports):
    s = reports["adam_near_zero"].samples
    assert (s.status, s.batch_size, s.samples) == ("attributed", 64, [S])
    assert s.sample_leaves == {"batch['ids']": [f"s{DEFECT_STEP:05d}-{S:02d}"]}
    assert s.passes <= 1 + 2 * math.ceil(math.log2(64))


def test_batchnorm_failure_is_reported_as_coupled_not_guessed(reports):
    s = reports["batchnorm_near_zero"].samples
    assert s.status == "coupled" and s.samples == []
    assert any(S in group for group in s.coupled_groups)
    assert "fail only together" in s.message


def test_optimizer_only_failure_is_not_blamed_on_samples(reports):
    r = reports["adam_state_overflow"]
    assert r.samples.status == "not_reproduced"
    assert r.operation.site.phase == "optimizer"
    assert [d.kind for d in r.data_defects if d.step == DEFECT_STEP] == ["extreme"]


def test_precursors_cover_the_window_and_show_the_event(reports):
    r = reports["adam_near_zero"]
    steps = [p.step for p in r.precursors]
    # From checkpoint 0, not the start checkpoint 10: that would leave 7 steps before the event, too few for a drift.
    assert steps == list(range(0, steps[-1] + 1)) and steps[-1] >= DEFECT_STEP + 1
    before = [p for p in r.precursors if p.step < DEFECT_STEP]
    assert all(math.isfinite(p.grad_norm) and math.isfinite(p.state_max_abs["exp_avg_sq"]) for p in before)
    at = next(p for p in r.precursors if p.step == DEFECT_STEP)
    assert math.isinf(at.grad_max_abs) and at.activation_max_abs > 100  # log(3e-45) = -103 in the activations


def test_step_function_can_opt_out_of_splitting(runs, monkeypatch):
    monkeypatch.setattr(scenarios.train_step, "nanforensics_splittable", False, raising=False)
    r = replay_run(runs["adam_near_zero"], ReplayOptions(device="cpu"))
    assert r.samples.status == "opted_out" and "opted out" in r.samples.message


def test_cli_explain_switch(runs):
    on = run_cli("replay", runs["adam_near_zero"], "--json", "-").json()
    off = run_cli("replay", runs["adam_near_zero"], "--json", "-", "--no-explain").json()
    assert on["operation"]["site"]["op"] == "aten::div.Tensor" and on["samples"]["samples"] == [S]
    assert off["operation"] is None and off["samples"] is None
    assert off["data_defects"] == on["data_defects"] and off["responsible_step"] == on["responsible_step"]
