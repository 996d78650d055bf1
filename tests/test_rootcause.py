"""Root cause inside the responsible step: operation, samples, data, precursors — each scenario from a real
forward/backward with its known answer."""

from __future__ import annotations

import copy
import inspect
import math

import pytest
import torch
from nanforensics import Recorder
from nanforensics.replay.engine import ReplayOptions, replay_run
from nanforensics.replay.monitor import StepMonitor
from nanforensics.replay.session import Session, pinned_threads
from nanforensics.report import Event, OperationCulprit, ReplayReport
from nanforensics.rootcause.findings import operation_sentence
from nanforensics.rootcause.operations import trace_step
from nanforensics.rootcause.samples import ALONE_UP_TO, attribute_samples, coupled_text
from nanforensics.runs.run import Run, UserCode

import scenarios
from conftest import DEFECT_STEP, run_cli

S, F = scenarios.DEFECT_SAMPLE, scenarios.DEFECT_FEATURE


@pytest.fixture(scope="module")
def reports(runs) -> dict[str, ReplayReport]:
    names = ["adam_near_zero", "masked_log_zero", "logcosh_overflow", "fp16_activation_overflow", "nan_in_data",
             "batchnorm_near_zero", "adam_state_overflow", "clipped_near_zero", "decoder_fully_padded"]
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
    assert "regressor.py" in op.forward.source and "in forward" in op.forward.source
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
    assert s.passes <= 2 + 2 * math.ceil(math.log2(64))  # the whole batch, one sample probed alone, the halving
    # above ALONE_UP_TO: found by group testing, and the message says how far that goes
    assert s.judged == "group_testing" and 64 > ALONE_UP_TO
    assert s.message == (f"sample {S} of 64 produces the non-finite value alone (found by group testing: {s.passes} "
                         "passes of the whole step, each through optimizer.step(); a sample that fails alone but passes "
                         "among others, as a loss averaged over the batch allows, may go unnamed: only a batch of up to "
                         f"{ALONE_UP_TO} samples has each sample run alone)")


def test_batchnorm_failure_is_reported_as_coupled_not_guessed(reports):
    """The message says what was tried: the group and its two halves. BatchNorm1d refuses a single sample, so no
    sample was run alone and the message does not say that none fails alone; it says why."""
    s = reports["batchnorm_near_zero"].samples
    assert s.status == "coupled" and s.samples == []
    assert any(S in group for group in s.coupled_groups)
    g = s.coupled_groups[0]
    assert s.message.startswith(f"samples {g} fail together, and neither half of them ({g[:len(g) // 2]}, "
                                f"{g[len(g) // 2:]}) reproduces the failure: a failure that needs samples together "), s.message
    assert "alone reproduces" not in s.message and "single samples could not be run: " in s.message
    assert "smaller subset" not in s.message


def test_a_coupled_group_s_message_claims_what_was_tried_and_no_more():
    """Halving tries a failing group's two halves, never its other subsets; the samples alone only where each was
    run alone (a pair's halves are its samples, so nothing is added for it)."""
    assert coupled_text([0, 1, 2, 3], alone_ran=True) == (
        "samples [0, 1, 2, 3] fail together, and neither half of them ([0, 1], [2, 3]) nor any of them alone reproduces "
        "the failure: a failure that needs samples together (batch-coupled operations such as BatchNorm, or a loss "
        "normalised over the batch)")
    assert coupled_text([0, 1, 2, 3], alone_ran=False).startswith(
        "samples [0, 1, 2, 3] fail together, and neither half of them ([0, 1], [2, 3]) reproduces the failure: ")
    assert coupled_text([4, 5, 6], alone_ran=True).startswith(
        "samples [4, 5, 6] fail together, and neither half of them ([4], [5, 6]) nor any of them alone reproduces ")
    assert coupled_text([4, 5], alone_ran=True).startswith(
        "samples [4, 5] fail together, and neither half of them ([4], [5]) reproduces the failure: ")


