"""A non-finite loss that never reaches the model (every label -100): verdict ``loss_only``, exit code 4, apart
from a later step that does poison the state."""

from __future__ import annotations

import itertools
import json
import math

import pytest
import torch
from nanforensics.report import STAGES, loss_only

import scenarios
from conftest import DEFECT_STEP, run_cli, tree_digest

LOSS_ONLY = ("but no gradient, parameter, optimizer-state or buffer value was: the non-finite loss never reached the "
             "model, so training could continue")


def test_the_rule_over_every_set_of_stages():
    """The one rule replay and sample attribution share, over every set of stages a step's non-finite values can lie
    in (256, enumerated): loss-only iff the loss is non-finite and nothing but forward activations are beside it (a
    loss module's own output, a mean over no target). The rule tightened to the loss alone (a strict subset) passed
    the real runs below, whose loss-only steps hold the loss alone."""
    for n in range(len(STAGES) + 1):
        for stages in itertools.combinations(STAGES, n):
            assert loss_only(stages) == ("loss" in stages and set(stages) <= {"forward", "loss"}), stages


def test_a_batch_without_targets_gives_a_nan_loss_and_zero_gradients():
    """The case as the issue describes it, checked with torch alone."""
    model = scenarios.build_decoder()
    batch = scenarios.make_token_batch(DEFECT_STEP, defect="no_labels")
    logits = model(batch["tokens"])
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                             batch["labels"][:, 1:].reshape(-1), ignore_index=-100)
    loss.backward()
    assert math.isnan(loss.item())
    assert all(torch.equal(p.grad, torch.zeros_like(p)) for p in model.parameters())


def test_replay_says_loss_only_and_exits_4(runs, tmp_path):
    run, md, saved = runs["decoder_no_labels"], tmp_path / "report.md", tmp_path / "report.json"
    before = tree_digest(run)
    result = run_cli("replay", run, "--json", saved, "--markdown", md)
    assert tree_digest(run) == before
    assert result.code == 4, result.stderr
    r = json.loads(saved.read_text())
    assert (r["verdict"], r["loss_only_steps"], r["origin"], r["events"]) == ("loss_only", [DEFECT_STEP], None, [])
    assert r["logged_first_nonfinite_loss_step"] == r["first_nonfinite_loss_step"] == DEFECT_STEP
    assert r["setup"]["last_step"] == 23  # replayed on past the NaN loss, to the end of the log
    spread = {s["step"]: s for s in r["spread"]}
    assert spread[DEFECT_STEP]["replayed_loss"] == "nan" and spread[DEFECT_STEP + 1]["replayed_loss"] != "nan"
    assert all(s["params_nonfinite"] == s["state_nonfinite"] == s["buffers_nonfinite"] == 0 for s in r["spread"])
    assert r["reproduced"] and [c["exact"] for c in r["checkpoints_compared"]] == [True]
    assert any(f.startswith(f"The loss was NaN at step {DEFECT_STEP}, {LOSS_ONLY}") and "no valid target" in f
               for f in r["findings"]), r["findings"]
    assert not any("No non-finite value" in f for f in r["findings"])
    assert "LOSS ONLY" in result.stdout
    assert f"non-finite loss at step {DEFECT_STEP} only" in md.read_text()


def test_a_later_step_that_poisons_the_state_is_the_origin(tmp_path):
    run, saved = tmp_path / "run", tmp_path / "report.json"
    scenarios.record(run, "decoder_no_labels", steps=DEFECT_STEP + 3, defects={12: "no_labels",
                                                                               DEFECT_STEP: "fully_padded"})
    result = run_cli("replay", run, "--json", saved, "--no-explain")
    assert result.code == 1, result.stderr
    r = json.loads(saved.read_text())
    assert (r["verdict"], r["responsible_step"], r["origin"]["stage"]) == ("nonfinite", DEFECT_STEP, "forward")
    assert r["loss_only_steps"] == [12] and r["logged_first_nonfinite_loss_step"] == 12
    assert not any(e["step"] == 12 for e in r["events"])
    f = r["findings"]
    assert any(s.startswith(f"The loss was NaN at step 12 before the origin, {LOSS_ONLY}") for s in f), f
    assert any(f"The logged loss first shows NaN at step {DEFECT_STEP + 1}" in s for s in f), f
    assert not any("already non-finite at step 12" in s for s in f), f
    assert f"logged loss first NaN at step {DEFECT_STEP + 1}" in result.stdout


def test_postmortem_verdict_and_exit_code_follow_the_replay(runs, tmp_path):
    result = run_cli("postmortem", runs["decoder_no_labels"], "--json", tmp_path / "pm.json", "--junit",
                     tmp_path / "junit.xml")
    assert result.code == 4, result.stderr
    r = json.loads((tmp_path / "pm.json").read_text())
    assert (r["verdict"], r["replay"]["verdict"], r["responsible_step"]) == ("loss_only", "loss_only", None)
    assert f"step {DEFECT_STEP} only" in r["headline"]
    assert "LOSS ONLY" in result.stdout
    assert 'type="loss_only"' in (tmp_path / "junit.xml").read_text()


@pytest.mark.parametrize("name, stage", [("logcosh_overflow", "loss"), ("decoder_fully_padded", "forward")])
def test_a_nonfinite_loss_that_reaches_the_model_is_never_loss_only(runs, tmp_path, name, stage):
    """The other side of the decision: a loss that turns non-finite in the loss itself or before it, and whose
    backward carries it into the gradients, is the origin (verdict nonfinite, exit 1), not loss-only."""
    result = run_cli("replay", runs[name], "--json", tmp_path / "r.json", "--no-explain")
    assert result.code == 1, result.stderr
    r = json.loads((tmp_path / "r.json").read_text())
    assert (r["verdict"], r["loss_only_steps"], r["responsible_step"]) == ("nonfinite", [], DEFECT_STEP)
    assert r["origin"]["stage"] == stage
    assert not any(LOSS_ONLY in f for f in r["findings"]), r["findings"]
