"""Reproduction: the replayed state, bit for bit, against the checkpoints the replay passes; losses in float32 ulps,
so that a loss rounded differently in its last bits is not a divergence, and a state that differs is."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from nanforensics.replay.reproduction import LOSS_ULPS
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from conftest import ROOT, run_cli


def replay(run: Path, *args: str) -> dict:
    result = run_cli("replay", run, "--json", "-", "--no-explain", *args, cwd=ROOT)
    assert result.code in (0, 1), result.stderr
    return result.json()


def shift_logged_loss(run: Path, step: int, ulps: int) -> float:
    """Move the logged loss of ``step`` by ``ulps`` float32 ulps (a kernel that rounds differently); returns it."""
    path = run / "steps.jsonl"
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    value = np.float32(lines[step]["loss"])
    for _ in range(ulps):
        value = np.nextafter(value, np.float32(np.inf))
    lines[step]["loss"] = float(value)
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return float(value)


def test_seed_sample_reproduces_against_its_checkpoint(tmp_path):
    md = tmp_path / "report.md"
    r = replay(Path("sample_runs/seed_adam"), "--markdown", str(md))
    same_cpu = r["setup"]["recorded_cpu"] == r["setup"]["replay_cpu"]  # else the losses' reductions may round apart
    assert (r["reproduced"], r["diverged_at_step"]) == (True, None)
    assert r["loss_max_ulps"] == 0 if same_cpu else r["loss_max_ulps"] <= LOSS_ULPS
    [c] = r["checkpoints_compared"]  # replayed from step 20 to 29: it passes the checkpoint of step 30
    assert (c["step"], c["exact"], c["mismatched_tensors"], c["tensors"], c["error"]) == (30, True, 0, 28, None)
    assert 0 < c["nan_matched"] < c["values"]  # the run is NaN by then; the rest (Adam's step counts) bit-exact
    assert "reproduced (parameters, optimizer state and buffers equal at step 30" in md.read_text()


def test_passed_checkpoints_bit_exact_and_losses_within_a_couple_of_ulps(copy_run, tmp_path):
    run, md = copy_run("clean"), tmp_path / "report.md"
    shift_logged_loss(run, 15, 2)
    r = replay(run, "--from-step", "5", "--markdown", str(md))
    assert (r["verdict"], r["reproduced"], r["diverged_at_step"], r["loss_max_ulps"]) == ("clean", True, None, 2)
    assert [(c["step"], c["exact"], c["nan_matched"]) for c in r["checkpoints_compared"]] == [(10, True, 0),
                                                                                           (20, True, 0)]
    assert {s["step"]: s["loss_ulps"] for s in r["spread"]}[15] == 2
    assert "reproduced (parameters, optimizer state and buffers bit-exact at step 20; losses within 2 ulp)" \
        in md.read_text()
    assert ("Replayed losses differ from the logged ones by up to 2 float32 ulp: the state is bit-exact at step 20, "
            "so that is the loss's own rounding") in " ".join(r["findings"])


def test_losses_alone_when_no_checkpoint_is_passed(copy_run):
    run = copy_run("clean")  # replayed from its last checkpoint, step 20, to step 23: no checkpoint after it
    shift_logged_loss(run, 21, 2)
    r = replay(run)
    assert (r["reproduced"], r["checkpoints_compared"], r["loss_max_ulps"]) == (True, [], 2)
    far = shift_logged_loss(run, 21, 5000)
    r = replay(run)
    assert (r["reproduced"], r["diverged_at_step"]) == (False, 21)
    assert any(f.startswith(f"Not reproduced: losses diverge from step 21 (logged {far:.9g}, replayed ")
               and "5002 ulp apart" in f for f in r["findings"]), r["findings"]


@pytest.mark.parametrize("file, key, index, tensor, kind", [
    ("model.safetensors", "fc1.weight", (2, 3), "fc1.weight", "parameter"),
    ("optimizer.safetensors", "fc2.weight/exp_avg_sq", (1, 4), "exp_avg_sq of fc2.weight", "optimizer_state"),
])
def test_a_checkpoint_altered_in_one_coordinate_names_the_step_and_tensor(copy_run, file, key, index, tensor, kind):
    run = copy_run("clean")
    path = run / "checkpoints" / "step_00000010" / file
    with safe_open(str(path), framework="pt") as f:
        metadata = f.metadata()
    tensors = load_file(path)
    recorded = float(np.nextafter(np.float32(tensors[key][index].item()), np.float32(np.inf)))
    tensors[key][index] = recorded
    save_file(tensors, path, metadata=metadata)
    r = replay(run, "--from-step", "5")
    assert (r["verdict"], r["reproduced"], r["diverged_at_step"]) == ("clean", False, 10)
    [c] = r["checkpoints_compared"]  # once one differs, the later ones are not read
    m = c["first_mismatch"]
    assert (c["step"], c["exact"], c["mismatched_tensors"]) == (10, False, 1)
    assert (m["tensor"], m["kind"], m["index"], m["elements"], m["ulps"]) == (tensor, kind, list(index), 1, 1)
    assert m["recorded"] == repr(recorded) and float(m["replayed"]) != recorded
    where = f"{tensor}[{', '.join(map(str, index))}]"
    assert any(f.startswith(f"Not reproduced: the state diverged by step 10: {where} is {recorded!r} in the "
                            "checkpoint of step 10") for f in r["findings"]), r["findings"]