def test_optimizer_only_failure_is_traced_to_its_sample_through_the_update(reports):
    """Forward and backward stay finite (the 1e13 reading's gradient is large, not infinite): the samples are judged
    through optimizer.step(), where that sample's gradient alone overflows exp_avg_sq (issue 31's oracle)."""
    r = reports["adam_state_overflow"]
    assert (r.samples.status, r.samples.samples) == ("attributed", [S])
    assert "through optimizer.step()" in r.samples.message
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


# ---- provenance: the operation where the origin's value was born, not the first non-finite op in time ----------


def _operation_sentence(r: ReplayReport) -> str:
    [sentence] = [f for f in r.findings if f.startswith("Operation:")]
    return sentence


def _line_of(function, text: str) -> int:
    lines, first = inspect.getsourcelines(function)
    return first + next(i for i, line in enumerate(lines) if text in line)


def test_fully_masked_attention_row_is_softmax_not_the_causal_mask(reports):
    r = reports["decoder_fully_padded"]
    assert (r.origin.stage, r.origin.tensor, r.origin.value) == ("forward", "blocks.0.attn.proj", "nan")
    op = r.operation
    # the causal mask's masked_fill(-inf) fires on every step; softmax of a row that is -inf throughout is 0/0
    assert (op.site.op, op.site.phase, op.site.module) == ("aten::_softmax.default", "forward", "blocks.0.attn")
    assert op.site.source == f"tests/scenarios.py:{_line_of(scenarios.CausalSelfAttention.forward, 'F.softmax(')} " \
                             "in forward"
    assert op.output_value == "nan" and op.output_index[0] == S  # the fully padded sequence
    assert op.site.input_ranges[0][0] == "-inf" and op.inputs_at_index == [["-inf", "-inf"]]  # a row of all -inf
    assert op.inf_source.kind == "constant" and op.inf_source.site.op == "aten::masked_fill.Scalar"
    fill = _line_of(scenarios.CausalSelfAttention.forward, "masked_fill(causal |")
    assert op.inf_source.site.source == f"tests/scenarios.py:{fill} in forward"
    assert op.nan_site is None and op.path[0] == "aten::_softmax.default"
    assert op.traced_from == "forward blocks.0.attn.proj[5, 0, 0] = nan"
    assert r.samples.samples == [S]
    sentence = _operation_sentence(r)
    assert sentence.startswith("Operation: forward aten::_softmax.default in module `blocks.0.attn`")
    assert "from inputs holding -inf ([-inf," in sentence and "from finite inputs" not in sentence
    assert "computed from ranged over [-inf, -inf] (all -inf)" in sentence
    assert "aten::masked_fill.Scalar in module `blocks.0.attn`" in sentence and "as a constant (a mask)," in sentence
    assert "held it before the step" not in sentence and "already held it" not in sentence
    assert "NaN arose" not in sentence
    origin = next(f for f in r.findings if f.startswith("Origin:"))
    assert "blocks.0.attn.proj's output is the first module output to hold it" in origin
    assert "finite inputs" not in origin  # proj's own input was already NaN


def test_operation_sentence_says_finite_inputs_only_when_they_were(reports):
    r = reports["logcosh_overflow"]
    sentence = _operation_sentence(r)
    assert "produced inf at [5, 0] from finite inputs [" in sentence
    assert "(all " not in sentence and "as a constant" not in sentence and "NaN arose" not in sentence
    assert "its outputs ranged over" not in sentence and "the forward op's inputs" not in sentence
    assert "the forward op's inputs ranged over [1.401e-45, " in _operation_sentence(reports["adam_near_zero"])
    assert sentence.endswith("Traced back from loss = inf: aten::mean.default <- aten::log.default "
                             "<- aten::cosh.default.")


def _trace(model, optimizer, step_fn, batch) -> tuple[Event, OperationCulprit | None]:
    """One step as replay explains it: the origin from the monitor in locate mode, then, from the same state, the
    trace."""
    snapshot = copy.deepcopy(model.state_dict()), copy.deepcopy(optimizer.state_dict())
    with pinned_threads(2), StepMonitor(model, optimizer) as monitor:
        monitor.begin(DEFECT_STEP, batch, locate=True)
        origin = monitor.end(step_fn(model, optimizer, batch))[0]
    model.load_state_dict(snapshot[0])
    optimizer.load_state_dict(snapshot[1])
    with pinned_threads(2):
        return origin, trace_step(model, optimizer, lambda: step_fn(model, optimizer, batch), origin)


