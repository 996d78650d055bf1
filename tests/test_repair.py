"""nanforensics repair: a checkpoint that resumes cleanly, verified, written atomically, never into the run."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch
from nanforensics import BadInput, Recorder
from nanforensics.replay.repair import NothingToRepair, RepairOptions, repair_run
from nanforensics.replay.session import pinned_threads
from nanforensics.runs.checkpoint import Checkpoint, restore_rng
from nanforensics.runs.run import Run

import scenarios
from conftest import DEFECT_STEP, assert_one_line_error, run_cli, tree_digest

REPAIR_PAGE = Path(__file__).resolve().parent.parent / "docs" / "repair.md"
RESUME = DEFECT_STEP + 1
S = scenarios.DEFECT_SAMPLE


def _fresh() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = scenarios.build_model()
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def _documented_loader(ckpt: str) -> str:
    """docs/repair.md's plain torch + safetensors loading code with its imports, run as documented on the checkpoint
    ``ckpt`` (the page runs it on a checkpoint of the seed sample, which is in the same format) and on the test's own
    model and optimizer."""
    block = re.search(r"With plain `torch` \+ `safetensors`.*?```python\n(.*?)```", REPAIR_PAGE.read_text(), re.S).group(1)
    imports = [line for line in block.splitlines() if line.startswith(("import ", "from ")) and "regressor" not in line]
    loader = block[block.index("\nckpt = ") + 1:]
    shown = loader.splitlines()[0]
    assert shown.startswith('ckpt = "') and loader.count(shown) == 1, shown
    return "\n".join(imports) + "\n" + loader.replace(shown, f"ckpt = {ckpt!r}")


def _without_sample(batch: dict, sample: int) -> dict:
    keep = [i for i in range(len(batch["ids"])) if i != sample]
    return {"x": batch["x"][keep], "y": batch["y"][keep], "ids": [batch["ids"][i] for i in keep]}


def test_repair_drops_the_bad_sample_and_the_run_resumes_finite(runs, tmp_path, monkeypatch):
    run_dir = runs["adam_near_zero"]
    before = tree_digest(run_dir)
    result = run_cli("repair", run_dir, "--out", "repaired", cwd=tmp_path)
    assert tree_digest(run_dir) == before
    assert result.code == 0, result.stderr
    assert "REPAIRED" in result.stdout and "Verified" in result.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["repaired"]  # no temporary folder left beside it
    out = tmp_path / "repaired"
    folder = out / "checkpoints" / f"step_{RESUME:08d}"
    assert sorted(p.name for p in folder.iterdir()) == ["meta.json", "model.safetensors", "optimizer.safetensors"]
    report = json.loads((out / "repair.json").read_text())
    assert report["schema"] == "nanforensics.repair/1" and report["written"] is True
    assert (report["responsible_step"], report["from_checkpoint"], report["resume_step"]) == (DEFECT_STEP, 10, RESUME)
    assert report["change"] == f"drop-samples={S}"  # sample attribution found the one bad reading
    v = report["verification"]
    assert (v["finite"], v["step"], v["last_step"]) == (True, RESUME, RESUME + 4)

    # our format, and the documented plain torch + safetensors code, load the same tensors
    run = Run(run_dir)
    model, optimizer = _fresh()
    meta = Checkpoint(folder, RESUME).load_into(model, optimizer)
    plain_model, plain_optimizer = _fresh()
    monkeypatch.chdir(tmp_path)
    exec(_documented_loader(f"repaired/checkpoints/step_{RESUME:08d}"), {"model": plain_model, "optimizer": plain_optimizer})
    for a, b in zip(model.state_dict().values(), plain_model.state_dict().values()):
        assert torch.equal(a, b)
    assert all(torch.equal(a, b) for p, q in zip(optimizer.state.values(), plain_optimizer.state.values())
               for a, b in zip(p.values(), q.values()))

    with pinned_threads(run.manifest.num_threads):
        # it is exactly the run with sample 5 left out of step 17's batch
        truth, truth_optimizer = _fresh()
        restore_rng(Checkpoint(run.path / "checkpoints" / "step_00000010", 10).load_into(truth, truth_optimizer)["rng"])
        for step in range(10, DEFECT_STEP):
            scenarios.train_step(truth, truth_optimizer, run.batch(step))
        scenarios.train_step(truth, truth_optimizer, _without_sample(run.batch(DEFECT_STEP), S))
        assert all(torch.equal(a, b) for a, b in zip(truth.state_dict().values(), model.state_dict().values()))
        # and it trains on: the logged batches after it, then fresh ones
        restore_rng(meta["rng"])
        batches = [run.batch(s) for s in range(RESUME, 24)] + [scenarios.make_batch(s) for s in range(24, 40)]
        losses = [float(scenarios.train_step(model, optimizer, b).detach()) for b in batches]
    assert all(math.isfinite(x) for x in losses)
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())


def test_reset_state_repairs_in_place(runs, tmp_path):
    report = repair_run(runs["adam_near_zero"], tmp_path / "r", RepairOptions(reset_state=True, device="cpu"))
    assert report.written and report.change == "reset-state" and report.verification.finite
    assert report.detail == "zeroed the optimizer state of 1 coordinate, put back 1 parameter value"
    model, optimizer = _fresh()
    Checkpoint(Path(report.checkpoint), RESUME).load_into(model, optimizer)
    assert all(bool(torch.isfinite(t).all()) for s in optimizer.state.values() for t in s.values())


def test_non_empty_out_is_refused_unless_forced(runs, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert_one_line_error(run_cli("repair", runs["adam_near_zero"], "--out", out), "out", "not empty", "--force")
    assert (out / "keep.txt").read_text() == "mine"
    report = repair_run(runs["adam_near_zero"], out, RepairOptions(force=True, device="cpu"))
    assert report.written and sorted(p.name for p in out.iterdir()) == ["checkpoints", "manifest.json", "repair.json"]


def test_never_into_the_run_and_nothing_to_repair(runs, tmp_path):
    with pytest.raises(BadInput, match="lies inside .*, which this command examines and never writes into"):
        repair_run(runs["adam_near_zero"], runs["adam_near_zero"] / "repaired")
    with pytest.raises(BadInput, match="holds .*: replacing it would delete it"):
        repair_run(runs["adam_near_zero"], runs["adam_near_zero"].parent, RepairOptions(force=True))
    with pytest.raises(NothingToRepair, match="nothing to repair") as raised:
        repair_run(runs["clean"], tmp_path / "r", RepairOptions(device="cpu"))
    assert raised.value.diagnosis.verdict == "clean"
    assert not (tmp_path / "r").exists()
    # not bad input: the replay's own exit code (0, clean), one line on stdout, nothing written
    result = run_cli("repair", runs["clean"], "--out", tmp_path / "r")
    assert result.code == 0 and "Traceback" not in result.stderr, result
    assert result.stdout.startswith("nanforensics: nothing to repair: steps ") and result.stdout.count("\n") == 1
    assert not (tmp_path / "r").exists()


def test_a_repair_that_does_not_stay_finite_writes_nothing(tmp_path):
    run = tmp_path / "two_defects"  # the same reading fails at steps 17 and 18: dropping the first is not enough
    model, optimizer = _fresh()
    with Recorder(run, model, optimizer, model_factory=scenarios.build_model, step_fn=scenarios.train_step,
                  checkpoint_every=10) as rec:
        for step in range(24):
            batch = scenarios.make_batch(step, 0, "near_zero" if step in (DEFECT_STEP, RESUME) else None)
            rec.log(step, batch, scenarios.train_step(model, optimizer, batch))
    report = repair_run(run, tmp_path / "out", RepairOptions(device="cpu"))
    assert report.written is False and not report.verification.finite
    assert report.verification.first_nonfinite_step == RESUME
    assert any(f.startswith("Not written") for f in report.findings)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["two_defects"]
