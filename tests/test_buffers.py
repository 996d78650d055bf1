"""Buffers are state: a BatchNorm running_var that one 1e30 pixel makes inf, while every parameter, gradient and
optimizer-state value stays finite, is the origin (stage ``buffer``), and scan and bisect call it a buffer."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from nanforensics.checkpoints.scan import BY_NAME, POISONED_BUFFERS, POISONED_PARAMETERS, RECORDED, scan_checkpoint
from nanforensics.formats import open_checkpoint
from nanforensics.inputs import TensorFile
from nanforensics.replay.monitor import StepMonitor
from safetensors.torch import load_file
from torch import nn

import scenarios
from conftest import DEFECT_STEP, run_cli, tree_digest

RUN = "batchnorm_huge_pixel"


def checkpoint(run: Path, step: int) -> Path:
    return run / "checkpoints" / f"step_{step:08d}"


def test_the_case_is_what_the_issue_describes(runs):
    """Straight from the recorded files, without nanforensics' checks: after the step with the huge pixel only
    BatchNorm's running_var is non-finite; parameters and Adam's moments are finite, and so is every logged loss."""
    run = runs[RUN]
    model = load_file(checkpoint(run, 20) / "model.safetensors")
    bad = {k for k, t in model.items() if t.is_floating_point() and not torch.isfinite(t).all()}
    assert bad == {"norm.running_var"} and torch.isinf(model["norm.running_var"]).all()
    assert all(torch.isfinite(t).all() for t in load_file(checkpoint(run, 20) / "optimizer.safetensors").values())
    assert all(torch.isfinite(t).all() for t in load_file(checkpoint(run, 10) / "model.safetensors").values()
               if t.is_floating_point())
    assert all(math.isfinite(float(line.split('"loss": ')[1].rstrip("}\n")))
               for line in (run / "steps.jsonl").read_text().splitlines())


def test_replay_names_the_buffer_step_and_coordinate(runs, tmp_path):
    run, md, saved = runs[RUN], tmp_path / "report.md", tmp_path / "report.json"
    before = tree_digest(run)
    result = run_cli("replay", run, "--json", saved, "--markdown", md)
    assert tree_digest(run) == before
    assert result.code == 1, result.stderr  # was 0, CLEAN: the buffer went unchecked
    r = json.loads(saved.read_text())
    assert (r["verdict"], r["responsible_step"], r["logged_first_nonfinite_loss_step"]) == ("nonfinite", DEFECT_STEP,
                                                                                           None)
    o = r["origin"]
    assert (o["step"], o["stage"], o["tensor"], o["index"], o["value"]) == (DEFECT_STEP, "buffer", "norm.running_var",
                                                                            [0], "inf")
    assert o["elements_nonfinite"] == 4 and o["tensors_nonfinite"] == 1  # every channel's variance overflowed
    assert r["setup"]["from_checkpoint"] == 10  # checkpoint 20 holds the inf buffer: not a clean start
    # What happens after: the buffer stays inf (a running average keeps it), nothing else ever goes non-finite.
    assert {e["stage"] for e in r["events"]} == {"buffer"}
    assert [e["step"] for e in r["events"]] == list(range(DEFECT_STEP, r["setup"]["last_step"] + 1))
    spread = {s["step"]: s for s in r["spread"]}
    assert spread[DEFECT_STEP - 1]["buffers_nonfinite"] == 0 and spread[DEFECT_STEP]["buffers_nonfinite"] == 4
    assert spread[DEFECT_STEP + 1]["buffers_nonfinite"] == 4 and spread[DEFECT_STEP]["buffers_total"] == 8
    assert all(s["params_nonfinite"] == 0 and s["state_nonfinite"] == 0 for s in r["spread"])
    assert all(isinstance(s["replayed_loss"], float) for s in r["spread"])
    assert r["state_poisoned"] is False and r["fully_nonfinite_step"] is None
    # the 1e30 pixel: a data defect, and the one sample that overflows the statistics on its own
    assert [(d["kind"], d["index"]) for d in r["data_defects"]] == [("extreme", [scenarios.DEFECT_SAMPLE, 0, 4, 4])]
    assert (r["samples"]["status"], r["samples"]["samples"]) == ("attributed", [scenarios.DEFECT_SAMPLE])
    f = r["findings"]
    assert any(s.startswith(f"Origin: step {DEFECT_STEP}, buffer norm.running_var[0] = inf") and "BatchNorm" in s
               for s in f), f
    assert any(f"norm.running_var holds non-finite values from step {DEFECT_STEP}; the parameters stayed finite"
               in s for s in f), f
    assert any("replayed losses stayed finite" in s and "eval mode" in s for s in f), f
    assert "buffer norm.running_var[0] = inf" in result.stdout and "| buffers |" in md.read_text()


def test_buffers_that_follow_the_parameters_are_a_consequence(runs):
    """BatchNorm on the near-zero reading: the gradient is the origin; the statistics go NaN a step after the
    parameters, and the findings say so, without the sentences of a buffer origin."""
    r = run_cli("replay", runs["batchnorm_near_zero"], "--json", "-", "--no-explain").json()
    assert r["origin"]["stage"] == "grad"
    [first] = [e for e in r["events"] if e["stage"] == "buffer"][:1]
    assert (first["step"], first["tensor"], first["tensors_nonfinite"]) == (DEFECT_STEP + 1, "norm.running_mean", 2)
    assert (f"Buffer norm.running_mean and 1 other buffer went non-finite at step {DEFECT_STEP + 1}, after the "
            f"parameters (step {DEFECT_STEP}): a consequence, not the origin.") in r["findings"]
    assert not any("running statistics" in s or "persists" in s for s in r["findings"])


def test_scan_calls_a_buffer_a_buffer(runs):
    result = run_cli("scan", checkpoint(runs[RUN], 20), "--json", "-")
    assert result.code == 1, result.stderr
    r = result.json()
    assert (r["verdict"], r["buffer_split"]) == (POISONED_BUFFERS, RECORDED)
    [bad] = [t for t in r["tensors"] if t["nonfinite"]]
    assert (bad["name"], bad["group"], bad["buffer"], bad["nonfinite"]) == ("norm.running_var", "model", True, 4)
    kinds = {t["name"]: t["buffer"] for t in r["tensors"]}
    assert (kinds["conv.weight"], kinds["norm.num_batches_tracked"]) == (False, True)
    text = run_cli("scan", checkpoint(runs[RUN], 20)).stdout
    assert "POISONED BUFFERS" in text and "POISONED PARAMETERS" not in text


def test_bisect_calls_a_buffer_a_buffer(runs):
    result = run_cli("bisect", runs[RUN], "--json", "-")
    assert result.code == 1, result.stderr
    r = result.json()
    assert (r["first_poisoned"]["step"], r["last_clean"]["step"]) == (20, 10)
    assert r["first_poisoned_verdict"] == POISONED_BUFFERS
    assert [t["name"] for t in r["poisoned_tensors"]] == ["norm.running_var"]
    assert "buffers only" in run_cli("bisect", runs[RUN]).stdout


def test_other_formats_recognise_batchnorm_statistics_and_say_when_they_cannot_tell(runs, tmp_path):
    model = {k: v.clone() for k, v in TensorFile(checkpoint(runs[RUN], 20) / "model.safetensors").items()}
    torch.save({"model": model}, tmp_path / "bn.pt")
    r = scan_checkpoint(open_checkpoint(tmp_path / "bn.pt"))
    assert (r.verdict, r.buffer_split) == (POISONED_BUFFERS, BY_NAME)
    assert {t.name: t.buffer for t in r.tensors if "norm" in t.name}["model.norm.running_var"] is True
    assert next(t for t in r.tensors if t.name == "model.conv.weight").buffer is None  # a name says nothing here
    # an EMA shadow a format does not label: counted as a parameter, and the report says it may be a buffer
    torch.save({"model": {**model, "norm.running_var": torch.ones(4), "ema_shadow": torch.full((3,), math.nan)}},
               tmp_path / "ema.pt")
    result = run_cli("scan", tmp_path / "ema.pt")
    assert result.code == 1 and "POISONED PARAMETERS" in result.stdout
    assert "does not record which model tensors are buffers: model.ema_shadow" in " ".join(result.stdout.split())
    # a bad buffer read before a bad parameter: the scan reads on and the verdict is the parameter's
    model["head.bias"] = torch.full_like(model["head.bias"], math.nan)
    torch.save({"model": model}, tmp_path / "both.pt")
    assert scan_checkpoint(open_checkpoint(tmp_path / "both.pt")).verdict == POISONED_PARAMETERS


def test_checkpoints_older_than_the_buffer_list_fall_back_to_names(runs, copy_run):
    run = copy_run(RUN)
    meta = checkpoint(run, 20) / "meta.json"
    data = json.loads(meta.read_text())
    del data["buffer_names"]
    meta.write_text(json.dumps(data))
    r = scan_checkpoint(open_checkpoint(checkpoint(run, 20)))
    assert (r.verdict, r.buffer_split) == (POISONED_BUFFERS, BY_NAME)
    assert next(t for t in r.tensors if t.name == "conv.weight").buffer is False  # in param_names


class _MaskedNorm(nn.Module):
    """A constant -inf mask kept as a non-persistent buffer (never in a checkpoint), beside BatchNorm's buffers."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.BatchNorm1d(4)
        self.register_buffer("mask", torch.tensor([0.0, 0.0, 0.0, -math.inf]), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(self.norm(x) + self.mask, dim=-1)


@pytest.mark.parametrize("locate", [False, True])
def test_a_buffer_non_finite_from_the_start_is_a_constant_not_an_origin(locate):
    torch.manual_seed(0)
    model = _MaskedNorm()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    with StepMonitor(model, optimizer) as monitor:
        for step, scale in enumerate((1.0, 1e30)):
            x = torch.randn(8, 4)
            x[0, 0] *= scale
            monitor.begin(step, {"x": x}, locate)
            optimizer.zero_grad()
            loss = F.mse_loss(model(x), torch.full((8, 4), 0.25))
            loss.backward()
            optimizer.step()
            events = monitor.end(loss)
            if step == 0:  # the -inf mask is there every step: not an event
                assert events == []
            else:  # the overflowed batch variance is
                assert [(e.stage, e.tensor) for e in events] == [("buffer", "norm.running_var")]
                assert events[0].value == ("inf" if locate else "") and events[0].index == ([0] if locate else [])
