"""nanforensics replay, through its real entry point, on runs recorded by the project's own recorder."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from nanforensics.replay.engine import ReplayOptions, replay_run

import scenarios
from conftest import DEFECT_STEP, assert_one_line_error, run_cli, tree_digest

F = scenarios.DEFECT_FEATURE


def replay_json(run: Path, *args: str) -> tuple[int, dict]:
    before = tree_digest(run)
    result = run_cli("replay", run, "--json", "-", *args)
    assert tree_digest(run) == before, "replay wrote into the run directory"
    assert result.code in (0, 1, 3), result.stderr
    return result.code, result.json()


def events(report: dict, step: int, stage: str) -> list[dict]:
    return [e for e in report["events"] if e["step"] == step and e["stage"] == stage]


def test_seed_case_names_the_batch_before_the_nan_loss(runs):
    code, r = replay_json(runs["adam_near_zero"])
    assert code == 1
    assert r["schema"] == "nanforensics.replay/1"
    assert r["verdict"] == "nonfinite"
    assert r["responsible_step"] == DEFECT_STEP
    assert r["logged_first_nonfinite_loss_step"] == DEFECT_STEP + 1
    assert r["first_nonfinite_loss_step"] == DEFECT_STEP + 1
    assert r["responsible_batch"]["file"].endswith(f"batches/step_{DEFECT_STEP:08d}.safetensors")
    assert r["responsible_batch"]["leaves"]["batch['ids']"][0] == f"s{DEFECT_STEP:05d}-00"
    o = r["origin"]
    assert (o["step"], o["stage"], o["tensor"], o["index"]) == (DEFECT_STEP, "grad", "features.gain", [F])
    assert o["value"] in ("inf", "-inf") and o["elements_nonfinite"] == 1
    # the chain at step t: the infinite gradient reaches both moments, the update is inf/inf = NaN
    state = {e["state_key"]: e for e in events(r, DEFECT_STEP, "optimizer_state")}
    assert set(state) == {"exp_avg", "exp_avg_sq"}
    assert all(e["tensor"] == "features.gain" and e["index"] == [F] for e in state.values())
    assert state["exp_avg_sq"]["value"] == "inf"
    [param] = events(r, DEFECT_STEP, "param")
    assert (param["tensor"], param["index"], param["value"], param["elements_nonfinite"]) == ("features.gain", [F], "nan", 1)
    assert not events(r, DEFECT_STEP, "forward") and not events(r, DEFECT_STEP, "loss")
    # a step later the loss is NaN and every parameter is
    assert events(r, DEFECT_STEP + 1, "loss")[0]["value"] == "nan"
    assert r["fully_nonfinite_step"] == DEFECT_STEP + 1
    assert r["state_poisoned"] is True
    spread = {s["step"]: s for s in r["spread"]}
    assert spread[DEFECT_STEP - 1]["params_nonfinite"] == 0
    assert spread[DEFECT_STEP]["params_nonfinite"] == 1 and spread[DEFECT_STEP]["state_nonfinite"] == 2
    assert spread[DEFECT_STEP + 1]["params_nonfinite"] == spread[DEFECT_STEP + 1]["params_total"]
    assert any("clipping" in f for f in r["findings"])
    assert any("not step 18's" in f for f in r["findings"])


def test_replay_is_bit_exact_on_cpu(runs):
    _, r = replay_json(runs["adam_near_zero"])
    assert r["reproduced"] is True and r["diverged_at_step"] is None
    compared = [s for s in r["spread"] if s["logged_loss"] is not None]
    assert len(compared) >= 8
    for s in compared:
        assert s["logged_loss"] == s["replayed_loss"], s  # exact: equal floats, or both "nan"


def test_clean_run_exits_zero(runs):
    code, r = replay_json(runs["clean"])
    assert code == 0 and r["verdict"] == "clean" and r["origin"] is None and r["events"] == []
    assert r["reproduced"] is True
    assert r["setup"]["last_step"] == 23  # replayed from the last checkpoint to the end of the log


def test_sgd_momentum_shows_the_nan_loss_two_steps_late(runs):
    code, r = replay_json(runs["sgd_near_zero"])
    assert code == 1
    assert (r["origin"]["stage"], r["origin"]["tensor"], r["origin"]["index"]) == ("grad", "features.gain", [F])
    assert r["responsible_step"] == DEFECT_STEP
    assert r["logged_first_nonfinite_loss_step"] == DEFECT_STEP + 2
    [buf] = events(r, DEFECT_STEP, "optimizer_state")
    assert buf["state_key"] == "momentum_buffer" and buf["index"] == [F]


@pytest.mark.parametrize("scenario, stage, tensor, index", [
    ("nan_in_data", "batch", "batch['x']", [scenarios.DEFECT_SAMPLE, F]),
    ("squared_relu_overflow", "forward", "act", None),
    ("poisson_log_zero", "loss", "loss", []),
    ("adam_near_zero", "grad", "features.gain", [F]),
    ("clipped_near_zero", "grad", "features.gain", [F]),
    ("adam_state_overflow", "optimizer_state", None, None),
])
def test_each_stage_of_origin(runs, scenario, stage, tensor, index):
    code, r = replay_json(runs[scenario])
    assert code == 1, r["findings"]
    o = r["origin"]
    assert o["step"] == DEFECT_STEP and o["stage"] == stage, o
    if tensor is not None:
        assert o["tensor"] == tensor
    if index is not None:
        assert o["index"] == index
    assert r["responsible_batch"]["step"] == DEFECT_STEP


def test_clipping_turns_the_infinite_gradient_into_nan(runs):
    _, r = replay_json(runs["clipped_near_zero"])
    [grad] = events(r, DEFECT_STEP, "grad")
    [seen] = events(r, DEFECT_STEP, "optimizer_grad")
    assert grad["value"] in ("inf", "-inf") and grad["elements_nonfinite"] == 1
    # clip_grad_norm_: total norm inf, factor 0, inf*0 = NaN, and 0*finite = 0 elsewhere
    assert seen["value"] == "nan" and seen["index"] == [F]
    assert any("turned the" in f and "clipping" in f for f in r["findings"])


def test_state_overflow_with_finite_gradients_and_loss(runs):
    _, r = replay_json(runs["adam_state_overflow"])
    assert r["logged_first_nonfinite_loss_step"] is None
    o = r["origin"]
    assert o["state_key"] == "exp_avg_sq" and o["value"] == "inf"
    assert not events(r, DEFECT_STEP, "grad") and not events(r, DEFECT_STEP, "param")
    assert r["state_poisoned"] is True


def test_logged_nan_that_does_not_reproduce_exits_3(copy_run):
    run = copy_run("clean")
    lines = (run / "steps.jsonl").read_text().splitlines()
    lines[20] = json.dumps({"step": 20, "loss": "nan"})  # as if the logging path had a bug
    (run / "steps.jsonl").write_text("\n".join(lines) + "\n")
    code, r = replay_json(run)
    assert code == 3 and r["verdict"] == "not_reproduced"
    assert r["logged_first_nonfinite_loss_step"] == 20
    assert r["reproduced"] is False and r["diverged_at_step"] == 20


def test_from_step_and_markdown(runs, tmp_path):
    md = tmp_path / "report.md"
    result = run_cli("replay", runs["adam_near_zero"], "--from-step", "5", "--markdown", md)
    assert result.code == 1, result.stderr
    assert "responsible step 17" in result.stdout
    assert "features.gain[3]" in result.stdout
    text = md.read_text()
    assert text.startswith("## nanforensics replay: non-finite")
    assert "| 17 |" in text and "`grad features.gain[3] = " in text


def test_library_api_matches_cli(runs):
    report = replay_run(runs["adam_near_zero"], ReplayOptions(device="cpu"))
    assert report.responsible_step == DEFECT_STEP and report.origin is not None
    assert report.origin.stage == "grad"
    assert math.isnan(report.spread[-1].replayed_loss)


def test_missing_manifest(copy_run):
    run = copy_run("clean")
    (run / "manifest.json").unlink()
    before = tree_digest(run)
    assert_one_line_error(run_cli("replay", run), "manifest.json", "missing")
    assert tree_digest(run) == before


def test_missing_checkpoints(copy_run):
    run = copy_run("adam_near_zero")
    for c in (run / "checkpoints").iterdir():
        for f in c.iterdir():
            f.unlink()
        c.rmdir()
    assert_one_line_error(run_cli("replay", run), "checkpoints", "no checkpoints")


def test_missing_batch(copy_run):
    run = copy_run("adam_near_zero")
    (run / "batches" / "step_00000012.safetensors").unlink()
    before = tree_digest(run)
    assert_one_line_error(run_cli("replay", run), "step_00000012.safetensors", "missing")
    assert tree_digest(run) == before


def test_unimportable_step_function(copy_run):
    run = copy_run("adam_near_zero")
    manifest = json.loads((run / "manifest.json").read_text())
    manifest["step_fn"] = "no_such_training_module:train_step"
    (run / "manifest.json").write_text(json.dumps(manifest))
    assert_one_line_error(run_cli("replay", run), "manifest.json", "no_such_training_module:train_step",
                          "not importable")


def test_future_manifest_format(copy_run):
    run = copy_run("clean")
    manifest = json.loads((run / "manifest.json").read_text())
    manifest["format"] = "nanforensics.run/9"
    (run / "manifest.json").write_text(json.dumps(manifest))
    assert_one_line_error(run_cli("replay", run), "manifest.json", "newer")


def test_unwritable_json_path(runs, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    assert_one_line_error(run_cli("replay", runs["clean"], "--json", blocker / "report.json"), "report.json")


def test_failed_replay_leaves_earlier_report(copy_run, tmp_path):
    run = copy_run("adam_near_zero")
    report = tmp_path / "report.json"
    report.write_text("earlier")
    (run / "batches" / "step_00000019.safetensors").write_bytes(b"truncated")
    assert_one_line_error(run_cli("replay", run, "--json", report, "--markdown", tmp_path / "r.md"),
                          "step_00000019.safetensors")
    assert report.read_text() == "earlier"
    assert not (tmp_path / "r.md").exists()


def test_usage_errors_exit_2(runs):
    assert run_cli("replay").code == 2
    assert run_cli("replay", runs["clean"], "--after", "-1").code == 2
    assert_one_line_error(run_cli("replay", runs["clean"], "--device", "tpu"), "--device", "tpu")