def _traced_decoder_step(**model_kwargs) -> OperationCulprit | None:
    """The fully padded batch through a freshly built decoder."""
    model = scenarios.build_decoder(**model_kwargs)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return _trace(model, optimizer, scenarios.train_step_lm, scenarios.make_token_batch(DEFECT_STEP,
                                                                                          defect="fully_padded"))[1]


def test_causal_mask_kept_as_a_buffer_is_named_beside_the_padding_fill():
    op = _traced_decoder_step(bias_buffer=True)  # scores + causal_bias (0 / -inf), then masked_fill for padding
    assert (op.site.op, op.site.module, op.output_index[0]) == ("aten::_softmax.default", "blocks.0.attn", S)
    assert (op.inf_source.kind, op.inf_source.site.op, op.inf_source.tensor) == (
        "constant", "aten::masked_fill.Scalar", "blocks.0.attn.causal_bias")
    sentence = operation_sentence(op)
    assert "wrote it as a constant (a mask), and blocks.0.attn.causal_bias held it before the step" in sentence


def test_inf_only_held_before_the_step_is_said_so():
    """Every slot of an attention over fixed slots disabled by a -inf bias buffer (a configuration slip)."""

    class Slots(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.score = torch.nn.Linear(4, 3)
            self.register_buffer("slot_bias", torch.full((3,), float("-inf")))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.softmax(self.score(x) + self.slot_bias, dim=-1)

    torch.manual_seed(0)
    model = Slots()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(2, 4)

    def step() -> torch.Tensor:
        optimizer.zero_grad()
        loss = model(x).sum()
        loss.backward()
        optimizer.step()
        return loss

    op = trace_step(model, optimizer, step, Event(0, "forward", "<root>", [0, 0], "nan"))
    assert op.site.op == "aten::_softmax.default" and op.inputs_at_index == [["-inf", "-inf"]]
    assert (op.inf_source.kind, op.inf_source.site, op.inf_source.tensor) == ("outside", None, "slot_bias")
    sentence = operation_sentence(op)
    assert "was not computed in this step: slot_bias already held it" in sentence and "as a constant" not in sentence


def test_where_discarding_log_of_zero_names_the_forward_log_and_the_backward_nan(reports):
    op = reports["masked_log_zero"].operation
    assert (op.nan_site.op, op.nan_site.phase, op.nan_node) == ("aten::div.Tensor", "backward", "LogBackward0")
    assert op.path[:2] == ["aten::log.default", "aten::div.Tensor"]
    sentence = _operation_sentence(reports["masked_log_zero"])
    assert "NaN arose in the backward pass, at backward aten::div.Tensor" in sentence
    assert "autograd node LogBackward0" in sentence
    # the near-zero reading: the backward division is the birth itself, no forward op made a non-finite value
    near_zero = reports["adam_near_zero"]
    assert near_zero.operation.nan_site is None and "NaN arose" not in _operation_sentence(near_zero)


def test_clipping_in_place_does_not_move_the_culprit(reports):
    op = reports["clipped_near_zero"].operation  # clip_grad_norm_ multiplies the gradients in place afterwards
    assert (op.site.op, op.autograd_node, op.forward.op) == ("aten::div.Tensor", "LogBackward0", "torch.log")
    assert op.output_index == [S, F]


def test_foreach_optimizer_names_the_element_that_overflowed(runs):
    """Adam with foreach=True updates every parameter's state in one op: output i comes from element i only."""
    session = _session_before_defect(runs["adam_state_overflow"])
    for group in session.optimizer.param_groups:
        group["foreach"] = True
    origin, op = _trace(session.model, session.optimizer, scenarios.train_step, session.batch(DEFECT_STEP))
    assert (origin.stage, origin.state_key) == ("optimizer_state", "exp_avg_sq")
    assert (op.site.op, op.site.phase, op.output_value) == ("aten::_foreach_addcmul_.Scalar", "optimizer", "inf")
    assert op.output_index == origin.index
    assert len(op.site.input_ranges) == 3  # its own state, grad, grad: one parameter's elements, not every list


def test_batchnorm_running_var_written_without_a_schema_annotation():
    """native_batch_norm updates running_var in place although its schema does not say so; one 1e30 pixel makes
    the batch variance overflow into it. (The origin is built by hand: replay checks buffers as a stage of its own.)"""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.ReLU(),
                                torch.nn.Flatten(), torch.nn.Linear(4 * 6 * 6, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(8, 1, 8, 8), torch.randint(0, 2, (8,))
    x[S % 8, 0, 2, 2] = 1e30

    def step() -> torch.Tensor:
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        return loss

    op = trace_step(model, optimizer, step, Event(0, "buffer", "1.running_var", [0], "inf"))
    assert (op.site.op, op.site.phase, op.site.module, op.output_value) == ("aten::native_batch_norm.default",
                                                                            "forward", "1", "inf")
    assert float(op.site.input_ranges[0][1]) > 1e29 and op.site.input_ranges[4] == ["1", "1"]  # running_var before


# ---- a Hugging Face GPT-2 from its config, recorded with the recorder through a train step of our own ----------

GPT2_DEFECT = 5


@pytest.fixture(scope="module")
def gpt2_reports(tmp_path_factory) -> dict[str, ReplayReport]:
    pytest.importorskip("transformers", reason="transformers is not installed (nanforensics[hf])")
    out = {}
    for name, step_fn, defect in (("all_ignored", scenarios.train_step_gpt2, "all_ignored"),
                                  ("all_ignored_summed", scenarios.train_step_gpt2_summed, "all_ignored"),
                                  ("cold", scenarios.train_step_gpt2_distill, "cold")):
        run = tmp_path_factory.mktemp("gpt2") / name
        model = scenarios.build_gpt2()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        with Recorder(run, model, optimizer, model_factory=scenarios.build_gpt2, step_fn=step_fn,
                      checkpoint_every=4) as rec:
            for step in range(GPT2_DEFECT + 2):
                batch = scenarios.make_gpt2_batch(step, defect=defect if step == GPT2_DEFECT else None)
                rec.log(step, batch, step_fn(model, optimizer, batch))
        out[name] = replay_run(run, ReplayOptions(device="cpu"))
    return out


def test_gpt2_all_ignored_labels_names_the_loss_reduction(gpt2_reports):
    r = gpt2_reports["all_ignored"]
    # the gradients stay 0: a loss-only step, no origin, yet its loss is explained
    assert (r.verdict, r.loss_only_steps, r.origin, r.events, r.reproduced) == ("loss_only", [GPT2_DEFECT], None, [], True)
    assert r.setup.last_step == GPT2_DEFECT + 1  # replayed past the loss-only step, to the end of the log
    op = r.operation
    # the mean over no tokens: nll_loss's sum (0) over its total weight (0); never empty_like or the attention mask
    assert (op.site.op, op.site.phase, op.output_value) == ("aten::nll_loss_forward.default", "forward", "nan")
    assert op.site.input_ranges[1] == ["-100", "-100"]  # every target ignored
    assert op.site.output_ranges == [["nan", "nan"], ["0", "0"]]  # the loss, and the total weight it divided by
    assert op.site.source.startswith("transformers/") and op.inf_source is None and op.nan_site is None
    assert not any(name in " ".join(op.path) for name in ("empty", "masked_fill", "full", "where"))
    sentence = _operation_sentence(r)
    assert "from finite inputs [" in sentence and ", [-100, -100]; its outputs ranged over [nan, nan], [0, 0]" \
        in sentence
    assert "inputs holding" not in sentence and "NaN arose" not in sentence


def test_gpt2_trainer_style_summed_loss_names_its_division(gpt2_reports):
    """As the Trainer has it: summed, then divided by the labelled tokens it counted, 0/0."""
    op = gpt2_reports["all_ignored_summed"].operation
    assert (op.site.op, op.site.phase, op.output_value) == ("aten::div.Tensor", "forward", "nan")
    assert op.site.input_ranges == [["0", "0"], ["0", "0"]] and op.site.input_dtypes == ["float32", "int64"]
    assert op.site.source.startswith("transformers/loss/")


def test_gpt2_exp_overflow_is_the_root_of_the_nan_downstream(gpt2_reports):
    r = gpt2_reports["cold"]
    assert (r.responsible_step, r.origin.stage, r.origin.value) == (GPT2_DEFECT, "loss", "nan")
    op = r.operation
    assert (op.site.op, op.site.phase, op.site.module, op.output_value) == ("aten::exp.default", "forward", None,
                                                                            "inf")
    assert op.site.source == f"tests/scenarios.py:{_line_of(scenarios.train_step_gpt2_distill, 'torch.exp(')} " \
                             "in train_step_gpt2_distill"
    assert float(op.inputs_at_index[0][0]) > 88.7  # exp of it is past float32's largest value
    assert (op.nan_site.op, op.nan_site.phase) == ("aten::div.Tensor", "forward") and op.inf_source is None
    assert op.path[:2] == ["aten::exp.default", "aten::div.Tensor"]
    sentence = _operation_sentence(r)
    assert "from finite inputs" in sentence.split("NaN arose")[0]
    assert "NaN arose downstream of it, at forward aten::div.Tensor outside any module" in sentence
    assert "from inputs holding inf (" in sentence.split("NaN arose")[1] and "as a constant" not in sentence


@pytest.mark.parametrize("name", ["adam_near_zero", "masked_log_zero", "fp16_activation_overflow", "nan_in_data",
                                  "batchnorm_near_zero", "decoder_fully_padded"])
def test_samples_read_off_the_coordinates_are_those_halving_names(reports, runs, name):
    """Above ALONE_UP_TO the replay starts group testing from the sample the origin's (or its operation's) coordinates
    point at: the same samples as probing and halving alone, in three passes where one sample fails alone. Up to it
    (the decoder's batch of 8) every sample is run alone and the hint changes nothing: the batch, each sample, and the
    batch without the one that fails."""
    r = reports[name]
    run = Run(runs[name])
    with pinned_threads(run.num_threads):
        session = Session(run, UserCode.load(run), [c for c in run.checkpoints() if c.step <= r.origin.step][-1],
                          torch.device("cpu"))
        session.advance_to(r.origin.step)
        plain = attribute_samples(session)
    assert (r.samples.status, r.samples.samples, r.samples.coupled_groups) == (
        plain.status, plain.samples, plain.coupled_groups)
    if r.samples.batch_size <= ALONE_UP_TO:
        assert (r.samples.judged, r.samples.passes, plain.passes) == ("each_alone", 10, 10) and name.startswith("decoder")
        assert r.samples.message == (f"sample {S} of 8 produces the non-finite value alone (each of the 8 samples run "
                                     "alone: 10 passes of the whole step, each through optimizer.step())")
    elif r.samples.status == "attributed" and len(r.samples.samples) == 1:
        assert r.samples.passes == 3 < plain.passes and r.samples.judged == "group_testing"
    else:
        assert r.samples.passes <= plain.passes + 2


def test_rewinding_from_memory_finds_what_rewinding_from_a_checkpoint_finds(reports, runs):
    """From checkpoint 0 the flagged step re-runs from the state kept before it, the precursors taken on the way;
    from checkpoint 10 (seven steps before it, too few for the curves) the replay rewinds to checkpoint 0. Same
    origin, operation, samples and curves."""
    old = reports["adam_near_zero"]
    new = replay_run(runs["adam_near_zero"], ReplayOptions(device="cpu", from_step=0))
    assert (new.setup.first_step, old.setup.first_step) == (0, 10)
    assert (new.origin, new.operation, new.samples) == (old.origin, old.operation, old.samples)
    assert repr(new.precursors) == repr(old.precursors)  # NaN != NaN: compared as written
